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

import torch

from .. import payload as P
from .registry import register
from .base import Compressor, OptionError, as_number
from .topk import topk_indices


@register
class RegTopK(Compressor):
    SELECT_PASSES = 3.0  # read passes per selection (gradsift bench select; the wire plan's model)
    SELECTS_LARGEST = False
    name = "regtopk"
    OPTIONS = {"mu": 4.0, "unsent": 1e8, "form": "code"}
    EXACT_K = True
    OBSERVES = True
    SUMMARY = "REGTOP-k: top-k on |a|*|tanh((1+Delta)/mu)|, Delta from the previous round's aggregate"

    def validate(self) -> None:
        as_number("mu", self.options["mu"], lo=0.0, lo_open=True)
        as_number("unsent", self.options["unsent"])
        if self.options["form"] not in ("code", "paper"):
            raise OptionError(f"form must be code or paper, got {self.options['form']!r}")
        self.options["mu"] = float(self.options["mu"])
        self.options["unsent"] = float(self.options["unsent"])
        self._unsent_factor = abs(math.tanh((1.0 + self.options["unsent"]) / self.options["mu"]))

    @property
    def unsent_factor(self) -> float:
        """The factor of entries not sent last round: |tanh((1 + Q) / mu)| (1 for the default Q)."""
        return self._unsent_factor

    def init_state(self, key, numel, device):
        return {"prev_idx": None, "prev_factor": None, "prev_numer": None}

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        st, k, _ = self.begin(key, x)
        score = x.abs()
        idx_prev = st["prev_idx"]
        if idx_prev is not None and idx_prev.numel():
            base = self._unsent_factor
            if base != 1.0:
                score.mul_(base)
            a_prev = x[idx_prev]
            if self.options["form"] == "code":
                factor = st["prev_factor"]
            else:
                factor = self.paper_factor(st["prev_numer"], a_prev)
            score[idx_prev] = a_prev.abs_().mul_(factor.to(score.dtype))
        idx = topk_indices(score, k)
        return P.sparse(self.wire(x[idx]), idx, x.numel(), x.dtype, k)

    def paper_factor(self, numer: torch.Tensor, a_now: torch.Tensor) -> torch.Tensor:
        """|tanh((1 + Delta) / mu)| with Delta = numer / (omega * a_now); a_now == 0 counts as unsent."""
        denom = self.weight * a_now.to(numer.dtype)
        f = torch.tanh((1.0 + numer / denom) / self.options["mu"]).abs_()
        return f.masked_fill_(denom == 0, self.unsent_factor)

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        st = self.tensors[key]
        idx = sent.indices
        acc = P.accumulate_dtype(mean.dtype)
        ghat = sent.values.to(acc)
        g = mean[idx].to(acc)
        st["prev_idx"] = idx
        if self.options["form"] == "code":
            # 1 + Delta = 1 + (g/w - ghat)/ghat = g / (w * ghat); ghat == 0 counts as not sent
            f = torch.tanh(g / (ghat * (self.weight * self.options["mu"]))).abs_()
            st["prev_factor"] = f.masked_fill_(ghat == 0, self.unsent_factor)
        else:
            st["prev_numer"] = g - self.weight * ghat
