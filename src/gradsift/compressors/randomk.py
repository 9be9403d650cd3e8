"""``randomk``: k entries chosen uniformly at random (rTop-k Definition 2; Stich et al. 2018).

Options:

``shared`` (false)  every worker draws the same k indices from the shared seed,
                    so the payload is shared-index: values all-reduced, no
                    indices on the wire. Otherwise each worker draws its own.
``scale`` (false)   multiply the sent values by d/k, the unbiased random-k of
                    Wangni et al. 2018. Meant for runs without error feedback:
                    with feedback the scaled part would be subtracted from
                    memory and the residual would blow up, so both together
                    are refused.
"""

from __future__ import annotations

import torch

from .. import payload as P
from ..kernels import many as kernels
from ..kernels.draw import MAX_DRAW_N, draw_k
from ..kernels.rows import Draw
from .registry import register
from ..options import Option
from .base import Compressor, OptionError, fill_from


@register
class RandomK(Compressor):
    SELECT_PASSES = 1.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False
    name = "randomk"
    OPTIONS = {
        "shared": Option.flag(False, doc="every worker draws the same indices (values all-reduced)"),
        "scale": Option.flag(False, doc="unbiased: scale the values by d/k (needs memory=none)"),
    }
    EXACT_K = True
    SUMMARY = "k uniformly random entries (shared=true: same indices on every worker, all-reduced)"

    def check_memory(self, memory: str) -> None:
        if memory != "none" and self.options["scale"]:
            raise OptionError("randomk: scale=true (unbiased d/k scaling) needs feedback=false")

    def payload_kind(self) -> str:
        return P.SHARED if self.options["shared"] else P.SPARSE

    FUSES_MEMORY = True

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        if kernels.batchable(x):
            return self._select_many([key], [x], None)[0]
        st, k, step = self.begin(key, x)
        idx = draw_k(x.numel(), k, self.draw_seed(key, step, shared=self.options["shared"]), x.device)
        return self._payload(idx, x[idx], x, k, cast=True)

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        if not acc.is_cuda:
            return self._select_many([key], [acc], [grad])[0]
        acc.add_(grad)
        st, k, step = self.begin(key, acc)
        idx = draw_k(acc.numel(), k, self.draw_seed(key, step, shared=self.options["shared"]), acc.device)
        vals = acc[idx]
        acc.index_fill_(0, idx, 0.0)
        return self._payload(idx, vals, acc, k, cast=False)

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        return self._select_many(keys, xs, None)

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """Error feedback fused: ``acc += grad`` and the drawn entries read and zeroed in the same pass
        (:func:`gradsift.kernels.many.pick_many`, which draws them: the same indices as
        :func:`gradsift.kernels.draw.draw_k`; float32 values as accumulated, the memory casts them)."""
        if accs and accs[0].is_cuda:
            fill_from(accs, srcs)
            return [self.select_into(key, acc, grad) for key, acc, grad in zip(keys, accs, grads)]
        return self._select_many(keys, accs, grads, srcs)

    def _select_many(self, keys, xs, adds, srcs=None) -> list[P.Payload]:
        shared, zero = self.options["shared"], adds is not None
        ks, draws = [], []
        for key, x in zip(keys, xs):
            if x.numel() >= MAX_DRAW_N:
                raise ValueError(f"randomk: tensor {key!r} has {x.numel()} entries; at most 2^31 - 1")
            st, k, step = self.begin(key, x)
            ks.append(k)
            draws.append(Draw(min(k, x.numel()), self.draw_seed(key, step, shared=shared)))
        picks = kernels.pick_many(xs, adds if adds is not None else [None] * len(xs), draws, zero, srcs)
        return [self._payload(idx, vals, x, k, cast=not zero) for x, k, (idx, vals) in zip(xs, ks, picks)]

    def _payload(self, idx, vals, x, k, cast: bool) -> P.Payload:
        if self.options["scale"]:
            vals = vals * (x.numel() / k)
        make = P.shared if self.options["shared"] else P.sparse
        return make(self.wire(vals, sparse=not self.options["shared"]) if cast else vals, idx, x.numel(), x.dtype, k)
