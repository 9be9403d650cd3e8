"""Selection kernels: exact, identical on the compiled and eager paths, fused with error feedback, never a hard failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift import payload as P

BACKENDS = ["compiled", "eager"]
N = 200_000


def adversarial(name: str, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(name) % 1000)
    if name == "gaussian":
        return torch.randn(n, generator=g)
    if name == "all-equal":
        return torch.full((n,), -0.5)
    if name == "many-zeros":
        x = torch.zeros(n)
        x[torch.randperm(n, generator=g)[: n // 50]] = torch.randn(n // 50, generator=g)
        x[:10] = -0.0
        return x
    if name == "heavy-tail":  # Student-t(1): magnitudes over many orders
        return torch.randn(n, generator=g) / torch.randn(n, generator=g).abs().clamp_min(1e-30)
    if name == "ties":  # a few distinct values, many ties at every k
        return torch.randint(-3, 4, (n,), generator=g).float() * 0.25
    if name == "tiny-and-huge":
        x = torch.randn(n, generator=g) * 1e-40  # subnormals
        x[::1000] = 3.0e38
        return x
    raise ValueError(name)


CASES = ["gaussian", "all-equal", "many-zeros", "heavy-tail", "ties", "tiny-and-huge"]


def ks(n: int) -> list[int]:
    return [1, 2, 17, n // 1000, n // 100, n // 10, n // 2, n - 1, n]


@pytest.mark.parametrize("case", CASES)
def test_exact_topk_same_set_as_torch_up_to_ties_and_identical_on_both_paths(case):
    x = adversarial(case)
    a = x.abs()
    for k in ks(N):
        out = {}
        for b in BACKENDS:
            with kernels.using(b):
                out[b] = kernels.topk(x, k)
        (ic, vc), (ie, ve) = out["compiled"], out["eager"]
        assert torch.equal(ic, ie) and torch.equal(vc, ve), (case, k)
        assert ic.numel() == k and ic.unique().numel() == k and torch.equal(vc, x[ic])
        ref = torch.topk(a, k, sorted=True).values
        kth = ref[-1]
        # same multiset of magnitudes as torch.topk; ties at the k-th magnitude go to the lowest indices
        assert torch.equal(a[ic].sort(descending=True).values, ref), (case, k)
        tied = torch.nonzero(a == kth).squeeze(1)
        chosen_ties = ic[a[ic] == kth].sort().values
        assert torch.equal(chosen_ties, tied[: chosen_ties.numel()]), (case, k)


@pytest.mark.parametrize("case", CASES)
def test_threshold_selection_is_strict_and_identical_on_both_paths(case):
    x = adversarial(case)
    a = x.abs()
    for t in [0.0, float(a.median()), float(a.max()), float(a.max()) * 2, float(a[a > 0].min()) if (a > 0).any() else 1.0]:
        out = {}
        for b in BACKENDS:
            with kernels.using(b):
                out[b] = kernels.select_above(x, t)
        assert torch.equal(out["compiled"][0], out["eager"][0]) and torch.equal(out["compiled"][1], out["eager"][1])
        idx = out["compiled"][0]
        assert torch.equal(idx.sort().values, torch.nonzero(a > t).squeeze(1)), (case, t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_accumulate_select_zero_is_exact(backend):
    g = torch.Generator().manual_seed(7)
    r = torch.randn(N, generator=g)
    grad = torch.randn(N, generator=g)
    acc = r + grad
    with kernels.using(backend):
        h = kernels.abs_histogram(r, add=grad)
        assert torch.equal(r, acc)  # the histogram pass accumulated in place
        idx, vals = kernels.topk(r, N // 100, hist=h, zero=True)
    assert torch.equal(vals, acc[idx])
    expect = acc.clone()
    expect[idx] = 0
    assert torch.equal(r, expect)  # residual = accumulated - sent, exactly


@pytest.mark.parametrize("spec", ["topk", "topk:value_dtype=fp16", "sidco", "sidco:dist=gp", "sidco:dist=gamma",
                                  "regtopk", "regtopk:form=paper", "rtopk", "dgc:memory=ef", "randomk", "gaussiank",
                                  "redsync"])
def test_compressors_give_identical_payloads_and_lose_nothing_on_both_paths(spec):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(300, 400, generator=g) / torch.rand(300, 400, generator=g).clamp_min(0.05) for _ in range(6)]
    runs = {}
    for b in BACKENDS:
        with kernels.using(b):
            comp = make_compressor(spec, 0.01, world_size=2)
            sent = torch.zeros(120_000, dtype=torch.float64)
            out = []
            for x in grads:
                p = comp.compress("w", x)
                if comp.OBSERVES:
                    comp.observe("w", p, p.to_dense())
                out.append(p)
                sent += p.to_dense(torch.float64)
            runs[b] = (out, sent, comp.residual["w"].clone())
    for pc, pe in zip(runs["compiled"][0], runs["eager"][0]):
        assert pc.kind == pe.kind and torch.equal(pc.values, pe.values) and torch.equal(pc.indices, pe.indices)
    total = sum(x.reshape(-1).double() for x in grads)
    for b in BACKENDS:
        torch.testing.assert_close(runs[b][1] + runs[b][2].double(), total, rtol=1e-6, atol=1e-4)


def test_sidco_estimate_is_right_on_mixed_scales_and_exact_zeros_from_the_first_call():
    """A whole-model-like vector: layers of scales 1e-4..1, half of it an embedding's exact zeros."""
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(400_000, generator=g) * s for s in (1.0, 0.1, 0.01, 1e-4)]
    emb = torch.zeros(1_600_000)
    rows = torch.randperm(16_000, generator=g)[:300]
    emb.view(16_000, 100)[rows] = torch.randn(300, 100, generator=g) * 0.3
    x = torch.cat(parts + [emb])
    for dist in ("exp", "gp", "gamma"):
        for ratio in (0.1, 0.01, 0.001):
            comp = make_compressor(f"sidco:dist={dist},feedback=false", ratio)
            first = comp.compress("model", x)
            assert 0.8 <= first.count / first.target <= 1.25, (dist, ratio, first.count / first.target)


