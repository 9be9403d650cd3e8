"""``gaussiank``: GaussianKSGD's threshold (Shi et al. 2019), as SIDCo's baseline.

Model the gradient as Gaussian and take the two-sided quantile::

    thr = mean + std * Phi^-1(1 - ratio / 2)

then correct it: if fewer than 2k/3 entries exceed it, halve it; if more than
4k/3, multiply it by 1.5. As printed (``refine=paper``, notes/reference-code.md)
at most 3 corrections, which on error-fed gradients often stop outside the
band: on mnist1d-cnn at 8 workers and ratio 0.01 it sent about 60% of top-k's
bytes and took 1033 steps to dense's accuracy minus a point (dense's budget
600, 3 seeds). gradsift's default (``refine=bracket``) takes the same steps
until one threshold selected too many and one too few, then halves that
bracket geometrically, at most 8 corrections: 717 steps, top-k's bytes
(docs/results.md, "DGC's and GaussianK's defaults"). Entries with ``|x| > thr`` are sent. Error
feedback on by default. Deviation: a threshold that selects nothing from a
non-zero tensor sends its largest entries instead, ties included
(:data:`gradsift.compressors.tails.LARGEST_IF_NONE`: a constant tensor).
"""

from __future__ import annotations

import functools
import math

import torch

from .registry import register
from ..options import Option
from ..kernels.many import gaussk_corrections
from .tails import OnTail, counted_compiled, last_first


@functools.lru_cache(maxsize=4096)
def normal_quantile(p: float) -> float:
    """``Phi^-1(p)`` in float64 (kept per ``p``: a model's tensors ask for the same few each step, and the torch call
    costs about 10 us)."""
    return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))


@register
class GaussianK(OnTail):
    SELECT_PASSES = 6.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False  # a mean or spread that overflows gives no threshold at all
    name = "gaussiank"
    OPTIONS = {
        "rounds": Option.integer(None, lo=0, optional=True, doc="correction rounds (unset: 8 for the bracket, 3 as "
                                                                "printed)"),
        "refine": Option.choice("bracket", ("bracket", "paper"), doc="halve a bracket of thresholds, or the "
                                                                     "printed x0.5/x1.5 steps"),
    }
    CAPACITY = 4 / 3  # its corrections stop anywhere in [2k/3, 4k/3]
    SUMMARY = "GaussianKSGD: Gaussian quantile threshold, corrected into [2k/3, 4k/3] (refine=paper: 3 x0.5/x1.5 steps)"

    def threshold(self, x: torch.Tensor, k: int, tail) -> float:
        """The Gaussian quantile (:meth:`quantile`) and its corrections (:meth:`correct`)."""
        return self.correct(self.quantile(x, k), k, tail)

    def quantile(self, x: torch.Tensor, k: int) -> float:
        """``mean + std * Phi^-1(1 - ratio / 2)``: the spread from the sum of squares and the mean, two cheap reads
        (``x.std()`` costs 7 read passes at one thread), in float64 from the tensor's sums."""
        d = x.numel()
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        mean = float(xf.mean())
        var = (float(torch.dot(xf, xf)) / d - mean * mean) * d / (d - 1) if d > 1 else 0.0
        return mean + math.sqrt(max(var, 0.0)) * normal_quantile(1.0 - (k / d) / 2.0)

    def _rounds(self) -> int:
        rounds = self.options["rounds"]
        return int((3 if self.options["refine"] == "paper" else 8) if rounds is None else rounds)

    def thresholds(self, xs, ks, tails) -> list[float | None]:
        """:meth:`threshold` of a group's tensors: the quantiles last first (what the group's pass wrote last is
        likeliest still in cache), then the corrections of those whose counts the compiled kernels read (float32
        candidates at or above a floor, every one of them recorded, and the tensor) in one compiled call
        (:func:`gradsift.kernels.many.gaussk_corrections`: the same float64 operations and counts), the others here."""
        thrs = last_first(lambda i: self.quantile(xs[i], ks[i]), tails)
        compiled = counted_compiled(xs, tails)
        rounds, paper = self._rounds(), self.options["refine"] == "paper"
        rows = [(thrs[i], ks[i], tails[i].vals, tails[i].floor_bits, tails[i].count, xs[i], rounds, paper)
                for i in compiled]
        for i, t in zip(compiled, gaussk_corrections(rows) if rows else ()):
            thrs[i] = t
        done = set(compiled)
        for i in range(len(xs)):
            if thrs[i] is not None and i not in done:
                thrs[i] = self.correct(thrs[i], ks[i], tails[i])
        return thrs

    def correct(self, thr: float, k: int, tail) -> float:
        """The corrections: while outside [2k/3, 4k/3], halve (too few) or multiply by 1.5 (too many) -- with the
        bracket, until one threshold selected too many and one too few, then halve that bracket geometrically."""
        count = tail.count_above(thr, enough=4 * k / 3)
        paper = self.options["refine"] == "paper"
        many = few = None  # the highest threshold seen to select too many, the lowest to select too few
        for _ in range(self._rounds()):
            if count < 2 * k / 3:
                few = thr
            elif count > 4 * k / 3:
                many = thr
            else:
                break
            if paper or many is None or few is None:  # the printed steps (and the bracket's until it has both ends)
                thr = thr * 0.5 if count < 2 * k / 3 else thr * 1.5
            else:  # both ends known: halve the bracket (geometrically: the tail's counts fall off multiplicatively)
                thr = math.sqrt(many * few) if many > 0 else 0.5 * (many + few)
            count = tail.count_above(thr, enough=4 * k / 3)
        return thr
