"""The DDP communication hook: a thin adapter from a DDP bucket to the road.

Per bucket, :meth:`GradsiftState.on_bucket` maps the bucket's gradients to a
:class:`~gradsift.road.Layout` (per-parameter keys, or the one ``"model"`` key),
starts the :class:`~gradsift.road.Road` with the ``torch.distributed``
transport (asynchronous collectives only, all issued in the hook body), and
returns a future whose callback finishes the road (local work: decode,
observe) and writes the means into the bucket. A bucket sent whole with
nothing held back is summed in the bucket itself (``Road.in_place``). :meth:`GradsiftState.end_step`
closes the step: skipped steps are rolled back on every rank, and ``last`` /
``totals`` hold the telemetry.
"""

from __future__ import annotations

import sys
import time
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..compressors.base import NonFiniteGradient, move_state
from ..layerwise import pipelined_step_s
from ..road import Layout, Road
from ..runconfig import ConfigError
from ..transport.dist import DistTransport
from .aside import average_velocity, momentum_step, momentum_whole
from .consensus import verify_same
from .probe import WireProbe

class Part(NamedTuple):
    """One bucket on its way: where its means go, and (when it waited for a later bucket's message) the future
    DDP holds for it."""

    layout: Layout
    grads: list[torch.Tensor]
    buffer: torch.Tensor
    trip: Any
    waiting: torch.futures.Future | None = None


TOTAL_KEYS = ("bytes_per_worker", "wire_bytes_per_worker", "select_s", "comm_s", "est_comm_s", "overflow")


