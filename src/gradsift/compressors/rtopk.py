"""``rtopk``: rTop-k (Barnes, Inan, Isik, Ozgur, IEEE JSAIT 2020; rtopk-statistical-estimation.md).

Definition 3 / Algorithm 1: take the r entries of largest magnitude (top-r),
then send k of them chosen uniformly at random::

    I = indices of the r largest |a_i|;   U = a uniform k-subset of I;   send a_U

with error compensation (Algorithm 1: ``g <- g + m``, ``m <- g - rTop_k(g)``),
so it is on by default. The paper fixes ``k / r = 1 / n`` for n workers
("if an entry is among the top-k at all n nodes, one node updates it in
expectation"): the default ``r = N * k``, capped at the tensor size. Option
``r_over_k`` sets another multiple (``r_over_k=1`` is top-k). Proposition 1:
``E||w - rTop_k(w)||^2 = (1 - k/r) sum_{j<=r} w_(j)^2 + sum_{j>r} w_(j)^2``.

The random choice comes from the compressor's own generator, seeded per
(seed, rank, tensor, step): workers pick independently, as in the paper.
The paper's experiments used DGC-style warm-up (density decaying
exponentially over the first epochs); every compressor takes it as the
``warmup`` option (in steps).
"""

from __future__ import annotations

import torch

from .. import payload as P
from .registry import register
from .base import Compressor, OptionError, as_number
from .topk import topk_indices


@register
class RTopK(Compressor):
    SELECT_PASSES = 2.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False
    name = "rtopk"
    OPTIONS = {"r_over_k": 0.0}
    EXACT_K = True
    SUMMARY = "rTop-k: k entries drawn uniformly from the top r = N*k, with error feedback"

    def validate(self) -> None:
        rk = as_number("r_over_k", self.options["r_over_k"], lo=0.0)
        if rk != 0 and rk < 1:
            raise OptionError(f"r_over_k must be 0 (meaning the worker count) or >= 1, got {rk}")

    def r_for(self, k: int, numel: int) -> int:
        rk = self.options["r_over_k"] or float(self.world_size)
        return min(numel, max(k, int(round(rk * k))))

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, step = self.begin(key, x)
        d = x.numel()
        r = self.r_for(k, d)
        top_r = topk_indices(x, r)
        if r > k:
            # torch.topk's unsorted order depends on threading; sort the r indices so the
            # random subset depends only on the seed (simulator and DDP ranks draw alike)
            top_r = top_r.sort().values
            g = self.rng(key, step, x.device)
            top_r = top_r[torch.randperm(r, generator=g, device=x.device)[:k]]
        return P.sparse(self.wire(x[top_r]), top_r, d, x.dtype, k)
