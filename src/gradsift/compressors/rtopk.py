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

Step size: Algorithm 1 steps with plain SGD (``w <- w - eta g``, Theorem 3's
setting). An entry of the top r waits about r/k steps in error feedback
before it is drawn, and a momentum optimizer replays each such burst over
1/(1 - beta) steps: on mnist1d-cnn with momentum 0.9 the loss swings between
1.9 and 2.3 for 600 steps, where plain SGD at the same long-run step
(lr / (1 - beta)) trains as dense does (docs/methods/rtopk.md). So runs that
take a task's default momentum optimizer fold the momentum into the step
(``PLAIN_SGD``); an explicit ``--optimizer`` is kept.
"""

from __future__ import annotations

import torch

from .. import kernels
from .. import payload as P
from ..kernels.many import batchable, topk_many
from .registry import register
from ..options import Option
from ..kernels.draw import draw_k
from .base import Compressor, OptionError, fill_from
from .topk import topk_indices


@register
class RTopK(Compressor):
    SELECT_PASSES = 2.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False
    name = "rtopk"
    OPTIONS = {"r_over_k": Option.number(0.0, lo=0.0, doc="r as a multiple of k: 0 means the worker count "
                                                           "(the paper's k/r = 1/n), else at least 1")}
    EXACT_K = True
    PLAIN_SGD = True  # top entries wait ~r/k steps: a momentum optimizer compounds the wait (module docstring)
    SUMMARY = "rTop-k: k entries drawn uniformly from the top r = N*k, with error feedback"

    def validate(self) -> None:
        rk = self.options["r_over_k"]
        if rk != 0 and rk < 1:
            raise OptionError(f"r_over_k must be 0 (meaning the worker count) or >= 1, got {rk}")

    def r_for(self, k: int, numel: int) -> int:
        rk = self.options["r_over_k"] or float(self.world_size)
        return min(numel, max(k, int(round(rk * k))))

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, step = self.begin(key, x)
        d = x.numel()
        r = self.r_for(k, d)
        if batchable(x):
            top_r = topk_many([x], [r], [st])[0][0]
        else:
            top_r = topk_indices(x, r)
        top_r = self._draw(key, step, top_r, k)
        return P.sparse(self.wire(x[top_r]), top_r, d, x.dtype, k)

    def _draw(self, key: str, step: int, top_r: torch.Tensor, k: int) -> torch.Tensor:
        """k of the top r, uniformly: the r indices sorted (kernels and ``torch.topk`` order them differently) so
        the subset depends only on the seed (simulator and DDP ranks draw alike); the k come in index order, as
        the index coder sends them."""
        r = top_r.numel()
        if r <= k:
            return top_r
        return top_r.sort().values[draw_k(r, k, self.draw_seed(key, step), top_r.device)]

    FUSES_MEMORY = True

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        return self.select_many_into([key], [acc], [grad])[0]

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """Error feedback fused into the top-r pass (:func:`gradsift.kernels.many.topk_many`): ``acc += grad``, the
        top r, k of them drawn (``topk_many``'s ``keeps``: in the pass, the others put back), zeroed in ``acc``;
        with ``wire`` bf16 the pass also takes the wire's cast, as top-k's does."""
        begun = self.begin_many(keys, accs)
        rs = [self.r_for(k, acc.numel()) for acc, (_, k, _) in zip(accs, begun)]
        if accs and accs[0].is_cuda:
            fill_from(accs, srcs)
            picks = [kernels.topk(acc, r, hist=kernels.accumulate(acc, g)) for acc, g, r in zip(accs, grads, rs)]
            out = []
            for key, acc, (idx, _), (_, k, step) in zip(keys, accs, picks, begun):
                idx = self._draw(key, step, idx, k)
                vals = acc[idx]
                acc.index_fill_(0, idx, 0.0)
                out.append(P.sparse(vals, idx, acc.numel(), acc.dtype, k))
            return out
        fin = [False] * len(accs)
        keeps = [(k, self.draw_seed(key, step)) if k < r else None for key, r, (_, k, step) in zip(keys, rs, begun)]
        picks = topk_many(accs, rs, [st for st, _, _ in begun], adds=grads, zero=True, finite=fin, srcs=srcs,
                          wire_bf16=wire == torch.bfloat16, keeps=keeps)
        return [P.sparse(vals, idx, acc.numel(), acc.dtype, k, f)
                for (idx, vals), acc, (_, k, _), f in zip(picks, accs, begun, fin)]