def test_unavailable_compiler_means_one_warning_then_eager(tmp_path):
    code = ("import warnings, torch; from gradsift import kernels, make_compressor\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    p = make_compressor('topk', 0.01).compress('w', torch.randn(100_000))\n"
            "    p = make_compressor('topk', 0.01).compress('w', torch.randn(100_000))\n"
            "print(kernels.backend(), p.count, sum('eager path' in str(x.message) for x in w))\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), PATH=str(tmp_path), GRADSIFT_CACHE=str(tmp_path / "c"))
    env.pop("GRADSIFT_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["eager", "1000", "1"]
    forced = subprocess.run([sys.executable, "-c", "from gradsift import kernels; kernels.backend()"],
                            capture_output=True, text=True, env=dict(env, GRADSIFT_KERNELS="compiled"), timeout=120)
    assert forced.returncode != 0 and "KernelUnavailable" in forced.stderr and "could not compile" in forced.stderr


def test_ranks_starting_at_once_build_the_kernels_once(tmp_path):
    cc = tmp_path / "cc"  # a compiler that logs each call, takes a second, and writes an empty library
    cc.write_text(f"#!/bin/sh\necho call >> {tmp_path / 'calls'}\nsleep 1\nout=\n"
                  "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n: > \"$out\"\n")
    cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc), GRADSIFT_CACHE=str(tmp_path / "cache"))
    code = "from gradsift.kernels import native; print(native.build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1  # the same library for all three
    assert (tmp_path / "calls").read_text().split() == ["call"]  # compiled by one of them


