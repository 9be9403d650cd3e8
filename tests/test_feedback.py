"""Memory around a compressor: composition, capacity overflow kept in memory, whole tensors, checkpoint and rollback."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsift import kernels, make_compressor
from gradsift import payload as P
from gradsift.compressors import OptionError
from gradsift.memory.factory import memory_of
from gradsift.memory.feedback import ErrorFeedback
from gradsift.memory.momentum import MomentumCorrection


def test_memory_is_composed_by_the_factory():
    assert isinstance(make_compressor("topk", 0.1), ErrorFeedback)
    assert isinstance(make_compressor("dgc", 0.1), MomentumCorrection)
    m = make_compressor("topk:memory=momentum,momentum=0.5", 0.1)  # DGC's memory for any sparsifier
    assert isinstance(m, MomentumCorrection) and m.memory_options["momentum"] == 0.5
    assert memory_of("gsb") == "none" and memory_of("gsb:feedback=true") == "ef" and memory_of("dgc:feedback=false") == "none"
    for bad in ("topk:memory=ef,feedback=true", "topk:momentum=0.9", "topk:memory=lots", "dgc:feedback=false,clip=1"):
        with pytest.raises(OptionError):
            make_compressor(bad, 0.1)
    with pytest.raises(OptionError, match="ratio is required"):
        make_compressor("topk")


def test_overflow_beyond_capacity_stays_in_memory():
    """A threshold method that selects more than its wire capacity sends the largest entries; nothing is lost."""
    comp = make_compressor("gaussiank:rounds=0", 0.01)  # no corrections: the Gaussian quantile is low on Laplace input
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(20_000, dtype=torch.float64)
    total = torch.zeros(20_000, dtype=torch.float64)
    overflow = 0
    for _ in range(20):
        u = torch.rand(20_000, generator=g, dtype=torch.float64) - 0.5
        x = -u.sign() * torch.log1p(-2 * u.abs())  # Laplace: 2.6% above the Gaussian 99.5% quantile
        p = comp.compress("w", x)
        assert p.count <= p.capacity == comp.inner.capacity_for(200, 20_000)
        overflow += p.overflow
        sent += p.to_dense(torch.float64)
        total += x
    assert overflow > 0  # the test exercises the cut
    torch.testing.assert_close(sent + comp.residual["w"], total, rtol=1e-12, atol=1e-9)


def test_a_groups_payloads_are_cut_to_capacity_in_one_call_as_one_by_one():
    """Over capacity, a group's payloads cut in one compiled call keep what ``fit_capacity`` keeps -- the largest,
    in their order -- and put back into memory what it puts back, bit for bit (distinct magnitudes, ties kept whole
    or dropped whole, a zero, caps of 0 and past the count); where magnitudes tie across the cut, or a NaN is among
    them, the payload is left as it was, for ``fit_capacity`` (``torch.topk`` picks among the ties)."""
    from gradsift.kernels.scatter import keep_largest_many
    g = torch.Generator().manual_seed(3)
    cases = []  # (values, positions, cap, memory, cut by the call)
    for n, cap, tied in ((50, 20, False), (7, 3, False), (300, 1, False), (12, 0, False), (9, 12, False),
                         (1000, 999, False), (40, 10, True), (30, 5, "nan")):
        vals = torch.randn(n, generator=g)
        if n == 300:
            vals[::3] = 0.0  # ties below the cut
        if tied is True:
            vals[::4] = vals[0].abs() + 10.0  # ten entries of one magnitude at the top
            vals[1] = -vals[0]  # and an eleventh: a cut of 10 falls among them
        if tied == "nan":
            vals[3] = float("nan")
        idx = torch.sort(torch.randperm(4 * n, generator=g)[:n]).values
        mem = torch.randn(4 * n, generator=g)
        mem[idx] = 0.0
        cases.append((vals, idx, cap, mem, tied is False))
    got = [(v.clone(), i.clone(), c, m.clone()) for v, i, c, m, _ in cases]
    with kernels.using("compiled"):
        done = keep_largest_many([v for v, *_ in got], [i for _, i, *_ in got], [c for *_, c, _ in got],
                                 [m for *_, m in got])
    assert done == [cut and c < v.numel() for v, _, c, _, cut in cases]
    for (v, i, c, m, cut), (gv, gi, _, gm), d in zip(cases, got, done):
        if not d:  # left as it was
            assert torch.equal(gv.view(torch.int32), v.view(torch.int32)) and torch.equal(gi, i) and torch.equal(gm, m)
            continue
        p = P.sparse(v.clone(), i.clone(), m.numel(), torch.float32, max(c, 1))
        p.capacity = c
        wm = m.clone()
        dropped = P.fit_capacity(p)
        wm.index_put_((dropped.indices,), dropped.values, accumulate=True)
        assert torch.equal(gv[:c].view(torch.int32), p.values.view(torch.int32)) and torch.equal(gi[:c], p.indices)
        assert torch.equal(gm.view(torch.int32), wm.view(torch.int32))


def test_a_groups_values_cast_for_the_wire_in_one_call_as_torch_casts_them():
    """bf16 on the wire for a group in one compiled call: the bits of ``Compressor.wire``'s cast (ties to even,
    saturation past bf16's range) and of the rounding added back into memory; a NaN leaves it all to torch."""
    from gradsift.kernels.scatter import cast_bf16_many
    comp = make_compressor("gaussiank", 0.01)
    g = torch.Generator().manual_seed(5)
    vals = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g) for n in (40, 1, 300)]
    vals[0][:4] = torch.tensor([3.3961e38, -3.4e38, 1.00390625, 1.01171875])  # past bf16's max; bf16 ties
    idxs = [torch.sort(torch.randperm(5 * v.numel(), generator=g)[:v.numel()]).values for v in vals]
    mems = [torch.randn(5 * v.numel(), generator=g) for v in vals]
    want = []
    for m, i, v in zip(mems, idxs, vals):
        w = comp.wire(v.clone())
        want.append((w, m.clone().index_add_(0, i, v - w.float())))
    with kernels.using("compiled"):
        got_m = [m.clone() for m in mems]
        got = cast_bf16_many(got_m, idxs, vals)
        assert got is not None
        for (w, wm), gv, gm in zip(want, got, got_m):
            assert gv.dtype == torch.bfloat16 and torch.equal(gv.view(torch.int16), w.view(torch.int16))
            assert torch.equal(gm.view(torch.int32), wm.view(torch.int32))
        vals[2][7] = float("nan")
        kept = [m.clone() for m in mems]
        assert cast_bf16_many(kept, idxs, vals) is None and all(torch.equal(a, b) for a, b in zip(kept, mems))


