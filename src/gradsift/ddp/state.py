"""The DDP communication hook: a thin adapter from a DDP bucket to a rank's road.

Everything a rank is -- settings, compressor, route owner, road, the optimizer hand-off, the cross-rank check,
closing a step, telemetry and checkpoints -- is the :class:`gradsift.runtime.rank.Rank`'s it holds (``core``). What DDP
adds is here: per bucket,
:meth:`GradsiftState.on_bucket` maps the bucket's gradients to a :class:`~gradsift.runtime.road.Layout` group
(per-parameter keys, or the one ``"model"`` key) and hands it to the road with the ``torch.distributed``
transport (asynchronous collectives only, all issued in the hook body); the returned future's callback finishes
the road (local work: decode, observe) and writes the means into the bucket. Small payloads may wait, already
selected, for the next bucket's message (``merge_small``). A bucket sent by the scatter route needs a second
collective after its all-to-all (the owners' all-gather); collectives started from a future's callback hang on
gloo, so every scattered bucket's second stage starts in the step's last hook call, in bucket order (the
all-to-alls overlap backward, which nothing blocks), and DDP holds a future that the finished group resolves.
When the route owner says ``aside``, :class:`gradsift.ddp.aside.Aside` lets DDP's own all-reduce take the steps.
:meth:`GradsiftState.end_step` closes each step: skipped steps are rolled back on every rank, ``last`` and
``totals`` hold the telemetry.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..compressors.base import NonFiniteGradient
from ..payload.indexcode import CorruptPayload
from ..runtime.consensus import max_over_ranks
from ..errors import ConfigError
from ..route.layerwise import pipelined_step_s
from ..runtime.rank import Phase, Rank
from ..runtime.rankstate import RankState
from ..runtime.road import Layout
from ..route.routing import ASIDE
from ..runtime.settings import Settings
from ..transport.dist import DistTransport
from .aside import Aside, check_mean


class Part(NamedTuple):
    """One bucket on its way: where its means go, and (when it waited for a later bucket) the future DDP holds."""

    layout: Layout
    grads: list[torch.Tensor]
    buffer: torch.Tensor
    trip: Any
    waiting: torch.futures.Future | None = None


class GradsiftState(RankState):
    """A DDP rank: a :class:`~gradsift.runtime.rank.Rank` (``core``) and its buckets. Checkpointable without the process
    group."""

    def __init__(self, settings: Settings, named: Sequence[tuple[str, torch.nn.Parameter]], *, model=None):
        """``model``: the DDP wrapper (``register``), which standing aside needs; None for ``hook_state``, whose
        process group may not exist yet (then everything is set up at the first hook call)."""
        named = list(named)
        dtype = named[0][1].dtype if named else torch.float32
        tensors = ([("model", (sum(p.numel() for _, p in named),), dtype)] if settings.granularity == "model"
                   else [(n, tuple(p.shape), p.dtype) for n, p in named])
        dense, device = sum(p.numel() * p.element_size() for _, p in named), named[0][1].device if named else None
        self.core = Rank(settings, tensors, runtime="ddp", dense_bytes=dense, device=device)
        self.named = named
        self.name_of = {id(p): n for n, p in self.named}
        self.model = model
        self.group_arg = settings.process_group if settings.process_group is not None or model is None else \
            model.process_group
        self.aside: Aside | None = None
        self.usage = None  # a gradsift.ddp.usage.Usage where DDP may leave parameters unused (register)
        self._aside_fields: dict[str, Any] = {}  # the last hooked step's telemetry, for the steps DDP's own took
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._held: list[Part] = []  # LAGS Sec. 5: selected payloads waiting for the next bucket's message
        self._open: list[tuple[Any, list[Part], torch.futures.Future]] = []  # scattered groups awaiting stage 2
        self._starts, self._in_place, self._last_hook_end = [], 0, 0.0  # hooks' starts, buckets summed in place
        self._ended = self._unclosed_said = False  # the open step's last bucket went (a next bucket: another step)

    # ------------------------------------------------------------ set-up
    def ensure_ready(self) -> None:
        """Build the rank on the process group (at registration, or at the first hook call for ``hook_state``)
        and check the configuration on every rank."""
        if self.core.built:
            return
        s = self.core.settings
        why = None if self.model is not None else "hook_state() has no DDP wrapper to stand aside for"
        if why is None and s.weights is not None:
            why = "the mean is weighted (DDP's own all-reduce is not)"
        if why is None and s.sum_order == "rank":
            why = "sums run in rank order (sum_order='rank'; DDP's own all-reduce sums in the backend's)"
        transport = DistTransport(self.group_arg, s.weights, s.sum_order)
        self.core.build(transport, aside=why, combine=lambda v: max_over_ranks(v, transport.group))
        self.core.verify()

    @property
    def group(self):
        return self.transport.group if self.transport is not None else self.group_arg

    def _layout(self, params: Sequence[torch.nn.Parameter]) -> Layout:
        ids = tuple(id(p) for p in params)
        lay = self._layouts.get(ids)
        if lay is None:
            if self.granularity == "model":
                if len(params) != len(self.named):
                    raise ConfigError(
                        f"whole-model compression needs one DDP bucket holding all {len(self.named)} gradients, got a "
                        f"bucket with {len(params)}: build DDP with bucket_cap_mb >= the model's gradient size")
                pos = {id(p): i for i, p in enumerate(params)}
                lay = Layout([n for n, _ in self.named], "model", [pos[id(p)] for _, p in self.named])
            else:
                lay = Layout([self.name_of[id(p)] for p in params], "layer")
            self._layouts[ids] = lay
        return lay

    # ------------------------------------------------------------ the hook
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.ensure_ready()
        if self.phase is Phase.OPEN and self._ended:  # a new backward, and nothing closed the last step: close it now
            self._close_forgotten()
        self.core.opened()
        self._ended = bucket.is_last()
        layout = self._layout(bucket.parameters())
        grads, buffer, last = bucket.gradients(), bucket.buffer(), bucket.is_last()
        self._starts.append(time.perf_counter())
        if self.usage is not None and (unused := self.usage.unused_in(bucket.parameters())):
            self.road.unused.save(layout, unused, [p.numel() for _, p in self.named], grads[0].device)
        trip = self.road.start(layout.group(grads, buffer), self.transport, send=False)
        part = Part(layout, grads, buffer, trip)
        if trip.in_place:  # on its way already
            self._in_place += 1
            fut = self._finish_after(trip, [part])
            if last and self._held:  # nothing may wait past the step's last bucket
                self._send([])
        elif not last and self._may_wait(trip):
            waiting: torch.futures.Future = torch.futures.Future()
            self._held.append(part._replace(waiting=waiting))
            fut = waiting
        else:
            fut = self._send([part])
        if last:  # every scattered bucket's second stage, in bucket order: the same collectives on every rank
            self._advance_open()
        self._last_hook_end = time.perf_counter()
        return fut

    def _may_wait(self, trip) -> bool:
        """Whether this bucket's payloads, with those already waiting, are less than the link moves in one message
        latency, so they wait for the next bucket (the same on every rank: sizes follow from the configuration)."""
        if not (self.settings.merge_small and self.granularity == "layer"):
            return False
        held = sum(h.trip.wire_bytes for h in self._held)
        return held + trip.wire_bytes < self.road.net.alpha * self.road.net.beta

    def _send(self, parts: list[Part]) -> torch.futures.Future:
        """Send the waiting buckets and ``parts`` as one message; the future of the last part."""
        parts, self._held = self._held + parts, []
        trip = self.road.send([p.trip for p in parts], self.transport)
        if not trip.pending.needs_advance:
            return self._finish_after(trip, parts)
        held: torch.futures.Future = torch.futures.Future()  # resolved when the group is done (_advance_open)
        self._open.append((trip, parts, held))
        return held

    def _advance_open(self) -> None:
        """Start the second stage of every scattered group still open (it waits for their all-to-alls), and let each
        group's finished future resolve the one DDP holds. A failure resolves it to zeros and is raised by
        :meth:`end_step` (DDP reads these futures in C++, where an exception is no error)."""
        opened, self._open = self._open, []
        for trip, parts, held in opened:
            trip.pending.advance()
            buffer = parts[-1].buffer

            def relay(f: torch.futures.Future, held=held, buffer=buffer) -> None:
                try:
                    held.set_result(f.value())
                except BaseException as e:  # noqa: BLE001 - re-raised by end_step
                    self.error = self.error or e
                    buffer.zero_()
                    held.set_result(buffer)

            self._finish_after(trip, parts).then(relay)

    def _finish_after(self, trip, parts: list[Part]) -> torch.futures.Future:
        """A future that finishes ``trip`` (the road: decode, observe) and writes each part's means into its
        bucket; the parts that waited get theirs resolved (or failed) with it."""
        own = parts[-1].buffer

        def finish(delivered) -> torch.Tensor:
            try:
                means = self.road.finish(trip, delivered())
            except BaseException as e:
                # DDP reads a hook's future in C++, where set_exception's value is no error: the waiting buckets
                # resolve to zeros and this one carries the error, which backward() raises inside a RuntimeError --
                # unless the optimizer's step closes gradsift's: then all resolve to zeros and it raises, unwrapped
                stops = isinstance(e, (NonFiniteGradient, CorruptPayload))  # gradsift's own, the same on every rank
                self.error, deferred = (e if stops else self.error), stops and self.attached
                for part in [p for p in parts if p.waiting is not None or deferred]:
                    part.buffer.zero_()
                    if part.waiting is not None:
                        part.waiting.set_result(part.buffer)
                if deferred:
                    return own
                raise
            off = 0
            for part in parts:
                n = len(part.trip.keys)
                if means is None:  # skipped on every rank: p.grad reads non-finite, as after DDP's own all-reduce
                    part.buffer.fill_(float("nan"))  # (a GradScaler then skips the step and lowers its scale)
                elif not part.trip.in_place:  # (in place, the means already are the bucket)
                    part.layout.write(means[off:off + n], part.grads)  # grads are views into the bucket buffer
                if means is not None and self.watch is not None:  # what the optimizer must find in p.grad
                    self.watch.record(part.layout.names, [part.grads[j] for j in part.layout.order])
                off += n
                if part.waiting is not None:
                    part.waiting.set_result(part.buffer)
            return own

        return trip.pending.future(then=finish)

    # ------------------------------------------------------------ per step
    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Close the step (call after ``backward()``, on every rank). Returns True if it must be skipped.

        A skipped step (``on_nonfinite="skip"``) restores every bucket's memory and compressor state to what it
        was before the step, on every rank. Given the backward pass's start (``time.perf_counter()``), ``last``
        also holds the alpha-beta estimate of the communication that would stick out past backward if each
        bucket's collectives started when its hook was called and buckets queued on one link
        (``est_pipelined_tail_s``). ``loss`` (optional) lets a non-finite sum of DDP's own all-reduce name this
        rank when its own loss was not finite.
        """
        self.ensure_ready()
        if self.phase is Phase.CLOSED and self.aside is None:  # closed already and nothing sent since: a second call does nothing
            return self.last.get("skipped", False)
        self._open = []  # (only left by a backward pass that failed before its last bucket)
        if self.error is not None:  # a scattered group failed (its future resolved to zeros): stop here
            raise self.error
        restored = self.usage.close(self.road) if self.usage is not None else None  # (before a rollback)
        if self.aside is not None:  # DDP's own all-reduce took the step: the hook saw nothing of it
            self.aside.close_step(loss)
            skipped = self.core.close_step(lambda _: {**self._aside_fields, "comm_s": None, "ddp_allreduce": True})
        else:
            skipped = self.core.close_step(lambda tally: self._hooked_fields(tally, backward_start, restored))
            self._aside_fields = {k: v for k, v in self.last.items() if k in ("density", "k_ratio", "bytes_per_worker",
                                                                             "wire_bytes_per_worker", "est_comm_s")}
        self._starts, self._in_place, self._held = [], 0, []  # (held: only a backward that failed midway)
        if self.routing.mode == ASIDE and self.aside is None and self.model is not None and not skipped:
            self.aside = Aside(self, self.model)
        return skipped

    def _close_forgotten(self) -> None:
        """The last step was never closed (no ``end_step()``, no ``optimizer.step()``: a GradScaler skips it on a
        non-finite gradient): close it now. Without ``optimizer=``, said once and for every non-finite step, which
        has reached the optimizer by then (only ``optimizer=``, or ``end_step()`` before the step, keeps it off)."""
        said, self._unclosed_said = self._unclosed_said, True
        if (self.end_step() or not said) and not self.attached and self.global_rank == 0:
            warnings.warn("gradsift: a step ended without end_step() or optimizer= given to register: closed at the "
                          "next backward, so a non-finite gradient reaches the optimizer; pass optimizer= to register "
                          "(its step closes gradsift's)", RuntimeWarning, stacklevel=2)

    def end_plain_step(self, loss: torch.Tensor | None = None) -> bool:
        """Close a step whose gradients DDP's own all-reduce averaged outside this hook (a benchmark's hookless
        twin, ``--paired-ddp``): the non-finite rule only; the compressor's state and the totals are untouched.
        Returns True if it must be skipped."""
        self.ensure_ready()
        check_mean(self, loss)
        skipped, _ = self.road.close_step()
        return skipped

    def _hooked_fields(self, tally, backward_start: float | None, restored) -> dict[str, Any]:
        fields = tally.fields()
        finished = [r.finished for r in tally.reports]
        fields.update(buckets=len(self._starts), messages=len(tally.reports), buckets_in_place=self._in_place,
                      tail_wait_s=max(0.0, max(finished, default=0.0) - self._last_hook_end))
        if restored is not None:
            fields["params_unused"] = len(restored)
        if backward_start is not None and tally.reports:
            # backward's computation ends when the last bucket is handed over; what the link still has to do
            # after that, in the alpha-beta model, is the tail that sticks out
            order = sorted((r.started - backward_start, r.est_comm_s) for r in tally.reports)
            last_start = order[-1][0]
            end, _ = pipelined_step_s(0.0, last_start, [o[0] for o in order], [0.0] * len(order), [o[1] for o in order])
            fields["est_pipelined_tail_s"] = max(0.0, end - last_start)
        return fields

    # ------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, st: dict[str, Any]) -> None:  # pragma: no cover - restore via load_state_dict
        raise TypeError("a GradsiftState is restored with register(...).load_state_dict(sd), not unpickled")
