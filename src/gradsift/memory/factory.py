"""Build a compressor from a spec and compose its memory around it.

A spec is ``"name"`` or ``"name:key=value,key=value"`` (values parse as int, float, ``true``/``false``, else
string), read once into a :class:`gradsift.memory.spec.Spec`. The keys every method takes
(``Compressor.COMMON_OPTIONS`` and the memory's choice, ``memory``/``feedback``), each method's and each memory's
options are declared beside their code (``OPTIONS``: :class:`gradsift.options.Option`) and listed, with their
types, defaults and bounds, in the API reference (docs/api.md, "Options"). The memory's default is the method's
(``ef``; ``momentum`` for DGC; ``none`` for the sampling methods and PowerSGD); an optimizer handed over may change
it (its recipe, :func:`gradsift.memory.recipes.recipe_spec`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compressors import compressor_class
from ..compressors.base import Compressor, OptionError
from .spec import MEMORY_CLASSES, Spec
from .. import payload as P
from .wirecast import cast_below_16_bits


SPARSE_VALUE_DTYPE = torch.bfloat16  # fp32's range: no scaling, and error feedback keeps the 2**-9 it rounds off


def memory_of(spec: "str | Spec") -> str:
    """The memory a spec resolves to, without building it."""
    return Spec.parse(spec).resolved_memory


def with_memory(compressor: Compressor, memory: str, **options: Any):
    """``compressor`` inside the named memory (``ef``, ``momentum``, ``adam`` or ``none``)."""
    if memory not in MEMORY_CLASSES:
        raise OptionError(f"memory must be one of {', '.join(MEMORY_CLASSES)}, got {memory!r}")
    cls = MEMORY_CLASSES[memory]
    if cls is None:
        if options:
            raise OptionError(f"{compressor.name}: option {sorted(options)[0]!r} needs a memory (memory=ef, "
                              "momentum or adam)")
        return compressor
    return cls(compressor, **options)


def make_compressor(spec: "str | Spec", ratio: float | None = None, *, seed: int = 0, rank: int = 0,
                    world_size: int = 1, weight: float | None = None, **options: Any):
    """Build a compressor from a spec (a string or a :class:`~gradsift.memory.spec.Spec`), wrapped in its memory.

    ``ratio`` may also come from the spec (``topk:ratio=0.01``); it is required
    for every method but ``dense`` and ``powersgd``. ``seed``, ``rank``, ``world_size`` and
    ``weight`` (this worker's weight in the mean, default 1/world_size) place the
    compressor in its run: shared-index methods draw from ``seed`` only,
    everything else from ``(seed, rank)``. Options given both in the spec and as
    keywords are an error.
    """
    s = Spec.parse(spec, **options)
    name, cls = s.method, compressor_class(s.method)
    if s.ratio is not None:
        if ratio is not None:
            raise OptionError("ratio given both in the spec and as an argument")
        ratio = s.ratio
    if ratio is None:
        if cls.RATIO_REQUIRED:
            raise OptionError(f"{name}: ratio is required (a number in (0, 1], e.g. 0.01)")
        ratio = 1.0
    memory = s.resolved_memory
    mem_opts = s.checked_memory_options()
    comp = cls(ratio, seed=seed, rank=rank, world_size=world_size, weight=weight, value_dtype=s.value_dtype,
               warmup=s.warmup, **s.options)
    comp.check_memory(memory)
    if comp.value_bits:
        check_below_16_bits(comp, memory, mem_opts.get("residual_dtype", "fp32"))
    if s.value_dtype is None and cls.VALUE_DTYPE is None and memory != "none":
        comp.sparse_dtype = SPARSE_VALUE_DTYPE  # the memory keeps what the rounding drops
    return with_memory(comp, memory, **mem_opts)


def check_below_16_bits(comp, memory: str, residual_dtype: str) -> None:
    """``value_dtype=int4``/``int2`` needs a sparse payload (every worker its own indices: codes cannot be summed
    by an all-reduce) and a float32 memory that keeps what the rounding drops."""
    vd = comp.value_dtype_name
    if comp.payload_kind() != P.SPARSE or comp.ROUNDS > 1:
        raise OptionError(f"{comp.name}: value_dtype={vd} codes the values of sparse payloads (each worker its own "
                          f"indices); {comp.name} sends values every worker sums in place: use bf16 or fp16")
    if memory == "none":
        raise OptionError(f"{comp.name}: value_dtype={vd} rounds every value to {comp.value_bits} bits and only a "
                          "memory keeps what that drops: use memory=ef (the default), momentum or adam")
    if residual_dtype != "fp32":
        raise OptionError(f"{comp.name}: value_dtype={vd} puts what its rounding drops back into the residual, which "
                          f"must then be fp32 (residual_dtype={residual_dtype} given)")


def sparsify(spec: str, tensor: torch.Tensor, ratio: float | None = None, **options: Any):
    """Run a fresh compressor once on one tensor; return ``(values, indices)``: the values as the receivers decode
    them, in the tensor's dtype (rounded to bf16 on the wire by default: ``value_dtype=fp32`` keeps them).

    Indices are int64 positions in the flattened tensor (for a dense payload,
    every position).
    """
    comp = make_compressor(spec, ratio, **options)
    p = comp.compress("tensor", tensor)
    if comp.inner.value_bits:  # (the road's cast: values below 16 bits on their levels, in index order)
        cast_below_16_bits(comp, ["tensor"], [p])
    values = p.values.to(tensor.dtype)  # what the receivers decode (bf16 on the wire by default: value_dtype)
    if p.indices is None:
        return values, torch.arange(p.numel, device=p.values.device)
    return values, p.indices
