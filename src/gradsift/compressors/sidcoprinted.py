"""SIDCo's Algorithm 1 exactly as the paper prints it (``sidco:paper=true``; Abdelmoniem et al., MLSys 2021,
Appendix, Algorithm 1): the per-stage ratios fixed, every stage fitted on the actual exceedances of the previous
threshold, the stage count adapted once per window of Q calls, every ``|g| >= eta_M`` sent, no correction. A mixin
of :class:`gradsift.compressors.sidco.SIDCo`, whose options it reads; ``docs/methods/sidco.md`` has the one reading
it needed."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import payload as P
from ..kernels import many
from .sidcofits import exp_threshold, gamma_threshold_approx, gp_threshold, max_stages
from .tails import largest_instead, nonfinite

PAPER_CAPACITY = 4.0  # wire slots per target entry as printed (paper=true): no band bounds its count
GAMMA_EPS = 1e-10  # the authors' code adds it to |g| in the gamma fit's mean of logs (log 0 otherwise)


class PrintedAlgorithm:
    """Algorithm 1's ``Sparsify`` and ``Adapt_Stages`` on one tensor at a time (``options``, ``wire`` and the stage
    state come from the compressor)."""

    options: dict[str, Any]

    def stage_ratios(self, ratio: float, stages: int) -> list[float]:
        """The fixed per-stage ratios of Sec. 2.4: ``first_ratio`` for stage 1, the rest of the target split evenly in
        log space, ``delta = prod(delta_m)`` (the authors' code uses ``first_ratio`` only below it, with more than
        one stage)."""
        first = self.options["first_ratio"]
        if stages <= 1 or ratio >= first:
            return [ratio]
        rest = (ratio / first) ** (1.0 / (stages - 1))
        return [first] + [rest] * (stages - 1)

    def printed_threshold(self, mags: torch.Tensor, ratio: float, stages: int) -> float:
        """``eta_M`` of Algorithm 1's multi-stage loop on the magnitudes ``mags`` (float32, every entry, zeros
        included as printed): stage 1 fits all of them (eq. (6); eq. (7) from location 0 for ``gp``; eq. (15)'s
        closed form for ``gamma``, the one Algorithm 1 prints); stage m >= 2 fits the exceedances ``|g| > eta_{m-1}``
        shifted by ``eta_{m-1}`` (eqs. (10)-(11) for ``exp``, (7)-(9) otherwise) at its fixed ratio, and adds the
        location back. Means and variances in float64, the variance unbiased (the authors' code). A stage with
        nothing above the previous threshold ends the chain there."""
        dist = self.options["dist"]
        data, eta = mags, 0.0
        for m, r in enumerate(self.stage_ratios(ratio, stages)):
            if m:
                data = data[data > eta]
                if not data.numel():
                    break
            n = data.numel()
            mean = float(data.sum(dtype=torch.float64)) / n
            if dist == "exp":
                eta = exp_threshold(mean, r, eta)
                continue
            if dist == "gamma" and m == 0:
                logs = torch.log(data.to(torch.float64) + GAMMA_EPS)
                eta = gamma_threshold_approx(mean, float(logs.mean()), r) if mean > 0 else 0.0
                continue
            shifted = data.to(torch.float64) - eta
            sm = float(shifted.mean())
            var = float(shifted.var()) if n > 1 else 0.0
            eta = gp_threshold(sm, var, r, eta)
        return eta

    def adapt_printed(self, st: dict[str, Any], selected: int, k: int, ratio: float) -> None:
        """``Adapt_Stages`` (Algorithm 1, lines 6-10 and 20-26): after every ``window`` (Q) calls, the mean count
        selected over them against ``k (1 + eps_h)`` and ``k (1 - eps_l)``: one stage fewer above, one more below,
        within ``[1, ceil(log(delta) / log(0.5))]``. (The printed lines leave the Q-th call's count out of the sum
        and still divide by Q, which reads 0.8 of the mean at Q = 5 -- exactly ``1 - eps_l``; the mean over the
        window is what the text describes, and what is taken here.)"""
        st["calls"] += 1
        st["selected"] += int(selected)
        if st["calls"] < self.options["window"]:
            return
        avg = st["selected"] / st["calls"]
        st["calls"], st["selected"] = 0, 0
        if not self.options["adapt"]:
            return
        m = st["stages"]
        if avg > k * (1.0 + self.options["eps_h"]):
            m -= 1
        if avg < k * (1.0 - self.options["eps_l"]):
            m += 1
        st["stages"] = min(max(m, 1), max_stages(ratio))

    def printed(self, x: torch.Tensor, add: torch.Tensor | None, st: dict[str, Any], k: int) -> P.Payload:
        """Algorithm 1's ``Sparsify`` on one tensor: the printed chain (:meth:`printed_threshold`), then every entry
        with ``|g| >= eta_M`` (line 12's rule) is sent; no correction. With error feedback the gradient is added first
        (``x += add``) and what was sent is zeroed. A threshold that selects nothing from a non-zero tensor sends its
        largest entries instead (:data:`gradsift.compressors.tails.LARGEST_IF_NONE`); NaN or Inf are sent as they
        are, for the memory to see."""
        zero = add is not None
        if zero:
            x.add_(add)
        d = x.numel()
        mags = x.detach().reshape(-1).abs().to(torch.float32)
        top = float(mags.max()) if d else 0.0
        if not math.isfinite(top):
            idx, vals = nonfinite(x)
            if zero:
                x.index_fill_(0, idx, 0.0)
            return P.sparse(vals if zero else self.wire(vals), idx, d, x.dtype, k)
        ratio = k / d
        t = self.printed_threshold(mags, ratio, st["stages"])
        idx, vals = many.take_above(x, None, t, inclusive=True) if t > 0.0 else (torch.empty(0, dtype=torch.int64), x[:0])
        if not idx.numel() and top > 0.0:
            idx, vals = largest_instead(x, top, False)
        if zero:
            x.index_fill_(0, idx, 0.0)
        self.adapt_printed(st, idx.numel(), k, ratio)
        return P.sparse(vals if zero else self.wire(vals), idx, d, x.dtype, k)

