"""SIDCo in one pass (:mod:`gradsift.compressors.sidco`): the moments the scan gathers at levels (both backends, the
same integers, within their rounding of the true sums), the statistics read above the floor and at the levels, and
the selection's quality over a model's worth of tensors with error feedback."""

from __future__ import annotations

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.compressors.histstats import ScanStats, TailStats
from gradsift.kernels.many import scan_many
from gradsift.kernels.moments import Levels

SIZES = (1, 63, 64, 65, 1000, 70_001, 300_000)  # the tail, one block, many blocks, past a flush of the lanes


@pytest.mark.parametrize("squares", [False, True])
def test_the_pass_gathers_the_same_moments_at_levels_on_both_backends(squares):
    g = torch.Generator().manual_seed(7)
    for n in SIZES:
        x = torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(0.02)
        x[::5] = 0.0
        add = torch.randn(n, generator=g)
        want = (x + add).abs().double()
        lv = Levels((0.0, 0.3, 1.0, 2.5), Levels.scale_for(float(want.max()) / 3), squares)
        got = []
        for backend in ("compiled", "eager"):
            xx = x.clone()
            with kernels.using(backend):
                (scan,) = scan_many([xx], [add], [3.0], [n], levels=[lv])
            got.append((scan.moments, scan.top))
        assert got[0] == got[1], n
        moments, top = got[0]
        assert lv.fits(top)
        for level, (count, q1, q2) in zip(lv.levels, moments):
            on = want[want > level]
            assert count == on.numel()
            # every q1 is |x| scale rounded to an integer: off by at most half a unit each
            assert abs(q1 / lv.scale - float(on.sum())) <= 0.5 * count / lv.scale + 1e-9 * float(on.sum())
            if squares:  # (|x| scale)^2 rounded to float32, then 2^-20 of it to an integer
                err = 0.5 * count * 2.0 ** 20 / lv.scale ** 2 + 2.0 ** -23 * float((on * on).sum())
                assert abs(q2 * 2.0 ** 20 / lv.scale ** 2 - float((on * on).sum())) <= err * 1.001
            else:
                assert q2 == 0


def test_a_scale_the_magnitudes_outgrew_is_flagged():
    x = torch.full((1000,), 3.0)
    lv = Levels((0.0,), Levels.scale_for(0.001), False)
    (scan,) = scan_many([x], [None], [None], [0], levels=[lv])
    assert not lv.fits(scan.top) and Levels((0.0,), Levels.scale_for(3.0), False).fits(scan.top)


def test_statistics_are_the_tensors_above_the_floor_and_exact_at_the_levels():
    """Above the floor ScanStats reads the candidates as TailStats reads the whole tensor; under it, a stage starts
    from the highest level at or below its threshold, with that level's exact count; counts there read the tensor
    unless the candidates already exceed what the caller needs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200_000, generator=g)
    whole = TailStats.of_tensor(x)
    floor = 2.0
    lv = Levels((0.0, 0.5, 1.2), Levels.scale_for(float(x.abs().max())), True)
    (scan,) = scan_many([x], [None], [floor], [200_000], levels=[lv])
    stats = ScanStats(x, ScanStats.level_rows(lv, scan.moments), TailStats.of_tensor(scan.vals), floor, scan.count,
                      float(x.abs().max()))
    for t in (2.0, 2.5, 3.7):
        assert stats.stage(t, True) == pytest.approx(whole.stage(t, True), rel=1e-12)
        assert stats.count(t) == whole.count(t)
    for t, level in ((0.0, 0.0), (0.4, 0.0), (0.5, 0.5), (1.0, 0.5), (1.9, 1.2)):
        loc, n, s1, _ = stats.stage(t)
        on = x.abs()[x.abs() > level].double()
        assert loc == level and n == on.numel() and s1 == pytest.approx(float(on.sum()), rel=1e-5)
    assert stats.count(1.5) == int((x.abs() > 1.5).sum())  # read
    assert stats.count(1.5, enough=100) == scan.count  # more than enough reached the floor: no read
    assert (1.2, int((x.abs() > 1.2).sum())) in stats.points()


@pytest.mark.parametrize("dist", ["exp", "gp"])
def test_one_pass_sidco_keeps_the_target_over_a_models_tensors_with_error_feedback(dist):
    """After the first call (the histogram's two passes, which leave the floor and the levels) every tensor takes the
    one pass; the count stays near the target (mean within [0.8, 1.25] of it over the tensors that send 20 or more),
    also across a thousandfold jump in scale (the moments are gathered again at a scale that fits)."""
    g = torch.Generator().manual_seed(1)
    shapes = [(64,), (4096,), (70_000,), (300_000,)]
    comp = make_compressor(f"sidco:dist={dist}", 0.01)
    keys = [f"t{i}" for i in range(len(shapes))]
    seen = []
    for step in range(12):
        scale = 1000.0 if step >= 8 else 1.0
        ps = comp.compress_many(keys, [torch.randn(s, generator=g) * scale for s in shapes])
        if step >= 2:
            seen += [p.count / p.target for p in ps if p.target >= 20]
    assert 0.8 <= sum(seen) / len(seen) <= 1.25, seen
    assert all(0.3 <= q <= 3.0 for q in seen), seen


@pytest.mark.parametrize("spec", ["sidco", "sidco:dist=gp", "sidco:feedback=false", "sidco:adapt=false,stages=4",
                                  "sidco:correct=false"])
def test_the_compiled_threshold_is_the_python_ones_to_the_bit(spec):
    """``sd_in_scan`` (select.c) repeats ``SIDCo.threshold`` on a scan's statistics -- the same float64 operations
    in the same order -- so the compiled and eager backends send the same entries, call after call, through a
    thirtyfold jump in scale (moments gathered again), on a model's mix of tensor sizes."""
    shapes = [(64,), (256,), (1000,), (4096,), (3, 3, 64, 64), (70_000,), (512, 600)]
    keys = [f"t{i}" for i in range(len(shapes))]
    runs = []
    for backend in ("compiled", "eager"):
        g = torch.Generator().manual_seed(0)
        with kernels.using(backend):
            comp = make_compressor(spec, 0.01)
            out = []
            for step in range(8):
                grads = [torch.randn(s, generator=g) * (30.0 if step == 5 else 1.0) for s in shapes]
                out.append([(p.indices.clone(), p.values.clone()) for p in comp.compress_many(keys, grads)])
            runs.append((out, {k: dict(v) for k, v in comp.inner.tensors.items()}))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert runs[0][1] == runs[1][1]  # stage counts, floors, ladders: the same state


def test_redsyncs_mean_magnitude_is_summed_in_the_pass():
    """RedSync asks the pass for the moments at level 0 (Tail.abs_sum): within the rounding of 2^-19 of the largest
    magnitude per entry of the true sum, the same on both backends; a scale the magnitudes outgrew reads the tensor."""
    from gradsift.compressors.tails import abs_sum, tails_many

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300_000, generator=g) / torch.rand(300_000, generator=g).clamp_min(0.05)
    top = float(x.abs().max())
    sums = []
    for backend in ("compiled", "eager"):
        for guess in (top, top / 100):  # a scale from the last call's largest: fits; one outgrown: read instead
            st = {}
            with kernels.using(backend):
                (tail,) = tails_many([x.clone()], [None], [st], [3000], 3.0,
                                     levels=[Levels((0.0,), Levels.scale_for(guess), False)])
                sums.append(tail.abs_sum())
    exact = float(x.abs().double().sum())
    assert sums[0] == sums[2] and sums[1] == sums[3] == abs_sum(x)
    assert abs(sums[0] - exact) <= 300_000 * top * 2.0 ** -19


