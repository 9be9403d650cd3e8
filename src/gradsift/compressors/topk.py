"""``topk``: the k entries of largest magnitude (Aji & Heafield 2017; Stich et al. 2018).

REGTOP-k eq. (5) and LAGS eq. (4) define it: with |x_(1)| >= ... >= |x_(d)|,
send the entries of the k largest magnitudes. Exact, ties at the k-th magnitude
going to the lowest indices, by :func:`gradsift.kernels.many.topk_many`: usually
one pass per tensor (the candidates above a floor guessed from the previous
call, then a selection among them), else a histogram pass and a compaction pass
(:func:`gradsift.kernels.topk`) -- never a sort (``torch.topk`` costs 15-40 read
passes on this CPU). With error feedback by default, fused into the same pass
(:meth:`TopK.select_into`); the tensors of a group in one call
(:meth:`TopK.select_many_into`).
"""

from __future__ import annotations

import torch

from .. import kernels
from .. import payload as P
from ..kernels.many import batchable, topk_many
from .base import Compressor, fill_from
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
        if batchable(x):
            return self.select_many([key], [x])[0]
        st, k, _ = self.begin(key, x)
        idx = topk_indices(x, k)
        return P.sparse(self.wire(x[idx]), idx, x.numel(), x.dtype, k)

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        begun = self.begin_many(keys, xs)
        picks = topk_many(xs, [k for _, k, _ in begun], [st for st, _, _ in begun])
        return [P.sparse(self.wire(vals), idx, x.numel(), x.dtype, k) for (idx, vals), x, (_, k, _) in
                zip(picks, xs, begun)]

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        """Error feedback fused into the selection: ``acc += grad``, select, zero the selected entries in ``acc``.
        The payload's values are the accumulated ones (float32); the memory casts them for the wire."""
        return self.select_many_into([key], [acc], [grad])[0]

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """:meth:`select_into` for the tensors of a group in one call (:func:`gradsift.kernels.many.topk_many`: one
        pass over most of them, reading ``srcs`` where given; the same selections as one call each). With ``wire``
        bf16 the pass also takes the wire's cast (``topk_many``'s ``wire_bf16``)."""
        begun = self.begin_many(keys, accs)
        ks = [k for _, k, _ in begun]
        fin = [False] * len(accs)  # (per tensor: the pass read it all finite, so the memory need not check)
        if accs and accs[0].is_cuda:
            fill_from(accs, srcs)
            torch._foreach_add_(accs, grads)  # (kernels.accumulate's plain add on a GPU, for the group at once)
            picks = kernels.topk_each(accs, ks, zero=True)
        else:
            picks = topk_many(accs, ks, [st for st, _, _ in begun], adds=grads, zero=True, finite=fin, srcs=srcs,
                              wire_bf16=wire == torch.bfloat16)
        return [P.sparse(vals, idx, acc.numel(), acc.dtype, k, f)
                for (idx, vals), acc, k, f in zip(picks, accs, ks, fin)]
