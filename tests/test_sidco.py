"""SIDCo: estimation quality with adaptation, thresholds against the paper's closed forms and scipy."""

from __future__ import annotations

import math

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.compressors.sidco import (
    exp_threshold, gamma_shape, gamma_threshold, gamma_threshold_approx, gamma_upper_quantile, gp_threshold,
    max_stages,
)


def laplace(n, g):
    u = torch.rand(n, generator=g).clamp_(1e-12, 1 - 1e-12) - 0.5
    return -u.sign() * torch.log1p(-2 * u.abs())


@pytest.mark.parametrize("dist", ["exp", "gp", "gamma"])
@pytest.mark.parametrize("source", ["gaussian", "laplace"])
def test_adaptation_reaches_target_count(dist, source):
    """Mean achieved/target count over calls 10-20 within [0.8, 1.25] at ratios 0.1, 0.01, 0.001 (n = 1e6)."""
    n = 1_000_000
    g = torch.Generator().manual_seed(11)
    pool = [torch.randn(n, generator=g) if source == "gaussian" else laplace(n, g) for _ in range(3)]
    for ratio in (0.1, 0.01, 0.001):
        comp = make_compressor(f"sidco:dist={dist},feedback=false", ratio)
        quality = []
        for call in range(1, 21):
            p = comp.compress("g", pool[call % 3], check_finite=False)
            if call >= 10:
                quality.append(p.count / p.target)
        mean = sum(quality) / len(quality)
        assert 0.8 <= mean <= 1.25, (dist, source, ratio, mean, comp.inner.tensors["g"]["stages"])


def test_single_stage_thresholds_match_closed_forms():
    g = torch.Generator().manual_seed(1)
    a = laplace(200_000, g).abs().double()
    m, v = float(a.mean()), float(a.var())
    r = 0.01
    # eq. (6): eta = beta_hat * log(1/delta), beta_hat = mean |g|
    assert exp_threshold(m, r) == pytest.approx(m * math.log(1 / r), rel=1e-12)
    # eqs. (7)-(9) with eta_prev = 0: eta = beta/alpha * (exp(-alpha log delta) - 1),
    # alpha = (1 - mu^2/sigma^2)/2, beta = mu (mu^2/sigma^2 + 1)/2
    alpha = 0.5 * (1 - m * m / v)
    beta = 0.5 * m * (m * m / v + 1)
    assert gp_threshold(m, v, r) == pytest.approx(beta / alpha * (math.exp(-alpha * math.log(r)) - 1), rel=1e-12)
    # later stage, eq. (7) with eta_prev and eqs. (10)-(11)
    t = 2.0
    exc = a[a > t]
    y = exc - t
    my, vy = float(y.mean()), float(y.var())
    al = 0.5 * (1 - my * my / vy)
    be = 0.5 * my * (my * my / vy + 1)
    assert gp_threshold(my, vy, 0.1, t) == pytest.approx(be / al * (math.exp(-al * math.log(0.1)) - 1) + t, rel=1e-12)
    assert exp_threshold(float(exc.mean()), 0.1, t) == pytest.approx((float(exc.mean()) - t) * math.log(10) + t)


def test_gamma_threshold_matches_scipy_gammaincinv():
    special = pytest.importorskip("scipy.special")
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(100_000, generator=g), laplace(100_000, g), torch.rand(100_000, generator=g) ** 3):
        a = x.abs().double()
        mean = float(a.mean())
        mean_log = float(torch.log(a + 1e-8 * mean).mean())
        alpha, beta = gamma_shape(mean, mean_log)
        for r in (0.25, 0.1, 0.01, 0.001):
            expect = beta * special.gammaincinv(alpha, 1 - r)
            assert gamma_threshold(mean, mean_log, r) == pytest.approx(expect, rel=1e-7)
    for alpha in (0.2, 0.5, 1.0, 1.36, 3.0):
        for r in (0.5, 1e-2, 1e-6):
            assert gamma_upper_quantile(alpha, r) == pytest.approx(special.gammainccinv(alpha, r), rel=1e-8)


