"""``topk``: the k entries of largest magnitude (Aji & Heafield 2017; Stich et al. 2018).

REGTOP-k eq. (5) and LAGS eq. (4) define it: with |x_(1)| >= ... >= |x_(d)|,
send the entries of the k largest magnitudes. Exact: ``torch.topk`` on |x|
(about 40-70 read passes on a CPU); ties are broken by ``torch.topk``,
deterministically for a given input. With error feedback by default.
"""

from __future__ import annotations

import torch

from .. import payload as P
from .registry import register
from .base import Compressor


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a non-negative score (unsorted)."""
    if k >= score.numel():
        return torch.arange(score.numel(), device=score.device)
    return torch.topk(score, k, sorted=False).indices


@register
class TopK(Compressor):
    name = "topk"
    EXACT_K = True
    SUMMARY = "exact top-k by magnitude, with error feedback"

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, _ = self.begin(key, x)
        idx = topk_indices(x.abs(), k)
        return P.sparse(self.wire(x[idx]), idx, x.numel(), x.dtype, k)
