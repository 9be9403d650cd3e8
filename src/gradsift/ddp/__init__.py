"""gradsift inside ``torch.nn.parallel.DistributedDataParallel``: a communication hook.

One call registers any registered compressor on a DDP model::

    model = DDP(model, bucket_cap_mb=...)
    state = gradsift.ddp.register(model, "topk", ratio=0.01)
    ...
    loss.backward()             # the hook compresses, communicates, and writes the mean gradient
    if state.end_step():        # True when the step must be skipped (on_nonfinite="skip")
        continue
    optimizer.step()

The hook (:mod:`gradsift.ddp.state`) is a thin adapter over the road
(:mod:`gradsift.runtime.road`) that the simulator runs too. What the adapter adds:

* **keys** -- per-layer state is keyed by parameter name (``"layer"``
  granularity), so DDP's bucket rebuild after the first iterations cannot mix it
  up; whole-model compression (``"model"``) flattens the one bucket in
  parameter order under the key ``"model"`` and refuses a model that is not
  bucketed that way, saying how to set ``bucket_cap_mb``;
* **collectives** are all issued in the hook body and none blocks; the future's
  callback only decodes, observes and writes back (collectives started inside
  callbacks hang on gloo with several buckets);
* **configuration check** at registration: every rank must run the same
  compressor configuration; on a mismatch every rank raises
  :class:`ConfigMismatch` naming the difference (never a hang: it is one
  all-gather, under the process group's timeout);
* **non-finite gradients** follow the road's one rule (a flag inside the data):
  every rank raises :class:`gradsift.compressors.base.NonFiniteGradient`
  (``"error"``) or the step is skipped on every rank with the compressor state
  restored (``"skip"``; its ``p.grad`` reads NaN, as after DDP's own all-reduce, so an AMP GradScaler skips
  the step and lowers its scale as it would without gradsift);
* **the route** -- how each step travels (measuring, compressed, every tensor
  whole, or DDP's own all-reduce once the hook would only repeat it) is the
  route owner's (:mod:`gradsift.route.routing`); rank 0 says in one line what the
  wire plan sends other than the method named, and every change of route;
* **checkpoints** -- ``state_dict()`` / ``load_state_dict()`` hold this rank's
  compressor state, its route and totals, and no process group;
* ``no_sync()`` accumulation works unchanged (DDP skips the hook), and so do
  fp16/bf16 gradients and GPU tensors (nothing assumes CPU). DDP's own
  ``mixed_precision=`` registers a hook of its own and cannot be combined.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from ..messages import say
from ..runtime.consensus import ConfigMismatch, control_device
from ..errors import ConfigError
from ..runtime.gradwatch import WrittenGrads
from ..runtime.settings import Settings
from .lags import DdpLags
from .state import GradsiftState
from .usage import Usage


def gradsift_hook(state: GradsiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (a plain function: DDP inspects its name and signature)."""
    return state.on_bucket(bucket)


