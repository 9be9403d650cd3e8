"""The road every gradient travels, written once for both runtimes::

    gradient --(remember)--> accumulated --(select)--> payload --(move)--> mean --(observe)--> state

A runtime hands one worker's :class:`Road` a *group* of gradients at a time --
a DDP bucket, or in the simulator one tensor (or the whole model) -- and the
transport to move it with. The road:

1. maps the group to compression inputs (:class:`Layout`: one per parameter,
   ``layer`` granularity, or all of them flattened in parameter order,
   ``model``);
2. checks that the inputs are finite -- one rule for both runtimes: a worker
   whose input is not finite compresses zeros instead, so it issues exactly the
   collectives every other worker issues, and raises its flag, which travels
   inside the data (:mod:`gradsift.transport.wire`);
3. for every tensor asks the wire plan (:mod:`gradsift.plan`) whether it goes
   sparse, whole, or densified, and lets the compressor with its memory
   (remember + select) make the payload;
4. starts the transport (asynchronous in DDP; the simulator's in-process
   group completes when its last worker starts). A DDP bucket whose every
   tensor goes whole with nothing held back in memory (:meth:`Road.in_place`:
   the measured plan chose whole, or the method is uncompressed) skips all of
   the above and is summed in place in DDP's own bucket buffer by one
   all-reduce, as DDP's default hook does (:meth:`Road.start_in_place`); its
   finiteness is read off the sum, where a non-finite input on any rank shows;
5. on delivery (:meth:`Road.finish`): counts the group in the step's telemetry
   (:mod:`gradsift.telemetry`); if any worker raised its flag, raises
   :class:`~gradsift.compressors.base.NonFiniteGradient` (``on_nonfinite="error"``)
   or marks the step skipped (``"skip"``: every worker rolls back every group of
   the step in :meth:`Road.close_step`, from checkpoints the memory and the
   compressor took of their own state); otherwise lets the compressor observe
   the mean and hands the means back for the runtime to write.

``Simulator.step`` (:mod:`gradsift.simulate`) and the DDP bucket hook
(:mod:`gradsift.ddp`) differ only in where gradients come from and which
transport they pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .compressors.base import NonFiniteGradient, is_finite
from .netmodel import NetworkModel
from .payload import SPARSE, Payload, dense
from .plan import WirePlan
from .telemetry import StepTally, group_report
from .transport.wire import GATHER, REDUCE, group_bytes


class Layout:
    """How a group's gradients map to compression inputs and back.

    ``names`` are the parameters in parameter order; ``order[i]`` is where
    parameter i's gradient sits in the list the runtime hands over (DDP's bucket
    order), identity by default. ``layer`` compresses each gradient under its
    parameter's name; ``model`` compresses their concatenation under ``"model"``.
    """

    def __init__(self, names: Sequence[str], granularity: str, order: Sequence[int] | None = None):
        self.names = list(names)
        self.granularity = granularity
        self.order = list(order) if order is not None else list(range(len(self.names)))
        self.keys = ["model"] if granularity == "model" else self.names

    def inputs(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ordered = [grads[j] for j in self.order]
        if self.granularity == "model":
            return [torch.cat([g.reshape(-1) for g in ordered])]
        return ordered

    def shapes(self, grads: Sequence[torch.Tensor]) -> list[torch.Size]:
        """The compression inputs' shapes, without building them."""
        if self.granularity == "model":
            return [torch.Size([sum(g.numel() for g in grads)])]
        return [grads[j].shape for j in self.order]

    def in_buffer(self, grads: Sequence[torch.Tensor], buffer: torch.Tensor) -> list[torch.Tensor]:
        """The inputs as views of the runtime's flat buffer the grads live in (one per key): no copy."""
        return [buffer] if self.granularity == "model" else self.inputs(grads)

    def views(self, means: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """The mean of every parameter (in parameter order), shaped like it."""
        if self.granularity == "model":
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            return [m.view(s) for m, s in zip(means[0].split(sizes), shapes)]
        return [m.view(s) for m, s in zip(means, shapes)]

    def write(self, means: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Copy the means into the runtime's gradient tensors (DDP: views into its bucket)."""
        ordered = [grads[j] for j in self.order]
        for g, m in zip(ordered, self.views(means, [g.shape for g in ordered])):
            g.copy_(m)


@dataclass
class Trip:
    """One group on the road: what was sent, how, and the transport's handle on it."""

    keys: list[str]
    payloads: list[Payload]
    routes: list[str]
    pending: Any
    flag: int
    select_s: list[float] = field(default_factory=list)
    whole: list[bool] = field(default_factory=list)  # sent whole by the plan: the compressor did not select
    numels: list[int] = field(default_factory=list)  # the tensors' sizes (0 for a later round of the same tensors)
    transport: Any = None
    in_place: bool = False  # summed in the runtime's own buffer: the flags are read off the sum, not sent


class Road:
    """One worker's road (see the module docstring).

    ``party`` names a worker in messages (``"worker"`` in the simulator,
    ``"rank"`` in DDP).
    """

    def __init__(self, compressor, *, plan: WirePlan | None = None, net: NetworkModel | None = None,
                 on_nonfinite: str = "error", party: str = "worker"):
        self.compressor = compressor
        self.net = net or NetworkModel()
        self.plan = plan or WirePlan(self.net, compressor.world_size, enabled=False)
        self.on_nonfinite = on_nonfinite
        self.party = party
        self.step = 0  # steps closed without being skipped
        self.tally = StepTally()
        self._tokens: list[Any] = []
        self._skipped = False

    # ------------------------------------------------------------ one group
    def start(self, keys: Sequence[str], inputs: Sequence[torch.Tensor], transport, send: bool = True) -> Trip:
        """Remember, select, and hand the group to ``transport`` (a local endpoint or a DistTransport). With
        ``send=False`` the payloads are made but not sent (``pending`` is None): :meth:`send` sends several
        such groups as one."""
        finite = all(is_finite(x) for x in inputs)
        if self.on_nonfinite == "skip":
            self._tokens.append(self.compressor.checkpoint(keys))
        if not finite:  # the same collectives as every other worker, with the flag raised
            inputs = [torch.zeros_like(x) for x in inputs]
        payloads, routes, times, whole = [], [], [], []
        for key, x in zip(keys, inputs):
            decision = self.plan.decide(self.compressor, key, x.shape, x.dtype)
            t0 = time.perf_counter()
            p = self.compressor.compress(key, x, check_finite=False, dense=decision.dense)
            times.append(time.perf_counter() - t0)
            finite = finite and not p.nonfinite  # memory overflowed: same collectives, flag raised
            payloads.append(p)
            whole.append(decision.dense)
            routes.append((decision.wire_route or GATHER) if p.kind == SPARSE else REDUCE)
        flag = 0 if finite else 1
        pending = transport.start(payloads, routes, flag) if send else None
        return Trip(list(keys), payloads, routes, pending, flag, times, whole, [x.numel() for x in inputs], transport)

    def send(self, trips: Sequence[Trip], transport) -> Trip:
        """Send groups made with ``start(..., send=False)`` as one group: one set of collectives for all their
        payloads (LAGS Sec. 5: small sparsified tensors merged into one message; every tensor keeps its own
        selection, so the means are the same as sending each alone). :meth:`finish` on the result gives the means
        of every key, in the order of ``trips``."""
        if len(trips) == 1:  # nothing merged: the group goes as it was made
            trip = trips[0]
            trip.pending = transport.start(trip.payloads, trip.routes, trip.flag)
            return trip
        keys = [k for t in trips for k in t.keys]
        payloads = [p for t in trips for p in t.payloads]
        routes = [r for t in trips for r in t.routes]
        flag = max(t.flag for t in trips)
        pending = transport.start(payloads, routes, flag)
        return Trip(keys, payloads, routes, pending, flag, [x for t in trips for x in t.select_s],
                    [w for t in trips for w in t.whole], [n for t in trips for n in t.numels], transport)

    def wire_bytes(self, trip: Trip) -> int:
        """What one worker puts on the wire for a group (all-reduce and all-gather buffers)."""
        return sum(group_bytes(trip.payloads, trip.routes))

    def in_place(self, keys: Sequence[str], shapes: Sequence[torch.Size], dtype: torch.dtype) -> bool:
        """Whether a group may be summed in place (module docstring, step 4): every tensor goes whole, exactly as
        it is -- no memory held back for it, no momentum applied by the method, values sent in the gradient's own
        dtype -- and the method has one round. The result equals the whole route's, with no copy and no flag."""
        c, inner = self.compressor, self.compressor.inner
        if inner.ROUNDS != 1 or getattr(c, "applies_momentum", False) or not dtype.is_floating_point:
            return False
        if inner.value_dtype is not None and inner.value_dtype != dtype:
            return False
        held = getattr(c, "residual", None) or {}
        return all(key not in held and self.plan.decide(c, key, shape, dtype).dense for key, shape in zip(keys, shapes))

    def start_in_place(self, keys: Sequence[str], views: Sequence[torch.Tensor], flat: torch.Tensor,
                       transport) -> Trip:
        """Sum ``flat`` (the runtime's buffer; ``views`` are the group's tensors in it, one per key) in place by
        one all-reduce, divided by the number of workers (or weighted). Only when :meth:`in_place` said so."""
        if self.on_nonfinite == "skip":
            self._tokens.append(self.compressor.checkpoint(keys))
        flag = 0 if is_finite(flat) else 1  # for the message only: a non-finite input shows in the sum anyway
        payloads = [dense(v.reshape(-1), v.dtype) for v in views]
        pending = transport.start_in_place(flat, payloads)
        return Trip(list(keys), payloads, [REDUCE] * len(payloads), pending, flag, [0.0] * len(payloads),
                    [True] * len(payloads), [v.numel() for v in views], transport, in_place=True)

    def advance(self, trip: Trip, delivery) -> Trip | None:
        """The next round of a method with dependent collectives (PowerSGD), started from this round's means;
        None when the group is done (always for one-round methods, and when any worker raised its flag)."""
        c = self.compressor
        if c.ROUNDS == 1 or delivery.any_flag:
            return None
        t0 = time.perf_counter()
        nxt = [c.next_round(k, p, m) for k, p, m in zip(trip.keys, trip.payloads, delivery.means)]
        if all(p is None for p in nxt):
            return None
        if any(p is None for p in nxt):
            raise ValueError("a multi-round compressor must finish every tensor of a group in the same round")
        self.tally.add(group_report(trip, delivery, self.net))
        routes = [REDUCE] * len(nxt)
        pending = trip.transport.start(nxt, routes, 0)
        return Trip(trip.keys, nxt, routes, pending, 0, [time.perf_counter() - t0], trip.whole, [0] * len(nxt),
                    trip.transport)

    def finish(self, trip: Trip, delivery) -> list[torch.Tensor] | None:
        """Count the group; on a raised flag raise (error) or return None (skip); else observe, return the means."""
        self.tally.add(group_report(trip, delivery, self.net))
        if delivery.any_flag:
            flagged = delivery.flagged
            me = self.compressor.rank
            if trip.flag:
                who = f"{self.party} {me}"
            else:
                who = f"{self.party} {flagged[0]}" if flagged else f"another {self.party}"
            shown = ", ".join(trip.keys[:3]) + (", ..." if len(trip.keys) > 3 else "")
            msg = f"non-finite gradient on {who} at step {self.step + 1} ({shown})"
            if self.on_nonfinite == "skip":
                self._skipped = True
                return None
            raise NonFiniteGradient(msg + "; the step was not applied (use --on-nonfinite skip to skip such steps)")
        c = self.compressor
        if c.ROUNDS > 1:
            return [c.decode(key, m) for key, m in zip(trip.keys, delivery.means)]
        if c.OBSERVES:
            for key, p, m, whole in zip(trip.keys, trip.payloads, delivery.means, trip.whole):
                if not whole:
                    c.observe(key, p, m)
        return delivery.means

    # ------------------------------------------------------------ one step
    @property
    def skipped(self) -> bool:
        return self._skipped

    def close_step(self) -> tuple[bool, StepTally]:
        """End the step: roll back every group if it was skipped; return (skipped, the step's tally)."""
        skipped, tally = self._skipped, self.tally
        if skipped:
            for token in reversed(self._tokens):
                self.compressor.rollback(token)
        else:
            self.step += 1
        self._tokens, self._skipped, self.tally = [], False, StepTally()
        return skipped, tally
