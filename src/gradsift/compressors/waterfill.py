"""Algorithm 1 of the GSB paper (Song et al., CVPR 2021: gsb-gradient-sampling-bayes-prior.md) as water-filling:
sampling probabilities proportional to non-negative weights, capped at 1, summing to k
(:mod:`gradsift.compressors.sampling` draws from them)."""

from __future__ import annotations

import math

import torch

from ..kernels import many


def normalize_probabilities(w: torch.Tensor, k: int, iters: int = 5) -> torch.Tensor:
    """Sampling probabilities proportional to the non-negative weights ``w``, capped at 1, summing to k: the
    tensor ``min(scale * base, 1)`` of :func:`water_level`."""
    base, scale = water_level(w, k, iters)
    return base.mul(scale).clamp_(max=1.0)


def water_level(w: torch.Tensor, k: int, iters: int = 5, total: float | None = None,
                top: float | None = None) -> tuple[torch.Tensor, float]:
    """(base, scale): the sampling probabilities of the non-negative weights ``w`` are ``min(scale * base, 1)``
    elementwise, in float32 (the scale rounded to float32, as torch multiplies by a number) -- left for the draw to
    compute (:func:`gradsift.kernels.draw.bernoulli`), so no probability tensor is written. ``total``: ``w``'s sum,
    when the caller keeps it; ``top``: a bound on its largest entry, when the caller keeps one (while the level
    stays at or above it nothing caps: no count is needed).

    Algorithm 1 of the GSB paper as water-filling (see the module docstring):
    line 1 ``p = k w / sum(w)``; then up to ``iters`` times cap the entries
    above 1 (cumulatively) and rescale the uncapped ones to the remaining budget.
    With all weights zero the probabilities are uniform, k/d.

    Every uncapped entry is ``c * w`` for one scale ``c``, and ``c`` only grows
    (the budget left per unit of uncapped weight rises as entries cap), so the
    cumulative capped set is always ``{w > 1/c}``. Each round therefore needs
    a count above ``1/c`` and the capped entries' sum (one compiled read, then the
    few capped entries), never a rebuilt ``p``. The total is torch's float32 sum
    (cascaded: relative error about 1e-7; a float64 sum costs 27 read passes'
    time), summed again in float64 only when the capped entries hold over 90% of
    it (``rest``, the difference, would be mostly that error); the capped entries
    are summed in float64.
    """
    d = w.numel()
    w = w.to(torch.float32)
    total, exact = (float(w.sum()) if total is None else total), False
    if not (total > 0) or not math.isfinite(total):
        return torch.full((d,), min(1.0, k / max(d, 1)), dtype=torch.float32, device=w.device), 1.0
    c = k / total
    n_capped = 0
    for _ in range(iters):
        if top is not None and n_capped == 0 and top <= 1.0 / c:
            break  # nothing reaches 1 (the count would be 0)
        n = many.count_above(w, 1.0 / c)  # (w >= 0: its magnitude; one compiled read, no mask)
        if n == n_capped:
            break  # nothing new above 1
        n_capped = n
        budget = k - n
        if budget <= 0:  # unreachable in exact arithmetic (each round caps fewer than the budget); rounding guard
            return (w > 1.0 / c).to(torch.float32), 1.0
        capped = float(many.take_above(w, None, 1.0 / c)[1].sum(dtype=torch.float64))
        if not exact and capped > 0.9 * total:  # the difference below would be mostly the float32 total's error
            total, exact = float(w.sum(dtype=torch.float64)), True
        rest = total - capped  # the uncapped weight
        if not (rest > 0):
            break
        c = budget / rest
    return w, c
