"""SIDCo's estimation (:mod:`gradsift.compressors.sidco`; Abdelmoniem et al., MLSys 2021): the thresholds of the
paper's sparsity-inducing distributions (eqs. (6)-(16)), each from a few moments of the magnitudes above a location,
and the multi-stage chain, its adaptive stage count and the correction that :class:`Estimator` runs on any statistics
(``histstats.py``)."""

from __future__ import annotations

import functools
import math

import torch

from ..kernels.moments import SD_PATH


def exp_threshold(mean: float, r: float, t_min: float = 0.0) -> float:
    """Exponential quantile: ``(mean - t_min) * log(1/r) + t_min`` (eqs. (6), (10)-(11))."""
    return (mean - t_min) * math.log(1.0 / r) + t_min


def gp_threshold(m: float, v: float, r: float, t_min: float = 0.0) -> float:
    """Generalized Pareto quantile by moment matching (eqs. (7)-(9)); m, v of the data minus ``t_min``."""
    if not (v > 0) or not (m > 0):
        return t_min + max(m, 0.0)
    q = m * m / v
    xi = 0.5 * (1.0 - q)
    beta = 0.5 * m * (q + 1.0)
    if abs(xi) < 1e-9:
        return t_min + beta * math.log(1.0 / r)
    return t_min + beta / xi * math.expm1(-xi * math.log(r))


def gamma_shape(mean: float, mean_log: float) -> tuple[float, float]:
    """Minka's closed-form gamma shape and scale (eq. (16))."""
    s = math.log(mean) - mean_log
    if not (s > 0):
        s = 1e-12
    alpha = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    return alpha, mean / alpha


def gamma_upper_quantile(alpha: float, r: float) -> float:
    """x with Q(alpha, x) = r (regularized upper incomplete gamma), by Newton on log Q in log x.

    Torch only (``torch.special.gammaincc``), float64 scalars; the relative error is
    below 1e-9 (tested against scipy's ``gammaincinv``).
    """
    a = torch.tensor(alpha, dtype=torch.float64)
    lgam = math.lgamma(alpha)
    # Wilson-Hilferty start
    z = math.sqrt(2.0) * _erfinv(1.0 - 2.0 * r)
    h = 1.0 / (9.0 * alpha)
    x0 = alpha * max(1.0 - h + z * math.sqrt(h), 0.05) ** 3
    u = math.log(max(x0, 1e-300))
    log_r = math.log(r)
    for _ in range(60):
        x = math.exp(u)
        q = float(torch.special.gammaincc(a, torch.tensor(x, dtype=torch.float64)))
        if q <= 0.0:  # overshoot into underflow: step back
            u -= 0.5
            continue
        g = math.log(q) - log_r
        # d log Q / d log x = -x * pdf(x) / Q, pdf = x^(a-1) e^-x / Gamma(a)
        log_pdf_x = alpha * u - x - lgam
        dg = -math.exp(log_pdf_x - math.log(q))
        if dg == 0.0:
            u += 0.5 if g > 0 else -0.5
            continue
        step = g / dg
        step = max(-2.0, min(2.0, step))
        u -= step
        if abs(step) < 1e-12:
            break
    return math.exp(u)


def _erfinv(y: float) -> float:
    return float(torch.special.erfinv(torch.tensor(y, dtype=torch.float64)))


def gamma_threshold(mean: float, mean_log: float, r: float) -> float:
    """``beta * P^{-1}(alpha, 1 - r)`` (eq. (14)), the exact gamma quantile."""
    alpha, beta = gamma_shape(mean, mean_log)
    return beta * gamma_upper_quantile(alpha, r)


def gamma_threshold_approx(mean: float, mean_log: float, r: float) -> float:
    """Eq. (15)'s closed form ``-beta (log r + log Gamma(alpha))`` (valid for alpha <= 1)."""
    alpha, beta = gamma_shape(mean, mean_log)
    return -beta * (math.log(r) + math.lgamma(alpha))


def max_stages(ratio: float) -> int:
    """``ceil(log(ratio) / log(0.5))``, at least 1."""
    if ratio >= 0.5:
        return 1
    return max(1, math.ceil(math.log(ratio) / math.log(0.5) - 1e-12))


@functools.lru_cache(maxsize=4096)
def path_room(k: int, n: int) -> int:
    """How many stage thresholds a chain for ``k`` of ``n`` keeps before its last (the compiled pass's out row)."""
    return min(max_stages(k / n) - 1, SD_PATH)


