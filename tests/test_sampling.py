"""Gradient sampling (GS, RSB, GSB): Algorithm 1 normalization, shared draws, coverage, accounting."""

from __future__ import annotations

import pytest
import torch

from gradsift import payload as P
from gradsift import make_compressor
from gradsift.compressors.sampling import normalize_probabilities
from helpers import run_round


def inputs():
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(100_000, generator=g)
    # Student-t with 2 degrees of freedom: normal / sqrt(chi2_2 / 2), chi2_2 = -2 log U
    t2 = torch.randn(100_000, generator=g) / (-torch.rand(100_000, generator=g).log()).sqrt()
    return {"gaussian": gauss, "student-t(2)": t2}


@pytest.mark.parametrize("name", ["gaussian", "student-t(2)"])
@pytest.mark.parametrize("k", [10, 1000, 10_000])
def test_normalization_caps_at_one_and_sums_to_k(name, k):
    g = inputs()[name]
    p = normalize_probabilities(g.square(), k, iters=5)
    assert float(p.max()) <= 1.0
    assert float(p.min()) >= 0.0
    assert abs(float(p.sum()) - k) <= 0.03 * k, float(p.sum())


def explicit_water_filling(w, k, iters):
    """Reference: keep p, cap entries above 1 cumulatively, rescale the uncapped ones to the remaining budget."""
    p = w * (k / w.sum())
    capped = torch.zeros_like(p, dtype=torch.bool)
    for _ in range(iters):
        over = p > 1
        if not over.any():
            break
        capped |= over
        p[capped] = 1.0
        budget = k - int(capped.sum())
        if budget <= 0:
            p[~capped] = 0.0
            break
        p[~capped] *= budget / p[~capped].sum()
    return p.clamp(max=1.0)


@pytest.mark.parametrize("name", ["gaussian", "student-t(2)"])
@pytest.mark.parametrize("k,iters", [(10, 5), (1000, 1), (1000, 5), (10_000, 3), (99_000, 5)])
def test_threshold_form_matches_explicit_water_filling(name, k, iters):
    """The implementation tracks one scale c (capped set = {w > 1/c}); same probabilities as the explicit loop."""
    w = inputs()[name].double().square()
    ours = normalize_probabilities(w, k, iters=iters).double()
    ref = explicit_water_filling(w.clone(), k, iters)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6), float((ours - ref).abs().max())


def test_literal_pseudo_code_falls_short_on_heavy_tails():
    """The literal line 12 rescales capped entries too; water-filling does not (documented deviation)."""
    g = inputs()["student-t(2)"]
    k = 10_000
    p = k * g.square() / g.square().sum()
    kk = k
    for _ in range(5):  # Algorithm 1 as printed
        over = p > 1
        l = int(over.sum())
        p_capped = p.clamp(max=1)
        if l == 0 or kk <= 0:
            p = p_capped
            break
        s = (kk - l) / p[~over].sum()
        p = p * s
        kk -= l
    literal = float(p.clamp(max=1).sum())
    ours = float(normalize_probabilities(g.square(), k).sum())
    assert literal < 0.97 * k < ours


def test_all_workers_draw_identical_coordinates():
    n = 4
    for spec in ("gs:tau=3", "rsb", "gsb:tau=3"):
        comps = [make_compressor(spec, 0.05, rank=r, world_size=n, seed=7) for r in range(n)]
        g = torch.Generator().manual_seed(1)
        for step in range(8):
            grads = [[torch.randn(500, generator=g) * torch.linspace(0.1, 3, 500)] for _ in range(n)]
            payloads, _ = run_round(comps, ["w"], grads)
            kinds = {p[0].kind for p in payloads}
            assert len(kinds) == 1
            if payloads[0][0].kind == P.SHARED:
                for ps in payloads[1:]:
                    assert torch.equal(ps[0].indices, payloads[0][0].indices)


