"""The DDP communication hook: a thin adapter from a DDP bucket to the road.

Per bucket, :meth:`GradsiftState.on_bucket` maps the bucket's gradients to a :class:`~gradsift.road.Layout`
group (per-parameter keys, or the one ``"model"`` key) and hands it to the :class:`~gradsift.road.Road` with the
``torch.distributed`` transport (asynchronous collectives only, all issued in the hook body); the returned
future's callback finishes the road (local work: decode, observe) and writes the means into the bucket. Small
payloads may wait, already selected, for the next bucket's message (``merge_small``). A bucket sent by the scatter
route needs a second collective after its all-to-all (the owners' all-gather); collectives started from a future's
callback hang on gloo, so every scattered bucket's second stage starts in the step's last hook call, in bucket
order (the all-to-alls overlap backward, which nothing blocks), and DDP holds a future that the finished group
resolves. How a step travels is the
route owner's (:class:`gradsift.routing.Routing`): this adapter only acts on it -- when it says ``aside``,
:class:`gradsift.ddp.aside.Aside` lets DDP's own all-reduce take the steps. :meth:`GradsiftState.end_step` closes
each step: skipped steps are rolled back on every rank, ``last`` and ``totals`` hold the telemetry.
"""

from __future__ import annotations

import sys
import time
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..compressors.base import NonFiniteGradient, move_state
from ..elastic import fold_memory
from ..errors import ConfigError
from ..layerwise import pipelined_step_s
from ..road import Layout
from ..routing import ASIDE
from ..telemetry import Totals
from .aside import Aside, check_mean
from .consensus import verify_same
from .settings import HookSettings


class Part(NamedTuple):
    """One bucket on its way: where its means go, and (when it waited for a later bucket's message) the future
    DDP holds for it."""

    layout: Layout
    grads: list[torch.Tensor]
    buffer: torch.Tensor
    trip: Any
    waiting: torch.futures.Future | None = None


