"""``gs``, ``rsb``, ``gsb``: gradient sampling with a Bayes prior.

Song, Zhao, Pan, Liu, Zhang, Xu, Jin, "Communication Efficient SGD via Gradient
Sampling with Bayes Prior", CVPR 2021 (gsb-gradient-sampling-bayes-prior.md).

Every ``tau`` steps (default 100, Sec. 3.2.3 and Fig. 2, "Sync1") the workers
all-reduce their full gradient: that dense mean is the step's update and
becomes the *global gradient distribution* for the next ``tau - 1`` steps
(eq. (11)). In between ("Sync2") each coordinate i is kept by an independent
Bernoulli draw with probability ``p_i`` (Sec. 3.2.1):

* ``gs``  -- ``p_i`` proportional to the squared global gradient (eq. (3)),
  normalized to sum to k by Algorithm 1;
* ``rsb`` -- uniform sampling weighted by the Bayes prior (the ablation "RSB",
  Sec. 4.1);
* ``gsb`` -- both: the posterior of eq. (14), squared global gradient times the
  prior.

The Bayes prior (eqs. (12)-(13)) multiplies a coordinate's prior by ``alpha``
(default 0.9, Table 2) every time it is sampled (below: the other reading of
eq. 13); it is then L1-normalized. We
keep the products (float32, multiplied at the k sampled coordinates only: no
pass over the tensor) and divide them by their largest if one falls below
1e-30 (only ``prior="never"`` gets there); normalization does not change ``p``
because Algorithm 1 renormalizes. (An earlier gradsift kept it in log space and
took ``exp`` of every entry each step; its saved states are converted.)

Eq. 13 multiplies coordinate i's prior by alpha at step t when i is in
S_{t-1}, "the set of sampling coordinates in the previous t-1 training
iterations". Read literally, every coordinate sampled at any earlier step
decays at every step (``decay="visited"``: a pass over the prior per step).
The paper's own example -- "the prior probability of a coordinate being
sampled three times in succession will reduce quickly to 0.8^3" -- and its
gloss of alpha as "the probability that the sampled coordinate will be
resampled" count samplings, so the default (``decay="sampled"``) multiplies a
coordinate's prior by alpha each time it is sampled. The literal reading
pushes visited coordinates down faster and so covers more of the tensor
(docs/methods/gsb.md, docs/reproductions.md measure both).

The prior lives within one refresh window (``prior="window"``, the default):
each refresh restarts it from 1 together with the new global distribution, so
every window samples "denser for the larger gradient components" (Sec. 3.3.3,
Aim 1) and spreads the rest of its k over coordinates not yet visited in that
window (Aim 2; Fig. 3(b) measures coverage over 100 iterations, one window).
``prior="never"`` keeps counting samplings across windows, the reading of an
earlier gradsift: on d = 1e5, k = 1%, a fixed Student-t(2) global gradient and
tau = 100, the share of gradient energy each step captures fell from 0.445
(steps 1-99) to 0.095 (100-199) and 0.022 (900-999) -- the largest
coordinates pushed down for good, GSB drifting towards random sampling
(about 0.01) -- while the per-window prior keeps 0.445 in every window and
GS 0.705. ``rsb`` (no global distribution) restarts its prior at each
refresh the same way when ``tau > 0``.

Algorithm 1 squares its input. We feed it ``|g| * sqrt(prior)`` -- computed
directly as ``g^2 * prior`` -- so the prior enters once, not squared.

Algorithm 1 is read as the water-filling it intends: entries whose
probability exceeds 1 are capped at 1 and *stay* capped (the capped set is
cumulative), and only the uncapped entries are rescaled to the remaining
budget ``k - |capped|``, at most ``iters`` (5) times. The probabilities then
sum to k whenever d >= k. The literal pseudo-code rescales *every* entry in
line 12, overwriting the caps of line 7, and falls short of k on heavy tails;
we do not follow it there.

All workers hold the same global distribution and prior, and draw from a
generator seeded by ``(seed, tensor, step)`` without the rank, so they pick
identical coordinates: the payload is shared-index (values all-reduced, no
indices on the wire). That generator gives one seed; coordinate i's uniform is a
function of (seed, i) (:mod:`gradsift.kernels.draw`: a counter-based generator,
drawn in the compiled pass that reads p -- ``torch.rand`` over every entry cost
a third of GSB's step). Values travel in FP16 by default, as in the paper
(Sec. 4.1). The overall ratio is ``1/tau + k/d`` (Sec. 3.4): ``ratio`` is the
sampled part, k/d; the refresh's dense bytes come on top and show in the
accounting.

What the paper prescribes and what we chose: the paper sends the sampled
values as they are (``g_i`` where sampled; eq. (5)'s ``p_i * grad_i`` in
expectation) and mentions neither error feedback nor 1/p rescaling. That is
our default (``feedback=false``). We tried error feedback and measured it
fail: on mnist1d-cnn (8 workers, ratio 0.01, momentum SGD, 600 steps) ``gs``
with feedback reaches a non-finite gradient at step 394 and ``gsb`` ends at
loss 8.4, accuracy 0.12 (docs/methods/gsb.md) --
coordinates the global distribution gives near-zero probability accumulate
residual for up to ``tau`` steps and are then sent in one large kick, the
learning-rate scaling REGTOP-k's paper describes. ``feedback=true`` remains
available. ``unbiased=true`` divides sampled values by ``p_i`` (an unbiased
estimate of the gradient); it is refused together with feedback, because the
residual ``a - a/p = a (1 - 1/p)`` on every sampled entry is large, of the
opposite sign, and grows without bound.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import payload as P
from ..kernels import draw, scatter
from ..kernels.buffers import reuse_spare
from .registry import register
from ..options import Option
from .base import Compressor, OptionError, restore
from .state import UndoLog
from .waterfill import normalize_probabilities, water_level  # noqa: F401 (the API)


TINY = 1e-30  # a prior below this is rescaled by the largest (far above float32's smallest normal, 1.2e-38)


class _Sampling(Compressor):
    SELECTS_LARGEST = False
    """Shared machinery of gs / rsb / gsb; subclasses fix USE_GLOBAL and BAYES.

    A checkpoint (the rollback of a skipped step) shares the per-tensor state's tensors instead of copying them (the
    visited marks, the prior and the kept weights: 13 bytes an entry, copied every step, cost 40 ms a step on a
    5.3M-parameter model): a step writes the k sampled entries of them in place, and an open checkpoint's
    :class:`UndoLog` keeps what they held; whatever a step changes everywhere (a refresh, a rescale) it makes anew
    instead of writing in place."""

    USE_GLOBAL = True
    BAYES = True
    PRIORS = ("window", "never")
    DECAYS = ("sampled", "visited")  # eq. 13's two readings (module docstring)
    OPTIONS = {
        "tau": Option.integer(100, lo=1, doc="steps between refreshes of the global distribution (a dense step; "
                                             "Sec. 3.2.3)"),
        "alpha": Option.number(0.9, lo=0.0, hi=1.0, lo_open=True, doc="the Bayes prior's factor per sampling "
                                                                      "(eq. 13, Table 2)"),
        "iters": Option.integer(5, lo=1, doc="rounds of Algorithm 1's capping of probabilities above 1"),
        "unbiased": Option.flag(False, doc="divide the sampled values by their probability (needs memory=none)"),
        "prior": Option.choice("window", PRIORS, doc="when the Bayes prior restarts: each refresh window, or never"),
        "decay": Option.choice("sampled", DECAYS, doc="eq. 13's reading: the prior decays when an entry is sampled, "
                                                      "or every step once it was visited"),
    }
    VALUE_DTYPE = "fp16"
    OBSERVES = True
    MEMORY = "none"  # the paper's scheme; see the module docstring for why not error feedback

    def check_memory(self, memory: str) -> None:
        if memory != "none" and self.options["unbiased"]:
            raise OptionError(f"{self.name}: unbiased=true (1/p rescaling) needs feedback=false: with error "
                              "feedback the residual a - a/p would grow without bound")

    def init_state(self, key: str, numel: int, device: torch.device) -> dict[str, Any]:
        st: dict[str, Any] = {"visited": torch.zeros(numel, dtype=torch.bool, device=device),
                              "level": None, "level_k": 0}
        if self.USE_GLOBAL:
            st["global_sq"] = None
        if self.BAYES:
            st["prior"] = torch.ones(numel, dtype=torch.float32, device=device)
        return st

    def payload_kind(self) -> str:
        return P.SHARED

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """The per-tensor state of ``keys``, its tensors shared, and a log of what the step writes into them (class
        docstring); ``deep``: copied."""
        if deep:
            return super().checkpoint(keys, deep)
        log = UndoLog()
        logs = self.__dict__.setdefault("_logs", {})
        for k in keys:
            logs.setdefault(k, weakref.WeakSet()).add(log)  # (gone with the token: the road drops it at the step's end)
        return {"shared": {k: dict(self.tensors[k]) if k in self.tensors else None for k in keys}, "log": log}

    def rollback(self, token: dict[str, Any]) -> None:
        if "shared" not in token:
            return super().rollback(token)
        for t, at, before in reversed(token["log"].entries):
            t[at] = before
        restore(self.tensors, token["shared"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the open checkpoints' logs (weak references) and the spare refresh buffers (a cache)."""
        state = dict(self.__dict__)
        state.pop("_logs", None)
        state.pop("_sq_spare", None)
        return state

    def _note(self, key: str, idx: torch.Tensor, *tensors: torch.Tensor | None) -> None:
        """Before the entries ``idx`` of ``tensors`` are written in place: their values, into every open log of
        ``key``."""
        logs = self.__dict__.get("_logs", {}).get(key)
        if not logs:
            return
        noted = [(t, idx, t[idx]) for t in tensors if t is not None]
        for log in logs:
            log.entries += noted

    def is_refresh(self, step: int) -> bool:
        tau = self.options["tau"]
        return tau > 0 and step % tau == 0

    @staticmethod
    def _prior(st: dict[str, Any]) -> torch.Tensor:
        """The tensor's Bayes prior, alpha^(times sampled) relative to the largest (eqs. (12)-(13)); a state saved
        by an earlier gradsift, in log space, is converted once."""
        if "log_prior" in st:
            lp = st.pop("log_prior")
            st["prior"] = torch.exp(lp - lp.max())
        return st["prior"]

    def weights(self, st: dict[str, Any]) -> torch.Tensor | None:
        """The unnormalized sampling weights: g^2 (gs), prior (rsb), g^2 * prior (gsb: kept, and recomputed only
        where the prior changed -- the k sampled entries -- so a step makes no pass for it)."""
        w = st["global_sq"] if self.USE_GLOBAL else None
        if not self.BAYES or w is None:
            return self._prior(st) if self.BAYES else w
        if st.get("w") is None:
            st["w"] = w * self._prior(st)
            st["w_top"] = float(st["w"].max())  # (a bound until the next refresh: the weights only shrink)
        return st["w"]

    def probabilities(self, st: dict[str, Any], k: int, numel: int, device) -> tuple[torch.Tensor, float]:
        """(base, scale): this step's probabilities are ``min(scale * base, 1)`` (:func:`water_level`)."""
        if not self.BAYES and st.get("level") is not None and st.get("level_k") == k:
            return st["level"]  # gs: fixed between refreshes
        w = self.weights(st)
        if w is None:  # neither global nor prior: plain random sampling
            level = torch.full((numel,), min(1.0, k / numel), dtype=torch.float32, device=device), 1.0
        elif not self.BAYES:  # gs: computed once a window (cached below)
            level = water_level(w, k, self.options["iters"])
        else:
            if st.get("w_total") is None:  # the weights' sum, kept between steps (:meth:`_sampled` updates it)
                st["w_total"] = float(w.sum())
            top = st.get("w_top") if self.USE_GLOBAL else 1.0  # rsb: the prior, at most 1
            level = water_level(w, k, self.options["iters"], st["w_total"], top)
        if not self.BAYES:
            st["level"], st["level_k"] = level, k
        return level

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        return self._select(key, x, *self.begin(key, x))

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors: the draws and their bookkeeping in one compiled call
        (:func:`gradsift.kernels.scatter.sample_many`); a refresh, ``unbiased``, ``decay="visited"`` or an open
        checkpoint's log takes a tensor through :meth:`select` on its own."""
        out: list[P.Payload | None] = [None] * len(keys)
        rows, at = [], []
        simple = not self.options["unbiased"] and not (self.BAYES and self.options["decay"] == "visited")
        logs = self.__dict__.get("_logs", {})
        for i, (key, x, (st, k, step)) in enumerate(zip(keys, xs, self.begin_many(keys, xs))):
            if not simple or self.is_refresh(step) or logs.get(key):
                out[i] = self._select(key, x, st, k, step)
                continue
            base, scale = self.probabilities(st, k, x.numel(), x.device)
            w = st.get("w") if self.BAYES else None
            rows.append(scatter.Sample(base=base, seed=self._seed(key, step, x.device), scale=scale, expect=k, x=x,
                                       visited=st["visited"], prior=self._prior(st) if self.BAYES else None,
                                       alpha=self.options["alpha"], w=w,
                                       gsq=st["global_sq"] if w is not None else None))
            at.append((i, st, k))
        if not rows:
            return out
        drawn, values = scatter.sample_many(rows)
        wired = self.wire(values, sparse=False).split([d[0].numel() for d in drawn])  # (one cast for the group)
        for (i, st, k), row, (idx, _, old, new, least), vals in zip(at, rows, drawn, wired):
            self._settle(st, old, new, least)
            out[i] = P.shared(vals, idx, row.x.numel(), row.x.dtype, k)
        return out

    def _seed(self, key: str, step: int, device) -> int:
        """The draw's seed of (tensor, step), the same on every worker."""
        g = self.rng(key, step, device, shared=True)
        return int(torch.randint(0, 2**62, (1,), generator=g, device=g.device))

    def _select(self, key: str, x: torch.Tensor, st: dict[str, Any], k: int, step: int) -> P.Payload:
        d = x.numel()
        if self.is_refresh(step):  # Sync1: the dense all-reduce (not counted as sampling)
            if self.BAYES and self.options["prior"] == "window":
                st["prior"] = torch.ones_like(self._prior(st))  # a new window: the prior restarts (made anew: a
                # checkpoint may share the old one)
                st["w"] = st["w_total"] = None
                st.pop("seen", None)
            return P.dense(self.wire(x, sparse=False), x.dtype)
        base, scale = self.probabilities(st, k, d, x.device)
        idx = draw.bernoulli(base, self._seed(key, step, x.device), scale, expect=k)  # u_i < min(scale base_i, 1):
        # one compiled read of base
        vals = self._sampled(key, st, idx, x)
        if self.options["unbiased"]:  # divided by p_i, as the draw computed it; beyond the dtype's range it
            # saturates at the largest finite value, as the wire's narrowing does (never Inf on the wire)
            big = torch.finfo(vals.dtype).max
            vals = (vals / base[idx].mul(scale).clamp_(max=1.0).to(vals.dtype)).clamp_(-big, big)
        return P.shared(self.wire(vals, sparse=False), idx, d, x.dtype, k)

    def _sampled(self, key: str, st: dict[str, Any], idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The values at the sampled coordinates; those coordinates marked visited, their prior times alpha, the kept
        weights (gsb) and their sum following -- one compiled sweep over the k coordinates
        (:func:`gradsift.kernels.scatter.sampled`; advanced indexing cost 37 ms a step on ResNet-50's shapes, one torch
        index operation per array 13 ms, a sum over every entry 4.5 ms)."""
        self._note(key, idx, st["visited"])
        if not self.BAYES:
            return scatter.sampled(idx, x, st["visited"])[0]
        if self.options["decay"] == "visited":  # eq. 13 read literally: every coordinate of S_{t-1}, every step
            vals = scatter.sampled(idx, x, st["visited"])[0]
            seen = st.get("seen")  # S: sampled since the prior (re)started
            if seen is None:
                seen = st["seen"] = torch.zeros_like(st["visited"])
            self._note(key, idx, seen)
            seen[idx] = True
            prior = st["prior"] = self._prior(st) * torch.where(seen, self.options["alpha"], 1.0)  # (anew)
            if float(prior.max()) < TINY:  # (every coordinate visited for hundreds of steps)
                st["prior"] = prior / prior.max()
            st["w"] = st["w_total"] = None  # (the weights changed everywhere: recomputed from the prior)
            return vals
        w = st.get("w")
        self._note(key, idx, self._prior(st), w)
        vals, old, new, least = scatter.sampled(idx, x, st["visited"], self._prior(st), self.options["alpha"], w,
                                             st["global_sq"] if w is not None else None)
        self._settle(st, old, new, least)
        return vals

    def _settle(self, st: dict[str, Any], old: torch.Tensor | None, new: torch.Tensor | None, least: float) -> None:
        """After the bookkeeping at the sampled coordinates (``sampled``'s olds, news and smallest prior): a prior
        rescaled where it fell below :data:`TINY`, the kept weights' sum following the entries that changed."""
        if old is None:  # (gs: no prior)
            return
        if least < TINY:  # (prior="never" only: sampled hundreds of times)
            st["prior"] = self._prior(st) / self._prior(st).max()  # the same probabilities: Algorithm 1 renormalizes
            st["w"] = st["w_total"] = None
            return
        if st.get("w") is None and self.USE_GLOBAL:
            st["w_total"] = None
        if st.get("w_total") is not None:  # rsb: the weights are the prior; gsb: global_sq * prior, kept
            st["w_total"] += float(new.sum(dtype=torch.float64)) - float(old.sum(dtype=torch.float64))

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        """A dense round refreshes the global distribution: the mean's squares, written into the tensor the key's
        last refresh replaced once nothing holds it (a fresh allocation of every entry each step cost page faults
        where every round is dense), so a checkpoint's shared state keeps the one it holds."""
        if sent.kind == P.DENSE and self.USE_GLOBAL:
            st = self.tensors[key]
            spares = self.__dict__.setdefault("_sq_spare", {})
            out = reuse_spare(spares, key, mean, torch.float32)
            torch.square(mean.to(torch.float32), out=out)
            if st.get("global_sq") is not None:
                spares[key] = st["global_sq"]
            st["global_sq"] = out
            st["level"] = st["w"] = st["w_total"] = None

    def telemetry(self, workers) -> dict[str, float]:
        """Share of coordinates sampled at least once so far (identical on every worker)."""
        seen = total = 0
        for st in self.tensors.values():
            seen += int(st["visited"].sum())
            total += st["numel"]
        return {"visited_share": seen / total if total else 0.0}


@register
class GS(_Sampling):
    SELECT_PASSES = 10.0  # on real (heavy-tailed) gradients; fewer on Gaussian ones
    name = "gs"
    USE_GLOBAL, BAYES = True, False
    SUMMARY = "gradient sampling: Bernoulli draws from the global gradient (refreshed every tau steps), shared indices"


@register
class RSB(_Sampling):
    SELECT_PASSES = 25.0  # on real (heavy-tailed) gradients; fewer on Gaussian ones
    name = "rsb"
    USE_GLOBAL, BAYES = False, True
    OPTIONS = {**_Sampling.OPTIONS, "tau": Option.integer(100, lo=0, doc="steps between restarts of the Bayes prior "
                                                                         "(0: never; no global distribution here)")}
    SUMMARY = "random sampling with the Bayes prior (GSB ablation), shared indices"


@register
class GSB(_Sampling):
    SELECT_PASSES = 30.0  # on real (heavy-tailed) gradients; fewer on Gaussian ones
    name = "gsb"
    USE_GLOBAL, BAYES = True, True
    SUMMARY = "GSB: gradient sampling with the Bayes prior, shared indices, fp16 values"
