"""What a bucket costs in operations: the road's dispatched aten operations for one group may not grow per tensor
beyond today's ceilings (``benchmarks/op_count.py`` prints the table; docs/results.md, "The hook's own cost").

Each method's ceiling is the operations one more tensor in a group adds today, once the guesses have settled (the
eighth step: the first steps' floors miss on small tensors, which then take the two-pass path). The goal is none (a
constant number of operations per bucket, whatever its tensor count): lower a ceiling when a change removes
per-tensor operations, never raise one. What is left per tensor is mostly the methods' own arithmetic in torch
(GaussianK's mean and dot, GSB's seeded generator and float64 sums)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gradsift import kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from op_count import METHODS, RECIPES, ops_per_group  # noqa: E402

CEILING = {"dense": 1, "topk": 1, "randomk": 2, "regtopk": 2, "rtopk": 2, "gs": 2, "rsb": 6, "gsb": 6,
           "sidco": 2, "dgc": 1, "redsync": 4, "gaussiank": 8,
           "topk:memory=adam": 2, "sidco:memory=adam": 3, "topk:memory=momentum": 2}


def test_every_method_and_recipe_has_a_ceiling():
    assert sorted(CEILING) == sorted(METHODS + RECIPES)


@pytest.mark.parametrize("spec", METHODS + RECIPES)
def test_operations_per_added_tensor_stay_under_the_ceiling(spec):
    if kernels.backend() != "compiled":
        pytest.skip("the ceilings count the compiled kernels' path (no C compiler here)")
    few, many = ops_per_group(spec, 10, 200_000), ops_per_group(spec, 100, 200_000)
    per_tensor = (many - few) / 90
    assert per_tensor <= CEILING[spec], (f"{spec}: {per_tensor:.1f} aten operations per added tensor "
                                         f"({few} for 10 tensors, {many} for 100), ceiling {CEILING[spec]}")


@pytest.mark.parametrize("spec", ["dense", "topk", "gsb", "dense:value_dtype=bf16"])
def test_a_bucket_sent_whole_costs_the_same_operations_whatever_its_tensors(spec):
    """A bucket the route sends whole -- as it is, or cast once to the method's narrower wire dtype (GSB's fp16) --
    dispatches the same operations for 10 tensors as for 100, but the views that name each tensor in it (no kernel,
    no pass over data)."""
    few, many = (ops_per_group(spec, n, 200_000, whole=True, views=False) for n in (10, 100))
    assert few == many and few < 12, (few, many)
