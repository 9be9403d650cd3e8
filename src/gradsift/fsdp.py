"""gradsift inside FSDP2 (``torch.distributed.fsdp.fully_shard``): the gradient reduce-scatter, sparsified.

One call registers any registered compressor on every FSDP module of a model::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = gradsift.fsdp.register(model, "topk", ratio=0.01)
    ...
    loss.backward()             # each FSDP module's reduce-scatter goes through gradsift
    if state.end_step():        # True when the step must be skipped (on_nonfinite="skip")
        optimizer.zero_grad(); continue
    optimizer.step()

FSDP calls a module's reduce-scatter once per step with one flat input of ``N`` rows, row j this rank's gradient
for rank j's (padded) shard of every parameter of the module, and expects this rank's shard of the mean back.
gradsift (:class:`SparseReduceScatter`) hands that input to the same road the simulator and the DDP hook run
(:mod:`gradsift.road`), keyed by the module's name: the compressor selects from the whole input with error
feedback on this rank (sender side; the residual is as large as the module's unsharded gradient, ``state.memory``
reports it), with a capacity per destination shard (``ceil(1.25 k / N) + 2`` slots: what does not fit stays in
the residual, counted as overflow); one all-to-all brings every rank's entries in shard j to rank j, which sums
them in rank order (:mod:`gradsift.transport.shard`). There is no second stage: the owner needs only its shard,
so a rank receives about 1.25 k entries a module and step at any N, where a dense reduce-scatter moves
(N-1)/N of the module's gradient. The non-finite rule, telemetry (``state.last``, ``state.totals``) and
checkpointed state are the DDP hook's.

What it cannot do, refused in one line: a model without FSDP modules, a module with several parameter groups
(FSDP's setter refuses it), FSDP's symmetric-memory comms, a reduce-scatter asked for anything but the average
(fp16 reduce dtype, ``set_force_sum_reduction_for_comms``, a gradient divide factor), methods that read the whole
round's mean (REGTOP-k's posterior: an owner holds only its shard) or take several rounds (PowerSGD), and
shared-index methods (gsb, shared random-k) for now.

HSDP (:func:`register` with ``replicate_group``): FSDP shards inside each replica and reduce-scatters densely
there; gradsift takes each reduced shard in FSDP's all-reduce hook and makes it the mean over the replicas by the
road over the replicate group (the DDP hook's transport: any method that runs one round, REGTOP-k and GSB included,
by all-gather or the owners' scatter). The slow link between replicas carries only the compressed shards.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .compressors.base import NonFiniteGradient, move_state
from .ddp.consensus import control_device
from .errors import ConfigError
from .factory import make_compressor
from .netmodel import NetworkModel
from .plan import WirePlan, check_collective, check_sharded
from .road import Group, Road
from .routing import Routing
from .runconfig import NONFINITE
from .sharding import unit_key
from .telemetry import Totals
from .transport.dist import DistTransport
from .transport.shard import ShardTransport

try:  # the interface FSDP2 calls (a private module in torch 2.13; its shape is checked by the tests)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - a torch without FSDP2
    FSDPModule = None
    _ReduceScatter = object


class SparseReduceScatter(_ReduceScatter):
    """One FSDP module's reduce-scatter through gradsift (module docstring)."""

    def __init__(self, state: "FsdpState", key: str):
        self.state = state
        self.key = key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.state.reduce_scatter(self.key, output_tensor, input_tensor, group, op)
        return None


