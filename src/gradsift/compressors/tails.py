"""Threshold methods on the tail of a tensor, read in the pass that accumulates it.

A threshold method (GaussianK, RedSync, DGC) needs, besides a few statistics, how many entries lie above a trial
threshold and, at the end, those entries. Counting over the whole tensor costs a pass per count. Here one compiled
pass per tensor (:func:`gradsift.kernels.many.scan_many`) adds the gradient into the residual (or updates DGC's
velocity) and records every entry whose magnitude reaches a *floor* guessed from the previous call (:func:`learn`):
above the floor, counts and selections come from those few candidates, exactly; below it (or when the floor let
through more than the cap), from the whole tensor. The floor decides only where the counting happens, never its
result.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from .. import kernels
from .. import payload as P
from ..kernels import many
from ..kernels.many import INF_BITS, Guess, _bits, _magnitude, batchable
from ..kernels.moments import Levels
from .base import Compressor

WANT = 3  # candidates aimed at per target entry (threshold methods stop anywhere up to 2k)
GROW = (1.0, 1.1)  # how much of the last call's growth a floor expects again (Guess.floor's grow_range)


class Tail:
    """One tensor ``x`` after the pass: its entries at or above ``floor`` (``idx``, ``vals``, in index order), all
    of them when ``complete``; ``top`` the float32 bits of its largest magnitude when the pass read them (NaN and
    Inf at or above ``INF_BITS``); ``sample`` the strided sample the pass copied out, when one was asked for;
    ``picked`` = (threshold, count at it, indices, values, settled): the selection the compiled pass made (DGC's),
    settled (non-zero: ``tails_many``'s ``dgc``) when it also took it out of the memory."""

    def __init__(self, x: torch.Tensor, floor: float | None, idx, vals, count: int, top: int | None,
                 sample: torch.Tensor | None = None, levels: Levels | None = None, moments: list | None = None,
                 picked: tuple | None = None):
        self.x, self.floor, self.sample, self.picked = x, floor, sample, picked
        self.levels, self.moments = levels, moments
        self.complete = floor is not None and idx is not None
        self.idx, self.vals, self.count, self.top = idx, vals, count, top
        self._floor_bits = _bits(floor) if floor is not None else None
        self._abs = None
        self._count = None

    @classmethod
    def whole(cls, x: torch.Tensor) -> "Tail":
        """A tensor with no candidates recorded: every count and selection reads the whole of it."""
        return cls(x, None, None, None, 0, None)

    @property
    def finite(self) -> bool:
        """Whether the accumulated tensor holds no NaN or Inf (known from the pass; else a read of it)."""
        if self.top is None:
            return bool(torch.isfinite(self.x).all())
        return self.top < INF_BITS

    def _whole(self) -> torch.Tensor:
        """What counts over the whole tensor read: ``x`` itself where the compiled count takes it (one read, no
        copy), else ``|x|``, taken once for every trial threshold (GPU, other dtypes, the eager backend)."""
        if batchable(self.x) and kernels.backend() == "compiled":
            return self.x
        if self._abs is None:
            self._abs = self.x.abs()
        return self._abs

    def _covers(self, t: float) -> bool:
        return self.complete and t >= 0 and _bits(t) >= self._floor_bits

    def count_above(self, t: float, enough: float = float("inf"), inclusive: bool = False) -> int:
        """How many entries have ``|x| > t`` (``>=`` with ``inclusive``; compared as a tensor compares with a number)
        -- or, when more than ``enough`` reached the floor and ``t`` lies below it, that many: the caller only needed
        to know the count exceeds ``enough``, and no pass over the tensor is made."""
        fb = self._floor_bits
        if fb is not None:
            b = _bits(t) if t >= 0 else -1
            if b >= fb:
                if self.complete:  # on the candidates (their compiled count bound once)
                    if self._count is None:
                        lib = self._compiled_candidates()
                        self._count = functools.partial(_count_torch, self.vals) if lib is None else \
                            functools.partial(_count_bits, lib.gs_count_above, self.vals.data_ptr(), self.vals.numel())
                    return self._count(b, inclusive, t)
            elif self.count > enough:
                return self.count
        src = self._whole()
        return many.count_above(src, t, inclusive, magnitudes=src is not self.x)

    def in_candidates(self, t: float) -> bool:
        """Whether the entries above ``t`` are all among the candidates, which the compiled kernels read
        (:func:`gradsift.kernels.many.take_above_many` takes them)."""
        return self._covers(t) and self.idx.is_contiguous() and self._compiled_candidates() is not None

    @property
    def floor_bits(self) -> int | None:
        """The floor's float32 magnitude bits (None: no floor)."""
        return self._floor_bits

    def counts_compiled(self) -> bool:
        """Whether the counts at or above the floor read candidates the compiled kernels take, all of them recorded."""
        return self.complete and self._compiled_candidates() is not None

    def _compiled_candidates(self):
        """The compiled kernels' library where they read the candidates' values (float32, contiguous, on the CPU,
        the compiled backend), else None."""
        return kernels.compiled_lib(self.vals) if batchable(self.vals) else None

    def above(self, t: float, inclusive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the entries with ``|x| > t`` (``>=`` with ``inclusive``), in index order."""
        if self._covers(t):
            return many.take_above(self.vals, self.idx, t, inclusive)
        src = self._whole()
        if src is self.x:
            return many.take_above(src, None, t, inclusive)
        idx, _ = many.take_above(src, None, t, inclusive, magnitudes=True)
        return idx, self.x.index_select(0, idx)

    def abs_sum(self) -> float:
        """``sum(|x|)``: from the moments the pass gathered at level 0 when asked for and their scale fitted (the
        magnitudes rounded to 2^-19 of the largest: integer sums, the same on both backends), else a read
        (:func:`abs_sum`)."""
        if self.moments is not None and self.top is not None and self.levels.fits(self.top):
            return self.moments[0][1] / self.levels.scale
        return abs_sum(self.x if self.x.dtype in (torch.float32, torch.float64) else self.x.float())

    def max_abs(self) -> float:
        """The largest magnitude (read in the pass, else read here)."""
        if self.top is not None:
            return _magnitude(self.top)
        lo, hi = torch.aminmax(self.x)
        return max(-float(lo), float(hi))


def _count_bits(count, ptr: int, n: int, b: int, inclusive: bool, t: float) -> int:
    """The compiled count of the candidates at ``ptr`` above the magnitude bits ``b`` (``t``'s)."""
    return int(count(ptr, n, b, int(inclusive)))


def _count_torch(vals: torch.Tensor, b: int, inclusive: bool, t: float) -> int:
    """:func:`_count_bits` where the compiled count does not apply (no reference back to the tail: no cycle keeps
    its memory alive)."""
    return many.count_above(vals, t, inclusive)


CHUNK = 1 << 18


def abs_sum(x: torch.Tensor) -> float:
    """``sum(|x|)`` in cache-sized chunks through one reused buffer: about one read pass (``vector_norm(x, 1)`` takes
    five at one thread, ``x.abs().sum()`` allocates and faults in a tensor the size of ``x``)."""
    if x.numel() <= CHUNK:
        return float(x.abs().sum(dtype=torch.float64))
    buf = torch.empty(CHUNK, dtype=x.dtype, device=x.device)
    total = 0.0
    for part in x.split(CHUNK):
        out = buf[:part.numel()]
        torch.abs(part, out=out)
        total += float(out.sum())  # (float32 sums of a chunk are cascaded: accurate; float64 ones are slow)
    return total


def tail_plans(c: Compressor, keys, flats) -> tuple[list[dict[str, Any]], list[int], list | None]:
    """What :func:`tails_many` needs of a group for compressor ``c``: each tensor's state, its k this step, and,
    for a method that samples (``sample_plan``: DGC), its sample -- None where k covers the tensor."""
    sts = [c.state(k, f) for k, f in zip(keys, flats)]
    ks = [c.k_for(k, f.numel(), st["step"]) for k, f, st in zip(keys, flats, sts)]
    plans = ([c.sample_plan(key, st["step"], f.numel(), k, f.device) if k < f.numel() else None
              for key, f, st, k in zip(keys, flats, sts, ks)] if hasattr(c, "sample_plan") else None)
    return sts, ks, plans


def tails_many(xs: Sequence[torch.Tensor], adds: Sequence[torch.Tensor | None], states: Sequence[dict[str, Any]],
               ks: Sequence[int], want: float, momentum: tuple | None = None,
               samples: Sequence[tuple[int, int, int] | None] | None = None,
               levels: Sequence[Levels | None] | None = None, dgc: int | None = None,
               srcs: Sequence[torch.Tensor | None] | None = None) -> list[Tail]:
    """One pass per tensor (``xs[i] += adds[i]`` when given; with ``momentum``, momentum correction's update of the
    velocities ``xs``: :func:`gradsift.kernels.many.scan_many`): its :class:`Tail` above the floor guessed for it
    (:class:`Guess`, aiming at ``want`` candidates per target entry), with the strided sample ``samples[i]`` =
    (start, stride, count) when asked, and the moments at ``levels[i]`` (:class:`Levels`); ``momentum`` = (us, m,
    nesterov[, u_srcs]) as :func:`gradsift.kernels.many.scan_many` takes it. Tensors the compiled pass
    does not take (other dtypes, GPUs; never with ``momentum``) are accumulated in torch and counted over the whole
    tensor (no sample: the caller takes it; no moments). ``dgc``: the compiled pass selects as DGC does right after
    (with a sample; ``Tail.picked``) and settles the memory there with 1 (v zeroed where selected) or 2 (u too),
    plus 8: the sparse wire's bf16 cast taken there too (v keeps what it rounds off, the values exact in bf16).
    ``srcs[i]``: read from there, ``xs[i]`` written whole (:func:`gradsift.kernels.many.topk_many`)."""
    out: list[Tail | None] = [None] * len(xs)
    on = [i for i, x in enumerate(xs) if batchable(x)]
    srcs = list(srcs) if srcs is not None else [None] * len(xs)
    for i in set(range(len(xs))) - set(on):
        if srcs[i] is not None:
            xs[i].copy_(srcs[i])
        if adds[i] is not None:
            xs[i].add_(adds[i])
        out[i] = Tail.whole(xs[i])
    guesses = Guess.floors([states[i] for i in on], [xs[i].numel() for i in on], [ks[i] for i in on], want, GROW)
    floors = [g[0] if g else None for g in guesses]
    caps = [g[1] if g else 64 for g in guesses]  # (no guess: the pass looks for non-finite entries only)
    mom = None
    if momentum:  # (us, m, nesterov[, u's sources]): the batchable tensors' (MomentumCorrection passes only those)
        usrcs = momentum[3] if len(momentum) > 3 else [None] * len(xs)
        mom = ([momentum[0][i] for i in on], momentum[1], momentum[2], [usrcs[i] for i in on])
    plans = [samples[i] for i in on] if samples is not None else ()
    lv = [levels[i] for i in on] if levels is not None else ()
    scans = many.scan_many([xs[i] for i in on], [adds[i] for i in on], floors, caps, mom, plans, lv,
                           dgc=[(ks[i], dgc) for i in on] if dgc is not None else (),
                           srcs=[srcs[i] for i in on]) if on else []
    for i, fl, scan in zip(on, floors, scans):
        if scan.dgc is not None:
            out[i] = Tail(xs[i], fl, None, None, scan.count, scan.top, scan.sample,
                          picked=(scan.dgc[0], int(scan.dgc[1]), scan.idx, scan.vals, dgc))
            continue
        out[i] = Tail(xs[i], fl, scan.idx if fl is not None else None, scan.vals, scan.count, scan.top, scan.sample,
                      levels[i] if levels is not None else None, scan.moments)
    return out  # type: ignore[return-value]


LARGEST_IF_NONE = """A threshold that selects nothing from a non-zero tensor lies at or above its largest magnitude: on a
tensor whose magnitudes all tie (a constant gradient) a threshold from their mean and spread lands on them, and a fit
can overshoot or come out NaN. Error feedback would then hold the tensor (a red-team saw 0 entries in 50 steps, the
residual grown 50-fold). So the entries at the largest magnitude go instead, ties included (the method's capacity
caps them; the rest overflow into the memory): a deviation from the papers, which do not say."""


def largest_instead(x: torch.Tensor, top: float, zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`LARGEST_IF_NONE` on a whole tensor: (indices, values) of the entries at its largest magnitude
    ``top``, zeroed in ``x`` when the memory is fused (``zero``)."""
    idx, vals = many.take_above(x, None, top, inclusive=True)
    if zero:
        x.index_fill_(0, idx, 0.0)
    return idx, vals


def last_first(fn, tails) -> list:
    """``fn(i)`` for every tensor i whose pass read it finite (None for the others), the last tensor first: what a
    group's pass wrote last is likeliest still in cache."""
    out: list = [None] * len(tails)
    for i in range(len(tails) - 1, -1, -1):
        out[i] = fn(i) if tails[i].finite else None
    return out


def counted_compiled(xs, tails) -> list[int]:
    """The tensors (their places) read finite in the pass whose counts the compiled kernels take (float32 candidates
    at or above a floor, every one of them recorded, and the tensor): a method's searches of them run in one
    compiled call."""
    return [i for i, (x, t) in enumerate(zip(xs, tails))
            if t.finite and t.counts_compiled() and batchable(x) and kernels.compiled_lib(x) is not None]


class OnTail(Compressor):
    """A threshold method that picks its threshold from a :class:`Tail` (:meth:`threshold`): every tensor of a group
    in one pass (:meth:`select_many_into`, error feedback fused), its counts on the candidates; the entries with
    ``|x| > threshold`` are sent (none above it: :data:`LARGEST_IF_NONE`)."""

    FUSES_MEMORY = True
    WANT = WANT
    MEAN_IN_PASS = False  # the pass sums |x| (moments at level 0), for :meth:`Tail.abs_sum`

    def threshold(self, x: torch.Tensor, k: int, tail: Tail) -> float:
        """The method's threshold for the flat accumulated ``x`` (counts through ``tail``)."""
        raise NotImplementedError

    def thresholds(self, xs, ks, tails) -> list[float | None]:
        """:meth:`threshold` of a group's tensors (None where the tensor is not finite), the last first: what the
        group's pass wrote last is likeliest still in cache (GaussianK reads each tensor twice: 5% of its step over
        ResNet-50's 25 MiB buckets, paired runs)."""
        return last_first(lambda i: self.threshold(xs[i], ks[i], tails[i]), tails)

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        return self._on_tails([key], [x], None)[0]

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        return self._on_tails([key], [acc], [grad])[0]

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        return self._on_tails(keys, xs, None)

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """Error feedback fused into the counting pass: ``acc += grad``, the threshold counted on the candidates, the
        selected entries zeroed in ``acc`` (values as accumulated; the memory casts them for the wire -- with ``wire``
        bf16 the group's take does, for selections within their capacity)."""
        return self._on_tails(keys, accs, grads, srcs, wire == torch.bfloat16)

    def _on_tails(self, keys, xs, adds, srcs=None, wire_bf16: bool = False) -> list[P.Payload]:
        begun = self.begin_many(keys, xs)
        levels = [Levels((0.0,), Levels.scale_for(st.get("top", 0.0)), False) for st, _, _ in begun] \
            if self.MEAN_IN_PASS else None
        tails = tails_many(xs, adds or [None] * len(xs), [b[0] for b in begun], [b[1] for b in begun], self.WANT,
                           levels=levels, srcs=srcs)
        thrs = self.thresholds(xs, [b[1] for b in begun], tails)
        # the selections on the candidates in one compiled call, zeroed there in the memory; else one by one
        group = [i for i, (tail, t) in enumerate(zip(tails, thrs)) if t is not None and tail.in_candidates(t)]
        caps = [self.capacity_for(begun[i][1], xs[i].numel()) for i in group] if wire_bf16 else None
        taken = dict(zip(group, many.take_above_many(
            [tails[i].vals for i in group], [tails[i].idx for i in group], [thrs[i] for i in group],
            [xs[i] if adds is not None else None for i in group], caps))) if len(group) > 1 else {}
        out = []
        for i, (x, tail, (st, k, _), thr) in enumerate(zip(xs, tails, begun, thrs)):
            zeroed, over = i in taken, 0
            if thr is None:
                idx, vals = nonfinite(x)
            else:
                idx, vals, over = taken[i] if zeroed else (*tail.above(thr), 0)
                if not idx.numel() and (top := tail.max_abs()) > 0.0:  # (rare: a read only then; LARGEST_IF_NONE)
                    idx, vals = tail.above(top, inclusive=True)  # the largest go, ties included
                    zeroed = False
                learn(st, tail, thr, idx.numel() + over, k, want=self.WANT)  # (every entry above thr)
                if self.MEAN_IN_PASS and tail.top is not None:
                    st["top"] = tail.max_abs()  # (the next pass's scale)
            if adds is not None and not zeroed:
                x.index_fill_(0, idx, 0.0)
            out.append(P.sparse(vals if adds is not None else self.wire(vals), idx, x.numel(), x.dtype, k,
                                adds is not None and tail.top is not None and tail.top < INF_BITS))
            out[-1].overflow = over  # (cut to the wire's capacity by the take: what stayed in memory)
        return out


def nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the NaN and Inf entries: what a threshold method sends from an overflowed memory, so
    that the memory sees the overflow in the payload (:meth:`gradsift.memory.feedback.ErrorFeedback.compress_many`)."""
    idx = torch.nonzero(~torch.isfinite(x)).squeeze(1)
    return idx, x[idx]


def learn(st: dict[str, Any], tail: Tail, t: float, sent: int, k: int, want: float) -> None:
    """After a threshold ``t`` that selected ``sent`` entries: :meth:`Guess.update`, the next floor where ``want * k``
    entries are expected (a method probes thresholds around k; counts beyond ``want * k`` need not be exact)."""
    Guess.update(st, t, sent, want * k, tail.floor, tail.count if tail.floor is not None else None)
