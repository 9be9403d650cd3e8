"""The road every gradient travels, written once for both runtimes::

    gradient --(remember)--> accumulated --(select)--> payload --(move)--> mean --(observe)--> state

A runtime hands one worker's :class:`Road` a :class:`Group` of gradients at a time -- a DDP bucket, or in the
simulator one tensor (or the whole model) -- and the transport to move it with. The road:

1. maps the group to compression inputs (:class:`Layout`: one per parameter, ``layer`` granularity, or all of
   them flattened in parameter order, ``model``);
2. asks the route owner (:class:`gradsift.route.routing.Routing`) how the group travels. A group whose every tensor
   goes whole exactly as it is, with nothing held back in memory, is summed in the buffer it lives in (DDP's
   bucket; the simulator's tensor) by one collective, as DDP's default hook does, and its finiteness is read
   off the sum, where a non-finite input on any worker shows;
3. otherwise checks that the inputs are finite -- one rule for both runtimes: a worker whose input is not
   finite compresses zeros instead, so it issues exactly the collectives every other worker issues, and
   raises its flag, which travels inside the data (:mod:`gradsift.transport.wire`) -- and lets the compressor
   with its memory (remember + select) make each tensor's payload on the route the owner decided;
4. starts the transport (asynchronous in DDP; the simulator's in-process group completes when its last worker
   starts). ``send=False`` makes the payloads only: :meth:`Road.send` sends several groups as one;
5. on delivery (:meth:`Road.finish`): counts the group in the step's telemetry (:mod:`gradsift.runtime.telemetry`); if
   any worker raised its flag, applies the non-finite rule (:meth:`Road.nonfinite`: raise
   :class:`~gradsift.compressors.base.NonFiniteGradient`, or mark the step skipped: every worker then rolls back
   every group of the step in :meth:`Road.close_step`, from checkpoints the memory and the compressor took of
   their own state); otherwise lets the compressor observe the mean and hands the means back.

A parameter that no worker used in the step (DDP discards the means of those) leaves every memory as it was: the
runtime saves its state before the road takes its group and restores it at the step's end (:mod:`gradsift.runtime.unused`).

``Simulator.step`` (:mod:`gradsift.runtime.simulate`) and the DDP bucket hook (:mod:`gradsift.ddp`) differ only in where
gradients come from and which transport they pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..compressors.base import NonFiniteGradient, is_finite
from ..route.netmodel import NetworkModel
from ..route.owners import Owners
from ..payload import SPARSE, Partition, Payload, all_finite, dense
from ..route.plan import WirePlan
from ..payload.protocols import Selector, Transport
from ..route.routing import Routing
from .telemetry import StepTally, group_report
from ..transport.base import Delivery
from ..transport.wire import SHARD, group_bytes, partition_for, partition_sharded
from .unused import UnusedParams
from ..memory.wirecast import cast_below_16_bits


class Layout:
    """How a group's gradients map to compression inputs and back.

    ``names`` are the parameters in parameter order; ``order[i]`` is where parameter i's gradient sits in the
    list the runtime hands over (DDP's bucket order), identity by default. ``layer`` compresses each gradient
    under its parameter's name; ``model`` compresses their concatenation under ``"model"``.
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

    def group(self, grads: Sequence[torch.Tensor], buffer: torch.Tensor | None = None) -> "Group":
        """The group these gradients make; ``buffer``: the flat tensor they are views of (DDP's bucket)."""
        views = None
        if buffer is not None:  # the inputs as views of the buffer (one per key): no copy
            views = [buffer] if self.granularity == "model" else [grads[j] for j in self.order]
        return Group(self.keys, self.shapes(grads), grads[0].dtype, lambda: self.inputs(grads), buffer, views)

    def views(self, means: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """The mean of every parameter (in parameter order), shaped like it."""
        if self.granularity == "model":
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            return [m.view(s) for m, s in zip(means[0].split(sizes), shapes)]
        return [m.view(s) for m, s in zip(means, shapes)]

    def write(self, means: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Copy the means into the runtime's gradient tensors (DDP: views into its bucket)."""
        ordered = [grads[j] for j in self.order]
        pairs = [(g, m) for g, m in zip(ordered, self.views(means, [g.shape for g in ordered]))
                 if g.data_ptr() != m.data_ptr()]  # (a mean summed in place already is its gradient)
        if pairs:
            torch._foreach_copy_([g for g, _ in pairs], [m for _, m in pairs])  # (one call for the group)


@dataclass
class Group:
    """One group handed to the road: its keys and shapes, its compression inputs (made only when compressing),
    and, where the group lives in one flat buffer, that buffer and the key tensors as views of it."""

    keys: list[str]
    shapes: list[torch.Size]
    dtype: torch.dtype
    inputs: Callable[[], list[torch.Tensor]]
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] | None = None

    @staticmethod
    def of(key: str, x: torch.Tensor) -> "Group":
        """One tensor, which is its own buffer (the simulator's groups)."""
        flat = x.reshape(-1)
        return Group([key], [x.shape], x.dtype, lambda: [x], flat, [flat])


@dataclass(kw_only=True)
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
    into: tuple[torch.Tensor, list[int]] | None = None  # (buffer, where each key starts): where the means may go

    @property
    def wire_bytes(self) -> int:
        """What one worker puts on the wire for the group (all-reduce and all-gather buffers)."""
        return sum(group_bytes(self.payloads, self.routes))


def whole_together(c, keys) -> bool:
    """Whether the tensors ``keys`` a route sends whole go in one call (``send_whole_many``): a method alone, Adam's
    recipe or momentum correction (their memories update them together), or a memory holding none of them."""
    return c.applies_adam or c.applies_momentum or (c.ROUNDS == 1 and (c.inner is c or (
        c.WHOLE_AS_METHOD and not c.holds_back(keys))))


class Road:
    """One worker's road (see the module docstring). ``party`` names a worker in messages (``"worker"`` in the
    simulator, ``"rank"`` in DDP)."""

    def __init__(self, compressor: Selector, routing: Routing | None = None, *, net: NetworkModel | None = None,
                 on_nonfinite: str = "error", party: str = "worker"):
        """``routing`` None: every tensor as the method says (the wire plan off)."""
        self.compressor = compressor
        self.routing = routing or Routing(WirePlan(net or NetworkModel(), compressor.world_size, enabled=False), [])
        self.net = net or self.routing.plan.net
        self.on_nonfinite = on_nonfinite
        self.party = party
        self.owners = Owners()  # this worker's regions of the tensors sent by the scatter route
        self.unused = UnusedParams(self)  # the state of parameters this worker did not use this step
        self.step = 0  # steps closed without being skipped
        self.tally = StepTally()
        self._tokens: list[Any] = []
        self._skipped = False
        self._partitions: dict[tuple[str, int], Partition] = {}

    # ------------------------------------------------------------ one group
    def start(self, group: Group, transport: Transport, send: bool = True) -> Trip:
        """Route the group (module docstring, steps 2-4). Summed in place, it is on its way at once; otherwise
        ``send=False`` makes the payloads only, for :meth:`send`."""
        if self.on_nonfinite == "skip":
            self._tokens.append((self.compressor.checkpoint(group.keys), self.owners.checkpoint(group.keys)))
        routing, decisions = self.routing, None
        if group.buffer is not None:  # (one dtype: the buffer's; the decisions serve both ways)
            decisions = [routing.decide(self.compressor, key, shape, group.dtype)
                         for key, shape in zip(group.keys, group.shapes)]
            how = routing.in_place(self.compressor, group.keys, group.shapes, group.dtype, decisions)
            if how is not None:
                return self._in_place(group, transport, cast=how == "cast")
        inputs = group.inputs()
        finite = all_finite(inputs, group.buffer)
        if not finite:  # the same collectives as every other worker, with the flag raised
            inputs = [torch.zeros_like(x) for x in inputs]
        decisions = decisions or [routing.decide(self.compressor, key, shape, x.dtype)
                                  for key, shape, x in zip(group.keys, group.shapes, inputs)]
        splits = [routing.owner_split(d) for d in decisions]
        owners = [self._partition(key, x.numel(), split) if split else None
                  for key, x, split in zip(group.keys, inputs, splits)]
        payloads, times = self._compress(group.keys, inputs, decisions, owners)
        if self.compressor.inner.value_bits:  # values below 16 bits: rounded once the memory took them out
            cast_below_16_bits(self.compressor, list(group.keys), payloads)
        routes = []
        for p, d, own in zip(payloads, decisions, owners):
            finite = finite and not p.nonfinite  # memory overflowed: same collectives, flag raised
            route = routing.wire_route(d, p.kind)
            if route == SHARD:
                p.owners = own
            routes.append(route)
        whole = [d.whole for d in decisions]
        trip = Trip(keys=list(group.keys), payloads=payloads, routes=routes, pending=None, flag=0 if finite else 1,
                    select_s=times, whole=whole, numels=[x.numel() for x in inputs], transport=transport,
                    into=_places(group.buffer, inputs))
        return self.send([trip], transport) if send else trip

    def _compress(self, keys, inputs, decisions, owners) -> tuple[list[Payload], list[float]]:
        """Every tensor's payload and selection time: the tensors compressed alike (not whole, not scattered) in one
        call (``compress_many``: one kernel call for the group, the same selections), the whole ones in another
        where no memory keeps what they leave (a method alone, or a memory holding none of them: one cast,
        ``send_whole_many``) or the memory updates them together (Adam's recipe: one update of their directions),
        the others one by one."""
        c = self.compressor
        payloads: list[Any] = [None] * len(keys)
        times = [0.0] * len(keys)
        alike = [i for i, (d, own) in enumerate(zip(decisions, owners)) if not d.whole and own is None]
        whole = [i for i, (d, own) in enumerate(zip(decisions, owners)) if d.whole and own is None]
        if alike:
            _timed(payloads, times, alike, inputs, c.compress_many, [keys[i] for i in alike],
                   [inputs[i] for i in alike])
        if whole and whole_together(c, [keys[i] for i in whole]):
            _timed(payloads, times, whole, inputs, c.send_whole_many, [keys[i] for i in whole],
                   [inputs[i] for i in whole], [decisions[i].native for i in whole])
        for i, (key, x, d, own) in enumerate(zip(keys, inputs, decisions, owners)):
            if payloads[i] is None:
                t0 = time.perf_counter()
                payloads[i] = c.compress(key, x, check_finite=False, dense=d.whole, native=d.native, owners=own)
                times[i] = time.perf_counter() - t0
        return payloads, times

    def _partition(self, key: str, numel: int, route: str) -> Partition:
        """The owners' split of tensor ``key`` among the workers (every worker derives the same): the scatter route's
        hashed regions, or the shard route's contiguous shards of FSDP's reduce-scatter input."""
        part = self._partitions.get((key, numel))
        if part is None:
            c = self.compressor
            part = self._partitions[(key, numel)] = (
                partition_sharded(key, numel, c.world_size) if route == SHARD else
                partition_for(key, numel, c.world_size, c.inner.seed, self.routing.plan.scatter_keep))
        return part

    def partition_of(self, key: str, numel: int) -> Partition | None:
        """The owners' split this worker used for tensor ``key`` (None: it never went to owners)."""
        return self._partitions.get((key, numel))

    def _in_place(self, group: Group, transport: Transport, cast: bool = False) -> Trip:
        """The group summed in its buffer (``cast``: in the buffer's copy in the method's wire dtype, cast once,
        the mean written back into the buffer)."""
        flat = self.compressor.wire(group.buffer, sparse=False) if cast else group.buffer
        flag = 0 if is_finite(flat) else 1  # for the message only: a non-finite input shows in the sum
        if cast:  # (the wire's cast saturates what is finite and keeps what is not)
            payloads = [dense(v, group.dtype) for v in flat.split([v.numel() for v in group.views])]
        else:
            payloads = [dense(v.reshape(-1), v.dtype) for v in group.views]
        routes = self.routing.in_place_routes(len(payloads))
        pending = transport.start_in_place(flat, payloads, routes, flag, out=group.buffer if cast else None)
        return Trip(keys=list(group.keys), payloads=payloads, routes=routes, pending=pending, flag=flag,
                    select_s=[0.0] * len(payloads), whole=[True] * len(payloads),
                    numels=[v.numel() for v in group.views], transport=transport, in_place=True)

    def send(self, trips: Sequence[Trip], transport: Transport) -> Trip:
        """Send groups made with ``start(..., send=False)`` as one group: one set of collectives for all their
        payloads (LAGS Sec. 5: small sparsified tensors merged into one message; every tensor keeps its own
        selection, so the means are the same as sending each alone). :meth:`finish` on the result gives the means
        of every key, in the order of ``trips``."""
        if len(trips) == 1:
            trip = trips[0]
        else:
            trip = Trip(keys=[k for t in trips for k in t.keys], payloads=[p for t in trips for p in t.payloads],
                        routes=[r for t in trips for r in t.routes], pending=None, flag=max(t.flag for t in trips),
                        select_s=[x for t in trips for x in t.select_s], whole=[w for t in trips for w in t.whole],
                        numels=[n for t in trips for n in t.numels], transport=transport)
        trip.pending = transport.start(trip.payloads, trip.routes, trip.flag, owners=self.owners,
                                       merge=self.routing.plan.merges(trip.payloads, trip.routes))
        if len(trips) == 1 and trip.into is not None and hasattr(trip.pending, "sum_into"):
            trip.pending.sum_into(*trip.into)  # the means land in the runtime's buffer: nothing to copy
        return trip

    def advance(self, trip: Trip, delivery: Delivery) -> Trip | None:
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
        routes = self.routing.later_round_routes(len(nxt))
        pending = trip.transport.start(nxt, routes, 0)
        return Trip(keys=trip.keys, payloads=nxt, routes=routes, pending=pending, flag=0,
                    select_s=[time.perf_counter() - t0], whole=trip.whole, numels=[0] * len(nxt), transport=trip.transport)

    def finish(self, trip: Trip, delivery: Delivery) -> list[torch.Tensor] | None:
        """Count the group; on a raised flag apply the non-finite rule (None when skipped); else observe and
        return the means."""
        self.tally.add(group_report(trip, delivery, self.net))
        if delivery.any_flag:
            if trip.flag:
                who = f"{self.party} {self.compressor.rank}"
            else:
                flagged = delivery.flagged
                who = f"{self.party} {flagged[0]}" if flagged else f"another {self.party}"
            self.nonfinite(who, trip.keys)
            return None
        c = self.compressor
        if c.ROUNDS > 1:
            return [c.decode(key, m) for key, m in zip(trip.keys, delivery.means)]
        if c.OBSERVES:
            seen = [i for i, whole in enumerate(trip.whole) if not whole]
            c.observe_many([trip.keys[i] for i in seen], [trip.payloads[i] for i in seen],
                           [delivery.means[i] for i in seen])
        return delivery.means

    def nonfinite(self, who: str, keys: Sequence[str], how: str = "") -> None:
        """The one rule for a non-finite gradient, whatever route the step took: raise
        :class:`NonFiniteGradient` (``on_nonfinite="error"``), or mark the step skipped (``"skip"``; every worker
        reaches the same verdict from the same data). ``how`` says how the sum was made, if not by the road."""
        shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        if self.on_nonfinite == "skip":
            self._skipped = True
            return
        raise NonFiniteGradient(f"non-finite gradient on {who} at step {self.step + 1} ({shown}{how}); the step was "
                                "not applied (to skip such steps: on_nonfinite='skip', or --on-nonfinite skip)")

    # ------------------------------------------------------------ one step
    @property
    def skipped(self) -> bool:
        return self._skipped

    def close_step(self) -> tuple[bool, StepTally]:
        """End the step: roll back every group if it was skipped; return (skipped, the step's tally)."""
        skipped, tally = self._skipped, self.tally
        if skipped:
            for token, owned in reversed(self._tokens):
                self.compressor.rollback(token)
                self.owners.rollback(owned)
        else:
            self.step += 1
        tally.owner_deferred, self.owners.deferred = self.owners.deferred, 0
        if self.owners.residual:  # (a pass over this worker's regions: 1/N of each scattered tensor)
            tally.owner_residual_norm = self.owners.norm()
        self._tokens, self._skipped, self.tally = [], False, StepTally()
        self.unused.clear()  # (restored by the runtime before, where a parameter was unused everywhere)
        return skipped, tally


def round_trip(roads: Sequence[Road], groups: Sequence[Group], transports: Sequence[Any]
               ) -> tuple[list[Trip], list[list[torch.Tensor] | None]]:
    """One group on every worker's road in lockstep: every worker starts it, then each waits and finishes (after the
    later rounds of a method with dependent collectives, PowerSGD). Each worker's first trip (what it sent) and its
    means (None: the step is skipped). The simulator's round, and a synchronous runtime's with one road (FSDP)."""
    trips = firsts = [road.start(g, t) for road, g, t in zip(roads, groups, transports)]
    while True:
        deliveries = [t.pending.wait() for t in trips]
        nexts = [road.advance(t, d) for road, t, d in zip(roads, trips, deliveries)]
        if nexts[0] is None:
            return firsts, [road.finish(t, d) for road, t, d in zip(roads, trips, deliveries)]
        trips = nexts  # type: ignore[assignment]


def _places(buffer: torch.Tensor | None, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """(``buffer``, where each input starts in it) where every input is a contiguous piece of the flat ``buffer`` (a
    DDP bucket's gradients, by layer), so the transport may sum each mean where its input was; else None."""
    if buffer is None or buffer.dim() != 1 or not buffer.is_contiguous():
        return None
    base, size = buffer.data_ptr(), buffer.element_size()
    starts = []
    for x in inputs:
        at, odd = divmod(x.data_ptr() - base, size)
        if x.dtype != buffer.dtype or not x.is_contiguous() or odd or at < 0 or at + x.numel() > buffer.numel():
            return None
        starts.append(at)
    return buffer, starts


def _timed(payloads: list, times: list[float], which: list[int], inputs, call, *args) -> None:
    """``call(*args)`` for the tensors ``which`` of a group: their payloads placed, its time shared by size."""
    t0 = time.perf_counter()
    got = call(*args)
    spent = time.perf_counter() - t0
    total = sum(inputs[i].numel() for i in which) or 1
    for i, p in zip(which, got):
        payloads[i], times[i] = p, spent * inputs[i].numel() / total
