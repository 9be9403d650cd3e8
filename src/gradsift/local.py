"""Local SGD with gradsift's compressors on what the workers exchange: every rank steps alone, and every ``period``
optimizer steps the ranks exchange their *pseudo-gradients* (the model at the last sync minus their own) through
the same road, wire and error feedback a gradient takes. One call, after ``init_process_group``::

    model = build_model()                        # the plain module: every rank holds it whole, no DDP wrapper
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sync = gradsift.local.register(model, "topk", ratio=0.01, period=8, optimizer=opt)
    for x, y in loader:                          # the loop stays the user's
        loss_fn(model(x), y).backward()
        opt.step()                               # every 8th step ends with a sync
        opt.zero_grad()

The outer step (what the global model does with the mean pseudo-gradient ``d``; ``w`` the global model):

* ``outer="average"``: ``w <- w - d`` -- the ranks' models averaged, PyTorch's post-local SGD
  (``post_localSGD_hook`` with ``PeriodicModelAverager``; Lin et al. 2020) when ``compressor="dense"``;
* ``outer="nesterov"``: ``m <- mu m + d``, ``w <- w - lr (d + mu m)`` -- DiLoCo's outer Nesterov step (Douillard
  et al. 2023, Algorithm 1; its ``lr`` 0.7 and ``mu`` 0.9 are the defaults here); with ``compressor="dense"`` it is
  DiLoCo;
* ``outer="ef"``: each rank's error-feedback memory decays by ``mu`` before its pseudo-gradient is added, and
  ``w <- w - lr d`` -- SparseLoCo's error buffer standing in for the outer momentum (Sarfi et al. 2025: top-k of
  ``e <- mu e + delta`` sent, ``e`` keeps the rest). Its defaults here, ``lr`` 1 and ``mu`` 0.95, are this library's
  choice.

What a sparsifier does not send of a pseudo-gradient stays in that rank's memory for the next sync (error feedback,
as for gradients). ``warmup_steps``: the first steps average the gradients every step (one all-reduce a step, as
post-local SGD's first phase) before the local steps begin.

Non-finite values: a rank whose gradient holds NaN or Inf skips its own optimizer step (its gradients set to None,
so the optimizer leaves parameters and state alone) and says so; a pseudo-gradient that is not finite on any rank
skips that sync on every rank (``on_nonfinite="skip"``, the default here): memories are rolled back, the global
model stays, and every rank restarts from it -- the period's local steps are dropped.

A model sharded with FSDP2 inside each replica (``fully_shard(..., mesh=mesh["shard"])``) takes
``replicate_group=mesh["replicate"].get_group()``: FSDP averages each step's gradient inside a replica, and every
``period`` steps each rank syncs its shard's change with the ranks holding the same shard in the other replicas
(torchft's DiLoCo over replicas); a replica's ranks skip a non-finite step together.

The simulator's ``local:period=H,...`` runs (:mod:`gradsift.runtime.localsgd`) use :class:`LocalState` per worker,
so both runtimes do the same arithmetic: the same parameters, bit for bit, as 2 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError
from .runtime.localstate import OUTERS, LocalState, check_period
from .runtime.settings import Settings


class DistLocalState(LocalState):
    """:class:`LocalState` on ``torch.distributed``: the optimizer's hooks run it (:func:`register`)."""

    def ensure_ready(self) -> None:
        if self.built:
            return
        from .transport.dist import DistTransport

        s = self.settings
        self.build(DistTransport(s.process_group, s.weights, s.sum_order))
        self.verify()

    shard_group = None  # an FSDP module's: the ranks of this replica, which hold one model between them
    ddp_averages = False  # a DDP model's: its hook averages the warm-up's gradients (:func:`_between_syncs`)

    def grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """Under FSDP every rank of a replica skips its step together when any of them saw a gradient that is not
        finite (one small all-reduce on the replica's group): a replica whose shards stepped apart would not be
        one model."""
        ok = super().grads_finite(grads)
        if self.shard_group is None:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, group=self.shard_group)
        return bool(flag.item() == 0.0)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

        def before(opt, args, kwargs) -> None:
            if self.warming and not self.ddp_averages:  # every step's gradients averaged (post-local SGD's first phase)
                grads = self.grads()
                if grads:
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    dist.all_reduce(flat, group=self.transport.group)
                    flat.div_(self.world_size)
                    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]),
                                                                               grads)])
            self.before_inner_step()

        def after(opt, args, kwargs) -> None:
            if self.after_inner_step():
                self.finish_sync(self.start_sync())

        self._hooks = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
        self.core.attached = True