def test_refresh_schedule_and_accounting():
    comps = [make_compressor("gsb:tau=4", 0.01, rank=r, world_size=2) for r in range(2)]
    g = torch.Generator().manual_seed(2)
    kinds = []
    for step in range(9):
        grads = [[torch.randn(10_000, generator=g)] for _ in range(2)]
        payloads, means = run_round(comps, ["w"], grads)
        p = payloads[0][0]
        kinds.append(p.kind)
        assert p.values.dtype == torch.float16  # FP16 values by default
        if p.kind == P.SHARED:
            assert p.index_bytes == 0 and p.nbytes == p.count * 2  # no index bytes on the wire
        else:
            assert p.nbytes == 10_000 * 2
    assert kinds == ["dense", "shared", "shared", "shared", "dense", "shared", "shared", "shared", "dense"]
    from gradsift.transport.base import traffic_of
    from gradsift.transport.wire import route_of

    traffic = traffic_of([p[0] for p in payloads][:1], [route_of(payloads[0][0])], 2)
    assert traffic.allgather_bytes == 0 and traffic.allreduce_bytes > 0  # shared and dense payloads: all-reduce only


def test_counts_track_k_on_average():
    comp = make_compressor("gs:tau=1000", 0.01)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(50_000, generator=g) * torch.rand(50_000, generator=g) ** 4
    counts = []
    for step in range(40):
        p = comp.compress("w", base + 0.01 * torch.randn(50_000, generator=g))
        if p.kind == P.SHARED:
            counts.append(p.count)
    assert abs(sum(counts) / len(counts) - 500) < 0.05 * 500


def coverage(spec, steps=300, d=20_000, ratio=0.01):
    """Share of coordinates sampled at least once within `steps`, on a fixed heavy-tailed gradient."""
    g = torch.Generator().manual_seed(4)
    fixed = torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-4)  # heavy tails
    comp = make_compressor(spec, ratio, seed=1)
    for step in range(steps):
        p = comp.compress("w", fixed)
        comp.observe("w", p, p.to_dense())
    return comp.inner.telemetry([comp])["visited_share"]


def test_gsb_explores_more_coordinates_than_gs():
    gs, gsb = coverage("gs:tau=1000"), coverage("gsb:tau=1000")
    assert gsb > 1.5 * gs, (gs, gsb)


def test_unbiased_rescaling_needs_feedback_off():
    from gradsift.compressors import OptionError

    with pytest.raises(OptionError):
        make_compressor("gsb:unbiased=true,feedback=true", 0.01)
    comp = make_compressor("gs:unbiased=true,feedback=false,tau=10", 0.1, value_dtype="fp32")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    p0 = comp.compress("w", x)
    comp.observe("w", p0, x)
    st = comp.inner.tensors["w"]
    # average of many unbiased draws approaches the input
    acc = torch.zeros(1000)
    n = 400
    for _ in range(n):
        p = comp.compress("w", x)
        if p.kind == P.SHARED:
            acc += p.to_dense()
    base, scale = st["level"]
    covered = base.mul(scale).clamp(max=1.0) > 0
    err = ((acc / n - x)[covered]).abs().mean() / x[covered].abs().mean()
    assert err < 0.35


