"""A group's tensors selected in one call (``compress_many``, :mod:`gradsift.kernels.many`): the same selections and
memory as one call per tensor, on both kernel backends, whatever the floor guessed; nothing lost; overflow caught."""

from __future__ import annotations

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.compressors import available
from gradsift.kernels.draw import draw_k as random_indices
from gradsift.kernels.many import Guess, topk_many

BACKENDS = ["compiled", "eager"]
# small, medium, large (>= 65,536: the histogram path's size), one with k >= numel, a matrix, a 4-D kernel
SHAPES = [(64,), (3000,), (70_000,), (1,), (200, 400), (16, 8, 3, 3)]


def grads(steps: int, seed: int = 0, scale_growth: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) / torch.rand(s, generator=g).clamp_min(0.05) * scale_growth ** t
             for s in SHAPES] for t in range(steps)]


def same(p, q) -> bool:
    return (p.kind == q.kind and p.count == q.count and p.nonfinite == q.nonfinite and torch.equal(p.values, q.values)
            and (p.indices is None or torch.equal(p.indices, q.indices)))


def run(spec: str, batched: bool, steps: list, backend: str):
    keys = [f"t{i}" for i in range(len(SHAPES))]
    with kernels.using(backend):
        comp = make_compressor(spec, 0.02, world_size=2)
        out = []
        for gs in steps:
            whole = [comp.sends_dense(k, g.shape) for k, g in zip(keys, gs)]
            alike = [i for i, w in enumerate(whole) if not w]
            got = comp.compress_many([keys[i] for i in alike], [gs[i] for i in alike]) if batched else \
                [comp.compress(keys[i], gs[i], check_finite=False, dense=False) for i in alike]
            ps = dict(zip(alike, got))
            for i, w in enumerate(whole):
                if w:
                    ps[i] = comp.compress(keys[i], gs[i], check_finite=False)
            ps = [ps[i] for i in range(len(keys))]
            if comp.OBSERVES:
                for k, p in zip(keys, ps):
                    comp.observe(k, p, p.to_dense().float() * 0.7)
            out.append(ps)
        memory = {name: {k: v.clone() for k, v in store.items()} for name, store in comp.stores().items()}
    return out, memory


@pytest.mark.parametrize("name", sorted(available()) + ["topk:feedback=false", "randomk:feedback=false,shared=true",
                                                        "regtopk:feedback=false", "gaussiank:feedback=false",
                                                        "redsync:feedback=false", "sidco:dist=gp",
                                                        "sidco:feedback=false"])
def test_a_group_in_one_call_selects_what_one_call_per_tensor_does_on_both_backends(name):
    steps = grads(5, seed=hash(name) % 100, scale_growth=1.3)
    ref = run(name, False, steps, "eager")
    for backend in BACKENDS:
        for batched in (False, True):
            got = run(name, batched, steps, backend)
            for ps, qs in zip(ref[0], got[0]):
                assert all(same(p, q) for p, q in zip(ps, qs)), (name, backend, batched)
            assert ref[1].keys() == got[1].keys()
            for store in ref[1]:
                assert ref[1][store].keys() == got[1][store].keys()
                assert all(torch.equal(ref[1][store][k], got[1][store][k]) for k in ref[1][store]), (store, backend)


@pytest.mark.parametrize("spec", ["topk", "rtopk:r_over_k=3", "randomk", "regtopk", "regtopk:form=paper", "gaussiank",
                                  "redsync", "dgc:memory=ef", "sidco", "sidco:dist=gp"])