def test_gamma_closed_form_needs_shape_at_most_one():
    """Eq. (15) is the exact quantile at alpha = 1 and drifts for Gaussian input (alpha ~ 1.36)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(400_000, generator=g).abs().double()
    mean = float(a.mean())
    mean_log = float(torch.log(a + 1e-8 * mean).mean())
    alpha, _ = gamma_shape(mean, mean_log)
    assert 1.2 < alpha < 1.5
    exact, approx = gamma_threshold(mean, mean_log, 0.001), gamma_threshold_approx(mean, mean_log, 0.001)
    assert abs(approx - exact) / exact > 0.05
    # with alpha = 1 (s chosen so Minka's formula gives 1), the two agree
    s = 0.5772156649 + 0.0  # for alpha = 1 the MLE condition is s = -digamma(1) = Euler's gamma
    al, be = gamma_shape(1.0, -s)
    assert al == pytest.approx(1.0, abs=0.02)


def test_stage_schedule_keeps_each_share_on_exponential_data():
    """On exactly exponential magnitudes every exp stage keeps its share: 25% first, then the rest in log space."""
    from gradsift.compressors.sidco import TailStats

    assert [max_stages(r) for r in (0.1, 0.01, 0.001, 0.5, 0.9)] == [4, 7, 10, 1, 1]
    x = torch.empty(4_000_000).exponential_(generator=torch.Generator().manual_seed(9))
    comp = make_compressor("sidco:dist=exp,adapt=false,stages=3,feedback=false", 0.001).inner
    stats = TailStats.of_histogram(kernels.abs_histogram(x).counts)
    t, count, path = comp.chain(stats, 4000, 3)
    assert count == pytest.approx(4000, rel=0.05) and t == pytest.approx(math.log(1000), rel=0.02)
    # the stages before the last: 25% kept (log 4), then 4000/1e6 of that in two equal shares (log 4 + log 250/2)
    assert path == pytest.approx([math.log(4), math.log(4) + math.log(250) / 2], rel=0.02)


def test_selection_is_strict_and_sends_original_values():
    comp = make_compressor("sidco:feedback=false", 0.1)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4))
    p = comp.compress("t", x)
    assert torch.equal(p.values, x[p.indices])
    thr = x.abs()[p.indices].min()
    assert int((x.abs() > thr).sum()) + 1 >= p.count  # everything above the smallest sent value is sent


def test_stage_state_is_per_tensor_and_reported():
    comp = make_compressor("sidco:dist=gp,stages=1,feedback=false", 0.001)
    g = torch.Generator().manual_seed(5)
    for _ in range(15):
        comp.compress("gauss", torch.randn(200_000, generator=g))
        comp.compress("lap", laplace(200_000, g))
    st = comp.inner.tensors
    assert st["gauss"]["stages"] > 1  # escaped the 1-stage trap (GP on light tails selects too many)
    tel = comp.inner.telemetry([comp])
    assert tel["sidco_stages"] == pytest.approx((st["gauss"]["stages"] + st["lap"]["stages"]) / 2)


def test_count_is_corrected_where_every_fit_misses():
    """wordlm's whole-model gradient in miniature: 45% exact zeros, a bulk of tiny entries (log-normal around 2e-6)
    and 5% from dense layers a hundred times larger. Every fitted chain leaves about half of k at ratio 0.1 (the
    tail's mean sits in the dense layers); the histogram correction brings each fit into the band from the first
    call, and ``correct=false`` keeps the paper's estimate as it is."""
    g = torch.Generator().manual_seed(3)
    n = 1_000_000

    def lognormal(m, median, sigma):
        return (torch.randn(m, generator=g) * sigma).exp() * median * (torch.rand(m, generator=g) - 0.5).sign()

    x = torch.cat([torch.zeros(450_000), lognormal(500_000, 2e-6, 1.0), lognormal(50_000, 2e-4, 0.5)])
    x = x[torch.randperm(n, generator=g)]
    for dist in ("exp", "gp", "gamma"):
        raw = make_compressor(f"sidco:dist={dist},correct=false,feedback=false", 0.1).compress("m", x)
        assert raw.count / raw.target < 0.7, (dist, raw.count / raw.target)
        for ratio in (0.1, 0.01, 0.001):
            p = make_compressor(f"sidco:dist={dist},feedback=false", ratio).compress("m", x)
            assert 0.9 <= p.count / p.target <= 1.1, (dist, ratio, p.count / p.target)


def test_correction_stops_at_the_non_zero_count():
    """Fewer non-zero entries than k: every non-zero entry is sent and nothing else (no exact zero on the wire)."""
    x = torch.zeros(100_000)
    x[:5_000] = torch.randn(5_000, generator=torch.Generator().manual_seed(1))
    p = make_compressor("sidco:feedback=false", 0.1).compress("m", x)
    assert p.count == 5_000 and bool((p.values != 0).all())


def test_a_small_tensor_counts_its_keys_to_the_same_statistics_as_the_histogram():
    """TailStats.of_tensor (no 65,536-bucket histogram) gives what the histogram gives, at every threshold."""
    from gradsift.compressors.sidco import TailStats

    g = torch.Generator().manual_seed(4)
    for x in (torch.randn(3000, generator=g) * 1e-3, torch.zeros(50), torch.tensor([0.0, 2.0, -2.0, 1e-30]),
              torch.randn(40_000, generator=g) / torch.rand(40_000, generator=g)):
        a, b = TailStats.of_tensor(x), TailStats.of_histogram(kernels.abs_histogram(x.clone()).counts)
        for t in [0.0, *x.abs().unique()[::97].tolist(), float(x.abs().max()) * 2]:
            assert a.above(t) == pytest.approx(b.above(t), rel=1e-12, abs=0.0)
        assert a.largest() == b.largest()
