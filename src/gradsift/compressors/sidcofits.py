"""SIDCo's fits: the thresholds of the paper's sparsity-inducing distributions (:mod:`gradsift.compressors.sidco`;
Abdelmoniem et al., MLSys 2021, eqs. (6)-(16)), each from a few moments of the magnitudes above a location."""

from __future__ import annotations

import math

import torch


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