def test_whole_tensors_flush_memory_exactly():
    comp = make_compressor("topk", 0.1)
    x = torch.randn(100, dtype=torch.float64)
    first = comp.compress("w", x)
    left = comp.residual["w"].clone()
    whole = comp.compress("w", x, dense=True)  # what was held back goes too
    assert whole.kind == P.DENSE and torch.equal(whole.values, left + x)
    assert "w" not in comp.residual
    again = comp.compress("w", x, dense=True)  # nothing held back: the gradient as it is
    assert torch.equal(again.values, x) and "w" not in comp.residual
    assert first.count == 10


@pytest.mark.parametrize("spec", ["topk", "sidco", "dgc", "gsb:tau=3", "regtopk", "topk:memory=momentum",
                                  "topk:memory=adam", "topk:memory=adam,residual_dtype=bf16"])
def test_rollback_restores_memory_and_compressor_state_bit_for_bit(spec):
    comp = make_compressor(spec, 0.1, world_size=2)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 50, generator=g) for _ in range(6)]
    for x in xs[:3]:
        p = comp.compress("w", x)
        if comp.OBSERVES:
            comp.observe("w", p, p.to_dense())
    token = comp.checkpoint(["w"])
    before = comp.state_dict()
    p = comp.compress("w", xs[3])
    if comp.OBSERVES:
        comp.observe("w", p, p.to_dense())
    comp.rollback(token)
    after = comp.state_dict()
    twin = make_compressor(spec, 0.1, world_size=2)
    twin.load_state_dict(before)
    for x in xs[3:]:  # the rolled-back compressor continues exactly as one restored from before the step
        a, b = comp.compress("w", x), twin.compress("w", x)
        assert a.kind == b.kind and torch.equal(a.values, b.values)
    assert after.keys() == before.keys()