def _shards(named, replicate_group, settings: dict[str, Any]):
    """(the tensors to sync by name, their parameters, the shard group): an FSDP2 module's non-empty local shards and
    its mesh's group, checked against ``replicate_group``; a plain module's parameters (holders and group None)."""
    sharded = [p for _, p in named if hasattr(p, "device_mesh") and hasattr(p, "to_local")]
    if not sharded:
        if replicate_group is not None:
            raise ConfigError("gradsift.local.register: replicate_group= is for an FSDP module (the ranks holding this "
                              "rank's shard in the other replicas); a plain module syncs across process_group= "
                              "(default: every rank)")
        return named, None, None
    if len(sharded) != len(named):
        raise ConfigError("gradsift.local.register: some of the module's parameters are sharded (FSDP) and some are "
                          "not: shard the whole model (fully_shard on the root module too)")
    mesh = sharded[0].device_mesh
    if mesh.ndim != 1:
        raise ConfigError(f"gradsift.local.register: this FSDP module is sharded over a {mesh.ndim}-D mesh (HSDP), "
                          "which averages every step's gradients across replicas; shard it inside each replica "
                          "(fully_shard(..., mesh=mesh['shard'])) and pass replicate_group=mesh['replicate'].get_group()")
    if replicate_group is None:
        raise ConfigError("gradsift.local.register: an FSDP module holds one model across its shard group, and local "
                          "SGD runs between replicas of it: pass replicate_group= (the ranks holding this rank's shard "
                          "in the other replicas, e.g. mesh['replicate'].get_group() of a 2-D mesh whose 'shard' "
                          "dimension fully_shard used)")
    if settings.get("process_group") is not None:
        raise ConfigError("gradsift.local.register: an FSDP module syncs across replicate_group=; process_group= is "
                          "for a plain module")
    shard_group = mesh.get_group()
    shared = set(dist.get_process_group_ranks(shard_group)) & set(dist.get_process_group_ranks(replicate_group))
    if shared != {dist.get_rank()}:
        raise ConfigError(f"gradsift.local.register: replicate_group must hold one rank of each replica, this rank's "
                          f"shard-mates excluded; it shares {len(shared)} ranks with the module's shard group")
    from .runtime.localstate import local_tensor

    shards = [(n, local_tensor(p), p) for n, p in named]
    kept = [(n, t, p) for n, t, p in shards if t.numel() > 0]  # (an empty shard: nothing to sync)
    return [(n, t) for n, t, _ in kept], [p for *_, p in kept], shard_group