class Estimator:
    """SIDCo's threshold from statistics (the module docstring of :mod:`gradsift.compressors.sidco`); a mixin of the
    compressor, reading its ``options``."""

    options: dict

    def fit(self, stats, t: float, want: float, stages_left: int, first: bool) -> tuple[float, float]:
        """One stage from the previous threshold ``t``: (its threshold, the count at the location it fitted from).
        The location is ``t`` itself, or for :class:`ScanStats` under its floor the highest level at or below
        ``t``; the stage keeps ``first_ratio`` (first of several) or its share of what is left, in log space."""
        dist = self.options["dist"]
        loc, n, s1, s2 = stats.stage(t, squares=dist != "exp")
        if n <= want:
            return t, n
        r = want / n
        fr = self.options["first_ratio"]
        r = fr if (first and stages_left > 1 and r < fr) else r ** (1.0 / stages_left)
        r = min(r, 1.0)
        if n < 2:
            return t, n
        if dist == "exp":
            return exp_threshold(s1 / n, r, loc), n
        if dist == "gamma" and first:
            _, _, _, sl = stats.above(loc)
            return gamma_threshold(s1 / n, sl / n, r), n
        mean = s1 / n
        m = mean - loc  # mean of the exceedances shifted by the location
        v = max(s2 / n - mean * mean, 0.0) * n / (n - 1)  # unbiased; shifting does not change it
        return gp_threshold(m, v, r, loc), n

    def chain(self, stats, k: int, stages: int, seen: list | None = None, hi: float = float("inf")):
        """(threshold, count above it, the stages' thresholds before the last) after ``stages`` stages, each aiming
        at the count left (:mod:`gradsift.compressors.sidco`). Counted thresholds are appended to ``seen``; ``hi``:
        counts beyond it need not be exact."""
        t, path = 0.0, []
        memo = stats.memo  # (the chains of one call share their first stages)
        for i in range(stages):
            key = (k, t, stages - i, i == 0)
            got = memo.get(key)
            if got is None:
                got = memo[key] = self.fit(stats, t, k, stages - i, first=(i == 0))
            new, n = got
            if n <= k or not (new > t) or not math.isfinite(new):
                break
            path.append(new)
            t = new
            if seen is not None and stats.exact_counts:
                seen.append((t, stats.count(t)))
        count = stats.count(t, hi)
        if seen is not None and not stats.exact_counts:
            seen.append((t, count))
        return t, count, path[:-1]

    def threshold(self, stats, k: int, st: dict[str, Any], ratio: float) -> tuple[float, list]:
        """(the threshold, the stages' thresholds before the last of the chain taken)."""
        top = max_stages(ratio)
        start = min(max(st["stages"], 1), top)
        lo, hi = (1.0 - self.options["eps_l"]) * k, (1.0 + self.options["eps_h"]) * k
        seen = [(0.0, stats.count(0.0)), *stats.points()]
        if not self.options["adapt"]:
            t, count, path = self.chain(stats, k, start, seen, hi)
        else:
            best = None
            order = [start] + [m for d in range(1, top) for m in (start + d, start - d) if 1 <= m <= top]
            for m in order:
                t, count, path = self.chain(stats, k, m, seen, hi)
                miss = abs(math.log(max(count, 0.5) / k))
                if best is None or miss < best[0]:
                    best = (miss, m, t, count, path)
                if lo <= count <= hi:
                    break
            _, st["stages"], t, count, path = best
        if self.options["correct"] and not lo <= count <= hi:
            t = self.correct(stats, k, seen, t, count)
        return t, path

    def correct(self, stats, k: int, seen: list, t: float, count: float) -> float:
        """The fitted chain missed the band: move the threshold until its count is within half the band's width
        of ``k``. Between the closest thresholds seen on either side of ``k`` (the largest magnitude bounds it from
        above), each step takes the exponential tail through those two counts -- the threshold where ``log count``
        interpolated linearly reaches ``log k`` -- alternating with a geometric midpoint so a lopsided bracket still
        shrinks; at most 12 steps, then the closest seen."""
        lo, hi = (1.0 - self.options["eps_l"] / 2) * k, (1.0 + self.options["eps_h"] / 2) * k
        seen = [*seen, (t, count), (stats.largest(), 0.0)]
        below = max((p for p in seen if p[1] >= k), key=lambda p: p[0], default=None)
        above = min((p for p in seen if p[1] < k), key=lambda p: p[0])
        if below is None:  # fewer than k non-zero entries: nothing to correct
            return t
        for step in range(12):
            (t0, n0), (t1, n1) = below, above
            if step % 2 == 0 and n1 > 0:
                f0, f1 = math.log(n0 / k), math.log(n1 / k)
                nxt = t0 + (t1 - t0) * f0 / (f0 - f1)
            else:
                nxt = math.sqrt(t0 * t1) if t0 > 0 else t1 / 2
            if not t0 < nxt < t1:
                nxt = 0.5 * (t0 + t1)
            n = stats.count(nxt, (1.0 + self.options["eps_h"]) * k)
            if lo <= n <= hi:
                return nxt
            if n >= k:
                below = (nxt, n)
            else:
                above = (nxt, n)
        return min(below, above, key=lambda p: abs(math.log(max(p[1], 0.5) / k)))[0]
