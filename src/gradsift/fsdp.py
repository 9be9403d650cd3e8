"""gradsift inside FSDP2 (``torch.distributed.fsdp.fully_shard``): the gradient reduce-scatter, sparsified.

One call registers any registered compressor on every FSDP module of a model::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradsift.fsdp.register(model, "topk", ratio=0.01, optimizer=optimizer)
    ...
    loss.backward()             # each FSDP module's reduce-scatter goes through gradsift
    if state.end_step():        # True when the step must be skipped (on_nonfinite="skip")
        optimizer.zero_grad(); continue
    optimizer.step()

A rank here is the same object as under DDP and in the simulator (:class:`gradsift.runtime.rank.Rank`: the same settings
and defaults, the optimizer hand-off, the cross-rank check, the step's close, telemetry and checkpoints); this
module adds only FSDP's callbacks. FSDP calls a module's reduce-scatter once per step with one input of ``N``
rows, row j this rank's gradient for rank j's (padded) shard of every parameter of the module, and expects this
rank's shard of the mean back. :class:`SparseReduceScatter` hands that input to the rank's road, keyed by the
module's name: the compressor selects from the whole input with error feedback on this rank (sender side; the
residual is as large as the module's unsharded gradient, ``state.memory`` reports it), with a capacity per
destination shard (``ceil(1.25 k / N) + 2`` slots: what does not fit stays in the residual, counted as
overflow); one all-to-all brings every rank's entries in shard j to rank j, which sums them in rank order
(:mod:`gradsift.transport.shard`). There is no second stage: the owner needs only its shard, so a rank receives
about 1.25 k entries a module and step at any N, where a dense reduce-scatter moves (N-1)/N of the module's
gradient.

What it cannot do, refused in one line: a model without FSDP modules, a module with several parameter groups
(FSDP's setter refuses it), FSDP's symmetric-memory comms, a reduce-scatter asked for anything but the average or
the sum (a gradient divide factor other than the group's size: FSDP's pre-multiplied sum), methods that read the whole
round's mean (REGTOP-k's posterior: an owner holds only its shard) or take several rounds (PowerSGD), and
shared-index methods (gsb, shared random-k) for now (:func:`gradsift.route.routing.check_support`).

HSDP (``replicate_group``): FSDP shards inside each replica and reduce-scatters densely there; gradsift takes each
reduced shard in FSDP's all-reduce hook and makes it the mean over the replicas by the road over the replicate
group (the DDP hook's transport: any method that runs one round, REGTOP-k and GSB included, by all-gather or the
owners' scatter). The slow link between replicas carries only the compressed shards. A non-finite shard shows
only on the replicas holding it, so the step's close agrees on it across every rank (one small all-reduce).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .messages import say
from .compressors.base import NonFiniteGradient
from .runtime.consensus import control_device
from .errors import ConfigError
from .runtime.rank import Phase, Rank
from .runtime.rankstate import RankState
from .runtime.road import Group, round_trip
from .runtime.settings import Settings
from .runtime.sharding import ShardLayout, unit_key
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


class FsdpState(RankState):
    """An FSDP or HSDP rank: a :class:`~gradsift.runtime.rank.Rank` (``core``) and FSDP's two callbacks."""

    def __init__(self, settings: Settings, model: torch.nn.Module, layout: ShardLayout, params, *,
                 replicate_group=None):
        hsdp = replicate_group is not None
        shapes = layout.shard_shapes(params) if hsdp else layout.shapes(params)
        dtype = params[0].dtype
        dense = sum(p.numel() * p.element_size() for p in params) // (layout.world_size if hsdp else 1)
        self.core = Rank(settings, [(k, s, dtype) for k, s in zip(layout.keys, shapes)],
                         runtime="hsdp" if hsdp else "fsdp", dense_bytes=dense, device=params[0].device)
        self.shapes = dict(zip(layout.keys, shapes))
        self.replicate_group = replicate_group  # (HSDP) the ranks holding the same shard in the other replicas
        self.calls = 0

    # ------------------------------------------------------------ FSDP's callbacks
    def _exchange(self, key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """One module's input through the road: its mean (this rank's shard of it under FSDP), or None if
        skipped."""
        shape = self.shapes.get(key)
        if shape is None or flat.numel() != _numel(shape):
            raise ConfigError(f"gradsift.fsdp: FSDP module {key!r} handed {flat.numel()} entries, gradsift expected "
                              f"{_numel(shape) if shape else 'none'}: register after the last fully_shard call")
        self.core.opened()
        _, (means,) = round_trip([self.road], [Group([key], [shape], flat.dtype, lambda: [flat.view(shape)])],
                                 [self.transport])
        self.calls += 1
        return None if means is None else means[0]

    def reduce_scatter(self, key: str, output: torch.Tensor, inp: torch.Tensor, group, op) -> None:
        """(FSDP) this rank's shard of the mean of every rank's ``inp`` (``op`` AVG), or of their sum (``op`` SUM:
        FSDP divides afterwards -- its choice for reduce dtypes other than fp32 and bf16, such as fp64 or fp16, and
        under ``set_force_sum_reduction_for_comms``), into ``output``."""
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ConfigError(f"gradsift.fsdp averages or sums the gradients itself, and FSDP asked for {op}: a "
                              "gradient divide factor other than the group's size; leave set_gradient_divide_factor "
                              "unset (or divide the loss)")
        if dist.get_world_size(group) != self.transport.world_size:
            raise ConfigError("gradsift.fsdp: every FSDP module must reduce-scatter over the same process group")
        mean = self._exchange(key, inp.reshape(-1))
        if mean is None:  # skipped: nothing of this step is applied
            output.zero_()
        elif op == dist.ReduceOp.SUM:
            output.copy_((mean * self.transport.world_size).to(output.dtype))
        else:
            output.copy_(mean.to(output.dtype))

    def all_reduce(self, key: str, shard: torch.Tensor) -> None:
        """(HSDP) FSDP's hook on this rank's shard, reduced inside its replica: made the mean over every replica,
        in place, by the road (compressed with error feedback on this rank; any sparse collective)."""
        mean = self._exchange(key, shard.reshape(-1))
        if mean is None:
            shard.zero_()
        else:
            shard.copy_(mean.view_as(shard).to(shard.dtype))

    # ------------------------------------------------------------ per step
    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Close the step (after ``backward()``, on every rank). Returns True if it must be skipped: every
        module's compressor memory is then restored to what it was before the step, on every rank. (The
        arguments are the DDP state's; FSDP's exchange is not pipelined, so they are not needed.)"""
        if self.calls == 0:
            if self.phase is Phase.CLOSED:  # closed already and nothing sent since: a second call does nothing
                return self.last.get("skipped", False)
            raise RuntimeError("gradsift.fsdp: end_step() before any reduce-scatter ran (call it after backward())")
        if self.replicate_group is not None:  # (HSDP) a non-finite shard shows only where it lies: agree
            flag = torch.tensor([float(self.road.skipped)], device=control_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.road.nonfinite("a rank", [])  # (the road runs with "skip": this marks the step skipped)
        modules, self.calls = self.calls, 0
        skipped = self.core.close_step(lambda tally: {**tally.fields(), "modules": modules})
        if skipped and self.replicate_group is not None and self.settings.on_nonfinite == "error":
            raise NonFiniteGradient(f"non-finite gradient at step {self.road.step + 1}: the step was not applied "
                                    "on any rank (use on_nonfinite='skip' to skip such steps)")
        return skipped


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def register(model: torch.nn.Module, compressor: str = "topk", ratio: float | None = None, *,
             optimizer: torch.optim.Optimizer | None = None, replicate_group=None, metrics_path=None,
             **settings: Any) -> FsdpState:
    """Sparsify the gradient exchange of every FSDP module of ``model`` (FSDP2, ``fully_shard``) with
    ``compressor`` (a spec) at ``ratio``; call it on every rank after the last ``fully_shard``. Returns the state:
    call ``state.end_step()`` after every ``backward()``.

    ``settings`` are :class:`~gradsift.runtime.settings.Settings` under the same names and defaults as
    :func:`gradsift.ddp.register`'s (``seed``, ``on_nonfinite``, ``bandwidth_gbps``, ``latency_us``,
    ``wire_plan``, ``min_numel``, ``sparse_collective``, ``scatter_keep``, ...); any other keyword is the
    compressor's option. ``optimizer``: with momentum correction (``dgc``, ``memory=momentum``) its momentum is
    taken over, so momentum is applied once. ``metrics_path``: rank 0 appends one JSON line of telemetry per step.

    FSDP (a 1-D mesh): each module's reduce-scatter is sparsified (the module docstring). HSDP: shard over the
    ranks of one replica (``fully_shard(m, mesh=mesh["shard"])``) and pass ``replicate_group`` (e.g.
    ``mesh["replicate"].get_group()``): FSDP's own dense reduce-scatter runs inside the replica (the fast link)
    and gradsift makes each reduced shard the mean over the replicas (the slow link) through FSDP's all-reduce
    hook, compressed with error feedback, by all-gather or the owners' scatter. A native 2-D HSDP mesh is refused:
    FSDP would all-reduce across replicas densely itself."""
    if FSDPModule is None:  # pragma: no cover
        raise ConfigError("gradsift.fsdp needs torch.distributed.fsdp.fully_shard (FSDP2, torch 2.6 or later)")
    hsdp = replicate_group is not None
    s = Settings.of(compressor, ratio, settings, "hsdp" if hsdp else "fsdp", optimizer=optimizer)
    if s.said and dist.get_rank() == 0:
        say(s.said)
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ConfigError(f"gradsift.fsdp.register needs a model sharded with fully_shard (FSDP2); "
                          f"{type(model).__name__} has no FSDP module")
    if getattr(model, "_gradsift_state", None) is not None:
        raise ConfigError("gradsift.fsdp.register: this model is registered already (each FSDP module takes one "
                          "reduce-scatter); register once")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    meshes = {getattr(p, "device_mesh", None) for _, p in named}
    if any(m is not None and m.ndim > 1 for m in meshes):
        raise ConfigError("a 2-D (HSDP) mesh all-reduces across replicas densely inside FSDP: shard with "
                          "fully_shard(m, mesh=mesh['shard']) and pass replicate_group=mesh['replicate'].get_group()")
    mesh = next((m for m in meshes if m is not None), None)
    shard_group = mesh.get_group() if mesh is not None else dist.group.WORLD
    layout = ShardLayout(model, [n for n, _ in named], dist.get_world_size(shard_group),
                         roots={name for name, _ in modules})
    state = FsdpState(s, model, layout, [p for _, p in named], replicate_group=replicate_group)
    transport = DistTransport(replicate_group, None, s.sum_order) if hsdp else ShardTransport(shard_group)
    # every rank of a replica must decide alike under HSDP, so the road only flags; end_step agrees
    state.core.build(transport, aside="FSDP has no all-reduce of its own to stand aside for", flag_only=hsdp)
    state.verify(dist.group.WORLD)  # every rank, every replica and shard: the same configuration
    state.take_optimizer(optimizer, dist.group.WORLD)
    if metrics_path is not None:
        state.write_metrics(metrics_path)
    if state.global_rank == 0:  # what the wire plan sends other than the method names it, one line per kind
        for line in state.routing.notices(state.compressor, s.compressor, "wire_plan=False (--wire-plan off)"):
            say(line)
    for name, m in modules:
        key = unit_key(name)
        if key not in state.shapes:
            continue  # an FSDP module that holds no trainable parameter of its own
        try:
            if hsdp:
                m.set_all_reduce_hook(functools.partial(state.all_reduce, key))
            else:
                m.set_custom_reduce_scatter(SparseReduceScatter(state, key))
        except (AssertionError, ValueError, RuntimeError) as e:
            raise ConfigError(f"gradsift.fsdp cannot take FSDP module {key!r}: {str(e).strip()}") from None
    model._gradsift_state = state
    return state
