"""Conformance suite: every registered compressor, through the same checks.

Shape, dtype and device kept; exact k where promised; deterministic under a
seed; a state_dict round trip mid-run continues identically; error feedback
loses nothing (everything sent plus the final residual equals the sum of the
gradients, per worker).
"""

from __future__ import annotations

import io

import pytest
import torch

from gradsift import payload as P
from gradsift import make_compressor
from gradsift.compressors import available, parse_spec
from helpers import all_specs, make_workers, payload_equal, random_grads, run_round

SHAPES = [(12, 20), (50,), (3, 4, 5), (1,)]
KEYS = ["a.weight", "a.bias", "conv.weight", "scalar"]


@pytest.mark.parametrize("spec", all_specs())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_device_kept(spec, dtype):
    comps = make_workers(spec, 3, ratio=0.1)
    for step in range(4):
        grads = random_grads(3, SHAPES, step, dtype=dtype)
        payloads, means = run_round(comps, KEYS, grads)
        for i, shape in enumerate(SHAPES):
            numel = int(torch.Size(shape).numel())
            assert means[i].dtype == dtype
            assert means[i].device == grads[0][i].device
            assert means[i].shape == (numel,)
            assert means[i].view(shape).shape == torch.Size(shape)
            multi_round = available()[parse_spec(spec)[0]].ROUNDS > 1
            for ps in payloads:
                p = ps[i]
                assert p.kind in P.KINDS and p.values.dim() == 1
                if multi_round:  # PowerSGD's payloads are its low-rank factors, not the tensor
                    continue
                assert p.numel == numel
                assert p.to_dense().shape == (numel,) and p.to_dense().dtype == dtype
                if p.indices is not None:
                    assert p.indices.dtype == torch.int64
                    assert p.indices.numel() == p.values.numel()
                    assert p.indices.unique().numel() == p.indices.numel(), "indices repeat within a payload"
                    assert p.count == 0 or (int(p.indices.min()) >= 0 and int(p.indices.max()) < numel)
                assert torch.isfinite(means[i]).all()


@pytest.mark.parametrize("spec", [s for s in all_specs() if available()[parse_spec(s)[0]].EXACT_K])
def test_exact_k_where_promised(spec):
    ratio = 0.07
    comps = make_workers(spec, 2, ratio=ratio)
    for step in range(5):
        payloads, _ = run_round(comps, KEYS, random_grads(2, SHAPES, step))
        for ps in payloads:
            for p, shape in zip(ps, SHAPES):
                numel = int(torch.Size(shape).numel())
                expect = numel if p.kind == P.DENSE else max(1, round(ratio * numel))
                assert p.count == p.target, (spec, shape, p.count, p.target)
                if "warmup" not in spec and "powersgd" not in spec:  # PowerSGD's k is its factors' size
                    assert p.target == expect


@pytest.mark.parametrize("spec", all_specs())
def test_deterministic_under_seed(spec):
    runs = []
    for _ in range(2):
        comps = make_workers(spec, 2, ratio=0.1, seed=5)
        out = []
        for step in range(6):
            payloads, means = run_round(comps, KEYS, random_grads(2, SHAPES, step, dist="heavy"))
            out.append((payloads, means))
        runs.append(out)
    for (pa, ma), (pb, mb) in zip(*runs):
        for wa, wb in zip(pa, pb):
            for a, b in zip(wa, wb):
                assert payload_equal(a, b)
        for a, b in zip(ma, mb):
            assert torch.equal(a, b)