class GradsiftState:
    """Everything the hook needs, per rank. Checkpointable without the process group."""

    __slots__ = ("road", "transport", "named", "name_of", "granularity", "spec", "ratio", "step", "error", "last",
                 "totals", "lags", "writer", "explicit_momentum", "probe", "_measure", "_sent_settled", "_layouts", "_build", "_last_hook_end", "_starts", "_in_place",
                 "merge_small", "_held", "_aside")

    def __init__(self, road: Road | None, transport: DistTransport | None,
                 named: Sequence[tuple[str, torch.nn.Parameter]], granularity: str, spec: str, ratio: float | None,
                 build=None, measure: bool = False, merge_small: bool = True):
        self.road = road
        self.transport = transport
        self.named = list(named)
        self.name_of = {id(p): n for n, p in self.named}
        self.granularity = granularity
        self.spec, self.ratio = spec, ratio
        self.step = 0
        self.error: BaseException | None = None
        self.last: dict[str, Any] = {}
        self.totals: dict[str, float] = {"steps": 0, "skipped_steps": 0, **{k: 0.0 for k in TOTAL_KEYS}}
        self.lags = None
        self.writer = None  # a MetricsWriter (rank 0) for write_metrics()
        self.explicit_momentum = False  # the spec or options set momentum correction's momentum themselves
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._build = build  # hook_state: transport and road made at the first hook call
        self._measure = measure  # wire_plan="measure": a WireProbe once the road exists (gradsift.ddp.probe)
        self.probe: WireProbe | None = None
        self._last_hook_end = 0.0
        self._starts: list[float] = []
        self._in_place = 0  # buckets of this step summed in place
        # LAGS Sec. 5: a bucket whose payloads are small (less than the link moves in one message latency) waits,
        # already selected, for the next bucket and goes in its message; the step's last bucket sends what waits
        self.merge_small = merge_small
        self._held: list[Part] = []
        self._aside = False  # stand_aside() said so: DDP's own all-reduce takes the steps
        self._sent_settled = False  # the last step was sent under the plan the rest of the run keeps

    # ------------------------------------------------------------ set-up
    @property
    def compressor(self):
        self._ensure_ready()
        return self.road.compressor

    @property
    def rank(self) -> int:
        return self.transport.rank if self.transport is not None else 0

    @property
    def world_size(self) -> int:
        return self.transport.world_size if self.transport is not None else 1

    @property
    def group(self):
        return self.transport.group if self.transport is not None else None

    @property
    def net(self):
        return self.road.net

    def _ensure_ready(self) -> None:
        if self._build is not None:
            build, self._build = self._build, None
            self.transport, self.road = build()
            if self._measure and self.world_size > 1:
                inner = self.road.compressor.inner
                dtypes = {p.dtype for _, p in self.named}
                narrow = inner if inner.value_dtype is not None and dtypes != {inner.value_dtype} else None
                self.probe = WireProbe(self.road.plan, self.group, narrow=narrow)
            self.verify()

    @property
    def settled(self) -> bool:
        """Whether what the hook measures on its own steps is over: the measured wire plan has decided and LAGS
        has planned its ratios (from then on every step is sent as the rest of the run will be)."""
        self._ensure_ready()
        if self.probe is not None and self.probe.result is None:
            return False
        return self.lags is None or self.lags.ratios is not None

    def stand_aside(self) -> bool:
        """Whether the hook would only repeat DDP's own all-reduce from now on (then True for the rest of the run).

        It has settled, the wire plan is on (not the papers' exact setting), the mean is unweighted, and the last
        step sent every tensor whole with nothing held back: summed in place (:meth:`Road.in_place
        <gradsift.road.Road.in_place>`), or, for momentum correction (DGC; no local clipping, the gradient's own
        dtype on the wire), sent whole with plain momentum. The plan is fixed from then on and nothing
        compresses, so every later step would be the same; a training loop may step through a plain DDP wrapper
        of the same module instead and spare the Python hook's cost per bucket (``gradsift train`` does, see
        :func:`gradsift.launch.loop.train_ddp`). For momentum correction the velocity then follows the mean
        gradient: :meth:`momentum_aside` after every such step (this call averages the ranks' velocities once,
        one all-reduce). The answer is the same on every rank: it follows from the configuration and the
        measured plan's one all-reduced choice."""
        if self._aside:
            return True
        if self.road is None or not self.road.plan.enabled or self.transport.weights is not None:
            return False
        n = self.last.get("buckets", 0)
        if not n or self.last.get("skipped") or not self._sent_settled:
            return False  # (a step the probe timed whole says nothing of the plan it then chose)
        if self.last.get("buckets_in_place") == n:
            self._aside = True
        elif momentum_whole(self):
            average_velocity(self)
            self._aside = True
        return self._aside

    def momentum_aside(self) -> None:
        """After a step that DDP's own all-reduce took (:meth:`stand_aside`): for momentum correction, the mean
        gradient in each ``.grad`` becomes the velocity the hook would have sent (:func:`gradsift.ddp.aside.
        momentum_step`); nothing to do for a method summed in place."""
        momentum_step(self)

    def describe(self) -> dict[str, Any]:
        """What must agree between ranks."""
        plan = self.road.plan
        return {"compressor": self.road.compressor.config(), "granularity": self.granularity,
                "on_nonfinite": self.road.on_nonfinite, "merge_small": self.merge_small,
                "wire_plan": {"enabled": plan.enabled, "measure": self._measure, "min_numel": plan.min_numel,
                              **self.road.net.as_dict()},
                "tensors": [[n, list(p.shape)] for n, p in self.named]}

    def verify(self) -> None:
        """Every rank must run the same configuration (one blocking all-gather; outside the hook)."""
        verify_same(self.describe(), self.group, self.rank)

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
        self._ensure_ready()
        layout = self._layout(bucket.parameters())
        grads = bucket.gradients()
        buffer = bucket.buffer()
        last = bucket.is_last()
        self._starts.append(time.perf_counter())
        if self.road.in_place(layout.keys, layout.shapes(grads), buffer.dtype):
            if last and self._held:  # nothing may wait past the step's last bucket
                self._send([])
            trip = self.road.start_in_place(layout.keys, layout.in_buffer(grads, buffer), buffer, self.transport)
            self._in_place += 1
            fut = self._finish_after(trip, [Part(layout, grads, buffer, trip)])
        else:
            trip = self.road.start(layout.keys, layout.inputs(grads), self.transport, send=False)
            if not last and self._may_wait(trip):
                waiting: torch.futures.Future = torch.futures.Future()
                self._held.append(Part(layout, grads, buffer, trip, waiting))
                fut = waiting
            else:
                fut = self._send([Part(layout, grads, buffer, trip)])
        self._last_hook_end = time.perf_counter()
        return fut

    def _may_wait(self, trip) -> bool:
        """Whether this bucket's payloads, with those already waiting, are small enough to wait for the next
        bucket: less than the link moves in one message latency (the same on every rank: payload sizes follow
        from the configuration, not the data)."""
        if not (self.merge_small and self.granularity == "layer"):
            return False
        held = sum(self.road.wire_bytes(h.trip) for h in self._held)
        return held + self.road.wire_bytes(trip) < self.road.net.alpha * self.road.net.beta

    def _send(self, parts: list[Part]) -> torch.futures.Future:
        """Send the waiting buckets and ``parts`` as one message; the future of the last part."""
        parts, self._held = self._held + parts, []
        return self._finish_after(self.road.send([p.trip for p in parts], self.transport), parts)

    def _finish_after(self, trip, parts: list[Part]) -> torch.futures.Future:
        """A future that finishes ``trip`` (the road: decode, observe) and writes each part's means into its
        bucket; the parts that waited get theirs resolved (or failed) with it."""
        own = parts[-1].buffer

        def finish(delivered) -> torch.Tensor:
            try:
                means = self.road.finish(trip, delivered())
            except BaseException as e:
                if isinstance(e, NonFiniteGradient):
                    self.error = e
                # DDP reads a hook's future in C++, where set_exception's value is no error: the waiting buckets
                # resolve to zeros and this bucket's future carries the error, which backward() raises
                for part in parts:
                    if part.waiting is not None:
                        part.buffer.zero_()
                        part.waiting.set_result(part.buffer)
                raise
            off = 0
            for part in parts:
                n = len(part.trip.keys)
                if means is None:  # skipped on every rank: nothing is applied
                    part.buffer.zero_()
                elif not part.trip.in_place:  # (in place, the means already are the bucket)
                    part.layout.write(means[off:off + n], part.grads)  # grads are views into the bucket buffer
                off += n
                if part.waiting is not None:
                    part.waiting.set_result(part.buffer)
            return own

        return trip.pending.future(then=finish)

    # ------------------------------------------------------------ per step
    def end_step(self, backward_start: float | None = None) -> bool:
        """Close the step (call after ``backward()``). Returns True if it must be skipped.

        A skipped step (``on_nonfinite="skip"``) restores every bucket's memory and
        compressor state to what it was before the step, on every rank. Given the
        backward pass's start (``time.perf_counter()``), ``last`` also holds the
        alpha-beta estimate of the communication that would stick out past
        backward if each bucket's collectives started when its hook was called
        and buckets queued on one link (``est_pipelined_tail_s``).
        """
        self._ensure_ready()
        skipped, tally = self.road.close_step()
        fields = tally.fields()
        finished = [r.finished for r in tally.reports]
        fields.update(skipped=skipped, comm_s=tally.comm_in_flight_s(), buckets=len(self._starts),
                      messages=len(tally.reports), buckets_in_place=self._in_place,
                      tail_wait_s=max(0.0, max(finished, default=0.0) - self._last_hook_end))
        if backward_start is not None and tally.reports:
            # backward's computation ends when the last bucket is handed over; what the link still has to do
            # after that, in the alpha-beta model, is the tail that sticks out
            order = sorted((r.started - backward_start, r.est_comm_s) for r in tally.reports)
            last_start = order[-1][0]
            end, _ = pipelined_step_s(0.0, last_start, [o[0] for o in order], [0.0] * len(order), [o[1] for o in order])
            fields["est_pipelined_tail_s"] = max(0.0, end - last_start)
        self.last = fields
        self._sent_settled = self.settled  # this step went as the rest of the run will (before the probe decides)
        self._starts, self._in_place = [], 0
        self._held = []  # (only left by a backward pass that failed before its last bucket: nothing carries over)
        if skipped:
            self.totals["skipped_steps"] += 1
        else:
            self.step += 1
            self.totals["steps"] += 1
            for k in TOTAL_KEYS:
                self.totals[k] += float(fields.get(k, 0.0))
        if self.lags is not None:
            self.lags.after_step()
        elif self.probe is not None:
            self.probe.after_step(skipped)
        if self.writer is not None and not skipped:
            self.writer.write({"step": self.step, **{k: v for k, v in fields.items() if k != "skipped"}})
        return skipped

    # ------------------------------------------------------------- users' scripts
    def write_metrics(self, path) -> None:
        """Append one JSON line per step to ``path`` (rank 0; the CLI's telemetry fields)."""
        from ..records import MetricsWriter

        if self.rank == 0:
            self.writer = MetricsWriter(path)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Momentum correction (DGC's memory) applies momentum itself: take the optimizer's momentum over and
        set the optimizer's to 0, so momentum is applied once. Refuses what cannot be reconciled, in one line."""
        comp = self.compressor
        if getattr(comp, "memory_name", None) != "momentum":
            return
        if not isinstance(optimizer, torch.optim.SGD):
            raise ConfigError(f"{comp.name} applies momentum correction, which is defined for SGD; the optimizer is "
                              f"{type(optimizer).__name__}: use torch.optim.SGD")
        groups = optimizer.param_groups
        m, nesterov = groups[0].get("momentum", 0.0), bool(groups[0].get("nesterov", False))
        if any(g.get("momentum", 0.0) != m or bool(g.get("nesterov", False)) != nesterov for g in groups):
            raise ConfigError(f"{comp.name}: the optimizer's parameter groups use different momentum; momentum "
                              "correction applies one momentum to every tensor")
        if m == 0:
            return
        if self.explicit_momentum:
            raise ConfigError(f"{comp.name} sets its own momentum and the optimizer adds momentum={m}: build the "
                              "optimizer with momentum=0, or drop momentum from the compressor's options")
        comp.memory_options.update(momentum=float(m), nesterov=nesterov)
        for g in groups:
            g["momentum"], g["nesterov"] = 0.0, False
        self.verify()
        if self.rank == 0:
            print(f"gradsift: {comp.name} applies the optimizer's momentum {m:g}{' (Nesterov)' if nesterov else ''} "
                  "itself (momentum correction); the optimizer's momentum is now 0", file=sys.stderr)

    # ------------------------------------------------------------- pickling
    def state_dict(self) -> dict[str, Any]:
        """This rank's compressor state and settings, never the process group."""
        self._ensure_ready()
        return {"compressor_state": self.road.compressor.state_dict(), "step": self.step,
                "granularity": self.granularity, "on_nonfinite": self.road.on_nonfinite,
                "rank": self.rank, "world_size": self.world_size,
                "wire_probe": self.probe.state_dict() if self.probe is not None else None}

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, st: dict[str, Any]) -> None:  # pragma: no cover - restore via load_state_dict
        raise TypeError("a GradsiftState is restored with register(...).load_state_dict(sd), not unpickled")

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """This rank's state back (``docs/ddp.md``: save per rank). Another rank's is an error, unless
        ``reset_memory`` keeps the configuration and starts the memory afresh."""
        self._ensure_ready()
        if sd.get("granularity") != self.granularity:
            raise ValueError(f"checkpoint was taken with granularity {sd.get('granularity')!r}, "
                             f"this run uses {self.granularity!r}")
        if sd.get("world_size", self.world_size) != self.world_size:
            raise ValueError(f"state saved by a run of {sd.get('world_size')} ranks, this run has {self.world_size}")
        # the memory lives where the gradients do: checkpoints are read onto the CPU, training may run on a GPU
        here = self.named[0][1].device if self.named else torch.device("cpu")
        self.road.compressor.load_state_dict(move_state(sd["compressor_state"], here), reset_memory=reset_memory)
        self.step = self.road.step = int(sd.get("step", 0))
        if self.probe is not None:
            self.probe.load_state_dict(sd.get("wire_probe"))
        if self.lags is not None:
            self.lags.reapply()
