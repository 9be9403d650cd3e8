"""One rank's gradsift, whatever runs it: the record every runtime holds and adapts its callbacks to.

A *rank* (a worker of the simulator, a DDP or FSDP process) is, for gradsift: its settings
(:class:`~gradsift.runtime.settings.Settings`);
the compression inputs it will see (``tensors``: key, shape and dtype of each parameter, each FSDP module's
reduce-scatter input, or each HSDP shard); and, once its transport is known, its compressor inside its memory, its
route owner (:class:`~gradsift.route.routing.Routing`) and its road (:class:`~gradsift.runtime.road.Road`). This class
builds them, hands the optimizer's momentum (or Adam) over (:meth:`take_optimizer`), checks that every rank runs the same
configuration (:meth:`verify`), closes each step (:meth:`close_step`: totals, ``last``, the route's transitions,
the metrics line) and saves and loads everything the rank holds (:meth:`state_dict`: compressor state and memory,
the owners' residuals, the route, the totals). Nothing here calls back into a runtime: what a runtime must do
(close its step from the optimizer's) it passes in. A runtime holds a rank and adds only how gradients reach its
road:

* DDP (:class:`gradsift.ddp.state.GradsiftState`): buckets, merging small ones, standing aside;
* FSDP and HSDP (:class:`gradsift.fsdp.FsdpState`): the reduce-scatter, or the all-reduce hook, and HSDP's
  agreement on a skipped step;
* local SGD (:class:`gradsift.runtime.localstate.LocalState`): the global model and the outer step;
* the simulator (:class:`gradsift.runtime.simulate.Simulator`): N ranks in one process, one route owner among them.

The first three show their rank to the user through :class:`gradsift.runtime.rankstate.RankState`.
"""

from __future__ import annotations

import enum
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..messages import say, warn
from ..compressors.base import move_state
from .consensus import verify_same
from .gradwatch import undo_rescaling
from .elastic import check_shapes, fold_memory, numel_of
from ..errors import ConfigError
from ..memory.factory import make_compressor
from ..memory.momentum import take_over_momentum
from ..memory.recipes import momentum_recipe
from ..memory.adam_step import take_over_adam
from ..route.netmodel import NetworkModel
from ..route.plan import WirePlan
from .road import Road
from ..route.routing import ASIDE, Routing
from .settings import Settings
from .settle import settle_at_exit
from .telemetry import StepTally, Totals

Tensors = Sequence[tuple[str, Sequence[int], torch.dtype]]


class Phase(enum.Enum):
    """Where a rank's step is: ``IDLE`` (nothing travelled since the optimizer's last step), ``OPEN`` (something
    travelled: the step must be closed, by ``end_step()`` or the optimizer's step), ``CLOSED`` (closed, and nothing
    travelled since: a second ``end_step()`` does nothing; the optimizer's step makes it ``IDLE``)."""

    IDLE = "idle"
    OPEN = "open"
    CLOSED = "closed"