@pytest.mark.parametrize("spec", all_specs())
def test_state_round_trip_continues_identically(spec):
    n = 2
    comps = make_workers(spec, n, ratio=0.1, seed=3)
    for step in range(4):
        run_round(comps, KEYS, random_grads(n, SHAPES, step, dist="heavy"))
    # save through torch.save: the state must be plain, picklable data
    blobs = []
    for c in comps:
        buf = io.BytesIO()
        torch.save(c.state_dict(), buf)
        blobs.append(buf.getvalue())
    fresh = make_workers(spec, n, ratio=0.1, seed=3)
    for c, blob in zip(fresh, blobs):
        c.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
    for step in range(4, 9):
        grads = random_grads(n, SHAPES, step, dist="heavy")
        pa, ma = run_round(comps, KEYS, grads)
        pb, mb = run_round(fresh, KEYS, grads)
        for wa, wb in zip(pa, pb):
            for a, b in zip(wa, wb):
                assert payload_equal(a, b), (spec, step)
        for a, b in zip(ma, mb):
            assert torch.equal(a, b)


@pytest.mark.parametrize("spec", all_specs())
def test_state_from_other_config_is_refused(spec):
    a = make_compressor(spec, 0.1, world_size=2)
    run_round([a, make_compressor(spec, 0.1, rank=1, world_size=2)], KEYS[:1],
              random_grads(2, SHAPES[:1], 0))
    b = make_compressor(spec, 0.2, world_size=2)
    with pytest.raises(ValueError):
        b.load_state_dict(a.state_dict())


def _feedback_specs():
    from gradsift.memory.factory import memory_of

    return [s for s in all_specs() if memory_of(s) == "ef"]


@pytest.mark.parametrize("spec", _feedback_specs())
def test_error_feedback_loses_nothing(spec):
    """sum of everything sent + final residual == sum of all gradients, per worker (float64)."""
    n, steps = 3, 30
    comps = make_workers(spec, n, ratio=0.05, seed=1)
    sent_sum = [[torch.zeros(int(torch.Size(s).numel()), dtype=torch.float64) for s in SHAPES] for _ in range(n)]
    grad_sum = [[torch.zeros_like(t) for t in row] for row in sent_sum]
    for step in range(steps):
        grads = random_grads(n, SHAPES, step, dtype=torch.float64, dist="heavy")
        payloads, _ = run_round(comps, KEYS, grads)
        for w in range(n):
            for i in range(len(SHAPES)):
                sent_sum[w][i] += payloads[w][i].to_dense(torch.float64)
                grad_sum[w][i] += grads[w][i].reshape(-1)
    for w, c in enumerate(comps):
        for i, key in enumerate(KEYS):
            total = sent_sum[w][i] + c.residual[key]
            torch.testing.assert_close(total, grad_sum[w][i], rtol=1e-12, atol=1e-9)


def test_error_feedback_keeps_fp16_rounding_in_memory():
    comp = make_compressor("topk", 0.5, value_dtype="fp16")
    g = torch.tensor([1.0001, -2.0003, 0.1, 0.2], dtype=torch.float32)
    p = comp.compress("t", g)
    assert p.values.dtype == torch.float16
    total = p.to_dense(torch.float32) + comp.residual["t"]
    torch.testing.assert_close(total, g, rtol=0, atol=1e-7)
    assert comp.residual["t"].abs().max() > 0  # the fp16 rounding error was kept


def test_nonfinite_gradient_never_reaches_memory():
    from gradsift.compressors.base import NonFiniteGradient

    comp = make_compressor("topk", 0.5)
    comp.compress("t", torch.ones(8))
    before = comp.residual["t"].clone()
    for bad in (float("nan"), float("inf")):
        g = torch.ones(8)
        g[3] = bad
        with pytest.raises(NonFiniteGradient):
            comp.compress("t", g)
        assert torch.equal(comp.residual["t"], before)


def test_warmup_density_schedule():
    """DGC's exponential warm-up: density ratio**((t+1)/(W+1)) for t < W, then the ratio."""
    comp = make_compressor("topk:warmup=4", 0.001)
    x = torch.randn(100_000)
    counts = [comp.compress("w", x).count for _ in range(6)]
    expect = [round(0.001 ** ((t + 1) / 5) * 100_000) for t in range(4)] + [100, 100]
    assert counts == expect
    assert counts[0] > counts[1] > counts[2] > counts[3] > counts[4]