# DDP checks the annotations themselves (not their string form under postponed evaluation)
gradsift_hook.__annotations__ = {"state": GradsiftState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


def bucket_mb_for(named: Sequence[tuple[str, torch.nn.Parameter]]) -> float:
    """The ``bucket_cap_mb`` that puts every gradient in one DDP bucket (whole-model compression, PowerSGD on
    gloo): their size in MiB, 5% and 0.01 MiB over."""
    total = sum(p.numel() * p.element_size() for _, p in named)
    return total / 2**20 * 1.05 + 0.01


def _check_bucketing(model, named, granularity: str) -> None:
    if granularity != "model":
        return
    dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in named})
    if len(dtypes) > 1:  # DDP buckets each dtype apart: no bucket size makes one bucket of them
        raise ConfigError(f"whole-model compression needs one DDP bucket holding every gradient, but the parameters "
                          f"have {len(dtypes)} dtypes ({', '.join(dtypes)}) and DDP buckets each dtype apart: cast "
                          "the model to one dtype, or use granularity='layer'")
    total = sum(p.numel() * p.element_size() for _, p in named)
    cap = getattr(model, "bucket_bytes_cap", None)
    caps = list(getattr(model, "bucket_bytes_cap_list", []) or [])
    limit = min([cap] + caps) if caps else cap
    if getattr(model, "bucket_bytes_cap_default", False):
        limit = min(limit, dist._DEFAULT_FIRST_BUCKET_BYTES) if limit else dist._DEFAULT_FIRST_BUCKET_BYTES
    if limit is not None and total > limit:
        raise ConfigError(f"whole-model compression needs one DDP bucket holding every gradient ({total / 2**20:.2f} MiB), "
                          f"but buckets hold at most {limit / 2**20:.2f} MiB: build DDP with "
                          f"bucket_cap_mb={bucket_mb_for(named):.2f} (or larger)")


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: str, ratio: float | None = None, *,
             optimizer: torch.optim.Optimizer | None = None, lags: bool = False, metrics_path=None,
             **settings: Any) -> GradsiftState:
    """Register ``compressor`` (a spec string) as ``model``'s communication hook; return its state.

    Must be called on every rank, before the first backward pass. ``settings`` are
    :class:`~gradsift.runtime.settings.Settings` (``granularity``, ``seed``, ``weights``, ``on_nonfinite``,
    ``bandwidth_gbps``, ``latency_us``, ``wire_plan``, ``measure``, ``min_numel``, ``merge_small``,
    ``sum_order``, ``sparse_collective``, ``scatter_keep``, ``process_group``; :func:`gradsift.fsdp.register`
    takes the same); any other keyword is the compressor's option (as in :func:`gradsift.make_compressor`).
    ``optimizer``: with momentum correction (``dgc``, or ``memory=momentum``) the optimizer's momentum is taken
    over and set to 0 so it is applied once (:meth:`gradsift.runtime.rankstate.RankState.take_optimizer`; without it, a one-time
    warning). ``lags=True`` plans LAGS-SGD's per-layer ratios after a few profiled steps (``ratio`` is then
    ``1/c_u``) and prints the plan on rank 0. ``metrics_path``: rank 0 appends one JSON line of telemetry per
    step. Once every tensor goes whole with nothing held back, the hook stands aside and DDP's own all-reduce
    takes the steps (:mod:`gradsift.ddp.aside`).

    What ``p.grad`` holds after ``backward()``, by the recipe the optimizer chose: with error feedback (SGD, momentum
    SGD, ``memory=ef``) the mean of what the ranks sent, and with momentum correction (``dgc:memory=momentum``) the
    mean of their momentum-corrected updates -- a script may clip or rescale either as it would DDP's mean. Under
    the Adam recipe (AdamW; ``memory=adam``) the mean of the ranks' Adam directions, which the optimizer applies as
    it is: a factor on every gradient (``clip_grad_norm_``, a loss scaler's ``unscale_``) is undone at the
    optimizer's step, a ``clip_grad_norm_``'s max_norm then clips each rank's gradient before its Adam, and any other
    change stops every rank with one :class:`~gradsift.errors.ConfigError` line
    (:mod:`gradsift.runtime.gradwatch`).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            raise ConfigError(f"gradsift.ddp.register needs a DistributedDataParallel model on several processes, got "
                              f"{type(model).__name__} and a world size of 1: launch several processes (torchrun "
                              "--nproc-per-node N; on GPUs also accelerate launch --multi_gpu --num_processes N) and "
                              "wrap the model, model = DistributedDataParallel(model)")
        raise ConfigError(f"gradsift.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                          f"{type(model).__name__}: wrap it first, model = DistributedDataParallel(model)")
    if getattr(model, "_gradsift_state", None) is not None:
        raise ConfigError("gradsift.ddp.register: this DDP model already has gradsift's hook (DDP takes one "
                          "communication hook); register once, or wrap the model anew")
    s = Settings.of(compressor, ratio, settings, "ddp", optimizer=optimizer)
    if s.said and dist.is_initialized() and dist.get_rank() == 0:
        say(s.said)
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    _check_bucketing(model, named, s.granularity)
    state = GradsiftState(s, named, model=model)
    state.ensure_ready()  # builds the road and checks the configuration on every rank, now
    state.take_optimizer(optimizer)
    if optimizer is not None and state.compressor.applies_adam:  # the optimizer applies p.grad as the hook wrote it
        state.watch = WrittenGrads(dict(named))
    if model.find_unused_parameters or model.static_graph:  # parameters DDP may leave unused keep their memory
        state.usage = Usage(named, model)
    if lags:
        state.lags = DdpLags(state, model.module)
    if metrics_path is not None:
        state.write_metrics(metrics_path)
    if state.rank == 0:
        for line in state.routing.notices(state.compressor, s.compressor, "wire_plan=False (--wire-plan off)"):
            say(line)
    model.register_comm_hook(state, gradsift_hook)
    model._gradsift_state = state
    return state


def hook_state(module: torch.nn.Module, compressor: str, ratio: float | None = None, **settings: Any) -> GradsiftState:
    """A hook state for frameworks that wrap the model in DDP themselves (settings as :func:`register`'s).

    Pass it with :func:`gradsift_hook`: ``model.register_comm_hook(state, gradsift_hook)``. ``module`` is the
    model before wrapping. The process group, the compressor and the cross-rank configuration check are set up at
    the first hook call (a blocking all-gather then). Whole-model compression needs the wrapper built with
    ``bucket_cap_mb`` large enough for one bucket; the hook checks. Without the wrapper the hook cannot stand
    aside: whole steps keep going through it (summed in DDP's bucket, in place).
    """
    s = Settings.of(compressor, ratio, settings, "ddp")
    return GradsiftState(s, [(n, p) for n, p in module.named_parameters() if p.requires_grad])


def finish(code: int = 0) -> NoReturn:
    """End this rank's process with exit status ``code``, every time: the last line of a training script.

    With gloo, a rank that lets Python shut down right after a collective can die of SIGABRT instead of exiting
    with its code: a gloo worker thread drops its last reference to the finished collective's tensors a moment
    later, and if the interpreter is finalizing by then, taking the GIL unwinds that thread through C++
    ("terminate called without an active exception"; docs/ddp-reference.md, "Ending the process", gives the measured rate).
    So once a process group is up, stdout and stderr are flushed and the process ends with ``os._exit(code)``,
    skipping the interpreter's shutdown; the group is not destroyed first (destroying it while a DDP model lives
    deadlocks in gloo's destructor, pytorch/pytorch#56297). Close your own files before calling it. Without a
    process group it is ``sys.exit(code)``."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        os._exit(code)
    sys.exit(code)


__all__ = ["ConfigMismatch", "DdpLags", "GradsiftState", "Settings", "bucket_mb_for", "control_device", "finish",
           "gradsift_hook", "hook_state", "register"]
