"""``regtopk``: REGTOP-k (Bereyhi, Liang, Boudreau, Afana, ICASSP 2024; regtopk-bayesian-topk.md).

Top-k on a regularized score instead of on the accumulated gradient itself
(Algorithm 1, eq. (16) with ``u_mu(x) = tanh(x / mu)``)::

    s_n^t = Top_k( |a_n^t| * |tanh((1 + Delta_n^t) / mu)| )

where ``a_n^t`` is the error-feedback accumulated gradient of worker n and the
*posterior distortion* ``Delta_n^t`` comes from the previous round's
aggregate. The first round is plain top-k. An entry whose workers' values
cancelled in the aggregate gets ``1 + Delta = 0`` and is damped to zero, so it
stops being resent (the toy example of Sec. 1.2); an entry not sent last round
gets ``Delta = Q`` (option ``unsent``, default 1e8, so its factor is
``tanh((1 + Q) / mu) = 1``: the plain top-k score).

Two forms of Delta for the entries sent last round (``g`` is the round's
weighted mean, ``ghat_n`` what worker n sent, ``omega_n`` its weight):

``form=code`` (default) -- the authors' code (``Delta_updater`` in
    AlBerey/RegTopK), computed once per round after aggregation::

        Delta_n = (g / omega_n - ghat_n) / ghat_n        so   1 + Delta_n = g / (omega_n * ghat_n)

``form=paper`` -- Algorithm 1, line 5, literally: the same numerator divided
    by the *current* accumulated gradient, so it is evaluated at selection time::

        Delta_n = (g - omega_n * a_n^{t-1}) / (omega_n * a_n^t)

The two differ in the denominator: the code divides by the value sent last
round, the paper by this round's accumulated value. On the paper's linear
regression (20 workers, S = 0.6) the code's form reaches the optimality gap of
uncompressed GD (~1e-11) while the literal form did no better than TOP-k for
any mu tried (notes/reference-code.md), so the code's form is the default.

Deviations and guards: an entry sent with value exactly zero (or, in the
paper's form, whose current accumulated value is exactly zero) would give 0/0;
it is treated as not sent (factor of ``unsent``). With general worker weights
the code's ``N * g_mean`` is written ``g_mean / omega_n``. The authors' linear
regression script also reverts steps whose parameter change exceeds 100x the
last one; that is not in the paper and is not done here.

State per tensor: the indices sent last round and either their factor
(code form) or the numerator ``g - omega * ghat`` (paper form): k numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import payload as P
from ..kernels.scatter import gather_many
from ..kernels.many import batchable, topk_many
from .registry import register
from ..options import Option
from .base import Compressor, fill_from
from .topk import topk_indices


@register
class RegTopK(Compressor):
    SELECT_PASSES = 3.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False
    name = "regtopk"
    OPTIONS = {
        "mu": Option.number(4.0, lo=0.0, lo_open=True, doc="the regularizer's scale in tanh(x / mu) (eq. 16)"),
        "unsent": Option.number(1e8, doc="Q: the distortion of entries not sent last round (1e8: plain top-k score)"),
        "form": Option.choice("code", ("code", "paper"), doc="the distortion as the authors' code computes it, or "
                                                             "as Algorithm 1 prints it"),
    }
    EXACT_K = True
    OBSERVES = True
    SUMMARY = "REGTOP-k: top-k on |a|*|tanh((1+Delta)/mu)|, Delta from the previous round's aggregate"

    def validate(self) -> None:
        self._unsent_factor = abs(math.tanh((1.0 + self.options["unsent"]) / self.options["mu"]))

    @property
    def unsent_factor(self) -> float:
        """The factor of entries not sent last round: |tanh((1 + Q) / mu)| (1 for the default Q)."""
        return self._unsent_factor

    def init_state(self, key, numel, device):
        return {"prev_idx": None, "prev_factor": None, "prev_numer": None}

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """The per-tensor state of ``keys`` for :meth:`rollback`, its tensors shared, not copied: a step replaces
        them (:meth:`observe` makes new ones) and never writes them, so a clean step copies nothing."""
        if deep:
            return super().checkpoint(keys, deep)
        return {k: dict(self.tensors[k]) if k in self.tensors else None for k in keys}

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        if batchable(x):
            return self._select_many([key], [x], None)[0]
        st, k, _ = self.begin(key, x)
        idx = topk_indices(self.score(st, x), k)
        return P.sparse(self.wire(x[idx]), idx, x.numel(), x.dtype, k)

    def score(self, st, x: torch.Tensor) -> torch.Tensor:
        """Eq. (16)'s score over the whole tensor: |a| times the unsent factor, |a| times last round's factor at
        the entries sent then."""
        score = x.abs()
        idx_prev = st["prev_idx"]
        if idx_prev is not None and idx_prev.numel():
            base = self._unsent_factor
            if base != 1.0:
                score.mul_(base)
            score[idx_prev] = self._prev_scores(st, x)
        return score

    def _prev_scores(self, st, x: torch.Tensor) -> torch.Tensor:
        a_prev = x[st["prev_idx"]]
        factor = st["prev_factor"] if self.options["form"] == "code" else self.paper_factor(st["prev_numer"], a_prev)
        return a_prev.abs_().mul_(factor.to(a_prev.dtype))

    FUSES_MEMORY = True

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        return self.select_many_into([key], [acc], [grad])[0]

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        return self._select_many(keys, xs, None)

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """Error feedback fused into the pass that finds the candidates (:mod:`gradsift.compressors.tails`):
        ``acc += grad``, the top k scores, zeroed in ``acc`` (values as accumulated; the memory casts them -- with
        ``wire`` bf16 the pass takes that cast, as top-k's does)."""
        fill_from(accs, srcs)
        if accs and not batchable(accs[0]):
            out = []
            for key, acc, grad in zip(keys, accs, grads):
                acc.add_(grad)
                st, k, _ = self.begin(key, acc)
                idx = topk_indices(self.score(st, acc), k)
                vals = acc[idx]
                acc.index_fill_(0, idx, 0.0)
                out.append(P.sparse(vals, idx, acc.numel(), acc.dtype, k))
            return out
        return self._select_many(keys, accs, grads, wire)

    def _select_many(self, keys, xs, adds, wire=None) -> list[P.Payload]:
        """Eq. (16) in one pass per tensor (:func:`gradsift.kernels.many.topk_many` with scores): the factors of
        last round's entries are computed first (the paper's form from this round's accumulated values, added here
        as the pass adds them), the pass accumulates and ranks ``|a| * factor``; where it cannot settle the ranking
        the whole tensor is scored (:meth:`score`)."""
        begun = self.begin_many(keys, xs)
        adds = adds or [None] * len(xs)
        scores = [self._factors(st, x, a) for (st, _, _), x, a in zip(begun, xs, adds)]

        def rank(i: int):  # the whole tensor scored; sorted, as the next round's factors follow the indices
            score = self.score(begun[i][0], xs[i])
            idx = topk_indices(score, begun[i][1]).sort().values
            return idx, float(score[idx].min())

        fin = [False] * len(xs)  # (per tensor: the pass read it all finite, so the memory need not check)
        picks = topk_many(xs, [k for _, k, _ in begun], [st for st, _, _ in begun], adds=adds, zero=adds[0] is not None,
                          scores=scores, rank=rank, finite=fin, wire_bf16=wire == torch.bfloat16)
        return [P.sparse(vals if a is not None else self.wire(vals), idx, x.numel(), x.dtype, k, f and a is not None)
                for x, a, (idx, vals), (_, k, _), f in zip(xs, adds, picks, begun, fin)]

    def _factors(self, st, x: torch.Tensor, add: torch.Tensor | None):
        """(last round's positions, their factors, the unsent factor) for the pass: the score's multipliers."""
        prev = st["prev_idx"]
        if prev is None or not prev.numel():
            return (torch.empty(0, dtype=torch.int64), torch.empty(0), self._unsent_factor)
        if self.options["form"] == "code":
            return prev, st["prev_factor"], self._unsent_factor
        a_now = x.index_select(0, prev) if add is None else x.index_select(0, prev) + add.index_select(0, prev)
        return prev, self.paper_factor(st["prev_numer"], a_now), self._unsent_factor

    def paper_factor(self, numer: torch.Tensor, a_now: torch.Tensor) -> torch.Tensor:
        """|tanh((1 + Delta) / mu)| with Delta = numer / (omega * a_now); a_now == 0 counts as unsent."""
        denom = self.weight * a_now.to(numer.dtype)
        f = torch.tanh((1.0 + numer / denom) / self.options["mu"]).abs_()
        return f.masked_fill_(denom == 0, self.unsent_factor)

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        self.observe_many([key], [sent], [mean])

    def observe_many(self, keys, sents, means) -> None:
        """The next round's factors of a group's tensors: the round's mean read at the positions each sent (one
        compiled gather for the group where the means are float32 and every tensor's positions ascend, as the pass
        gives them; else one gather a tensor), the arithmetic of eq. (16)'s distortion once over them all
        (elementwise: the bits of one tensor at a time)."""
        if not keys:
            return
        flat = [m.reshape(-1) for m in means]
        got = gather_many(flat, [s.indices for s in sents]) if all(
            m.dtype == torch.float32 and s.indices is not None for m, s in zip(means, sents)) else None
        if got is not None and all(got[1]):  # (one compiled gather for the group; every sent index ascending)
            ghat = torch.cat([s.values for s in sents]).to(torch.float32)  # (bf16 and float32 values: exactly)
            self._learn([self.tensors[k] for k in keys], [s.indices for s in sents], ghat, got[0],
                        [s.indices.numel() for s in sents])
            return
        idxs, ghats, gs = [], [], []
        for sent, mean in zip(sents, means):
            idx, ghat = sent.indices, sent.values.to(P.accumulate_dtype(mean.dtype))
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):  # kept sorted: the pass walks them in order
                order = torch.argsort(idx)
                idx, ghat = idx[order], ghat[order]
            idxs.append(idx)
            ghats.append(ghat)
            gs.append(mean.reshape(-1).index_select(0, idx).to(ghat.dtype))  # (advanced indexing: several times slower)
        if len({g.dtype for g in gs}) > 1:  # (mixed precisions: tensor by tensor)
            for key, idx, ghat, g in zip(keys, idxs, ghats, gs):
                self._learn([self.tensors[key]], [idx], ghat, g, [idx.numel()])
            return
        self._learn([self.tensors[k] for k in keys], idxs, torch.cat(ghats), torch.cat(gs), [i.numel() for i in idxs])

    def _learn(self, sts, idxs, ghat: torch.Tensor, g: torch.Tensor, sizes) -> None:
        for st, idx in zip(sts, idxs):
            st["prev_idx"] = idx
        if self.options["form"] == "code":
            # 1 + Delta = 1 + (g/w - ghat)/ghat = g / (w * ghat); ghat == 0 counts as not sent
            f = torch.tanh(g / (ghat * (self.weight * self.options["mu"]))).abs_()
            for st, part in zip(sts, f.masked_fill_(ghat == 0, self.unsent_factor).split(sizes)):
                st["prev_factor"] = part
        else:
            for st, part in zip(sts, (g - self.weight * ghat).split(sizes)):
                st["prev_numer"] = part
