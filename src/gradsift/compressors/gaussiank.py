"""``gaussiank``: GaussianKSGD's threshold (Shi et al. 2019), as SIDCo's baseline.

Model the gradient as Gaussian and take the two-sided quantile::

    thr = mean + std * Phi^-1(1 - ratio / 2)

then correct it at most 3 times: if fewer than 2k/3 entries exceed it, halve
it; if more than 4k/3, multiply it by 1.5 (notes/reference-code.md). Entries
with ``|x| > thr`` are sent. Error feedback on by default. Gradients are
heavy-tailed, so the Gaussian quantile misjudges the tail: the SIDCo paper
reports counts near zero at ratio 0.001 (Sec. 4.2); we keep the method as
described. Deviation: a threshold that selects nothing from a non-zero tensor
sends its largest entries instead, ties included
(:data:`gradsift.compressors.tails.LARGEST_IF_NONE`: a constant tensor).
"""

from __future__ import annotations

import functools
import math

import torch

from .registry import register
from .base import OptionError, as_number
from .tails import OnTail


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
    OPTIONS = {"rounds": 3, "refine": "bracket"}
    CAPACITY = 4 / 3  # its corrections stop anywhere in [2k/3, 4k/3]
    SUMMARY = "GaussianKSGD: Gaussian quantile threshold with up to 3 x0.5/x1.5 corrections"

    def validate(self) -> None:
        as_number("rounds", self.options["rounds"], lo=0, integer=True)
        if self.options["refine"] not in ("bracket", "paper"):
            raise OptionError(f"gaussiank: refine must be bracket or paper, got {self.options['refine']!r}")

    def threshold(self, x: torch.Tensor, k: int, tail) -> float:
        """The Gaussian quantile and its corrections; the spread from the sum of squares and the mean, two cheap
        reads (``x.std()`` costs 7 read passes at one thread), in float64 from the tensor's sums."""
        d = x.numel()
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        mean = float(xf.mean())
        var = (float(torch.dot(xf, xf)) / d - mean * mean) * d / (d - 1) if d > 1 else 0.0
        thr = mean + math.sqrt(max(var, 0.0)) * normal_quantile(1.0 - (k / d) / 2.0)
        count = tail.count_above(thr, enough=4 * k / 3)
        paper = self.options["refine"] == "paper"
        many = few = None  # the highest threshold seen to select too many, the lowest to select too few
        for _ in range(int(self.options["rounds"])):
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