def test_momentum_memory_loses_nothing_for_any_sparsifier():
    """sum(sent) + v == sum of the momentum-corrected updates u_t = m u_(t-1) + g_t (u as masked after sending)."""
    m = 0.9
    comp = make_compressor(f"topk:memory=momentum,momentum={m}", 0.05)
    g = torch.Generator().manual_seed(2)
    u_prev = torch.zeros(200, dtype=torch.float64)
    sent = torch.zeros(200, dtype=torch.float64)
    updates = torch.zeros(200, dtype=torch.float64)
    masked = 0
    for _ in range(30):
        x = torch.randn(200, generator=g, dtype=torch.float64)
        p = comp.compress("w", x)
        updates += m * u_prev + x
        u_prev = comp.u["w"].clone()
        masked += int((u_prev[p.indices] == 0).sum())
        sent += p.to_dense(torch.float64)
    torch.testing.assert_close(sent + comp.residual["w"], updates, rtol=1e-12, atol=1e-9)
    assert masked == 30 * 10  # momentum factor masking zeroed u wherever v was sent


@pytest.mark.parametrize("spec", ["dgc", "dgc:nesterov=true", "dgc:masking=false", "topk:memory=momentum",
                                  "dgc:value_dtype=fp16", "dgc:clip=0.5"])
def test_momentum_sends_a_groups_whole_tensors_as_one_by_one(spec):
    """Momentum correction's send_whole_many (the velocities of a group's whole tensors advanced, added and settled
    in foreach calls, the values copied and checked once) sends what compress(dense=True) sends tensor by tensor and
    leaves the same u and v -- over steps, with a checkpoint holding the velocities, and with a tensor that overflows
    (its memory dropped, the others kept)."""
    from helpers import payload_equal

    shapes = [(30,), (1,), (200,), (7,), (64,)]
    keys = [f"b{i}" for i in range(len(shapes))]
    many, one = (make_compressor(spec, 0.1) for _ in range(2))
    gen = torch.Generator().manual_seed(11)
    for step in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if step == 3:
            grads[2][5] = 3e38  # (momentum's u + g overflows there once u holds a large velocity)
            grads[2][6] = float("inf")
        if step == 2:
            many.checkpoint(keys), one.checkpoint(keys)
        got = many.send_whole_many(keys, [g.clone() for g in grads], [False] * len(keys))
        want = [one.compress(k, g.clone(), check_finite=False, dense=True) for k, g in zip(keys, grads)]
        assert all(payload_equal(a, b) and a.nonfinite == b.nonfinite for a, b in zip(got, want)), (spec, step)
        assert (step == 3) == any(p.nonfinite for p in got)
        for store in ("u", "v"):
            a, b = getattr(many, store), getattr(one, store)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (spec, step, store)


@pytest.mark.parametrize("spec", ["topk:memory=momentum", "topk:memory=momentum,nesterov=true",
                                  "topk:memory=momentum,masking=false", "topk:memory=momentum,value_dtype=fp16"])
