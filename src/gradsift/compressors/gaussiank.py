"""``gaussiank``: GaussianKSGD's threshold (Shi et al. 2019), as SIDCo's baseline.

Model the gradient as Gaussian and take the two-sided quantile::

    thr = mean + std * Phi^-1(1 - ratio / 2)

then correct it at most 3 times: if fewer than 2k/3 entries exceed it, halve
it; if more than 4k/3, multiply it by 1.5 (notes/reference-code.md). Entries
with ``|x| > thr`` are sent. Error feedback on by default. Gradients are
heavy-tailed, so the Gaussian quantile misjudges the tail: the SIDCo paper
reports counts near zero at ratio 0.001 (Sec. 4.2); we keep the method as
described.
"""

from __future__ import annotations



import torch

from .. import payload as P
from .registry import register
from .base import Compressor, as_number


def normal_quantile(p: float) -> float:
    return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))


@register
class GaussianK(Compressor):
    SELECT_PASSES = 6.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False  # a mean or spread that overflows gives no threshold at all
    name = "gaussiank"
    OPTIONS = {"rounds": 3}
    CAPACITY = 4 / 3  # its corrections stop anywhere in [2k/3, 4k/3]
    SUMMARY = "GaussianKSGD: Gaussian quantile threshold with up to 3 x0.5/x1.5 corrections"

    def validate(self) -> None:
        as_number("rounds", self.options["rounds"], lo=0, integer=True)

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, _ = self.begin(key, x)
        d = x.numel()
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        mean = float(xf.mean())
        std = float(xf.std()) if d > 1 else 0.0
        thr = mean + std * normal_quantile(1.0 - (k / d) / 2.0)
        a = x.abs()
        count = int((a > thr).sum())
        for _ in range(int(self.options["rounds"])):
            if count < 2 * k / 3:
                thr *= 0.5
            elif count > 4 * k / 3:
                thr *= 1.5
            else:
                break
            count = int((a > thr).sum())
        idx = torch.nonzero(a > thr).squeeze(1)
        return P.sparse(self.wire(x[idx]), idx, d, x.dtype, k)