def _energy_per_window(spec: str, windows: int = 10, tau: int = 20, d: int = 100_000):
    """Share of a fixed heavy-tailed gradient's energy each sampling step captures, averaged per refresh window."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(d, generator=gen)
    chi = torch.randn(d, 2, generator=gen).square().sum(1) / 2  # Student-t(2) = z / sqrt(chi2_2 / 2)
    g = z / chi.sqrt()
    total = float(g.square().sum())
    comp = make_compressor(spec, 0.01, tau=tau)
    out = []
    for w in range(windows):
        shares = []
        for _ in range(tau):
            p = comp.compress("g", g)
            comp.observe("g", p, p.to_dense() if p.kind == "dense" else g)
            if p.kind != "dense":
                shares.append(float(g[p.indices].square().sum()) / total)
        out.append(sum(shares) / len(shares))
    return out


def test_gsb_prior_restarts_each_window_so_it_keeps_the_large_coordinates():
    per = _energy_per_window("gsb")
    assert all(abs(e - per[0]) <= 0.1 * per[0] for e in per), per  # the done-when: within 10%, 10 windows
    gs = _energy_per_window("gs", windows=2)
    assert per[0] < gs[0] and per[0] > 20 * 0.01  # between GS (the largest, always) and random sampling (~k/d)
    never = _energy_per_window("gsb:prior=never")
    assert never[0] == pytest.approx(per[0], rel=1e-6) and never[-1] < 0.5 * never[0], never  # the old drift


@pytest.mark.parametrize("backend", ["compiled", "eager"])
def test_the_counter_based_draw_is_bernoulli_and_the_same_on_both_backends(backend):
    """kernels.draw.bernoulli keeps i with probability p_i, independently: the compiled draw and its torch twin pick
    the same coordinates for a seed; kept counts match sum(p) (binomial spread); each coordinate's frequency its p;
    another seed draws differently; p = 0 is never kept, p = 1 always."""
    from gradsift import kernels
    from gradsift.kernels.draw import bernoulli, uniforms

    n = 200_003
    p = torch.linspace(0.0, 1.0, n, dtype=torch.float32) ** 3
    with kernels.using(backend):
        a = bernoulli(p, 12345)
    with kernels.using("eager" if backend == "compiled" else "compiled"):
        b = bernoulli(p, 12345)
    assert torch.equal(a, b)
    assert torch.equal(a, torch.nonzero(uniforms(n, 12345) < p).squeeze(1))
    mean, sd = float(p.sum()), float((p * (1 - p)).sum()) ** 0.5
    assert abs(a.numel() - mean) < 5 * sd and p[a].min() > 0 and bool((p == 1)[-1]) and a[-1] == n - 1
    hits = torch.zeros(4)
    q = torch.tensor([0.0, 0.1, 0.5, 0.9])
    with kernels.using(backend):
        for seed in range(2000):
            hits[bernoulli(q, seed)] += 1
    assert hits[0] == 0 and torch.allclose(hits / 2000, q, atol=0.04)
    with kernels.using(backend):
        assert not torch.equal(bernoulli(p, 12346), a)
        # a scale applied in the draw (water-filling's level): min(scale * w, 1) in float32, as torch computes it
        w, scale = p * 7.3 + 1e-3, 0.2173913043478261
        want = torch.nonzero(uniforms(n, 77) < (w * scale).clamp(max=1.0)).squeeze(1)
        assert torch.equal(bernoulli(w, 77, scale), want) and bool(((w * scale) > 1).any())
        for expect in (1.0, float(want.numel()), 10.0 * n):  # output sized from a guess: too small, right, large
            assert torch.equal(bernoulli(w, 77, scale, expect=expect), want)
    u = uniforms(1_000_000, 99)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.002


def test_the_sampled_coordinates_bookkeeping_is_the_same_compiled_and_in_torch():
    """kernels.scatter.sampled (one compiled sweep over the sampled coordinates) reads the values and updates visited,
    prior and the kept weights exactly as the torch operations it replaces, and reports the olds, news and smallest
    prior they report."""
    from gradsift import kernels
    from gradsift.kernels.scatter import sampled

    g = torch.Generator().manual_seed(8)
    n = 100_000
    x, gsq = torch.randn(n, generator=g), torch.rand(n, generator=g)
    prior = torch.rand(n, generator=g) * 0.9 + 0.1
    idx = torch.randperm(n, generator=g)[:3000].sort().values
    runs = {}
    for backend in ("compiled", "eager"):
        for form in ("gs", "rsb", "gsb"):
            visited, pr, w = torch.zeros(n, dtype=torch.bool), prior.clone(), gsq * prior
            with kernels.using(backend):
                got = sampled(idx, x, visited, None if form == "gs" else pr, 0.9, w if form == "gsb" else None,
                              gsq if form == "gsb" else None)
            runs[backend, form] = (got, visited, pr, w)
    for form in ("gs", "rsb", "gsb"):
        (a, va, pa, wa), (b, vb, pb, wb) = runs["compiled", form], runs["eager", form]
        assert torch.equal(va, vb) and torch.equal(pa, pb) and torch.equal(wa, wb) and a[3] == b[3]
        assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(a[:3], b[:3]))
        assert torch.equal(a[0], x[idx]) and int(va.sum()) == idx.numel()
    _, _, pr, w = runs["eager", "gsb"]
    assert torch.equal(pr[idx], prior[idx] * 0.9) and torch.equal(w[idx], gsq[idx] * pr[idx])


def test_a_groups_draws_in_one_call_are_each_tensors_draw_and_bookkeeping(monkeypatch):
    """kernels.scatter.sample_many (the draws and their bookkeeping for a group, one compiled call) gives what
    bernoulli then sampled give each tensor: the positions, values, olds, news and smallest prior, the state written
    the same -- for rows without a prior (gs), with one (rsb) and with kept weights (gsb), NaN, negative and capped
    levels, lengths off the draw's blocks of 64; and where a count outruns the room sized from the expected count
    (the draw again, the bookkeeping done skipped), the same; the group's values are the rows' one after another."""
    from gradsift.kernels import draw, scatter

    g = torch.Generator().manual_seed(3)

    def state(n, form):
        base, prior = torch.rand(n, generator=g) ** 4 * 0.05, torch.rand(n, generator=g) * 0.9 + 0.1
        gsq = torch.rand(n, generator=g)
        base[: min(n, 3)] = torch.tensor([float("nan"), -1.0, 30.0])[: min(n, 3)]
        w = gsq * prior if form == "gsb" else None
        return {"base": w if form == "gsb" else prior if form == "rsb" else base, "x": torch.randn(n, generator=g),
                "visited": torch.rand(n, generator=g) < 0.1, "prior": None if form == "gs" else prior, "w": w,
                "gsq": gsq if form == "gsb" else None}

    def copy(st):
        out = {k: v.clone() if v is not None else None for k, v in st.items()}
        if st["w"] is not None:  # (gsb draws from its kept weights)
            out["base"] = out["w"]
        elif st["prior"] is not None and st["base"] is st["prior"]:
            out["base"] = out["prior"]
        return out

    def same(a, b):
        return (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    for slack in (scatter.SLACK, 1):  # (1: rooms far too small for the larger rows)
        monkeypatch.setattr(scatter, "SLACK", slack)
        forms, ns = ["gs", "rsb", "gsb"] * 3, [1, 63, 64, 65, 1000, 4099, 70_001, 130, 20_000]
        states = [state(n, f) for n, f in zip(ns, forms)]
        scales = [1.0, 3.7, 0.5, 40.0, 1.0, 0.9, 1.3, 100.0, 1.0]
        mine, ref = [copy(st) for st in states], [copy(st) for st in states]
        rows = [scatter.Sample(base=st["base"], seed=1000 + j, scale=sc, expect=0.01 * st["base"].numel(), x=st["x"],
                               visited=st["visited"], prior=st["prior"], alpha=0.9, w=st["w"], gsq=st["gsq"])
                for j, (st, sc) in enumerate(zip(mine, scales))]
        got, values = scatter.sample_many(rows)
        assert torch.equal(values, torch.cat([r[1] for r in got]))
        for j, (st, sc, out) in enumerate(zip(ref, scales, got)):
            idx = draw.bernoulli(st["base"], 1000 + j, sc)
            want = (idx, *scatter.sampled(idx, st["x"], st["visited"], st["prior"], 0.9, st["w"], st["gsq"]))
            assert all(same(a, b) for a, b in zip(out[:4], want[:4])) and out[4] == want[4], (slack, j)
            assert all(same(mine[j][k], st[k]) for k in st), (slack, j)
        assert slack == scatter.SLACK or any(r[0].numel() > 2 * 0.01 * n + 1 for r, n in zip(got, ns))


@pytest.mark.parametrize("spec", ["gs", "rsb", "gsb", "gsb:prior=never", "gsb:decay=visited", "rsb:unbiased=true"])
def test_a_groups_selection_is_each_tensors_selection(spec):
    """A sampling method's select_many (the group's draws in one call, the values cast once) sends what select sends
    tensor by tensor, step after step across refreshes (tau 3), and leaves the same state."""
    from gradsift.memory.factory import make_compressor as make

    g = torch.Generator().manual_seed(5)
    sizes = [5, 64, 1000, 3001, 40_000]
    a, b = make(spec, 0.02, seed=3, tau=3), make(spec, 0.02, seed=3, tau=3)
    for step in range(8):
        xs = [torch.randn(n, generator=g) * (1 + i) for i, n in enumerate(sizes)]
        keys = [f"t{i}" for i in range(len(sizes))]
        many = a.compress_many(keys, xs)
        one = [b.compress(k, x, check_finite=False, dense=False) for k, x in zip(keys, xs)]
        for p, q in zip(many, one):
            assert p.kind == q.kind and torch.equal(p.values, q.values), (spec, step)
            assert p.kind == P.DENSE or torch.equal(p.indices, q.indices)
        for p, x, k in zip(many, xs, keys):
            if p.kind == P.DENSE:
                a.observe(k, p, x), b.observe(k, p, x)
    def same(u, v):
        if isinstance(u, torch.Tensor):
            return torch.equal(u, v)
        if isinstance(u, (tuple, list)):
            return len(u) == len(v) and all(same(p, q) for p, q in zip(u, v))
        return u == v

    for k in a.tensors:
        sa, sb = a.tensors[k], b.tensors[k]
        assert sa.keys() == sb.keys() and all(same(v, sb[j]) for j, v in sa.items()), (spec, k)


@pytest.mark.parametrize("name", ["gaussian", "student-t(2)"])
def test_a_bound_on_the_largest_weight_skips_counts_not_results(name, monkeypatch):
    """water_level with ``top`` (GSB keeps max(w) from the window's start: the weights only shrink) returns the same
    base and scale as without; a bound under the first level skips the count, one above it changes nothing."""
    from gradsift.compressors import waterfill
    from gradsift.compressors.sampling import water_level

    counts = []
    real = waterfill.many.count_above
    monkeypatch.setattr(waterfill.many, "count_above", lambda *a, **kw: counts.append(1) or real(*a, **kw))
    w = inputs()[name].float().square()
    for k in (10, 1000, 20_000):
        ref = water_level(w, k)
        first_level = float(w.sum()) / k
        for top in (float(w.max()), float(w.max()) * 10, 1e30):
            counts.clear()
            got = water_level(w, k, top=top)
            assert got[1] == ref[1] and torch.equal(got[0], ref[0])
            assert bool(counts) == (top > first_level), (k, top, first_level)


def test_settling_a_send_subtracts_as_index_add_does_and_masks_in_the_same_sweep():
    """kernels.scatter.subtract_at (memory settling: acc[idx] -= vals, zero[idx] = 0) gives torch's index_add_ with
    alpha -1 and index_fill_, bit for bit, compiled and in torch."""
    from gradsift import kernels
    from gradsift.kernels.scatter import subtract_at

    g = torch.Generator().manual_seed(4)
    acc, u = torch.randn(50_000, generator=g), torch.randn(50_000, generator=g)
    idx = torch.randperm(50_000, generator=g)[:700].sort().values
    vals = acc[idx] * torch.rand(700, generator=g)
    want_acc, want_u = acc.clone().index_add_(0, idx, vals, alpha=-1), u.clone().index_fill_(0, idx, 0.0)
    for backend in ("compiled", "eager"):
        a, b = acc.clone(), u.clone()
        with kernels.using(backend):
            subtract_at(a, idx, vals, b)
        assert torch.equal(a, want_acc) and torch.equal(b, want_u)
        a = acc.clone()
        with kernels.using(backend):
            subtract_at(a, idx, vals)
        assert torch.equal(a, want_acc)


def test_the_wire_casts_rounding_goes_back_into_every_memory_as_index_add_puts_it():
    """kernels.scatter.add_at_many (the bf16 cast's rounding put back into a group's memories, one compiled sweep)
    gives each memory's index_add_, bit for bit; an index outside a memory is refused before that memory changes."""
    import pytest as _pytest

    from gradsift import kernels
    from gradsift.memory.wirecast import cast_many_for_wire
    from gradsift.kernels.scatter import add_at_many

    g = torch.Generator().manual_seed(5)
    mems = [torch.randn(n, generator=g) for n in (1, 700, 50_000)]
    idxs = [torch.randperm(m.numel(), generator=g)[:k] for m, k in zip(mems, (1, 70, 500))]
    vals = [torch.randn(i.numel(), generator=g) * 1e-3 for i in idxs]
    want = [m.clone().index_add_(0, i, v) for m, i, v in zip(mems, idxs, vals)]
    got = [m.clone() for m in mems]
    if kernels.compiled_lib(torch.empty(0)) is not None:
        assert add_at_many(got, idxs, vals)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with _pytest.raises(IndexError):
            add_at_many([got[1]], [torch.tensor([700])], [torch.ones(1)])
        assert torch.equal(got[1], want[1])
    with kernels.using("eager"):
        assert not add_at_many(got, idxs, vals)  # (torch adds instead)
    # the group's cast, compiled and in torch: the same memories and the same wire values
    from gradsift import make_compressor
    from gradsift import payload as P
    out = []
    for backend in ("compiled", "eager"):
        ms = [m.clone() for m in mems]
        sents = [P.sparse(v.clone() * 1e3, i, m.numel(), torch.float32, i.numel()) for m, i, v in zip(mems, idxs, vals)]
        with kernels.using(backend):
            cast_many_for_wire(make_compressor("topk", 0.01), ms, sents)
        out.append((ms, [s.values for s in sents]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(out[0][1], out[1][1]))


def test_eq13_read_literally_decays_every_visited_coordinate_every_step():
    """``decay="visited"``: at each sampling step every coordinate sampled since the window began is multiplied by
    alpha (eq. 13's S_{t-1}), so a coordinate's prior is alpha^(steps since its first sampling); the default
    (``"sampled"``) counts its samplings instead. A refresh restarts both."""
    import pytest as _pytest

    from gradsift.compressors.base import OptionError

    d, alpha = 2000, 0.8
    grad = torch.randn(d, generator=torch.Generator().manual_seed(3))
    runs = {}
    for decay in ("visited", "sampled"):
        c = make_compressor(f"rsb:decay={decay},alpha={alpha},tau=50", 0.02)
        first = torch.full((d,), -1)
        times = torch.zeros(d)
        c.observe("w", c.compress("w", grad), grad)  # step 0: the refresh
        for step in range(1, 8):
            p = c.compress("w", grad)
            first[p.indices] = torch.where(first[p.indices] < 0, step, first[p.indices])
            times[p.indices] += 1
        runs[decay] = (c.tensors["w"]["prior"].clone(), first, times)
    prior, first, _ = runs["visited"]
    expect = torch.where(first > 0, alpha ** (8 - first).clamp(min=0).double(), torch.ones(d, dtype=torch.float64))
    assert torch.allclose(prior.double(), expect, rtol=1e-5)
    prior_s, _, times_s = runs["sampled"]
    assert torch.allclose(prior_s.double(), alpha ** times_s.double(), rtol=1e-5)
    assert (runs["visited"][2] > 0).sum() > (times_s > 0).sum()  # the literal reading covers more
    with _pytest.raises(OptionError, match="decay must be one of sampled, visited"):
        make_compressor("gsb:decay=always", 0.01)


@pytest.mark.parametrize("spec", ["gsb:tau=4", "gsb:tau=4,prior=never", "gsb:tau=4,decay=visited", "rsb", "gs:tau=4"])
def test_a_checkpoint_shares_the_state_and_a_rollback_restores_it_bit_for_bit(spec):
    """The road checkpoints every step for a skip: the sampling methods' checkpoint shares their tensors (visited
    marks, prior, kept weights) and logs the entries a step writes into them, so a clean step copies none of them;
    rolling back any kind of step (a refresh, a sampled step) leaves the state a deep copy from before holds, and the
    rolled-back compressor continues as one that never saw the step."""
    from gradsift.compressors.state import clone_state

    keys = ["a", "b"]
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(4000, generator=g), torch.randn(300, generator=g)] for _ in range(12)]
    comp, twin = (make_compressor(spec, 0.05, world_size=2, seed=3) for _ in range(2))

    def step(c, gs):
        sent = [c.compress(k, x) for k, x in zip(keys, gs)]
        for k, p in zip(keys, sent):
            c.observe(k, p, p.to_dense())
        return sent

    for t, gs in enumerate(grads[:-1]):
        before = clone_state(comp.tensors)
        held = {k: comp.tensors[k].get("prior") for k in keys} if t else {}
        token = comp.checkpoint(keys)
        shared = [v for st in token["shared"].values() if st for v in st.values() if isinstance(v, torch.Tensor)]
        live = [v for st in comp.tensors.values() for v in st.values() if isinstance(v, torch.Tensor)]
        assert all(any(v is w for w in live) for v in shared)  # the checkpoint copied no tensor
        step(comp, gs)
        if t and not comp.is_refresh(t) and "visited" not in spec:  # a sampled step wrote in place: no new prior
            assert all(comp.tensors[k].get("prior") is held[k] for k in keys)
        comp.rollback(token)
        after = comp.tensors
        assert before.keys() == after.keys(), t
        for k in before:
            assert before[k].keys() == after[k].keys(), (t, k)
            for name, v in before[k].items():
                assert _same(v, after[k][name]), (t, k, name)
        a, b = step(comp, gs), step(twin, gs)  # now the step for good, on both
        for x, y in zip(a, b):
            assert x.kind == y.kind and torch.equal(x.values, y.values), t
            assert (x.indices is None and y.indices is None) or torch.equal(x.indices, y.indices), t
    for k in keys:  # the twin never rolled back: the same state
        for name, v in twin.tensors[k].items():
            assert _same(v, comp.tensors[k][name]), (k, name)


