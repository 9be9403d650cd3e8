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

import math

import torch

from .. import payload as P
from .registry import register
from .base import Compressor, as_number
from .tails import fast, learn, nonfinite, tails_many


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

    FUSES_MEMORY = True

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        if fast(x):
            return self._select_many([key], [x], None)[0]
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

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        return self.select_many_into([key], [acc], [grad])[0]

    def select_many_into(self, keys, accs, grads) -> list[P.Payload]:
        """Error feedback fused into the counting pass (:mod:`gradsift.compressors.tails`): ``acc += grad``, the
        threshold and its corrections counted on the candidates, the selected entries zeroed in ``acc``."""
        if accs and not fast(accs[0]):
            out = []
            for key, acc, grad in zip(keys, accs, grads):
                acc.add_(grad)
                p = self.select(key, acc)
                p.values = acc[p.indices]  # as accumulated: the memory casts them for the wire
                acc.index_fill_(0, p.indices, 0.0)
                out.append(p)
            return out
        return self._select_many(keys, accs, grads)

    def _select_many(self, keys, xs, adds) -> list[P.Payload]:
        begun = [self.begin(key, x) for key, x in zip(keys, xs)]
        tails = tails_many(xs, adds or [None] * len(xs), [b[0] for b in begun], [b[1] for b in begun])
        out = []
        for x, tail, (st, k, _) in zip(xs, tails, begun):
            d = x.numel()
            if not tail.finite:
                idx, vals = nonfinite(x)
            else:
                # mean and spread in two cheap reads (x.std() costs 7 read passes at one thread): std from the sum
                # of squares, in float64 from float32 sums
                mean = float(x.mean())
                var = (float(torch.dot(x, x)) / d - mean * mean) * d / (d - 1) if d > 1 else 0.0
                thr = mean + math.sqrt(max(var, 0.0)) * normal_quantile(1.0 - (k / d) / 2.0)
                count = tail.count_above(thr, enough=4 * k / 3)
                for _ in range(int(self.options["rounds"])):
                    if count < 2 * k / 3:
                        thr *= 0.5
                    elif count > 4 * k / 3:
                        thr *= 1.5
                    else:
                        break
                    count = tail.count_above(thr, enough=4 * k / 3)
                idx, vals = tail.above(thr)
                learn(st, tail, thr, idx.numel(), k)
            if adds is not None:
                x.index_fill_(0, idx, 0.0)
            out.append(P.sparse(vals if adds is not None else self.wire(vals), idx, d, x.dtype, k))
        return out
