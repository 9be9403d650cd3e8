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

import math
from typing import Any, Sequence

import torch

from .. import payload as P
from ..kernels import many
from ..kernels.many import _bits, _magnitude
from .base import Compressor

WANT = 3  # candidates aimed at per target entry (threshold methods stop anywhere up to 2k)


class Tail:
    """One tensor ``x`` after the pass: its entries at or above ``floor`` (``idx``, ``vals``, in index order), all
    of them when ``complete``; ``finite`` whether the accumulated tensor holds no NaN or Inf."""

    def __init__(self, x: torch.Tensor, floor: float | None, idx, vals, count: int, finite: bool):
        self.x, self.floor = x, floor
        self.complete = floor is not None and idx is not None
        self.idx, self.vals, self.count, self.finite = idx, vals, count, finite
        self._floor_bits = _bits(floor) if floor is not None else None
        self._mag = None

    def _covers(self, t: float) -> bool:
        return self.complete and t >= 0 and _bits(t) >= self._floor_bits

    def magnitudes(self) -> torch.Tensor:
        if self._mag is None:
            self._mag = self.vals.abs()
        return self._mag

    def count_above(self, t: float, enough: float = float("inf")) -> int:
        """How many entries have ``|x| > t`` (float32 comparison, as :func:`gradsift.kernels.select_above`) -- or,
        when more than ``enough`` reached the floor and ``t`` lies below it, that many: the caller only needed to
        know the count exceeds ``enough``, and no pass over the tensor is made."""
        if self._covers(t):
            return int(torch.count_nonzero(self.magnitudes() > t))
        if self._floor_bits is not None and self.count > enough and (t < 0 or _bits(t) < self._floor_bits):
            return self.count
        return int(torch.count_nonzero(self.x.abs() > t))

    def count_at_least(self, t: float, enough: float = float("inf")) -> int:
        """:meth:`count_above` for ``|x| >= t`` (``t`` rounded to float32, as a comparison with a tensor rounds it)."""
        return self.count_above(just_below(t), enough)

    def at_least(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`above` for ``|x| >= t``."""
        return self.above(just_below(t))

    def above(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the entries with ``|x| > t``, in index order."""
        if self._covers(t):
            keep = self.magnitudes() > t
            return self.idx[keep], self.vals[keep]
        idx = torch.nonzero(self.x.abs() > t).squeeze(1)
        return idx, self.x[idx]

    def max_abs(self) -> float:
        """The largest magnitude (from the candidates when they hold it)."""
        if self.complete and self.count:
            return float(self.magnitudes().max())
        lo, hi = torch.aminmax(self.x)
        return max(-float(lo), float(hi))


def just_below(t: float) -> float:
    """The largest float32 below ``t`` rounded to float32 (so ``|x| >= t`` is ``|x| > just_below(t)``); -1 for 0."""
    b = _bits(t)
    return _magnitude(b - 1) if t > 0 and b > 0 else -1.0


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


def fast(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the compiled pass: a contiguous float32 CPU tensor (others: each method's torch path)."""
    return x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda and x.numel() > 0


def tails_many(xs: Sequence[torch.Tensor], adds: Sequence[torch.Tensor | None], states: Sequence[dict[str, Any]],
               ks: Sequence[int], momentum: tuple[Sequence[torch.Tensor], float, bool] | None = None) -> list[Tail]:
    """One pass per tensor (``xs[i] += adds[i]`` when given; with ``momentum``, momentum correction's update of the
    velocities ``xs``: :func:`gradsift.kernels.many.scan_many`): its :class:`Tail` above the floor guessed for it.
    Tensors the compiled pass does not take (other dtypes, GPUs; not with ``momentum``) are accumulated in torch and
    counted over the whole tensor."""
    out: list[Tail | None] = [None] * len(xs)
    on = [i for i, x in enumerate(xs) if fast(x)]
    for i, (x, a) in enumerate(zip(xs, adds)):
        if i not in on:
            if a is not None:
                x.add_(a)
            out[i] = Tail(x, None, None, None, 0, bool(torch.isfinite(x).all()))
    floors, caps = [], []
    for i in on:
        fl, st = states[i].get("floor"), states[i]
        floors.append(fl * min(st.get("grow", 1.0), 1.1) if fl else None)  # (a threshold that jumps up and down
        # -- DGC's sampled one -- must not lift the floor over the next one: at most 10% a step)
        caps.append(min(xs[i].numel(), int(2 * st.get("want", WANT) * ks[i]) + 64) if fl else 64)
    mom = (momentum[0], momentum[1], momentum[2]) if momentum else None
    scans = many.scan_many([xs[i] for i in on], [adds[i] for i in on], floors, caps, mom) if on else []
    for i, fl, (idx, vals, count) in zip(on, floors, scans):
        x = xs[i]
        if fl is None:  # no guess: the pass looked for non-finite entries only
            out[i] = Tail(x, None, None, None, 0, count == 0)
        else:  # non-finite entries are above any floor: among the candidates, when those are complete
            finite = bool(torch.isfinite(vals).all()) if idx is not None else bool(torch.isfinite(x).all())
            out[i] = Tail(x, fl, idx, vals, count, finite)
    return out  # type: ignore[return-value]


class OnTail(Compressor):
    """A threshold method that picks its threshold from a :class:`Tail` (:meth:`threshold`): every tensor of a group
    in one pass (:meth:`select_many_into`, error feedback fused), its counts on the candidates; the entries with
    ``|x| > threshold`` are sent."""

    FUSES_MEMORY = True
    WANT = WANT

    def threshold(self, x: torch.Tensor, k: int, tail: Tail) -> float:
        """The method's threshold for the flat accumulated ``x`` (counts through ``tail``)."""
        raise NotImplementedError

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        return self._on_tails([key], [x], None)[0]

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        return self._on_tails([key], [acc], [grad])[0]

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        return self._on_tails(keys, xs, None)

    def select_many_into(self, keys, accs, grads) -> list[P.Payload]:
        """Error feedback fused into the counting pass: ``acc += grad``, the threshold counted on the candidates, the
        selected entries zeroed in ``acc`` (values as accumulated; the memory casts them for the wire)."""
        return self._on_tails(keys, accs, grads)

    def _on_tails(self, keys, xs, adds) -> list[P.Payload]:
        begun = [self.begin(key, x) for key, x in zip(keys, xs)]
        tails = tails_many(xs, adds or [None] * len(xs), [b[0] for b in begun], [b[1] for b in begun])
        out = []
        for x, tail, (st, k, _) in zip(xs, tails, begun):
            if not tail.finite:
                idx, vals = nonfinite(x)
            else:
                thr = self.threshold(x, k, tail)
                idx, vals = tail.above(thr)
                learn(st, tail, thr, idx.numel(), k, want=self.WANT)
            if adds is not None:
                x.index_fill_(0, idx, 0.0)
            out.append(P.sparse(vals if adds is not None else self.wire(vals), idx, x.numel(), x.dtype, k))
        return out


def nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the NaN and Inf entries: what a threshold method sends from an overflowed memory, so
    that the memory sees the overflow in the payload (:meth:`gradsift.feedback.ErrorFeedback.compress_many`)."""
    idx = torch.nonzero(~torch.isfinite(x)).squeeze(1)
    return idx, x[idx]


def learn(st: dict[str, Any], tail: Tail, t: float, sent: int, k: int, want: float = WANT) -> None:
    """After a threshold ``t`` that selected ``sent`` entries: the next floor is where ``want * k`` entries are
    expected (a method probes thresholds around k; counts beyond ``WANT * k`` need not be exact), the count taken
    as log-linear in magnitude through (floor, its count) and (t, sent); ``grow`` is how much the threshold moved."""
    if not (t > 0) or not math.isfinite(t):
        return
    st["want"] = want
    want = want * k
    old_t = st.get("last_t")
    if old_t:
        st["grow"] = min(max(t / old_t, 0.5), 2.0)
    st["last_t"] = t
    fl, count = tail.floor, tail.count
    if fl is None or fl == t or count == sent or not (fl > 0):
        st["floor"] = t * (0.7 if sent < want else 1.0)
        return
    slope = math.log(max(count, 0.5) / max(sent, 0.5)) / (fl - t)  # d log(count) / d magnitude (negative)
    if not slope < 0:
        st["floor"] = fl * (0.8 if count < want else 1.25)
        return
    st["floor"] = min(max(t + math.log(want / max(sent, 0.5)) / slope, 0.1 * t), 10.0 * t)
