"""``dgc``: Deep Gradient Compression's sampled threshold and momentum correction.

Lin, Han, Mao, Wang, Dally. "Deep Gradient Compression." ICLR 2018; the
behaviour follows the public code (synxlin/deep-gradient-compression, read,
not copied; notes/reference-code.md).

Selection (:meth:`DGC.select`): estimate the top-k threshold from a strided
random sample of at least ``max(ceil(sample_ratio * d), ceil(2 / ratio))``
entries -- the smallest of the sample's top ``ceil(ratio * s)`` magnitudes --
and select ``|x| >= thr``. If that selects more than 1.3k entries, take the
exact top-k among the candidates; if fewer than 0.8k, lower the threshold by
0.8x (at most 10 times).

Memory: momentum correction (``memory=momentum``, DGC's default; see
:class:`gradsift.memory.momentum.MomentumCorrection`, which any sparsifier may use):
momentum is accumulated locally and the *velocity* is what gets sparsified::

    u <- m u + g;  v <- v + u            (Nesterov: u <- (u + g) m;  v <- v + u + g)
    send the selected entries of v; zero them in v, and in u (momentum factor masking)

so the optimizer must apply no momentum of its own (the runtimes hand the
optimizer's momentum to the memory). Its options ``momentum``, ``nesterov``,
``masking`` and ``clip`` are written in DGC's spec as before
(``dgc:momentum=0.9,clip=1.0``). DGC's warm-up (density decaying
exponentially over the first epochs) is every compressor's ``warmup`` option
(in steps).

Tensors with at most one dimension (biases, norms) are sent dense, as DGC
does (:meth:`DGC.sends_dense`); their momentum is then plain momentum (no
masking). The whole-model tensor of ``--granularity model`` (key ``"model"``)
is always compressed.

Deviations: clipping is per tensor (DGC clips the worker's whole gradient);
warm-up is per step rather than per epoch.

On the compiled backend the pass that updates the velocity also selects (and,
when the values go out uncast, settles u and v): ``select.c: dgc_in_scan``
repeats :meth:`DGC.select_tail`'s operations on the candidates
(``Tail.picked``); what would read the whole tensor stays in Python.
"""

from __future__ import annotations

import math

import torch

from .. import payload as P
from .registry import register
from ..options import Option
from .base import Compressor
from .tails import Tail, learn
from ..kernels.guess import Guess
from ..payload import fit_capacity
from .. import kernels


def sample_plan(d: int, ratio: float, sample_ratio: float, generator: torch.Generator) -> tuple[int, int, int]:
    """DGC's strided random sample of a tensor of ``d`` entries: (start, stride, count), the sample being
    ``x[start::stride][:count]`` -- at least ``sample_ratio * d`` and ``2 / ratio`` entries (all of them if that
    is d), from a random start."""
    s = min(d, max(math.ceil(sample_ratio * d), math.ceil(2.0 / ratio)))
    if s >= d:
        return 0, 1, d
    stride = d // s
    return int(torch.randint(0, stride, (1,), generator=generator, device=generator.device)), stride, s


def sampled_threshold(sample: torch.Tensor, ratio: float) -> float:
    """DGC's threshold estimate: the smallest of the ``ceil(ratio * s)`` largest magnitudes of the sample."""
    ks = max(1, math.ceil(ratio * sample.numel()))
    return float(torch.topk(sample.abs(), ks, sorted=False).values.min())


