"""What a runtime's per-rank object shows the user of its rank: the object ``gradsift.ddp.register``,
``gradsift.fsdp.register`` and ``gradsift.local.register`` return.

Each of those runtimes *holds* a :class:`~gradsift.runtime.rank.Rank` (``core``: the settings, compressor, route
owner, road, telemetry and checkpointed state, and the functions that build, hand an optimizer over, close a step,
save and load) and adds its own callbacks; none of them changes what the rank does. :class:`RankState` is the part
they share: the rank's figures read through (``last``, ``totals``, ``compressor``, ``memory``, ...), and the calls a
user makes -- each building the rank first where the runtime builds it late (:meth:`ensure_ready`: a DDP hook state
whose process group comes at the first hook call). A runtime says how a step ends (:meth:`end_step`) and may add
what its ranks must agree on and what its checkpoints hold.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .elastic import AllRanks
from .rank import Rank


def _through(name: str, doc: str, *, ready: bool = False, settable: bool = False) -> property:
    """The rank's attribute ``name``, read (and, if ``settable``, written) through the holder's ``core``; ``ready``:
    built first."""
    def get(self):
        if ready:
            self.ensure_ready()
        return getattr(self.core, name)

    def put(self, value) -> None:
        setattr(self.core, name, value)

    return property(get, put if settable else None, doc=doc)


class RankState:
    """One rank of a runtime (module docstring): it holds ``core``, a :class:`~gradsift.runtime.rank.Rank`."""

    core: Rank
    error: BaseException | None = None  # a failure a runtime's callback could not raise, raised at the step's close

    settings = _through("settings", "This rank's settings (:class:`~gradsift.runtime.settings.Settings`).")
    runtime = _through("runtime", "``ddp``, ``fsdp``, ``hsdp``, ``local`` or ``sim``.")
    tensors = _through("tensors", "The compression inputs: (key, shape, dtype) each.")
    device = _through("device", "Where the rank's memory lives.")
    road = _through("road", "The rank's road (:class:`~gradsift.runtime.road.Road`).", ready=True)
    transport = _through("transport", "The transport its road communicates on (None before it is built).")
    last = _through("last", "The last step's telemetry fields.", settable=True)
    totals = _through("totals", "The run's totals so far (:class:`~gradsift.runtime.telemetry.Totals`).")
    phase = _through("phase", "Where the step is (:class:`~gradsift.runtime.rank.Phase`).")
    compressor = _through("compressor", "The compressor, inside its memory.", ready=True)
    routing = _through("routing", "The route owner (:class:`~gradsift.route.routing.Routing`).", ready=True)
    rank = _through("rank", "This rank's index in the group its road communicates on.")
    world_size = _through("world_size", "The size of the group its road communicates on.")
    global_rank = _through("global_rank", "This rank in the whole job.")
    global_world = _through("global_world", "The whole job's size.")
    net = _through("net", "The link model (:class:`~gradsift.route.netmodel.NetworkModel`).", ready=True)
    granularity = _through("granularity", "``layer`` or ``model``.")
    step = _through("step", "Steps applied so far (skipped ones not counted).")
    settled = _through("settled", "Whether every step from now on travels as the rest of the run will.", ready=True)
    built = _through("built", "Whether the road is built.")
    attached = _through("attached", "Whether the optimizer's step closes gradsift's.")
    lags = _through("lags", "A LAGS-SGD controller, where the runtime plans per-layer ratios.", settable=True)
    watch = _through("watch", "What the optimizer must find in ``p.grad`` (the Adam recipe).", settable=True)

    def ensure_ready(self) -> None:
        """Build the rank if it is not built yet (a runtime whose process group comes later builds it here)."""

    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Close the step; whether it was skipped on every rank (each runtime says how its step ends)."""
        raise NotImplementedError

    # ------------------------------------------------------------ figures
    @property
    def memory(self) -> int:
        """Bytes of memory (error feedback's residuals, momentum correction's buffers, the owners' residuals) this
        rank holds."""
        return self.core.memory

    @property
    def memory_per_parameter(self) -> float:
        """:attr:`memory` over the parameters this rank compresses (under FSDP each module's unsharded size):
        4.0 for an fp32 residual on every tensor, about 1.0 with ``residual_dtype="fp8"``."""
        return self.core.memory_per_parameter

    @property
    def residual_rounding(self) -> float | None:
        """What a narrow residual store (``residual_dtype``) rounded off, relative to what it held, over the run
        (sqrt of the summed squares); None when the memory is stored exactly."""
        return self.core.residual_rounding

    def memory_summary(self) -> dict[str, Any]:
        """The memory figures of a run's summary.json: bytes, bytes per parameter, what a narrow store rounded off."""
        return self.core.memory_summary()

    # ------------------------------------------------------------ across ranks
    def describe(self) -> dict[str, Any]:
        """What must agree between ranks (:meth:`gradsift.runtime.rank.Rank.describe`)."""
        self.ensure_ready()
        return self.core.describe()

    def verify(self, group=None) -> None:
        """Every rank of ``group`` (default: the road's) runs the same configuration (one blocking all-gather)."""
        self.ensure_ready()
        self.core.verify(group)

    def take_optimizer(self, optimizer: torch.optim.Optimizer | None, group=None) -> None:
        """The optimizer hand-off: the step closes from the optimizer's; the method's recipe for the optimizer
        (:func:`gradsift.memory.recipes.momentum_recipe`, unless ``recipe=False``); with momentum correction
        (``dgc``, ``memory=momentum``) the optimizer's momentum becomes the method's and the optimizer's is set to
        0, checked again across ``group`` and said once; with ``memory=adam`` the optimizer applies the averaged
        Adam direction. Without an optimizer such a memory warns: applied twice
        (:meth:`gradsift.runtime.rank.Rank.take_optimizer`)."""
        self.ensure_ready()
        self.core.take_optimizer(optimizer, group, close=self.end_step)

    def write_metrics(self, path, group=None) -> None:
        """Append one JSON line per step to ``path`` (rank 0); a path rank 0 cannot write is one
        :class:`~gradsift.errors.ConfigError` line on every rank of ``group`` (default: the road's)."""
        self.ensure_ready()
        self.core.write_metrics(path, group)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank holds: its compressor state and memory, the owners' residuals, the route, the step
        and the totals; never a process group. Save it per rank."""
        self.ensure_ready()
        return self.core.state_dict()

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """This rank's state back. Another rank's state, another world size, runtime or granularity, or a memory
        saved for another model is refused in one line -- unless ``reset_memory`` keeps the configuration and
        starts the memory afresh (another rank's state only). The route holds as it was saved."""
        self.ensure_ready()
        self.core.load_state_dict(sd, reset_memory=reset_memory)

    def load_elastic(self, sds: Sequence[dict[str, Any]]) -> None:
        """Every rank's saved state, from a run of another world size (an elastic job that lost or gained a node):
        every rank's memory becomes what the saved ranks still had to send, per rank of the mean, so nothing is lost
        (:meth:`gradsift.runtime.rank.Rank.load_elastic`); the owners start empty, and the compressor's own state
        and the wire plan's route afresh."""
        self.ensure_ready()
        self.core.load_elastic(sds)

    def all_ranks(self) -> AllRanks:
        """This rank's state as a framework that writes one checkpoint file from rank 0 needs it
        (:class:`~gradsift.runtime.elastic.AllRanks`: Lightning's ``.ckpt``, Accelerate's
        ``register_for_checkpointing``)."""
        return AllRanks(self)
