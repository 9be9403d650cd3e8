"""Every registered compressor against arbitrary inputs: a clear error of gradsift's own, or a sound payload."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradsift import make_compressor
from gradsift import payload as P
from gradsift.compressors import InputError, NonFiniteGradient, OptionError
from gradsift.memory.factory import memory_of
from helpers import all_specs

OURS = (OptionError, InputError, NonFiniteGradient)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]
SHAPES = st.one_of(st.just(()), st.just((0,)), st.just((3, 0)), st.tuples(st.integers(1, 40)),
                   st.tuples(st.integers(1, 12), st.integers(1, 12)), st.just((300, 300)))
RATIOS = st.one_of(st.floats(min_value=-1, max_value=2), st.just(float("nan")), st.just(float("inf")), st.just(True),
                   st.just(1e-9), st.just(1.0), st.just("0.1"), st.none(), st.integers(-2, 2))
VALUES = st.sampled_from(["normal", "zeros", "huge", "tiny", "nan", "inf", "ties"])


def tensor(shape, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(0, 3, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x.zero_()
    elif kind == "huge":
        x = x.sign() * torch.finfo(dtype).max
    elif kind == "tiny":
        x = x * torch.finfo(dtype).tiny
    elif kind == "ties":
        x = x.round()
    x = x.to(dtype)
    if kind in ("nan", "inf") and x.numel():
        x.view(-1)[x.numel() // 2] = float(kind)
    return x


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(all_specs()), dtype=st.sampled_from(DTYPES), shape=SHAPES, ratio=RATIOS, kind=VALUES,
       seed=st.integers(0, 1000), steps=st.integers(1, 3))
def test_a_clear_error_or_a_sound_payload(spec, dtype, shape, ratio, kind, seed, steps):
    try:
        comp = make_compressor(spec, ratio)
    except OptionError as e:
        assert "\n" not in str(e)
        bad_ratio = (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio <= 1)
                     or (isinstance(ratio, float) and math.isnan(ratio)))
        assert bad_ratio or "powersgd" in spec or ratio is None, (spec, ratio, e)
        return
    total = None
    if math.prod(shape) == 0 and kind in ("nan", "inf"):
        kind = "normal"  # an empty tensor holds no NaN
    for step in range(steps):
        x = tensor(shape, dtype, kind, seed + step)
        try:
            p = comp.compress("t", x)
        except OURS as e:
            assert "\n" not in str(e)
            # an error only for what has no sound payload: integers, NaN/Inf, or a memory that overflowed
            assert not dtype.is_floating_point or kind in ("nan", "inf") or "overflowed" in str(e), (spec, dtype, e)
            return
        assert dtype.is_floating_point and kind not in ("nan", "inf"), (spec, dtype, kind)
        assert bool(torch.isfinite(p.values).all()), (spec, dtype, kind)
        numel = x.numel()
        assert p.kind in P.KINDS and p.values.dim() == 1
        if comp.inner.ROUNDS == 1:
            assert p.numel == numel and p.count <= numel
        if p.indices is not None:
            assert p.indices.numel() == p.count and p.indices.unique().numel() == p.count
            assert p.count == 0 or (0 <= int(p.indices.min()) and int(p.indices.max()) < numel)
        if numel == 0:
            assert p.count == 0
        if memory_of(spec) == "ef" and comp.inner.ROUNDS == 1:
            total = x.reshape(-1).double() if total is None else total + x.reshape(-1).double()
            sent = p.to_dense(torch.float64) if numel else torch.zeros(0, dtype=torch.float64)
            total = total - sent
            left = comp.residual.get("t")
            held = left.double().clone() if left is not None else torch.zeros_like(total)
            scale = float(total.abs().max()) if numel else 0.0
            if math.isfinite(scale):
                assert float((held - total).abs().max() if numel else 0.0) <= 1e-3 * max(scale, 1e-30) + 1e-30 or \
                    dtype in (torch.float16, torch.bfloat16), (spec, dtype, kind)
                total = held


def test_a_bf16_gradient_beyond_fp16_saturates_on_an_fp16_wire():
    """Found by the fuzz test above: gs (fp16 values) on a huge bf16 scalar sent Inf, because fp16's largest value,
    65504, rounds up to 65536 in bf16 before the cast. Saturation now happens in fp32."""
    p = make_compressor("gs", 1e-9).compress("t", torch.tensor(1e38, dtype=torch.bfloat16))
    assert p.values.dtype == torch.float16 and float(p.values[0]) == 65504.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_wire_cast_saturates_alike_on_its_quick_and_careful_forms(dtype):
    """The host's cast is the plain cast where nothing overflowed (one read of the result decides) and the careful
    one otherwise: the same bits as clamping first, Inf and NaN kept as they were, on either path."""
    from gradsift.compressors.wiredtypes import WireDtypes

    class Wire(WireDtypes):
        value_dtype, sparse_dtype, value_bits = dtype, None, 0

    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(3)
    for extra in ([], [7e4], [-1e39 if dtype == torch.bfloat16 else -1e5], [float("inf")], [float("nan"), 7e4],
                  [float("-inf"), 3e38]):
        x = torch.cat([torch.randn(300, generator=gen) * 100, torch.tensor(extra, dtype=torch.float32)])
        careful = torch.where(x.isinf(), x, x.clamp(-big, big)).to(dtype)
        got = Wire().wire(x, sparse=False)
        assert got.dtype == dtype and torch.equal(got.isnan(), careful.isnan())
        assert torch.equal(got[~got.isnan()], careful[~careful.isnan()]), extra