def register(model: torch.nn.Module, compressor: str = "dense", ratio: float | None = None, *, period: int = 8,
             optimizer: torch.optim.Optimizer | None = None, outer: str = "average", outer_lr: float | None = None,
             outer_momentum: float | None = None, warmup_steps: int = 0, metrics_path=None,
             replicate_group=None, **settings: Any) -> DistLocalState:
    """Local SGD on ``model``: every rank steps alone, and every ``period`` optimizer steps the ranks exchange their
    change of the model since the last sync (the *pseudo-gradient*) compressed by ``compressor`` (a spec string, as
    :func:`gradsift.ddp.register` takes), with error feedback; returns the rank's state (``state_dict()`` /
    ``load_state_dict()`` for checkpoints, ``last`` the last sync's telemetry).

    ``outer``: what the global model does with the mean change ``d``: ``"average"`` moves by it (the ranks' models
    averaged: PyTorch's post-local SGD with ``"dense"``); ``"nesterov"`` takes DiLoCo's outer Nesterov step
    (``outer_lr`` 0.7, ``outer_momentum`` 0.9 by default; DiLoCo with ``"dense"``); ``"ef"`` decays each rank's
    error-feedback memory by ``outer_momentum`` (0.95) before adding its change and moves by ``outer_lr`` (1) times
    ``d`` (SparseLoCo's error buffer as the outer momentum; a sparsifier with ``memory=ef``). ``warmup_steps``:
    the first steps average every step's gradients (one all-reduce a step) before the local steps begin.

    Call on every rank after ``init_process_group``, with the plain module (every rank holds it whole) or a DDP
    model (``DistributedDataParallel``: its all-reduce is replaced by a communication hook that leaves each rank's
    gradient as it is between syncs and averages it during the warm-up, as PyTorch's ``post_localSGD_hook``), and
    the optimizer that steps it; rank 0's parameters are broadcast first, as DDP does. The loop stays forward, backward,
    ``optimizer.step()``: the optimizer's hooks count the steps and sync. A rank whose gradient holds NaN or Inf
    skips its own step (said on that rank); a change that is not finite on any rank skips that sync on every rank
    (memories rolled back, every rank back at the global model). ``settings`` are
    :class:`~gradsift.runtime.settings.Settings` (``granularity``, ``seed``, ``on_nonfinite`` -- ``"skip"`` by
    default here --, ``wire_plan``, ``process_group``, ...); any other keyword is the compressor's option.
    ``metrics_path``: rank 0 appends one JSON line of telemetry per sync. ``replicate_group``: for an FSDP2 module
    sharded over a 1-D mesh inside each replica, the ranks holding this rank's shard in the other replicas (syncs
    run between them; the module's parameters' local shards are what a rank syncs and saves). Save the state per
    rank: it holds this rank's parameters and optimizer state too (they differ between syncs), so a resumed run goes
    on bit-identical to one that never stopped."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("gradsift.local.register needs a process group: call torch.distributed.init_process_group "
                          "first (torchrun --nproc-per-node N starts the processes)")
    ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    if ddp is not None:
        if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_gradsift_local", None) is not None:
            raise ConfigError("gradsift.local.register: this DDP model already has a communication hook; local SGD "
                              "replaces DDP's all-reduce with its own (none between syncs): register one of them")
        if settings.get("process_group") is None and ddp.process_group is not dist.group.WORLD:
            settings = {**settings, "process_group": ddp.process_group}
        model = ddp.module
    if getattr(model, "_gradsift_local", None) is not None:
        raise ConfigError("gradsift.local.register: this module already has gradsift's local SGD; register once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"gradsift.local.register needs optimizer= (the torch.optim.Optimizer that steps the "
                          f"model: a sync follows its step), got {type(optimizer).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in named if id(p) not in stepped]
    if missing:
        raise ConfigError(f"the optimizer does not step {len(missing)} of the model's parameters ({missing[0]}, ...): "
                          "local SGD needs the optimizer built on model.parameters()")
    check_period(period, warmup_steps)
    named, holders, shard_group = _shards(named, replicate_group, settings)
    settings = {"on_nonfinite": "skip", **settings}
    if shard_group is not None:
        settings["process_group"] = replicate_group
    s = Settings.of(compressor, ratio, settings, "local")
    state = DistLocalState(s, named, period=period, outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum,
                           warmup_steps=warmup_steps, holders=holders)
    state.shard_group = shard_group
    state.ensure_ready()
    with torch.no_grad():  # every rank starts from rank 0's model, as DDP does
        for p in state.params:
            dist.broadcast(p.data, src=dist.get_global_rank(state.transport.group, 0) if s.process_group is not None
                           else 0, group=state.transport.group)
        torch._foreach_copy_(state.globals, [p.detach() for p in state.params])
    if metrics_path is not None:
        state.write_metrics(metrics_path)
    state.attach(optimizer)
    if ddp is not None:
        state.ddp_averages = True
        ddp.register_comm_hook(state, _between_syncs)
        ddp._gradsift_local = state
    model._gradsift_local = state
    return state


def is_local_spec(spec: Any) -> bool:
    """Whether ``spec`` names local SGD (``local:period=H,...``, the command line's form) rather than a compressor."""
    return isinstance(spec, str) and (spec == "local" or spec.startswith("local:"))


def _spec_sync(spec: str, ratio: float | None, settings: dict[str, Any]):
    """(the spec's options, the sync's compressor ratio, the settings with the spec's value dtype) of a ``local:...``
    spec: its ``ratio`` and ``value_dtype`` win over the arguments'."""
    from .runtime.localsgd import local_options

    o = local_options(spec)
    if o["value_dtype"] is not None:
        settings = {**settings, "value_dtype": o["value_dtype"]}
    return o, (o["ratio"] if o["ratio"] is not None else ratio), settings


def check_spec(spec: str, ratio: float | None = None, settings: dict[str, Any] | None = None) -> None:
    """A ``local:...`` spec and the settings that go with it, checked where an integration is given them (one-line
    :class:`~gradsift.errors.ConfigError`), before any process group exists."""
    o, ratio, settings = _spec_sync(spec, ratio, dict(settings or {}))
    Settings.of(o["compressor"], ratio, settings, "local")


def from_spec(model: torch.nn.Module, spec: str, ratio: float | None = None, *,
              optimizer: torch.optim.Optimizer | None = None, **settings: Any) -> DistLocalState:
    """:func:`register` from a ``local:period=H[,start=S][,outer=...][,outer_lr=..][,outer_momentum=..]
    [,compressor=C][,ratio=R][,value_dtype=V]`` spec, the form ``gradsift train`` and the integrations take
    (``start`` is ``warmup_steps``; the spec's ``ratio`` and ``value_dtype`` win over the arguments')."""
    o, ratio, settings = _spec_sync(spec, ratio, settings)
    return register(model, o["compressor"], ratio, period=o["period"], optimizer=optimizer, outer=o["outer"],
                    outer_lr=o["outer_lr"], outer_momentum=o["outer_momentum"], warmup_steps=o["start"], **settings)


def _between_syncs(state: DistLocalState, bucket):  # (-> Future[Tensor]: DDP refuses a string annotation)
    """A DDP model's communication hook under local SGD: each rank's own gradient (no exchange) between syncs; the
    ranks' mean during the warm-up (sum, then divided, as the plain module's warm-up does)."""
    buf = bucket.buffer()
    if state.warming:
        work = dist.all_reduce(buf, group=state.transport.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].div_(state.world_size))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


__all__ = ["LocalState", "DistLocalState", "register", "from_spec", "OUTERS"]