@pytest.mark.skipif(kernels.backend() != "compiled", reason="the compiled pass selects under the floor itself")
@pytest.mark.parametrize("k, cap", [(5, 84), (400, 84)])
def test_a_threshold_under_the_floor_is_selected_from_the_tensor_when_it_fits(k, cap):
    """When the fit lands under the floor the candidates are not enough: the compiled pass reads the tensor again for
    the entries above the threshold -- the same ones take_above finds, zeroed -- into the candidates' room; more than
    the room holds are left to the caller (-1), the tensor untouched."""
    from gradsift.kernels.many import take_above

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g)
    top = float(x.abs().max())
    floor = top * 0.999  # one candidate: every threshold the fit finds lies under it
    state = {"stages": 3, "kth": floor, "slack": 1.0, "top": top}  # (the floor: kth times slack)
    (row,) = make_compressor("sidco", 0.01).inner._rows([x], [(state, k, None)], True)
    y = x.clone()
    (sc,) = scan_many([y], [torch.zeros_like(y)], (), [cap], sidco=[row])
    assert sc.sidco[7] == floor
    t, taken = sc.sidco[0], int(sc.sidco[3])
    assert 0.0 <= t < floor
    idx, vals = take_above(x, None, t)
    if idx.numel() <= cap:
        assert taken == idx.numel() and torch.equal(sc.idx, idx) and torch.equal(sc.vals, vals)
        assert torch.equal(y[idx], torch.zeros_like(vals)) and int((y != x).sum()) == idx.numel()
    else:
        assert taken == -1 and torch.equal(y, x)


@pytest.mark.skipif(kernels.backend() != "compiled", reason="the compiled pass learns the state itself")
@pytest.mark.parametrize("spec", ["sidco", "sidco:dist=gp", "sidco:feedback=false"])
def test_the_compiled_pass_learns_the_next_state_itself(spec, monkeypatch):
    """After a tensor's first call the compiled pass works out its floor and levels from the state and learns the
    next state in C (``sd_learn``): Python's ``Guess.update`` runs for no tensor of a model's mix of sizes (the
    state it keeps is Python's to the bit: ``test_the_compiled_threshold_is_the_python_ones_to_the_bit``)."""
    from gradsift.kernels.guess import Guess

    calls = []
    update = Guess.update
    monkeypatch.setattr(Guess, "update", staticmethod(lambda *a, **kw: (calls.append(a[2]), update(*a, **kw))[1]))
    shapes = [(64,), (256,), (1000,), (4096,), (3, 3, 64, 64), (70_000,), (512, 600)]
    keys = [f"t{i}" for i in range(len(shapes))]
    g = torch.Generator().manual_seed(0)
    comp = make_compressor(spec, 0.01)
    comp.compress_many(keys, [torch.randn(s, generator=g) for s in shapes])
    assert len(calls) == 2  # the first calls of the two large tensors: the histogram path
    calls.clear()
    for _ in range(10):
        sent = comp.compress_many(keys, [torch.randn(s, generator=g) for s in shapes])
        assert all(p.count > 0 for p in sent)
    assert calls == []