def test_error_feedback_in_one_call_loses_nothing(spec):
    steps = grads(6, seed=1)
    with kernels.using("compiled"):
        comp = make_compressor(spec, 0.02, world_size=2)
        keys = [f"t{i}" for i in range(len(SHAPES))]
        sent = {k: torch.zeros(torch.Size(s).numel(), dtype=torch.float64) for k, s in zip(keys, SHAPES)}
        for gs in steps:
            for k, p in zip(keys, comp.compress_many(keys, gs)):
                sent[k] += p.to_dense(torch.float64)
                if comp.OBSERVES:
                    comp.observe(k, p, p.to_dense())
    for i, k in enumerate(keys):
        total = sum(gs[i].reshape(-1).double() for gs in steps)
        kept = comp.residual[k].double() if k in comp.residual else 0.0
        torch.testing.assert_close(sent[k] + kept, total, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slack", [0.05, 0.9, 3.0])
def test_the_floor_decides_where_not_what(backend, slack):
    """A floor far too low (cap overflow), about right, or far too high (too few candidates): the exact top-k,
    ties at the k-th to the lowest indices, in index order, and the residual zeroed exactly there."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-40, 41, (100_000,), generator=g).float() * 0.5  # many ties at every magnitude
    add = torch.randn(100_000, generator=g) * 0.01
    k = 1234
    a = x + add
    mag = a.abs()
    kth = torch.sort(mag, descending=True).values[k - 1]
    above = torch.nonzero(mag > kth).squeeze(1)
    ties = torch.nonzero(mag == kth).squeeze(1)[:k - above.numel()]
    expect = torch.sort(torch.cat([above, ties])).values
    with kernels.using(backend):
        st = {"kth": float(kth), "slack": slack, "grow": 1.0}
        acc = x.clone()
        idx, vals = topk_many([acc], [k], [st], adds=[add], zero=True)[0]
    assert torch.equal(torch.sort(idx).values, expect)
    assert torch.equal(vals, a[idx])
    left = a.clone()
    left[idx] = 0
    assert torch.equal(acc, left)
    assert st["kth"] == float(kth)  # the guess learned the k-th magnitude


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wire_bf16", [False, True])
def test_ties_at_the_kth_among_the_candidates_go_to_the_lowest_indices(backend, wire_bf16):
    """Every candidate recorded (the floor under the k-th), thousands of entries tied exactly at the k-th magnitude
    spread over the tensor, fewer of them wanted than there are: those of the lowest indices, in index order, with
    their values (in bf16 with the wire's cast, memory keeping what it rounds off), whatever the sizes."""
    g = torch.Generator().manual_seed(12)
    for n, k in [(100_003, 1500), (40_961, 777), (5_000, 33)]:
        x = torch.randn(n, generator=g) * 0.1
        pos = torch.randperm(n, generator=g)
        tied, above = pos[:2 * k], pos[2 * k:2 * k + k // 2]
        x[tied] = 5.0 * torch.sign(torch.randn(tied.numel(), generator=g))
        x[above] = 6.0 + torch.rand(above.numel(), generator=g)
        expect = torch.sort(torch.cat([above, torch.sort(tied).values[:k - above.numel()]])).values
        with kernels.using(backend):
            st = {"kth": 5.0, "slack": 0.9, "grow": 1.0}  # (candidates: every entry at or above 4.5)
            acc = x.clone()
            idx, vals = topk_many([acc], [k], [st], adds=[torch.zeros(n)], zero=True, wire_bf16=wire_bf16)[0]
        assert torch.equal(idx, expect), (n, k)
        assert torch.equal(vals.float(), x[idx].to(vals.dtype).float())
        left = x.clone()
        left[idx] = x[idx] - vals.float()
        assert torch.equal(acc, left)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("share", [0.0, 0.3, 0.9])
def test_the_kth_found_in_the_first_the_last_or_a_middle_bin_of_the_candidates(backend, share):
    """Magnitudes spread over 2^-60..2^60 (far more 16-bit keys than the candidates' histogram has bins: the first
    bin holds every key below the last's 2,047, the last the largest), k = 1 (the k-th in the last bin), a third
    (a middle bin) or nine tenths of the entries (the first bin), sizes not a multiple of 8: the exact top-k."""
    g = torch.Generator().manual_seed(11)
    n = 5003
    x = torch.exp2(torch.rand(n, generator=g) * 120 - 60) * torch.sign(torch.randn(n, generator=g))
    x[::97] = x[5]  # ties at one magnitude
    k = max(1, int(share * n))
    mag = x.abs()
    kth = torch.sort(mag, descending=True).values[k - 1]
    above = torch.nonzero(mag > kth).squeeze(1)
    expect = torch.sort(torch.cat([above, torch.nonzero(mag == kth).squeeze(1)[:k - above.numel()]])).values
    with kernels.using(backend):
        floor = torch.sort(mag, descending=True).values[min(n - 1, 3 * k + 10)]  # candidates within the cap
        st = {"kth": float(floor), "slack": 1.0, "grow": 1.0}
        acc, fin = x.clone(), []
        idx, vals = topk_many([acc], [k], [st], zero=True, finite=fin)[0]
    assert fin == [True]  # (selected by the pass, not the histogram path)
    assert torch.equal(idx, expect) and torch.equal(vals, x[idx])


def test_random_k_in_the_pass_draws_the_indices_random_indices_draws():
    comp = make_compressor("randomk:shared=true", 0.01, feedback=False, seed=7)
    for n in (50, 3000, 80_000):
        x = torch.randn(n)
        p = comp.compress("w", x)
        step = comp.tensors["w"]["step"] - 1
        idx = random_indices(n, max(1, round(0.01 * n)), comp.draw_seed("w", step, shared=True), x.device)
        assert torch.equal(p.indices, idx) and torch.equal(p.values, x[idx])
        comp.tensors.clear()


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_momentum_correction_in_the_pass_rounds_as_torch(nesterov, backend):
    """DGC's velocity updated by the compiled pass equals MomentumCorrection's torch arithmetic bit for bit."""
    steps = grads(5, seed=2)
    keys = [f"t{i}" for i in range(len(SHAPES))]
    with kernels.using(backend):
        a = make_compressor("dgc", 0.02, momentum=0.9, nesterov=nesterov)
        b = make_compressor("dgc", 0.02, momentum=0.9, nesterov=nesterov)
        for gs in steps:
            pa = a.compress_many(keys, gs)
            pb = [b.compress(k, g, check_finite=False, dense=False) for k, g in zip(keys, gs)]
            assert all(same(p, q) for p, q in zip(pa, pb))
    for k in keys:
        assert torch.equal(a.u[k], b.u[k]) and torch.equal(a.v[k], b.v[k])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pass_copies_out_the_strided_sample_as_it_updates(backend):
    """scan_many's samples (DGC's threshold estimate) are x[start::stride][:count] of the updated tensor, whatever
    the start, stride and length (inside 64-entry blocks, across them, in the tail, count beyond the end)."""
    from gradsift.kernels.many import scan_many

    g = torch.Generator().manual_seed(8)
    for n, plan in [(1, (0, 1, 1)), (100, (3, 7, 14)), (1000, (0, 1, 1000)), (70_001, (99, 100, 700)),
                    (70_001, (5, 64, 5000)), (130, (129, 2, 9)), (64, (0, 65, 3))]:
        x, a = torch.randn(n, generator=g), torch.randn(n, generator=g)
        u = torch.randn(n, generator=g)
        want = x.clone()
        uu = u.clone()
        uu.mul_(0.9).add_(a)
        want.add_(uu)
        with kernels.using(backend):
            (scan,) = scan_many([x], [a], [1.0], [n], ([u], 0.9, False), [plan])
        assert torch.equal(x, want) and torch.equal(scan.sample, want[plan[0]::plan[1]][:plan[2]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pass_reads_the_largest_magnitude_and_so_finiteness(backend):
    """The pass's ``top`` is the bit pattern of max |x| after the update (plain add, momentum, no add), on every
    length (the 64-entry blocks and the tail), so that no caller reads the tensor again for finiteness or its max."""
    from gradsift.kernels.many import INF_BITS, _bits, scan_many

    g = torch.Generator().manual_seed(5)
    sizes = (1, 63, 64, 65, 1000, 70_001)
    for poison in (None, float("inf"), float("-inf"), float("nan")):
        xs = [torch.randn(n, generator=g) for n in sizes]
        adds = [torch.randn(n, generator=g) * 3 for n in sizes]
        us = [torch.randn(n, generator=g) for n in sizes]
        if poison is not None:
            for i, x in enumerate(xs):
                x[(7 * i + 3) % x.numel()] = poison
        for mode in ("add", "momentum", "none"):
            x2, a2, u2 = [x.clone() for x in xs], [a.clone() for a in adds], [u.clone() for u in us]
            with kernels.using(backend):
                out = scan_many(x2, a2 if mode != "none" else [None] * len(x2), [1.0] * len(x2), [10**6] * len(x2),
                                (u2, 0.9, False) if mode == "momentum" else None)
            for x, scan in zip(x2, out):
                if poison is None:
                    assert scan.top == _bits(float(x.abs().max())) and scan.top < INF_BITS
                else:
                    assert scan.top >= INF_BITS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("room", [1 << 20, 16])
def test_counting_and_taking_above_a_threshold_compare_as_torch_does(backend, room, monkeypatch):
    """kernels.many.count_above / take_above (the threshold methods' counts on candidates and tensors) give what
    ``|v| > t`` (``>=``) gives in torch -- t rounded to float32 as torch rounds a number, ties at t, signs -- with
    positions mapped through ``idx`` and values in order; with room for every entry or counted first."""
    from gradsift.kernels import many
    from gradsift.kernels.many import count_above, take_above

    monkeypatch.setattr(many, "TAKE_ROOM", room)

    g = torch.Generator().manual_seed(6)
    v = torch.randn(10_001, generator=g)
    v[::7] = 0.5
    v[3::11] = -0.5
    v[5] = 1.0000001192092896
    idx = torch.arange(v.numel(), dtype=torch.int64) * 3 + 1
    with kernels.using(backend):
        for t in (0.0, 0.5, 0.49999999, 1.00000010, 1.00000013, 2.0, 1e30, 3.5e38):
            for inclusive in (False, True):
                mask = v.abs() >= t if inclusive else v.abs() > t
                assert count_above(v, t, inclusive) == int(mask.sum())
                for pos in (None, idx):
                    got_i, got_v = take_above(v, pos, t, inclusive)
                    want = torch.nonzero(mask).squeeze(1)
                    assert torch.equal(got_i, want if pos is None else idx[want]) and torch.equal(got_v, v[want])


@pytest.mark.parametrize("spec", ["topk", "randomk", "gaussiank", "redsync", "regtopk", "rtopk", "dgc", "sidco",
                                  "sidco:dist=gp"])
def test_an_overflow_of_the_memory_is_flagged_and_dropped(spec):
    comp = make_compressor(spec, 0.02)
    keys = ["a", "b"]
    big = torch.full((70_000,), 3.0e38)
    for _ in range(2):
        comp.compress_many(keys, [torch.randn(70_000), torch.randn(500, 2)])
    ps = comp.compress_many(keys, [big, torch.randn(500, 2)])
    ps = comp.compress_many(keys, [big, torch.randn(500, 2)])  # 3e38 + 3e38 overflows in memory
    assert ps[0].nonfinite and not ps[1].nonfinite
    assert "a" not in comp.residual and torch.isfinite(ps[1].values).all()


def test_the_guess_is_plain_numbers_kept_with_the_tensor_state():
    comp = make_compressor("topk", 0.01)
    comp.compress_many(["w"], [torch.randn(100_000)])
    comp.compress_many(["w"], [torch.randn(100_000)])
    st = comp.inner.tensors["w"]
    assert all(isinstance(st[k], float) for k in ("kth", "slack", "grow"))
    assert Guess.floor(st, 100_000, 1000) is not None


def test_the_candidates_room_is_kept_between_calls_and_never_what_a_selection_returns():
    """Top-k's candidates live in buffers kept between calls (a fresh allocation each call costs a page fault per
    4 KiB touched): the next call writes over them, so no selection may be a view of them."""
    if kernels.backend() != "compiled":
        pytest.skip("the compiled pass keeps the buffers (no C compiler here)")
    from gradsift.kernels import buffers

    comp = make_compressor("topk", 0.05)
    keys = [f"t{i}" for i in range(len(SHAPES))]
    first = None
    for step, gs in enumerate(grads(6)):
        got = comp.compress_many(keys, gs)
        kept = [(p.indices.clone(), p.values.clone()) for p in got]
        room = buffers.ROOM.bufs[0].data_ptr()
        if step >= 2:  # (the first calls have no floors yet: the room grows to the guesses' caps, then stays)
            first = first or room
            assert room == first
        comp.compress_many(keys, [g * 3 for g in gs])  # writes over the candidates' room
        for p, (idx, vals) in zip(got, kept):
            assert torch.equal(p.indices, idx) and torch.equal(p.values, vals), step


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("wire_bf16", [False, True])
def test_plain_rows_built_a_column_at_a_time_ask_what_rows_built_one_at_a_time_do(wire_bf16, scored, monkeypatch):
    """The compiled pass's two ways of filling its spec (a group asking for top-k alone or of scores, REGTOP-k's, a
    column at a time; any group, a row at a time) give the same selections, values, residuals and guesses -- with
    sources and without, a floor that misses, a non-finite tensor."""
    import gradsift.kernels.many as many

    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    g = torch.Generator().manual_seed(3)
    sizes = [5000, 70_000, 3000, 40_000]
    base = [torch.randn(n, generator=g) for n in sizes]
    adds = [torch.randn(n, generator=g) for n in sizes]
    srcs = [None, torch.randn(70_000, generator=g), None, torch.randn(40_000, generator=g)]
    base[2][7] = float("inf")  # a non-finite tensor: its values stay float32
    ks = [50, 700, 30, 400]
    runs = {}
    real_topk = many.topk
    for way in ("plain", "rows"):
        if way == "rows":
            monkeypatch.setattr(many, "columns", lambda x: False)
        xs = [b.clone() for b in base]
        # (floors where about 2k reach them: the pass selects, but for the second, whose floor misses)
        sts = [{"kth": 3.6, "slack": 0.9, "grow": 1.0}, {"kth": 9.0, "slack": 0.9, "grow": 1.0},
               {"kth": 3.6, "slack": 0.9, "grow": 1.0}, {"kth": 3.6, "slack": 0.9, "grow": 1.0}]
        fin = [False] * 4
        scores = [(torch.randperm(n, generator=torch.Generator().manual_seed(n))[: n // 20].sort().values,
                   torch.rand(n // 20, generator=torch.Generator().manual_seed(n + 1)) * 1.5, 0.98)
                  for n in sizes] if scored else None

        def rank(i, xs=xs):  # (the whole tensor scored where the pass cannot settle it: either way, the same call)
            s = xs[i].abs() * scores[i][2]
            s[scores[i][0]] = xs[i][scores[i][0]].abs() * scores[i][1]
            idx = torch.topk(s, ks[i]).indices.sort().values
            return idx, float(s[idx].min())

        calls = []
        monkeypatch.setattr(many, "topk", lambda *a, **kw: calls.append(1) or real_topk(*a, **kw))
        got = topk_many(xs, ks, sts, adds=adds, zero=True, finite=fin, srcs=srcs, wire_bf16=wire_bf16,
                        scores=scores, rank=lambda i: calls.append(1) or rank(i))
        selected = len(sizes) - len(calls)
        runs[way] = (got, xs, sts, fin, selected)
    (a, xa, sa, fa, na), (b, xb, sb, fb, nb) = runs["plain"], runs["rows"]
    assert na == nb == 3  # (the pass selected all but the miss)
    for (ia, va), (ib, vb), x1, x2 in zip(a, b, xa, xb):
        assert torch.equal(ia, ib) and va.dtype == vb.dtype and torch.equal(va, vb) and torch.equal(x1, x2)
    assert sa == sb and fa == fb


def test_scans_built_a_column_at_a_time_give_what_rows_built_one_at_a_time_do(monkeypatch):
    """A group asking for its candidates alone (a threshold method's pass) gets the same candidates, counts, largest
    magnitudes and accumulated tensors whichever way its spec is filled -- floors and none (the non-finite entries
    only), sources and none, a cap the floor overflows, a non-finite tensor."""
    import gradsift.kernels.many as many

    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    g = torch.Generator().manual_seed(4)
    sizes = [5000, 70_000, 3000, 40_000, 900]
    base = [torch.randn(n, generator=g) for n in sizes]
    adds = [torch.randn(n, generator=g) for n in sizes]
    adds[4] = None
    srcs = [None, torch.randn(70_000, generator=g), None, torch.randn(40_000, generator=g), None]
    base[2][7], base[4][3] = float("inf"), float("nan")
    floors, caps = [2.5, 3.0, None, 0.5, 1.0], [400, 4000, 64, 500, 900]  # (the fourth's floor overflows its cap)
    runs = {}
    for way in ("plain", "rows"):
        if way == "rows":
            monkeypatch.setattr(many, "columns", lambda x: False)
        xs = [b.clone() for b in base]
        runs[way] = (many.scan_many(xs, adds, floors, caps, srcs=srcs), xs)
    (a, xa), (b, xb) = runs["plain"], runs["rows"]
    assert [s.result is None for s in a] == [False, False, False, True, False]
    bits = lambda t: t.view(torch.int32)  # noqa: E731 (bit for bit, NaN included)
    for sa, sb, x1, x2 in zip(a, b, xa, xb):
        assert (sa.count, sa.top, sa.kth, sa.sample) == (sb.count, sb.top, sb.kth, sb.sample)
        assert (sa.result is None) == (sb.result is None) and torch.equal(bits(x1), bits(x2))
        if sa.result is not None:
            assert torch.equal(sa.idx, sb.idx) and torch.equal(bits(sa.vals), bits(sb.vals))
    assert a[2].count == 1 and a[2].idx.tolist() == [7] and 3 in a[4].idx.tolist() and a[4].top > many.INF_BITS


def test_gaussiank_corrections_in_one_call_are_the_python_ones():
    """GaussianK's corrections of a group in one compiled call (kernels.many.gaussk_corrections) end at the threshold
    GaussianK.correct reaches: thresholds at or above the floor counted on the candidates, under it the floor's count
    where more than 4k/3 reached it and a count over the tensor where fewer did, negative, huge and NaN first
    thresholds, the printed steps and the bracket, any number of rounds."""
    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    from gradsift.compressors.tails import Tail
    from gradsift.kernels.many import gaussk_corrections

    g = torch.Generator().manual_seed(6)
    for spec in ("gaussiank", "gaussiank:refine=paper", "gaussiank:rounds=0", "gaussiank:rounds=20"):
        c = make_compressor(spec, 0.01).inner
        rows, want = [], []
        for n, floor, k in [(5000, 1.5, 50), (5000, 3.0, 50), (5000, 12.0, 50), (20_000, 0.2, 10), (300, 0.0, 3),
                            (64, 2.0, 1)]:
            x = torch.randn(n, generator=g) * (1 + torch.rand(n, generator=g) * 4)
            idx = torch.nonzero(x.abs() >= floor).squeeze(1)
            tail = Tail(x, floor, idx, x[idx], idx.numel(), None)
            for thr in (0.5, 2.2, 4.0, 9.0, -1.0, float("nan"), 1e39, float(floor)):
                rows.append((thr, k, tail.vals, tail.floor_bits, tail.count, x, c._rounds(),
                             c.options["refine"] == "paper"))
                want.append(c.correct(thr, k, tail))
        got = gaussk_corrections(rows)
        assert all(a == b or (a != a and b != b) for a, b in zip(got, want)), (spec, got, want)


def test_a_take_over_the_wire_capacity_keeps_what_the_cut_after_it_kept():
    """take_above_many with capacities: more entries above the threshold than the wire holds -> the capacity of
    largest magnitude stay, in index order, in bf16, the memory keeping what the cast rounds off, the others left in
    memory as they were, the overflow counted -- what taking them all, fit_capacity's cut (the dropped added back)
    and the wire's cast give; within the capacity, the cast alone; where magnitudes tie across the cut, every one
    taken and zeroed as without capacities (fit_capacity cuts later)."""
    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    from gradsift import payload as P
    from gradsift.kernels.many import take_above_many

    g = torch.Generator().manual_seed(9)
    rows = []
    for n, t, cap in [(5000, 1.5, 50), (5000, 1.5, 5000), (20_001, 0.5, 1), (3000, 2.5, 7)]:
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
        rows.append((x, t, cap))
    tied = torch.randn(4000, generator=g)
    tied[::40] = 3.0  # 100 entries tie at the largest magnitude, the cut among them
    rows.append((tied, 1.0, 60))
    floor = 0.4
    mems = [x.clone() for x, _, _ in rows]
    cands = [torch.nonzero(m.abs() >= floor).squeeze(1) for m in mems]
    got = take_above_many([m[c] for m, c in zip(mems, cands)], cands, [t for _, t, _ in rows], mems,
                          [cap for _, _, cap in rows])
    for (x, t, cap), mem, (idx, vals, over) in zip(rows, mems, got):
        above = torch.nonzero(x.abs() > t).squeeze(1)
        p = P.sparse(x[above], above, x.numel(), x.dtype, cap)
        p.capacity = cap
        left = x.clone()
        left[above] = 0.0
        mag = x[above].abs()
        tie = above.numel() > cap and int((mag >= torch.topk(mag, cap).values.min()).sum()) > cap
        dropped = P.fit_capacity(p) if above.numel() > cap and not tie else None
        if tie:  # (ties across the cut: taken whole, float32, zeroed)
            assert torch.equal(idx, above) and torch.equal(vals, x[above]) and over == 0 and torch.equal(mem, left)
            continue
        if dropped is not None:
            left[dropped.indices] += dropped.values
        wire = p.values.to(torch.bfloat16)
        left[p.indices] = p.values - wire.float()
        assert torch.equal(idx, p.indices) and vals.dtype == torch.bfloat16 and torch.equal(vals, wire)
        assert over == above.numel() - p.count and torch.equal(mem, left), (x.numel(), cap)


def test_redsync_searches_in_one_call_are_the_python_ones():
    """RedSync's searches of a group in one compiled call (kernels.many.redsync_searches) end at the threshold
    RedSync.threshold reaches: counts on the candidates at or above the floor, under it the floor's count where more
    than 2k reached it and a count over the tensor where fewer did; any width, means and maxima from the tail (a NaN
    mean included), tensors whose every entry ties."""
    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    from gradsift.compressors.tails import Tail
    from gradsift.kernels.many import _bits, redsync_searches

    g = torch.Generator().manual_seed(7)
    for tol in (0.2, 0.05, 0.001, 0.9):
        c = make_compressor(f"redsync:tol={tol}", 0.01).inner
        rows, want = [], []
        for n, floor, k in [(5000, 1.5, 50), (5000, 3.0, 50), (5000, 12.0, 50), (20_000, 0.2, 10), (300, 0.0, 3),
                            (64, 2.0, 1), (4000, 0.5, 40)]:
            x = torch.randn(n, generator=g) * (1 + torch.rand(n, generator=g) * 4)
            if n == 4000:
                x = torch.full((n,), 0.75)  # every magnitude ties
            idx = torch.nonzero(x.abs() >= floor).squeeze(1)
            top = _bits(float(x.abs().max()))
            tail = Tail(x, floor, idx, x[idx], idx.numel(), top)
            for mean in (tail.abs_sum() / n, 0.1, float("nan")):
                tail.abs_sum = lambda m=mean, d=n: m * d  # (the mean the search starts from)
                rows.append((tail.abs_sum() / n, k, tail.vals, tail.floor_bits, tail.count, x, tail.max_abs(), tol))
                want.append(c.threshold(x, k, tail))
        got = redsync_searches(rows)
        assert all(a == b or (a != a and b != b) for a, b in zip(got, want)), (tol, got, want)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_of_tensors_sent_whole_in_one_call_is_the_foreach_one(nesterov):
    """DGC's tensors sent whole (biases, norms): the compiled update, copy and settling of a group
    (kernels.scatter.momentum_whole) against the torch foreach path, bit for bit, over several steps -- what is sent,
    u and v -- and a tensor that overflows is flagged (its memory dropped) while the others settle."""
    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    g = torch.Generator().manual_seed(13)
    shapes = [(64,), (1000,), (3,), (257,)]
    keys = [f"b{i}" for i in range(len(shapes))]
    runs = {}
    for backend in ("compiled", "eager"):
        with kernels.using(backend):
            c = make_compressor("dgc", 0.01, momentum=0.9, nesterov=nesterov)
            g.manual_seed(13)
            sent = []
            for step in range(4):
                grads = [torch.randn(s, generator=g) * 10 ** (step - 1) for s in shapes]
                if step == 3:
                    grads[1][5] = float("inf")
                sent.append([(p.values.clone(), p.nonfinite) for p in c.send_whole_many(keys, grads, [False] * 4)])
            runs[backend] = (sent, {k: t.clone() for k, t in c.u.items()}, {k: t.clone() for k, t in c.v.items()})
    (sa, ua, va), (sb, ub, vb) = runs["compiled"], runs["eager"]
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) and f == h
               for step_a, step_b in zip(sa, sb) for (x, f), (y, h) in zip(step_a, step_b))
    assert ua.keys() == ub.keys() == va.keys() == vb.keys() and "b1" not in ua  # (the overflowed memory dropped)
    assert all(torch.equal(ua[k], ub[k]) and torch.equal(va[k], vb[k]) for k in ua)
    assert sa[3][1][1] and not sa[3][0][1]