class Rank:
    """One rank's compressor, route owner, road, telemetry and checkpointed state (module docstring).

    ``runtime`` is ``sim``, ``ddp``, ``fsdp``, ``hsdp`` or ``local`` (the simulator of FSDP's or HSDP's exchange
    counts as those); ``dense_bytes``: what this rank would send a step uncompressed; ``device``: where its memory
    lives; ``agreed``: what else every rank must run alike, beside the road's configuration (:meth:`describe`).
    """

    lags = None  # a LAGS-SGD controller, where the runtime plans per-layer ratios (the DDP hook's ``lags=True``)
    watch = None  # a WrittenGrads where the optimizer applies what the hook wrote as it is (the Adam recipe)

    def __init__(self, settings: Settings, tensors: Tensors, *, runtime: str, dense_bytes: int,
                 device: torch.device | None = None, agreed: dict[str, Any] | None = None):
        self.settings = settings
        self.agreed = dict(agreed or {})
        self.runtime = runtime
        self.tensors = [(k, tuple(int(s) for s in shape), dt) for k, shape, dt in tensors]
        self.device = device or torch.device("cpu")
        self.road: Road | None = None
        self.transport = None
        self.leads = True  # this rank advances the route owner (the simulator shares one among its ranks)
        self.global_rank, self.global_world = 0, 1
        self.last: dict[str, Any] = {}
        self.phase = Phase.IDLE  # where this rank's step is (:class:`Phase`)
        self.totals = Totals(dense_bytes)
        self.writer = None  # a MetricsWriter (rank 0)
        self.attached = False  # the optimizer's step closes gradsift's (errors of the step are raised there)

    # ------------------------------------------------------------ building
    def build(self, transport, *, routing: Routing | None = None, aside: str | None = None,
              combine: Callable[[list[float]], list[float]] | None = None, flag_only: bool = False,
              global_rank: int | None = None, global_world: int | None = None) -> Road:
        """This rank's compressor, route owner and road on ``transport``. ``routing``: a route owner shared with
        other ranks (the simulator's); ``aside``: why this runtime cannot stand aside (None: it can); ``combine``:
        the measured plan's reduction over ranks; ``flag_only``: a non-finite input only marks the step (the
        runtime agrees on it at the close, HSDP); ``global_rank``/``global_world``: this rank in the whole job (by
        default the default process group's, else the transport's)."""
        s = self.settings
        n, rank = transport.world_size, transport.rank
        joined = dist.is_available() and dist.is_initialized()
        if joined:
            settle_at_exit()  # the script may end without finish(): gloo's threads go idle before shutdown
        self.global_rank = global_rank if global_rank is not None else (dist.get_rank() if joined else rank)
        self.global_world = global_world if global_world is not None else (dist.get_world_size() if joined else n)
        comp = make_compressor(s.compressor, s.ratio, seed=s.seed, rank=rank, world_size=n,
                               weight=s.weights[rank] if s.weights is not None else None, **s.options)
        net = NetworkModel(s.bandwidth_gbps, s.latency_us)
        if routing is None:
            plan = WirePlan(net, n, enabled=s.wire_plan != "off", min_numel=s.min_numel,
                            sparse_collective=s.sparse_collective, scatter_keep=s.scatter_keep,
                            sharded=self.runtime == "fsdp")
            routing = Routing(plan, self.tensors, aside=aside)
            if s.wire_plan == "measure" and n > 1:
                routing.measure_with(comp, s.measure, combine)
        else:
            self.leads = False
        self.transport = transport
        self.road = Road(comp, routing, net=net, on_nonfinite="skip" if flag_only else s.on_nonfinite,
                         party="worker" if self.runtime == "sim" else "rank")
        self.totals.world_size(n, sharded=self.runtime == "fsdp")
        return self.road

    @property
    def built(self) -> bool:
        return self.road is not None

    @property
    def compressor(self):
        return self.road.compressor

    @property
    def routing(self) -> Routing:
        return self.road.routing

    @property
    def rank(self) -> int:
        """This rank's index in the group its road communicates on."""
        return self.transport.rank if self.transport is not None else 0

    @property
    def world_size(self) -> int:
        return self.transport.world_size if self.transport is not None else 1

    @property
    def net(self) -> NetworkModel:
        return self.road.net

    @property
    def granularity(self) -> str:
        return self.settings.granularity

    @property
    def step(self) -> int:
        """Steps applied so far (skipped ones not counted)."""
        return self.road.step if self.road is not None else 0

    @property
    def memory(self) -> int:
        """Bytes of memory (error feedback's residuals, momentum correction's buffers, the owners' residuals) this
        rank holds."""
        if self.road is None:
            return 0
        stores = list(self.road.compressor.stores().values()) + [self.road.owners.residual]
        return sum(t.numel() * t.element_size() for store in stores for t in store.values())

    @property
    def memory_per_parameter(self) -> float:
        """:attr:`memory` over the parameters this rank compresses (under FSDP each module's unsharded size):
        4.0 for an fp32 residual on every tensor, about 1.0 with ``residual_dtype="fp8"``."""
        return self.memory / max(sum(numel_of(s) for _, s, _ in self.tensors), 1)

    def memory_summary(self) -> dict[str, Any]:
        """The memory figures of a run's summary.json: bytes, bytes per parameter, what a narrow store rounded off."""
        return {"bytes": self.memory, "bytes_per_parameter": round(self.memory_per_parameter, 4),
                "residual_rounding": self.residual_rounding}

    @property
    def residual_rounding(self) -> float | None:
        """What a narrow residual store (``residual_dtype``) rounded off, relative to what it held, over the run
        (sqrt of the summed squares); None when the memory is stored exactly."""
        lost = getattr(self.road.compressor, "rounding_lost", None) if self.road is not None else None
        return lost() if lost is not None else None  # (a method without memory has none)

    # ------------------------------------------------------------ across ranks
    def describe(self) -> dict[str, Any]:
        """What must agree between ranks: the road's configuration and the runtime's ``agreed``."""
        return {"runtime": self.runtime, "compressor": self.road.compressor.config(), **self.settings.describe(),
                "tensors": [[k, list(s)] for k, s, _ in self.tensors], **self.agreed}

    def verify(self, group=None) -> None:
        """Every rank of ``group`` (default: the road's) must run the same configuration: one blocking all-gather,
        outside any hook; :class:`~gradsift.runtime.consensus.ConfigMismatch` on every rank names the difference."""
        group = group if group is not None else getattr(self.transport, "group", None)
        verify_same(self.describe(), group, self.global_rank)

    def take_optimizer(self, optimizer: torch.optim.Optimizer | None, group=None, *,
                       close: Callable[[], bool]) -> None:
        """The optimizer hand-off: the step closes from the optimizer's (:meth:`attach`, by ``close``, the
        runtime's end of a step); the method's recipe for
        the optimizer (:func:`gradsift.memory.recipes.momentum_recipe`, unless ``recipe=False``); with momentum
        correction (``dgc``, ``memory=momentum``) the optimizer's momentum becomes the method's and the optimizer's
        is set to 0 (:func:`gradsift.memory.momentum.take_over_momentum`), checked again across ``group`` and said
        once; with ``memory=adam`` the optimizer applies the averaged Adam direction
        (:func:`gradsift.memory.adam_step.take_over_adam`). Without an optimizer such a memory warns: applied twice."""
        comp = self.compressor
        if optimizer is None:
            if (comp.applies_momentum or comp.applies_adam) and self.global_rank == 0:
                warnings.warn(f"gradsift: {comp.name} applies {'momentum' if comp.applies_momentum else 'Adam'} itself "
                              f"(memory={comp.memory_name}): pass optimizer= to register so it takes the optimizer's "
                              "over, or it is applied twice", RuntimeWarning, stacklevel=3)
            return
        self.attach(optimizer, close)
        if take_over_adam(comp, optimizer, tensors=len(self.tensors)):
            self.verify(group)
        said = momentum_recipe(self.settings.compressor, optimizer) if self.settings.recipe else None
        if said and self.global_rank == 0:
            say(said)
        m = take_over_momentum(comp, optimizer)
        if m is None:
            return
        self.verify(group)
        if m and self.global_rank == 0:
            nesterov = comp.memory_options["nesterov"]
            say(f"gradsift: {comp.name} applies the optimizer's momentum {m:g}{' (Nesterov)' if nesterov else ''} "
                "itself (momentum correction); the optimizer's momentum is now 0")

    def attach(self, optimizer: torch.optim.Optimizer, close: Callable[[], bool]) -> None:
        """Close every step from the optimizer's own step, so a script needs no gradsift call per step: before
        ``optimizer.step()`` the step is closed by ``close()`` (the runtime's ``end_step``, which says whether it
        was skipped) unless the script did it; a step skipped on every
        rank (``on_nonfinite="skip"``) then reaches the optimizer with no gradients, which it skips (momentum and
        Adam's moments stay as they were)."""
        def before(opt, args, kwargs) -> None:
            if self.phase is Phase.OPEN:
                skipped = close()
            elif self.phase is Phase.CLOSED:
                skipped = self.last.get("skipped", False)
            else:  # nothing travelled (a checkpoint loader's step that initializes the optimizer's state)
                return
            if skipped:
                opt.zero_grad(set_to_none=True)
            if self.watch is not None:
                self.watch.clear() if skipped else undo_rescaling(self, opt)

        def after(opt, args, kwargs) -> None:
            if self.phase is Phase.CLOSED:
                self.phase = Phase.IDLE

        self._hooks = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
        self.attached = True

    def opened(self) -> None:
        """Something of a new step travelled (the runtime's callbacks say so)."""
        self.phase = Phase.OPEN

    # ------------------------------------------------------------ per step
    def others_settled(self) -> bool:
        """Whether what the runtime measures on its own steps is over (LAGS planned)."""
        return self.lags is None or self.lags.ratios is not None

    @property
    def settled(self) -> bool:
        """Whether every step from now on travels as the rest of the run will (nothing left to measure)."""
        return self.routing.settled and self.others_settled()

    def close_step(self, fields_of: Callable[[StepTally], dict[str, Any]]) -> bool:
        """Close the step on this rank: the road rolls a skipped step back; ``last`` and ``totals`` take the step's
        fields (``fields_of(tally)``); the route owner takes its transitions (said in one line on rank 0); rank 0's
        metrics line is written. Returns whether the step was skipped."""
        skipped, tally = self.road.close_step()
        self.phase = Phase.CLOSED
        fields = fields_of(tally)
        fields["skipped"] = skipped
        self.last = fields
        self.totals.add(fields, skipped)
        if self.lags is not None:
            self.lags.after_step()
        if self.leads:
            changed = self.routing.after_step(self.compressor, step=self.road.step, skipped=skipped,
                                              others_settled=self.others_settled())
            if changed is not None and changed != ASIDE and self.global_rank == 0:
                say(f"gradsift: wire plan {self.routing.reason} from step {self.road.step + 1} on")
        if skipped and self.global_rank == 0 and self.runtime in ("ddp", "fsdp", "hsdp"):  # (local SGD says its own)
            n = self.totals["steps"] + self.totals["skipped_steps"]
            warn(f"gradsift: step {n} skipped on every rank: a gradient was not finite (error-feedback memory "
                 "rolled back; the optimizer's step does nothing)")
        if self.writer is not None and not skipped:
            self.writer.write({"step": self.road.step, **{k: v for k, v in fields.items() if k != "skipped"}})
        return skipped

    def write_metrics(self, path, group=None) -> None:
        """Append one JSON line per step to ``path`` (rank 0; the command line's telemetry fields). Its folder is
        made if missing; a path rank 0 cannot write is one :class:`ConfigError` line on every rank of ``group``
        (default: the road's), not an error on rank 0 and a broken connection on the others."""
        from .records import MetricsWriter, OutputError

        said: list[Any] = [None]
        if self.global_rank == 0:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self.writer = MetricsWriter(path)
            except (OSError, OutputError) as e:
                said[0] = f"metrics_path {str(path)!r} cannot be written: {getattr(e, 'strerror', None) or e}"
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(said, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                       group=group)
        if said[0]:
            raise ConfigError(said[0])

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank holds: its compressor state and memory, the owners' residuals, the route, the step
        and the totals; never a process group. Save it per rank."""
        return {"runtime": self.runtime, "compressor_state": self.road.compressor.state_dict(), "step": self.road.step,
                "granularity": self.granularity, "on_nonfinite": self.settings.on_nonfinite,
                "rank": self.global_rank, "world_size": self.global_world, "group_rank": self.rank,
                "routing": self.routing.state_dict(), "totals": self.totals.state_dict(),
                "owners": self.road.owners.state_dict()}

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """This rank's state back. Another rank's state, another world size, runtime or granularity, or a memory
        saved for another model is refused in one line -- unless ``reset_memory`` keeps the configuration and
        starts the memory afresh (another rank's state only). The route holds as it was saved."""
        for what, mine in (("runtime", self.runtime), ("granularity", self.granularity),
                           ("world_size", self.global_world)):
            if sd.get(what, mine) != mine:
                raise ValueError(f"state saved with {what} {sd.get(what)!r}, this run has {mine!r}")
        saved = sd.get("rank", self.global_rank)
        other = saved != self.global_rank
        if other and not reset_memory:
            raise ValueError(f"this state belongs to rank {saved}, this is rank {self.global_rank}: load each rank's "
                             "own state (save per rank), or pass reset_memory=True to keep the configuration and "
                             "start the memory afresh")
        check_shapes(sd["compressor_state"], self.tensors)
        comp_sd = _foreign(sd["compressor_state"]) if other else sd["compressor_state"]
        self.road.compressor.load_state_dict(move_state(comp_sd, self.device), reset_memory=reset_memory)
        self.road.step = int(sd.get("step", 0))
        self.road.owners.load_state_dict(None if other else sd.get("owners"), self.device)
        if self.leads:
            self.routing.load_state_dict(sd.get("routing"))
        self.totals.load_state_dict(sd.get("totals"))
        if self.lags is not None:
            self.lags.reapply()

    def load_elastic(self, sds: Sequence[dict[str, Any]]) -> None:
        """Every rank's saved state, from a run of another world size (an elastic job that lost or gained a node):
        every rank's memory becomes what the saved ranks still had to send, per rank of the mean -- their residuals
        (momentum correction: velocities) and their owner residuals, summed and divided by the saved world size --
        so nothing is lost (:mod:`gradsift.runtime.elastic` states the rule); the owners start empty, and the compressor's
        own state (its random streams included) and the wire plan's route afresh."""
        check_shapes(sds[0]["compressor_state"], self.tensors)
        mem = self.road.compressor
        numel = {k: numel_of(s) for k, s, _ in self.tensors}
        if hasattr(mem, "take_stores"):  # (a method without memory holds nothing to fold)
            wide = [{**sd, "compressor_state": mem.wide_stores(sd["compressor_state"])} for sd in sds]
            mem.take_stores(fold_memory(wide, mem.STORES, mem.UNSENT, numel, mem.inner.seed, self.device))
        self.road.owners.load_state_dict({})
        self.road.step = int(sds[0].get("step", 0))
        self.totals.load_state_dict(sds[0].get("totals"))


def _foreign(sd: dict[str, Any]) -> dict[str, Any]:
    """A compressor state marked as no rank's, so that ``reset_memory`` keeps its configuration and drops its state
    (two HSDP shards of one replica share a compressor rank: the global rank decides)."""
    sd = dict(sd)
    if isinstance(sd.get("compressor"), dict):
        sd["compressor"] = _foreign(sd["compressor"])
    if "rank" in sd:
        sd["rank"] = -1
    return sd