@register
class DGC(Compressor):
    SELECT_PASSES = 5.0  # read passes per selection (gradsift bench select; the wire plan's model)
    name = "dgc"
    OPTIONS = {
        "sample_ratio": Option.number(0.01, lo=0.0, hi=1.0, lo_open=True, doc="the share of the tensor sampled to "
                                                                              "estimate the threshold"),
        "dense_1d": Option.flag(True, doc="send 1-D tensors (biases, norms) whole, as DGC's code does"),
    }
    CAPACITY = 1.3  # DGC's own band: more than 1.3k selected means an exact top-k among them
    MEMORY = "momentum"
    WANT = 3.0  # candidates aimed at per target entry: the sampled threshold varies, so a floor well below it
    SELECTS_IN_PASS = True  # the compiled pass that updates the velocity selects too (select.c: dgc_in_scan)
    SUMMARY = "DGC: sampled top-k threshold (1.3k/0.8k correction) with momentum correction and masking"

    def sends_dense(self, key: str, shape: torch.Size) -> bool:
        return bool(self.options["dense_1d"]) and len(shape) <= 1 and key != "model"

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        return self.select_tail(key, Tail.whole(x))

    def sample_plan(self, key: str, step: int, d: int, k: int, device) -> tuple[int, int, int]:
        """The sample :meth:`select_tail` estimates its threshold from, for tensor ``key`` at ``step`` (the same
        draw wherever the sample is taken)."""
        return sample_plan(d, k / d, self.options["sample_ratio"], self.rng(key, step, device))

    def select_tails(self, keys, tails) -> list[P.Payload | None]:
        """:meth:`emit` of a group's tensors from their tails, where the compiled pass selected and settled them
        (``Tail.picked``, read finite, the same settling): their guesses learned in one loop, their bf16 values made
        in one cast -- the payloads :meth:`select_tail` and :meth:`emit` make one by one; None for the others (the
        caller sends those one by one: a tensor whose threshold fell under its floor, a non-finite one)."""
        out: list[P.Payload | None] = [None] * len(tails)
        done = [j for j, t in enumerate(tails) if t.picked is not None and t.picked[4] and t.finite]
        settled = {tails[j].picked[4] for j in done}
        if len(settled) != 1:  # (none; or settled unlike one another, which one pass never does: one by one)
            return out
        bf16 = bool(next(iter(settled)) & 8)
        tails = [tails[j] for j in done]
        begun = self.begin_many([keys[j] for j in done], [t.x for t in tails])
        picks = [t.picked for t in tails]
        Guess.update_many([st for st, _, _ in begun], [p[0] for p in picks], [p[1] for p in picks],
                          [self.WANT * k for _, k, _ in begun], [t.floor for t in tails],
                          [t.count if t.floor is not None else None for t in tails])
        vals = [p[3] for p in picks]
        if bf16:  # (exact in bf16: the pass left what the cast rounds off in memory)
            vals = list(torch.cat(vals).to(torch.bfloat16).split([v.numel() for v in vals]))
        for j, t, (st, k, _), p, v in zip(done, tails, begun, picks, vals):
            d = t.x.numel()
            sent = P.sparse(v, p[2], d, t.x.dtype, k)
            sent.settled = True
            sent.capacity = self.capacity_for(k, d)
            if sent.count > sent.capacity:
                fit_capacity(sent)  # (the cut goes nowhere: emit's caller drops it too)
            out[j] = sent
        return out

    def select_tail(self, key: str, tail) -> P.Payload:
        """DGC's selection of the flat ``tail.x``: its counts on the candidates of the pass that updated the velocity
        (:mod:`gradsift.compressors.tails`), or over the whole tensor (:meth:`Tail.whole`); ``|x| >= thr``."""
        x = tail.x
        st, k, step = self.begin(key, x)
        d = x.numel()
        if tail.picked is not None:  # selected by the compiled pass, as below (the same operations)
            thr, reached, idx, vals, settled = tail.picked
            learn(st, tail, thr, reached, k, self.WANT)
            if settled & 8:  # the pass left the bf16 cast's rounding in memory: the values are exact in bf16
                vals = vals.to(torch.bfloat16)
            p = P.sparse(vals if settled else self.wire(vals), idx, d, x.dtype, k)  # settled: the memory casts
            p.settled = bool(settled)
            return p
        if k >= d:
            idx = torch.arange(d, device=x.device)
            return P.sparse(self.wire(x[idx]), idx, d, x.dtype, k)
        if tail.sample is None:  # (the compiled pass copies it out while it updates x: tails_many's samples)
            start, stride, s = self.sample_plan(key, step, d, k, x.device)
            tail.sample = x[start::stride][:s]
        thr = sampled_threshold(tail.sample, k / d)
        count = tail.count_above(thr, 1.3 * k, inclusive=True)
        for _ in range(10):
            if count >= 0.8 * k:
                break
            thr *= 0.8
            count = tail.count_above(thr, 1.3 * k, inclusive=True)
        idx, vals = tail.above(thr, inclusive=True)
        learn(st, tail, thr, idx.numel(), k, self.WANT)
        if idx.numel() > 1.3 * k:  # the k largest, ties to the lowest index (as the compiled pass keeps them), in
            keep = torch.sort(kernels.topk_lowest_ties(vals.abs(), k)).values  # index order: updates stay local
            idx, vals = idx.index_select(0, keep), vals.index_select(0, keep)
        return P.sparse(self.wire(vals), idx, d, x.dtype, k)