def test_momentum_correction_of_a_group_in_one_call_is_the_per_tensor_one(spec):
    """Momentum correction under top-k (the recipe a momentum optimizer picks for it) takes a group in a few
    calls -- the velocities advanced by foreach, the method's own group call accumulating ``v + u``, the sent
    positions masked in one sweep -- and sends what ``compress`` sends tensor by tensor, leaving the same u, v and
    state, bit for bit: over steps, with a checkpoint holding the velocities from the third on (the step's written
    into other tensors), and a tensor whose velocity overflows (flagged, its memory dropped, the others going on)."""
    from helpers import payload_equal
    from gradsift.memory.feedback import Memory

    if kernels.backend() != "compiled":
        pytest.skip("the group path is the compiled kernels' (no C compiler here)")
    shapes = [(64, 3, 3, 3), (256, 64), (1000,), (70_000,), (512, 60)]
    keys = [f"t{i}" for i in range(len(shapes))]
    many, one = (make_compressor(spec, 0.01, seed=3) for _ in range(2))
    calls = []
    real = MomentumCorrection._compress_fused
    gen = torch.Generator().manual_seed(5)
    for step in range(7):
        grads = [torch.randn(s, generator=gen) * (30.0 if step == 4 else 1.0) for s in shapes]
        if step == 5:
            grads[3][77] = 3e38  # (u + g overflows there once u holds a large velocity)
            grads[3][78] = float("inf")
        if step >= 2:
            many.checkpoint(keys), one.checkpoint(keys)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(MomentumCorrection, "_compress_fused", lambda *a: calls.append(1) or real(*a))
            got = many.compress_many(keys, [g.clone() for g in grads])
        want = Memory.compress_many(one, keys, [g.clone() for g in grads])  # (tensor by tensor)
        assert all(payload_equal(a, b) and a.nonfinite == b.nonfinite for a, b in zip(got, want)), (spec, step)
        assert (step == 5) == got[3].nonfinite and not any(p.nonfinite for j, p in enumerate(got) if j != 3)
        for store in ("u", "v"):
            a, b = getattr(many, store), getattr(one, store)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (spec, step, store)
        assert all({n: many.inner.tensors[k][n] for n in one.inner.tensors[k]} == one.inner.tensors[k]
                   for k in keys)
    assert len(calls) == 7  # (the group path took every step)


def test_a_narrow_residual_takes_its_bytes_and_loses_only_its_rounding_which_is_counted():
    """residual_dtype bf16 (2 bytes an entry) and fp8 (1 byte, plus one fp32 scale per tensor): sent + residual
    equals the accumulated gradient up to the residual's rounding, and the rounding reported is what the store
    dropped; fp32 (the default) loses nothing and reports none."""
    torch.manual_seed(0)
    spread = torch.logspace(-4, 0, 20000)  # entries over four decades, as a layer's gradient is
    grads = [torch.randn(20000) * spread for _ in range(20)]
    total = torch.stack(grads).double().sum(0)
    held, err = {}, {}
    for dtype in ("fp32", "bf16", "fp8"):
        c = make_compressor(f"topk:residual_dtype={dtype}", ratio=0.01)
        sent = torch.zeros(20000, dtype=torch.float64)
        for g in grads:
            sent += c.compress("w", g).to_dense(torch.float64)
        held[dtype] = sum(t.numel() * t.element_size() for store in c.stores().values() for t in store.values())
        r = c.residual_of("w").double()
        err[dtype] = float((sent + r - total).norm() / total.norm())
        lost = c.rounding_lost()
        if dtype == "fp32":
            assert err[dtype] < 1e-6 and lost is None
        else:
            assert 0 < lost < {"bf16": 2**-8, "fp8": 2**-4}[dtype], (dtype, lost)
            # what was lost is the rounding of each step's store, no more: at most ~sqrt(steps) x a step's share
            assert err[dtype] < 5 * lost, (dtype, err[dtype], lost)
    assert c.residual["w"].dtype == torch.float8_e4m3fn and c.residual_scale["w"].dim() == 0
    assert held["bf16"] == 40000 + 8 and held["fp8"] == 20000 + 4 + 8  # codes, an fp32 scale, a draw count
    assert err["bf16"] < err["fp8"] < 0.1


def test_fp8_rounds_stochastically_so_a_slowly_growing_residual_is_not_rounded_away():
    """An entry growing by less than half a code's step a step: rounded to the nearest code it is put back every
    step (most of its mass lost), rounded stochastically its expected value grows as it should."""
    from gradsift.memory import narrow

    gen = torch.Generator().manual_seed(0)
    inc = torch.rand(50000, generator=gen) * 1e-3  # up to 0.1% of the largest entry a step
    kept = {}
    for how, draws in (("nearest", None), ("stochastic", torch.Generator().manual_seed(1))):
        codes, scale = narrow.encode(torch.zeros(50000), narrow.FP8)
        for _ in range(200):
            acc = narrow.decode(codes, scale) + inc
            acc[0] = 1.0  # the largest entry, which sets the scale
            codes, scale = narrow.encode(acc, narrow.FP8, draws)
        kept[how] = float(narrow.decode(codes, scale)[1:].sum() / (200 * inc[1:].sum()))
    assert kept["nearest"] < 0.5 and abs(kept["stochastic"] - 1) < 0.01, kept


