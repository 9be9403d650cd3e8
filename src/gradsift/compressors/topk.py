"""``topk``: the k entries of largest magnitude (Aji & Heafield 2017; Stich et al. 2018).

REGTOP-k eq. (5) and LAGS eq. (4) define it: with |x_(1)| >= ... >= |x_(d)|,
send the entries of the k largest magnitudes. Exact, by :func:`gradsift.kernels.topk`:
a histogram pass and a compaction pass instead of a sort (``torch.topk`` costs
15-40 read passes on this CPU); ties at the k-th magnitude go to the lowest
indices. With error feedback by default, fused into the same two passes
(:meth:`TopK.select_into`).
"""

from __future__ import annotations

import torch

from .. import kernels
from .. import payload as P
from .base import Compressor
from .registry import register


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k entries of largest magnitude (exact; float32 ties go to the lowest indices)."""
    if k >= score.numel():
        return torch.arange(score.numel(), device=score.device)
    if score.dtype != torch.float32:  # the histogram path is for float32; others sort exactly in torch
        return torch.topk(score.abs(), k, sorted=False).indices
    return kernels.topk(score.contiguous(), k)[0]


@register
class TopK(Compressor):
    SELECT_PASSES = 2.0  # read passes per selection (gradsift bench select; the wire plan's model)
    name = "topk"
    EXACT_K = True
    SUMMARY = "exact top-k by magnitude, with error feedback"

    FUSES_MEMORY = True

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, _ = self.begin(key, x)
        idx = topk_indices(x, k)
        return P.sparse(self.wire(x[idx]), idx, x.numel(), x.dtype, k)

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        """Error feedback fused into the two passes: ``acc += grad``, select, zero the selected entries in ``acc``.
        The payload's values are the accumulated ones (float32); the memory casts them for the wire."""
        st, k, _ = self.begin(key, acc)
        hist = kernels.accumulate(acc, grad)
        idx, vals = kernels.topk(acc, k, hist=hist, zero=True)
        return P.sparse(vals, idx, acc.numel(), acc.dtype, k)