def test_payload_kind_and_order_are_deterministic():
    x = adversarial("ties")
    with kernels.using("compiled"):
        a = kernels.topk(x, N // 10)
        b = kernels.topk(x, N // 10)
    assert torch.equal(a[0], b[0])
    p = make_compressor("topk:feedback=false", 0.1).compress("w", x)
    assert p.kind == P.SPARSE and p.count == N // 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_last_bucket_picks_the_lowest_indices_at_ties_whether_its_candidates_are_few_or_many(backend):
    g = torch.Generator().manual_seed(5)
    few = torch.randn(N, generator=g)  # a handful of candidates share the threshold bucket: the sort path
    many = torch.randint(1, 3, (N,), generator=g).float()  # 100k candidates, all tied: the counting path
    for x in (few, many):
        for k in (1, 17, N // 100, N // 3):
            ref = torch.sort(x.abs(), descending=True, stable=True).indices[:k]  # ties: the lower index first
            with kernels.using(backend):
                idx, vals = kernels.topk(x.clone(), k)
            assert torch.equal(torch.sort(idx).values, torch.sort(ref).values)
            assert torch.equal(vals, x[idx])


@pytest.mark.parametrize("case", CASES)
def test_the_gpu_top_k_finishing_torch_topk_gives_the_histogram_kernels_results(case):
    """``_topk_gpu`` (torch.topk's radix select, ties re-chosen by lowest index) is device-agnostic code: run on
    the CPU here it must give the compiled kernels' indices, values, order and zeroing exactly."""
    x = adversarial(case)
    for k in ks(N)[:-1]:
        with kernels.using("compiled"):
            ic, vc = kernels.topk(x, k)
        xg = x.clone()
        ig, vg = kernels._topk_gpu(xg, k, zero=True)
        assert torch.equal(ic, ig) and torch.equal(vc, vg), (case, k)
        expect = x.clone()
        expect[ic] = 0
        assert torch.equal(xg, expect), (case, k)


def test_the_gpu_top_k_of_a_group_with_one_host_read_gives_each_tensors_results():
    """``topk_each`` (a GPU group's top-k: the steps of ``_topk_gpu`` for every tensor, one host read between) is
    device-agnostic: on the CPU it gives each tensor the compiled kernels' indices, values and zeroing, with k's
    of every kind in one group (0, under n, n and more, a non-float32 tensor)."""
    xs = [adversarial(case, 5_000 + 997 * i) for i, case in enumerate(CASES)]
    xs += [torch.randn(300), torch.randn(40), torch.randn(500, dtype=torch.float64)]
    want_k = [ks(x.numel())[i % 3] for i, x in enumerate(xs[:len(CASES)])] + [0, 40, 25]
    with kernels.using("compiled"):
        want = [kernels.topk(x.clone(), k, zero=True) for x, k in zip(xs, want_k)]
    got_x = [x.clone() for x in xs]
    got = kernels.topk_each(got_x, want_k, zero=True)
    for x, gx, (ic, vc), (ig, vg), k in zip(xs, got_x, want, got, want_k):
        assert torch.equal(ic, ig) and torch.equal(vc, vg), k
        expect = x.clone()
        expect[ic] = 0
        assert torch.equal(gx, expect), k


@pytest.mark.parametrize("n", [176, 70_000])
def test_ties_at_the_kth_magnitude_go_to_the_lowest_indices_at_any_size(n):
    """topk_lowest_ties: the histogram path's set at any size (under 65,536 entries top-k is torch.topk's, whose
    ties come in no set order) -- what DGC keeps past 1.3 k, as the compiled pass does."""
    x = torch.full((n,), -1.5)
    x[n // 2: n // 2 + 7] = 2.0
    want = sorted([*range(33), *range(n // 2, n // 2 + 7)])
    assert sorted(kernels.topk_lowest_ties(x.abs(), 40).tolist()) == want
    if n >= 65_536:
        assert sorted(kernels.topk(x, 40)[0].tolist()) == want


def test_a_gradients_two_figures_in_one_read_are_torchs():
    """What the Adam recipe's watch on ``p.grad`` records (``figures_many``): each tensor's L2 norm as torch's, to
    float64's rounding of a sum in another order, and its largest entry exactly torch's (NaN where one is NaN, 0 for
    an empty tensor); the same entries give the same bits; the eager backend leaves it to torch."""
    from gradsift.kernels.figures import figures_many

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=g) * 10 ** e for s, e in [((1000,), 0), ((7, 3), -3), ((0,), 0), ((5,), 2),
                                                                  ((300, 301), 1), ((9,), 0)]]
    grads[3].fill_(-2.0)  # (every entry negative: the largest is not 0)
    grads[5][4] = float("nan")
    with kernels.using("compiled"):
        l2, top = figures_many(grads)
        again = figures_many([x.clone() for x in grads])
    want_l2 = torch.tensor([float(x.double().norm()) for x in grads], dtype=torch.float64)
    want_top = torch.tensor([float(x.max()) if x.numel() else 0.0 for x in grads], dtype=torch.float64)
    ok = ~torch.isnan(want_top)
    assert torch.allclose(l2[:5], want_l2[:5], rtol=1e-12, atol=0) and torch.isnan(l2[5])
    assert torch.equal(top[ok], want_top[ok]) and torch.isnan(top[5])
    assert torch.equal(again[0][:5], l2[:5]) and torch.equal(again[1][ok], top[ok])
    with kernels.using("eager"):
        assert figures_many(grads) is None
    assert figures_many([torch.randn(4, dtype=torch.float64)]) is None