class GradsiftState:
    """Everything the hook needs, per rank. Checkpointable without the process group."""

    __slots__ = ("settings", "named", "name_of", "model", "group_arg", "road", "transport", "lags", "last", "totals",
                 "error", "writer", "aside", "usage", "_aside_fields", "_built", "_layouts", "_held", "_open",
                 "_starts", "_in_place", "_last_hook_end")

    def __init__(self, settings: HookSettings, named: Sequence[tuple[str, torch.nn.Parameter]], *, model=None):
        """``model``: the DDP wrapper (``register``), which standing aside needs; None for ``hook_state``, whose
        process group may not exist yet (then everything is set up at the first hook call)."""
        self.settings = settings
        self.named = list(named)
        self.name_of = {id(p): n for n, p in self.named}
        self.model = model
        self.group_arg = settings.process_group if settings.process_group is not None or model is None else \
            model.process_group
        self.road = self.transport = None
        self.lags = None
        self.last: dict[str, Any] = {}
        self.totals = Totals(sum(p.numel() * p.element_size() for _, p in self.named))
        self.error: BaseException | None = None
        self.writer = None  # a MetricsWriter (rank 0)
        self.aside: Aside | None = None
        self.usage = None  # a gradsift.ddp.usage.Usage where DDP may leave parameters unused (register)
        self._aside_fields: dict[str, Any] = {}  # the last hooked step's telemetry, for the steps DDP's own took
        self._built = False
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._held: list[Part] = []  # LAGS Sec. 5: selected payloads waiting for the next bucket's message
        self._open: list[tuple[Any, list[Part], torch.futures.Future]] = []  # scattered groups awaiting stage 2
        self._starts: list[float] = []
        self._in_place = 0  # buckets of this step summed in place
        self._last_hook_end = 0.0

    # ------------------------------------------------------------ set-up
    def _ensure_ready(self) -> None:
        if not self._built:
            self._built = True
            why = None if self.model is not None else "hook_state() has no DDP wrapper to stand aside for"
            self.transport, self.road = self.settings.build(self.named, self.group_arg, why)
            self.totals.world_size(self.world_size)
            self.verify()

    @property
    def compressor(self):
        self._ensure_ready()
        return self.road.compressor

    @property
    def routing(self):
        self._ensure_ready()
        return self.road.routing

    @property
    def rank(self) -> int:
        return self.transport.rank if self.transport is not None else 0

    @property
    def world_size(self) -> int:
        return self.transport.world_size if self.transport is not None else 1

    @property
    def group(self):
        return self.transport.group if self.transport is not None else self.group_arg

    @property
    def net(self):
        return self.road.net

    @property
    def granularity(self) -> str:
        return self.settings.granularity

    @property
    def settled(self) -> bool:
        """Whether everything the hook measures on its own steps is over (the measured plan decided, LAGS
        planned): every step from now on travels as the rest of the run will."""
        return self.routing.settled and (self.lags is None or self.lags.ratios is not None)

    def describe(self) -> dict[str, Any]:
        """What must agree between ranks."""
        return {"compressor": self.road.compressor.config(), **self.settings.describe(),
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
        """Whether this bucket's payloads, with those already waiting, are small enough to wait for the next
        bucket: less than the link moves in one message latency (the same on every rank: payload sizes follow
        from the configuration, not the data)."""
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
    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Close the step (call after ``backward()``, on every rank). Returns True if it must be skipped.

        A skipped step (``on_nonfinite="skip"``) restores every bucket's memory and compressor state to what it
        was before the step, on every rank. Given the backward pass's start (``time.perf_counter()``), ``last``
        also holds the alpha-beta estimate of the communication that would stick out past backward if each
        bucket's collectives started when its hook was called and buckets queued on one link
        (``est_pipelined_tail_s``). ``loss`` (optional) lets a non-finite sum of DDP's own all-reduce name this
        rank when its own loss was not finite.
        """
        self._ensure_ready()
        self._open = []  # (only left by a backward pass that failed before its last bucket)
        if self.error is not None:  # a scattered group failed (its future resolved to zeros): stop here
            raise self.error
        restored = self.usage.close(self.road) if self.usage is not None else None  # (before a rollback)
        if self.aside is not None:  # DDP's own all-reduce took the step: the hook saw nothing of it
            self.aside.close_step(loss)
            skipped, _ = self.road.close_step()
            fields = {**self._aside_fields, "comm_s": None, "ddp_allreduce": True, "skipped": skipped}
        else:
            skipped, tally = self.road.close_step()
            fields = self._hooked_fields(tally, backward_start)
            if restored is not None:
                fields["params_unused"] = len(restored)
            fields["skipped"] = skipped
            self._aside_fields = {k: v for k, v in fields.items() if k in ("density", "k_ratio", "bytes_per_worker",
                                                                          "wire_bytes_per_worker", "est_comm_s")}
        self.last = fields
        self.totals.add(fields, skipped)
        self._starts, self._in_place, self._held = [], 0, []  # (held: only a backward that failed midway)
        if self.lags is not None:
            self.lags.after_step()
        lags_done = self.lags is None or self.lags.ratios is not None
        changed = self.routing.after_step(self.road.compressor, step=self.road.step, skipped=skipped,
                                          others_settled=lags_done)
        if changed is not None and changed != ASIDE and self.rank == 0:
            print(f"gradsift: wire plan {self.routing.reason} from step {self.road.step + 1} on", file=sys.stderr)
        if self.routing.mode == ASIDE and self.aside is None and self.model is not None and not skipped:
            self.aside = Aside(self, self.model)
        if self.writer is not None and not skipped:
            self.writer.write({"step": self.road.step, **{k: v for k, v in fields.items() if k != "skipped"}})
        return skipped

    def end_plain_step(self, loss: torch.Tensor | None = None) -> bool:
        """Close a step whose gradients DDP's own all-reduce averaged outside this hook (a benchmark's hookless
        twin, ``--paired-ddp``): the non-finite rule only; the compressor's state and the totals are untouched.
        Returns True if it must be skipped."""
        self._ensure_ready()
        check_mean(self, loss)
        skipped, _ = self.road.close_step()
        return skipped

    def _hooked_fields(self, tally, backward_start: float | None) -> dict[str, Any]:
        fields = tally.fields()
        finished = [r.finished for r in tally.reports]
        fields.update(buckets=len(self._starts), messages=len(tally.reports), buckets_in_place=self._in_place,
                      tail_wait_s=max(0.0, max(finished, default=0.0) - self._last_hook_end))
        if backward_start is not None and tally.reports:
            # backward's computation ends when the last bucket is handed over; what the link still has to do
            # after that, in the alpha-beta model, is the tail that sticks out
            order = sorted((r.started - backward_start, r.est_comm_s) for r in tally.reports)
            last_start = order[-1][0]
            end, _ = pipelined_step_s(0.0, last_start, [o[0] for o in order], [0.0] * len(order), [o[1] for o in order])
            fields["est_pipelined_tail_s"] = max(0.0, end - last_start)
        return fields

    # ------------------------------------------------------------- users' scripts
    def write_metrics(self, path) -> None:
        """Append one JSON line per step to ``path`` (rank 0; the CLI's telemetry fields)."""
        from ..records import MetricsWriter

        if self.rank == 0:
            self.writer = MetricsWriter(path)

    # ------------------------------------------------------------- pickling
    @property
    def step(self) -> int:
        """Steps applied so far (skipped ones not counted)."""
        return self.road.step if self.road is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's compressor state, owner-side residuals, route and totals, never the process group."""
        self._ensure_ready()
        return {"compressor_state": self.road.compressor.state_dict(), "step": self.road.step,
                "granularity": self.granularity, "on_nonfinite": self.road.on_nonfinite,
                "rank": self.rank, "world_size": self.world_size, "routing": self.routing.state_dict(),
                "totals": self.totals.state_dict(), "owners": self.road.owners.state_dict()}

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, st: dict[str, Any]) -> None:  # pragma: no cover - restore via load_state_dict
        raise TypeError("a GradsiftState is restored with register(...).load_state_dict(sd), not unpickled")

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """This rank's state back (``docs/ddp-reference.md``: save per rank). Another rank's is an error, unless
        ``reset_memory`` keeps the configuration and starts the memory afresh. The route holds as it was saved
        (DDP's own all-reduce takes over again after the first step back)."""
        self._ensure_ready()
        if sd.get("granularity") != self.granularity:
            raise ValueError(f"checkpoint was taken with granularity {sd.get('granularity')!r}, "
                             f"this run uses {self.granularity!r}")
        if sd.get("world_size", self.world_size) != self.world_size:
            raise ValueError(f"state saved by a run of {sd.get('world_size')} ranks, this run has {self.world_size}")
        # the memory lives where the gradients do: checkpoints are read onto the CPU, training may run on a GPU
        here = self.named[0][1].device if self.named else torch.device("cpu")
        check_shapes(sd["compressor_state"], self.named, self.granularity)
        self.road.compressor.load_state_dict(move_state(sd["compressor_state"], here), reset_memory=reset_memory)
        self.road.step = int(sd.get("step", 0))
        self.road.owners.load_state_dict(sd.get("owners"), here)
        self.routing.load_state_dict(sd.get("routing"))
        self.totals.load_state_dict(sd.get("totals"))
        if self.lags is not None:
            self.lags.reapply()

    def load_elastic(self, sds: Sequence[dict[str, Any]]) -> None:
        """Every rank's saved state, from a run of another world size (an elastic job that lost or gained a node):
        every rank's memory becomes what the saved ranks still had to send, per rank of the mean -- their residuals
        (momentum correction: velocities) and their owner residuals, summed and divided by the saved world size --
        so nothing is lost (:mod:`gradsift.elastic` states the rule); the owners start empty, and the compressor's
        own state (its random streams included) and the wire plan's route afresh."""
        self._ensure_ready()
        check_shapes(sds[0]["compressor_state"], self.named, self.granularity)
        here = self.named[0][1].device if self.named else torch.device("cpu")
        mem = self.road.compressor
        numel = {n: p.numel() for n, p in self.named}
        numel["model"] = sum(numel.values())
        folded = fold_memory(sds, mem.STORES, mem.UNSENT, numel, mem.inner.seed, here)
        for name in mem.STORES:
            setattr(mem, name, folded.get(name, {}))
        self.road.owners.load_state_dict({})
        self.road.step = int(sds[0].get("step", 0))
        self.totals.load_state_dict(sds[0].get("totals"))


def check_shapes(compressor_state: dict[str, Any], named, granularity: str) -> None:
    """A memory saved for another model (a layer reshaped, a parameter renamed) is refused in one line at load,
    not at the first backward: every per-tensor store's entries must match the parameter's (or, for whole-model
    compression, the model's) element count."""
    numel = {n: p.numel() for n, p in named}
    if granularity == "model":
        numel = {"model": sum(numel.values())}
    for store, per_key in compressor_state.items():
        if not isinstance(per_key, dict):
            continue
        for key, t in per_key.items():
            if isinstance(t, torch.Tensor) and key in numel and t.numel() not in (numel[key], 0):
                raise ValueError(f"state {store}[{key!r}] holds {t.numel()} entries, this model's has {numel[key]}: "
                                 "the checkpoint is of another model")