def _same(v, w) -> bool:
    """Plain state equal bit for bit (tensors, numbers with NaN equal to NaN, tuples of them)."""
    if isinstance(v, torch.Tensor):
        return isinstance(w, torch.Tensor) and torch.equal(v, w)
    if isinstance(v, (tuple, list)):
        return type(v) is type(w) and len(v) == len(w) and all(_same(a, b) for a, b in zip(v, w))
    return v == w or (v != v and w != w)


def test_a_sampling_compressor_pickles_with_a_checkpoint_open():
    """The open checkpoints' logs are weak references: pickling (a framework copying its strategy, a spawned
    worker) leaves them out, and the copy continues as the original does."""
    import pickle

    comp = make_compressor("gsb:tau=3", 0.05, seed=2)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2000, generator=g) for _ in range(6)]
    for x in xs[:4]:
        p = comp.compress("w", x)
        comp.observe("w", p, p.to_dense())
    token = comp.checkpoint(["w"])
    twin = pickle.loads(pickle.dumps(comp))
    for x in xs[4:]:
        a, b = comp.compress("w", x), twin.compress("w", x)
        assert torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)
    del token


def test_unbiased_rescaling_saturates_instead_of_sending_inf():
    """1/p rescaling of values at the top of the float range: the largest finite value, never Inf on the wire."""
    c = make_compressor("gs:tau=2,unbiased=true", 1e-9)
    x = torch.tensor([1.0, -1.0]) * torch.finfo(torch.float32).max
    for _ in range(2):  # a refresh (dense), then a sampling step
        p = c.compress("t", x)
        assert bool(torch.isfinite(p.values).all()) and p.values.numel() > 0
