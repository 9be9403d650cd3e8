"""``redsync``: RedSync's trimmed threshold search (Fang et al., JPDC 2019), as SIDCo's baseline.

Thresholds of the form ``mean + r * (max - mean)`` over |x| are tried by a
binary search on r in [0, 1], stopping as soon as ``k < count < 2k`` or when
the search interval is narrower than ``tol`` (0.2, so at most a few rounds),
the way the SIDCo authors' baseline code does (notes/reference-code.md). Each
round costs a compare and a count over the tensor. The coarse search is the
method's weakness at small ratios: the SIDCo paper (Sec. 4.2, Fig. 9) reports
counts orders of magnitude below target at 0.001 and high variance; we keep
the search as described rather than tightening it. Error feedback on by default.

Deviations: when the search ends outside the band, the last threshold tried
is used as it is (no fallback to exact top-k); a threshold that selects nothing
from a non-zero tensor sends its largest entries instead, ties included
(:data:`gradsift.compressors.tails.LARGEST_IF_NONE`: a constant tensor).
"""

from __future__ import annotations

import torch

from .registry import register
from ..kernels.many import redsync_searches
from ..options import Option
from .tails import OnTail, counted_compiled, last_first


@register
class RedSync(OnTail):
    SELECT_PASSES = 10.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False  # a mean or spread that overflows gives no threshold at all
    name = "redsync"
    OPTIONS = {"tol": Option.number(0.2, lo=0.0, hi=1.0, lo_open=True, doc="the width at which the threshold "
                                                                           "search on r stops")}
    CAPACITY = 2.0  # its search stops anywhere in (k, 2k)
    SUMMARY = "RedSync: binary search of mean + r*(max - mean) until k < count < 2k (coarse)"
    WANT = 6.0  # candidates aimed at per target entry: the coarse search ends anywhere from k/2 to several k
    MEAN_IN_PASS = True

    def threshold(self, x: torch.Tensor, k: int, tail) -> float:
        """The search over ``mean + r (max - mean)``; the mean magnitude summed in the pass (:meth:`Tail.abs_sum`)."""
        d = x.numel()
        mean = tail.abs_sum() / d
        top = tail.max_abs()
        lo, hi = 0.0, 1.0
        thr = mean
        while hi - lo > self.options["tol"]:
            mid = 0.5 * (lo + hi)
            thr = mean + mid * (top - mean)
            count = tail.count_above(thr, enough=2 * k)
            if k < count < 2 * k:
                break
            if count <= k:
                hi = mid  # too few selected: lower the threshold
            else:
                lo = mid
        return thr

    def thresholds(self, xs, ks, tails) -> list[float | None]:
        """:meth:`threshold` of a group's tensors: the searches of those whose counts the compiled kernels read in
        one compiled call (:func:`gradsift.kernels.many.redsync_searches`: the same float64 operations and counts),
        the others here, the last first (None where the tensor is not finite)."""
        compiled = counted_compiled(xs, tails)
        tol = self.options["tol"]
        rows = [(tails[i].abs_sum() / xs[i].numel(), ks[i], tails[i].vals, tails[i].floor_bits, tails[i].count, xs[i],
                 tails[i].max_abs(), tol) for i in compiled]
        done = dict(zip(compiled, redsync_searches(rows) if rows else ()))
        return last_first(lambda i: done[i] if i in done else self.threshold(xs[i], ks[i], tails[i]), tails)
