"""rTop-k: Proposition 1's identity, exactly k sent, r = N*k by default."""

from __future__ import annotations

import torch

from gradsift import make_compressor


def test_proposition_1_identity_monte_carlo():
    d, k, r, trials = 200, 10, 40, 6000
    w = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sq = w.square().sort(descending=True).values
    expect = (1 - k / r) * sq[:r].sum() + sq[r:].sum()
    comp = make_compressor("rtopk:feedback=false", k / d, r_over_k=r / k)
    errs = []
    for t in range(trials):
        p = comp.compress("w", w)
        assert p.count == k
        errs.append((w - p.to_dense()).square().sum())
    errs = torch.stack(errs)
    mean, se = errs.mean(), errs.std() / trials ** 0.5
    assert abs(mean - expect) < 4 * se + 1e-12, (float(mean), float(expect), float(se))
    # and it is no worse than the compression-operator bound (1 - k/d)||w||^2
    assert mean <= (1 - k / d) * w.square().sum()


def test_rtopk_picks_only_from_top_r_and_r_defaults_to_n_times_k():
    n, d, k = 4, 1000, 10
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    top_r = set(torch.topk(x.abs(), n * k).indices.tolist())
    comps = [make_compressor("rtopk:feedback=false", k / d, rank=r, world_size=n, seed=2) for r in range(n)]
    seen = set()
    for c in comps:
        for _ in range(5):
            p = c.compress("w", x)
            assert p.count == k
            assert set(p.indices.tolist()) <= top_r
            seen |= set(p.indices.tolist())
    assert len(seen) > 2 * k  # workers and steps draw different subsets of the top r
    assert comps[0].inner.r_for(k, d) == n * k


def test_rtopk_with_r_equal_k_is_topk():
    x = torch.randn(500, generator=torch.Generator().manual_seed(3))
    a = make_compressor("rtopk:r_over_k=1,feedback=false", 0.02)
    b = make_compressor("topk:feedback=false", 0.02)
    assert set(a.compress("w", x).indices.tolist()) == set(b.compress("w", x).indices.tolist())