class FsdpState:
    """This rank's gradsift state under FSDP: the road, the transport, telemetry and totals."""

    def __init__(self, model: torch.nn.Module, compressor: str, ratio: float | None, seed: int,
                 on_nonfinite: str, net: NetworkModel, options: dict[str, Any], replicate_group=None,
                 sparse_collective: str = "gather"):
        self.spec, self.ratio, self.seed, self.options = compressor, ratio, seed, dict(options)
        self.on_nonfinite = on_nonfinite
        self.replicate_group = replicate_group  # (HSDP) the ranks holding the same shard in the other replicas
        self.sparse_collective = sparse_collective
        self.net = net
        self.model = model
        self.road: Road | None = None
        self.transport: ShardTransport | DistTransport | None = None
        self.pending_state: dict[str, Any] | None = None  # loaded before the road was built
        self.calls = 0
        self.last: dict[str, Any] = {}
        self.totals = Totals(sum(p.numel() * p.element_size() for p in model.parameters()))

    # ------------------------------------------------------------ the exchange
    def _build(self, transport, plan: WirePlan, on_nonfinite: str) -> Road:
        """This rank's road on ``transport`` (built at the first exchange: FSDP names the group only then)."""
        self.transport = transport
        comp = make_compressor(self.spec, self.ratio, seed=self.seed, rank=transport.rank,
                               world_size=transport.world_size, **self.options)
        self.road = Road(comp, Routing(plan, []), net=self.net, on_nonfinite=on_nonfinite, party="rank")
        self._apply_state()
        return self.road

    def _exchange(self, key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """One group through the road: its mean (this rank's shard of it under FSDP), or None if skipped."""
        trip = self.road.start(Group([key], [flat.shape], flat.dtype, lambda: [flat]), self.transport)
        means = self.road.finish(trip, trip.pending.wait())
        self.calls += 1
        return None if means is None else means[0]

    def reduce_scatter(self, key: str, output: torch.Tensor, inp: torch.Tensor, group, op) -> None:
        """(FSDP) this rank's shard of the mean of every rank's ``inp``, into ``output``."""
        if op != dist.ReduceOp.AVG:
            raise ConfigError(f"gradsift.fsdp sums and divides itself: FSDP asked for {op} (an fp16 reduce dtype, "
                              "set_force_sum_reduction_for_comms or a gradient divide factor); use fp32 or bf16 "
                              "gradients and FSDP's default averaging")
        if self.road is None:
            n = dist.get_world_size(group)
            self._build(ShardTransport(group), WirePlan(self.net, n, enabled=False, sharded=True), self.on_nonfinite)
        elif dist.get_world_size(group) != self.transport.world_size:
            raise ConfigError("gradsift.fsdp: every FSDP module must reduce-scatter over the same process group")
        mean = self._exchange(key, inp.reshape(-1))
        if mean is None:  # skipped: nothing of this step is applied
            output.zero_()
        else:
            output.copy_(mean.to(output.dtype))

    def all_reduce(self, key: str, shard: torch.Tensor) -> None:
        """(HSDP) FSDP's hook on this rank's shard, reduced inside its replica: made the mean over every replica,
        in place, by the road (compressed with error feedback on this rank; any sparse collective)."""
        if self.road is None:  # every rank of a replica must decide alike, so the road only flags; end_step agrees
            n = dist.get_world_size(self.replicate_group)
            self._build(DistTransport(self.replicate_group),
                        WirePlan(self.net, n, enabled=False, sparse_collective=self.sparse_collective), "skip")
        mean = self._exchange(key, shard.reshape(-1))
        if mean is None:
            shard.zero_()
        else:
            shard.copy_(mean.view_as(shard).to(shard.dtype))

    # ------------------------------------------------------------ per step
    lags = None  # (the DDP state's fields a training loop reads)
    error = None

    @property
    def compressor(self):
        return self.road.compressor if self.road is not None else None

    @property
    def routing(self) -> Routing | None:
        return self.road.routing if self.road is not None else None

    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Close the step (after ``backward()``, on every rank). Returns True if it must be skipped: every
        module's compressor memory is then restored to what it was before the step, on every rank. (The
        arguments are the DDP state's; FSDP's exchange is not pipelined, so they are not needed.)"""
        if self.road is None:
            raise RuntimeError("gradsift.fsdp: end_step() before any reduce-scatter ran (call it after backward())")
        if self.replicate_group is not None:  # (HSDP) a non-finite shard shows only where it lies: agree
            flag = torch.tensor([float(self.road.skipped)], device=control_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.road.nonfinite("a rank", [])  # (the road runs with "skip": this marks the step skipped)
        skipped, tally = self.road.close_step()
        if skipped and self.replicate_group is not None and self.on_nonfinite == "error":
            self.calls = 0
            raise NonFiniteGradient(f"non-finite gradient at step {self.road.step + 1}: the step was not applied "
                                    "on any rank (use on_nonfinite='skip' to skip such steps)")
        fields = tally.fields()
        fields.update(modules=self.calls, skipped=skipped)
        self.calls = 0
        self.last = fields
        self.totals.add(fields, skipped)
        return skipped

    @property
    def step(self) -> int:
        return self.road.step if self.road is not None else 0

    @property
    def memory(self) -> int:
        """Bytes of memory (error feedback's residuals, momentum correction's buffers) this rank holds."""
        stores = self.road.compressor.stores() if self.road is not None else {}
        return sum(t.numel() * t.element_size() for store in stores.values() for t in store.values())

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's compressor state, step and totals (save it per rank, beside the sharded model)."""
        if self.road is None:
            return {"step": 0, "totals": self.totals.state_dict()}
        return {"compressor_state": self.road.compressor.state_dict(), "step": self.road.step,
                "rank": self.transport.rank, "world_size": self.transport.world_size,
                "totals": self.totals.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; before the first step it is applied when the road is built."""
        self.pending_state = sd
        if self.road is not None:
            self._apply_state()

    def _apply_state(self) -> None:
        sd, self.pending_state = self.pending_state, None
        if sd is None:
            return
        if sd.get("world_size", self.transport.world_size) != self.transport.world_size:
            raise ValueError(f"state saved by a run of {sd.get('world_size')} ranks, this run has "
                             f"{self.transport.world_size}")
        if "compressor_state" in sd:  # (read onto the CPU; the memory lives where the gradients do)
            here = next(self.model.parameters()).device
            self.road.compressor.load_state_dict(move_state(sd["compressor_state"], here))
        self.road.step = int(sd.get("step", 0))
        self.totals.load_state_dict(sd.get("totals"))


def register(model: torch.nn.Module, compressor: str = "topk", ratio: float | None = None, *, seed: int = 0,
             on_nonfinite: str = "error", bandwidth_gbps: float = 10.0, latency_us: float = 10.0,
             replicate_group=None, sparse_collective: str = "gather", **options: Any) -> FsdpState:
    """Sparsify the gradient exchange of every FSDP module of ``model`` (FSDP2, ``fully_shard``) with
    ``compressor`` (a spec) at ``ratio``; the compressor's options as keywords. Returns the state: call
    ``state.end_step()`` after every ``backward()``.

    FSDP (a 1-D mesh): each module's reduce-scatter is sparsified (the module docstring). HSDP: shard over the
    ranks of one replica (``fully_shard(m, mesh=mesh["shard"])``) and pass ``replicate_group`` (e.g.
    ``mesh["replicate"].get_group()``): FSDP's own dense reduce-scatter runs inside the replica (the fast link)
    and gradsift makes each reduced shard the mean over the replicas (the slow link) through FSDP's all-reduce
    hook, compressed with error feedback, by all-gather or, ``sparse_collective="scatter"``, the owners' scatter.
    A native 2-D HSDP mesh is refused: FSDP would all-reduce across replicas densely itself."""
    if FSDPModule is None:  # pragma: no cover
        raise ConfigError("gradsift.fsdp needs torch.distributed.fsdp.fully_shard (FSDP2, torch 2.6 or later)")
    if on_nonfinite not in NONFINITE:
        raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {on_nonfinite!r}")
    if sparse_collective not in ("gather", "scatter"):
        raise ConfigError(f"sparse_collective must be gather or scatter, got {sparse_collective!r}")
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ConfigError(f"gradsift.fsdp.register needs a model sharded with fully_shard (FSDP2); "
                          f"{type(model).__name__} has no FSDP module")
    meshes = {getattr(p, "device_mesh", None) for p in model.parameters()}
    if any(m is not None and m.ndim > 1 for m in meshes):
        raise ConfigError("a 2-D (HSDP) mesh all-reduces across replicas densely inside FSDP: shard with "
                          "fully_shard(m, mesh=mesh['shard']) and pass replicate_group=mesh['replicate'].get_group()")
    c = make_compressor(compressor, ratio, **options)  # bad specs fail here, not inside backward
    if replicate_group is None:
        check_sharded(c)
    else:
        if c.ROUNDS > 1:
            raise ConfigError(f"{c.inner.name} runs several rounds, which FSDP's all-reduce hook cannot take")
        check_collective(c, sparse_collective)
    state = FsdpState(model, compressor, ratio, seed, on_nonfinite, NetworkModel(bandwidth_gbps, latency_us),
                      options, replicate_group, sparse_collective)
    if replicate_group is not None:  # across replicas a rank sends its shard: that is what dense would send
        shards = dist.get_world_size() // dist.get_world_size(replicate_group)
        state.totals.dense_bytes_per_step = state.totals.dense_bytes_per_step // shards
    for name, m in modules:
        key = unit_key(name)
        try:
            if replicate_group is None:
                m.set_custom_reduce_scatter(SparseReduceScatter(state, key))
            else:
                m.set_all_reduce_hook(functools.partial(state.all_reduce, key))
        except (AssertionError, ValueError, RuntimeError) as e:
            raise ConfigError(f"gradsift.fsdp cannot take FSDP module {key!r}: {str(e).strip()}") from None
    return state