def test_an_fp8_residual_round_trips_through_a_checkpoint_and_a_rollback():
    """The codes and their scale are state: saved (torch.save with weights_only loading), loaded into a fresh
    compressor and continued, the sends equal the uninterrupted run's; a rollback restores both."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(3000, generator=gen) for _ in range(8)]
    a = make_compressor("topk:residual_dtype=fp8", ratio=0.02)
    for g in grads[:4]:
        a.compress("w", g)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make_compressor("topk:residual_dtype=fp8", ratio=0.02)
    b.load_state_dict(torch.load(buf, weights_only=True))
    token = b.checkpoint(["w"])
    b.compress("w", grads[7] * 100)  # a step then taken back
    b.rollback(token)
    for g in grads[4:]:
        pa, pb = a.compress("w", g), b.compress("w", g)
        assert torch.equal(pa.indices, pb.indices) and torch.equal(pa.values, pb.values)
    assert torch.equal(a.residual["w"].view(torch.uint8), b.residual["w"].view(torch.uint8))
    assert torch.equal(a.residual_scale["w"], b.residual_scale["w"])


def test_an_elastic_fold_of_fp8_residuals_adds_their_values_not_their_codes():
    """Two ranks' fp8 residuals folded onto one: the new rank holds the mean of the decoded residuals (to fp8's
    rounding of the result), with its own scale."""
    from gradsift.runtime.elastic import fold_memory

    gen = torch.Generator().manual_seed(2)
    ranks = [make_compressor("topk:residual_dtype=fp8", ratio=0.02, rank=r, world_size=2) for r in range(2)]
    for c, scale in zip(ranks, (1.0, 1e-3)):  # scales three decades apart: codes alone would average wrongly
        for _ in range(3):
            c.compress("w", torch.randn(3000, generator=gen) * scale)
    saved = [{"compressor_state": c.state_dict()} for c in ranks]
    new = make_compressor("topk:residual_dtype=fp8", ratio=0.02)
    wide = [{**sd, "compressor_state": new.wide_stores(sd["compressor_state"])} for sd in saved]
    new.take_stores(fold_memory(wide, new.STORES, new.UNSENT, {"w": 3000}, seed=0))
    want = (ranks[0].residual_of("w") + ranks[1].residual_of("w")) / 2
    assert new.residual["w"].dtype == torch.float8_e4m3fn
    assert float((new.residual_of("w") - want).norm() / want.norm()) < 2**-4


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("spec", ["sidco", "gaussiank", "redsync", "topk"])
def test_an_overflow_in_a_groups_pass_is_flagged_and_its_memory_dropped(spec, backend):
    """The group path (the road's: no check of the gradient first) trusts a pass that read the tensor's largest
    magnitude for finiteness (``Payload.finite``): an Inf or NaN in memory plus gradient must still come out flagged
    ``nonfinite``, with zeroed values and that key's memory dropped, and the other tensors go on as before."""
    from gradsift import kernels

    if backend == "compiled" and kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    shapes = [(300,), (70_000,), (64, 64)]
    keys = [f"t{i}" for i in range(len(shapes))]
    g = torch.Generator().manual_seed(1)
    with kernels.using(backend):
        comp = make_compressor(spec, 0.01)
        for _ in range(3):
            comp.compress_many(keys, [torch.randn(s, generator=g) for s in shapes])
        for bad in (float("inf"), float("nan")):
            grads = [torch.randn(s, generator=g) for s in shapes]
            grads[1][12345] = bad
            sent = comp.compress_many(keys, grads)
            assert sent[1].nonfinite and not bool(sent[1].values.any())
            assert "t1" not in comp.residual
            assert not (sent[0].nonfinite or sent[2].nonfinite) and {"t0", "t2"} <= set(comp.residual)
            assert all(bool(torch.isfinite(comp.residual[k]).all()) for k in ("t0", "t2"))
            assert sent[0].finite and sent[2].finite  # (read finite by the pass: no second read)


@pytest.mark.parametrize("spec,per_param,rounded", [("dense", 0.0, False), ("topk", 4.0, False),
                                                    ("topk:residual_dtype=fp8", 1.0, True),
                                                    ("dgc:memory=momentum", 8.0, False)])
def test_a_runs_memory_figures_for_every_kind_of_memory(spec, per_param, rounded):
    """summary.json's memory: bytes a parameter as the stores hold them (dense none; error feedback 4, fp8 about 1;
    momentum correction's two buffers 8), and what a narrow store rounded off (None where stored exactly)."""
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.simulate import Simulator

    sim = Simulator(RunConfig(task="digits-mlp", compressor=spec, ratio=0.1, workers=2, steps=3, eval_every=1000,
                              optimizer="momentum"))
    sim.run()
    m = sim.ranks[0].memory_summary()
    assert m["bytes_per_parameter"] == pytest.approx(per_param, abs=0.02), m  # (fp8: 12 bytes a tensor more)
    assert (m["residual_rounding"] is not None) == rounded, m
    if rounded:
        assert 0 < m["residual_rounding"] < 2**-4


class _Copies(TorchDispatchMode):
    """Counts the operations that copy a tensor of at least ``size`` entries (a memory's, not a payload's)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.copies = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("clone", "copy_", "_foreach_copy_", "_to_copy"):
            dest = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]  # (in-place copies return None)
            outs = out if isinstance(out, (list, tuple)) else dest if out is None else [out]
            self.copies += sum(t.numel() >= self.size for t in outs if isinstance(t, torch.Tensor))
        return out


# the methods whose pass reads the kept memory where it is (error feedback's residual; DGC's u and v), the others copy it first
READ_IN_PLACE = ["topk", "randomk", "rtopk", "sidco", "gaussiank", "redsync", "dgc"]


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("spec", READ_IN_PLACE + ["regtopk", "topk:memory=adam", "sidco:memory=adam,masking=true"])
def test_a_clean_step_copies_no_memory_and_a_rollback_restores_it_bit_for_bit(spec, backend):
    """The road checkpoints every group where a step may be skipped; the checkpoint keeps the memory's tensors
    themselves (the residual; Adam's moments too) and the step writes new ones, so a clean step copies nothing (no
    clone per step) and a skipped one goes back to exactly the memory it started from: the rolled-back compressor
    continues as one that never saw the step. (The eager kernels copy the kept residual into the new tensor first:
    the same results; so does Adam's direction where the selection does not accumulate it, with masking.)"""
    if backend == "compiled" and kernels.backend() != "compiled":
        pytest.skip("no C compiler here")
    keys = [f"t{i}" for i in range(5)]
    comp, twin = (make_compressor(spec, 0.05, world_size=2, seed=4) for _ in range(2))
    g = torch.Generator().manual_seed(2)
    steps = [[torch.randn(3000 + 64 * i, generator=g) for i in range(len(keys))] for _ in range(6)]

    def step(c, grads, checkpoint: bool):
        token = c.checkpoint(keys) if checkpoint else None
        sent = c.compress_many(keys, grads)
        if c.OBSERVES:
            for k, p in zip(keys, sent):
                c.observe(k, p, p.to_dense())
        return token, sent

    with kernels.using(backend):
        _continue_after_a_rollback(spec, comp, twin, steps, keys, step, backend)


def _continue_after_a_rollback(spec, comp, twin, steps, keys, step, backend):
    first = {}
    for grads in steps[:2]:
        step(comp, grads, True)
        step(twin, grads, False)
        first = first or {k: comp.residual[k].data_ptr() for k in keys}
    stores = {name: store for name, store in comp.stores().items() if name != "t"}  # (Adam's t: 0-d, replaced)
    held = {(name, k): store[k] for name, store in stores.items() for k in keys}
    values = {nk: t.clone() for nk, t in held.items()}
    counter = _Copies(3000)
    with counter:
        token, _ = step(comp, steps[2], True)
    assert all(torch.equal(held[nk], values[nk]) for nk in held)  # the kept tensors were read, never written
    assert all(stores[name][k] is not t for (name, k), t in held.items())  # the step's are other tensors:
    assert all(comp.residual[k].data_ptr() == first[k] for k in keys)  # those the last step replaced, not allocated
    if backend == "eager":
        pass
    elif spec.split(":")[0] in READ_IN_PLACE and "masking" not in spec:
        assert counter.copies == 0, f"{spec}: {counter.copies} copies in a clean step"
    else:  # (REGTOP-k's factors read the accumulated values before its pass: the residual is copied in first)
        assert counter.copies == len(keys)
    comp.rollback(token)
    assert all(stores[name][k] is t for (name, k), t in held.items())
    for grads in steps[3:]:
        _, a = step(comp, grads, True)
        _, b = step(twin, grads, False)
        for x, y in zip(a, b):
            assert torch.equal(x.indices, y.indices) and torch.equal(x.values, y.values)
    for name, store in stores.items():
        assert all(torch.equal(store[k], getattr(twin, name)[k]) for k in keys), name


@pytest.mark.parametrize("spec", ["topk", "topk:memory=adam", "regtopk", "regtopk:form=code", "gaussiank",
                                  "redsync", "gaussiank:memory=adam"])
def test_the_pass_that_takes_the_wire_cast_leaves_what_the_cast_after_it_leaves(spec, monkeypatch):
    """Top-k's and REGTOP-k's compiled pass, and the threshold methods' group take, cast their selections to bf16 and
    leave v - bf16(v) in memory: the same bits, values and memory, as selecting in float32 and casting after (through
    clamping at bf16's largest value, an overflow and the steps between; a threshold method's selections past their
    wire capacity are cut first, then cast)."""
    if kernels.backend() != "compiled":
        pytest.skip("the compiled pass takes the cast (no C compiler here)")
    from gradsift.compressors.registry import compressor_class

    TopK = compressor_class(spec.split(":")[0])  # noqa: N806 (the class whose pass is patched)
    fused, after = make_compressor(spec, 0.05), make_compressor(spec, 0.05)
    select = TopK.select_many_into
    gen = torch.Generator().manual_seed(3)
    shapes = [(300,), (40, 50), (7,), (5000,), (64, 3, 3)]
    keys = [f"t{i}" for i in range(len(shapes))]
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = lambda t: t.view(ints[t.element_size()]) if t.is_floating_point() and t.dim() else t  # noqa: E731
    saw_bf16 = False
    for step in range(8):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if step == 3:  # beyond bf16's largest finite value (3.39e38), below float32's
            grads[3].view(-1)[17], grads[1].view(-1)[2] = 3.4e38, -3.399e38
        if step == 5:
            grads[0].view(-1)[9] = float("inf")
        got = fused.compress_many(keys, [g.clone() for g in grads])
        monkeypatch.setattr(TopK, "select_many_into",
                            lambda self, k, a, g, srcs=None, wire=None: select(self, k, a, g, srcs, None))
        want = after.compress_many(keys, [g.clone() for g in grads])
        monkeypatch.setattr(TopK, "select_many_into", select)
        if fused.OBSERVES:  # (REGTOP-k: the next round's factors from what was sent)
            fused.observe_many(keys, got, [g.reshape(-1) for g in grads])
            after.observe_many(keys, want, [g.reshape(-1) for g in grads])
        for p, q in zip(got, want):
            assert p.nonfinite == q.nonfinite and p.values.dtype == q.values.dtype
            assert torch.equal(p.indices, q.indices) and torch.equal(bits(p.values), bits(q.values))
            saw_bf16 |= p.values.dtype == torch.bfloat16
        for name, store in fused.stores().items():
            other = after.stores()[name]
            assert sorted(store) == sorted(other)
            for key in store:
                assert torch.equal(bits(store[key]), bits(other[key])), (step, name, key)
        for key, st in fused.inner.tensors.items():  # (REGTOP-k's factors: learned from the same sends)
            other = after.inner.tensors[key]
            assert all(torch.equal(bits(v), bits(other[n])) for n, v in st.items() if isinstance(v, torch.Tensor))
    assert saw_bf16
