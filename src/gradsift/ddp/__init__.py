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
(:mod:`gradsift.road`) that the simulator runs too. What the adapter adds:

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
  restored (``"skip"``);
* **checkpoints** -- ``state_dict()`` / ``load_state_dict()`` hold this rank's
  compressor state and no process group;
* ``no_sync()`` accumulation works unchanged (DDP skips the hook), and so do
  fp16/bf16 gradients and GPU tensors (nothing assumes CPU). DDP's own
  ``mixed_precision=`` registers a hook of its own and cannot be combined.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..compressors.registry import parse_spec
from ..factory import make_compressor
from ..netmodel import NetworkModel
from ..plan import WirePlan
from ..road import Road
from ..runconfig import GRANULARITIES, NONFINITE, ConfigError
from ..transport.dist import DistTransport
from .consensus import ConfigMismatch, control_device
from .lags import DdpLags
from .state import GradsiftState


def gradsift_hook(state: GradsiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (a plain function: DDP inspects its name and signature)."""
    return state.on_bucket(bucket)


# DDP checks the annotations themselves (not their string form under postponed evaluation)
gradsift_hook.__annotations__ = {"state": GradsiftState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


def _check_bucketing(model, named, granularity: str) -> None:
    if granularity != "model":
        return
    total = sum(p.numel() * p.element_size() for _, p in named)
    cap = getattr(model, "bucket_bytes_cap", None)
    caps = list(getattr(model, "bucket_bytes_cap_list", []) or [])
    limit = min([cap] + caps) if caps else cap
    if getattr(model, "bucket_bytes_cap_default", False):
        limit = min(limit, dist._DEFAULT_FIRST_BUCKET_BYTES) if limit else dist._DEFAULT_FIRST_BUCKET_BYTES
    if limit is not None and total > limit:
        need = total / 2**20 * 1.05 + 0.01
        raise ConfigError(f"whole-model compression needs one DDP bucket holding every gradient ({total / 2**20:.2f} MiB), "
                          f"but buckets hold at most {limit / 2**20:.2f} MiB: build DDP with bucket_cap_mb={need:.2f} "
                          "(or larger)")


def _check_common(granularity: str, on_nonfinite: str) -> None:
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if on_nonfinite not in NONFINITE:
        raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {on_nonfinite!r}")


def wire_mode(wire_plan) -> tuple[bool, bool]:
    """(plan enabled, measured) from ``wire_plan``: True/"auto" the alpha-beta plan, "measure" that plan checked
    against timed whole steps (:mod:`gradsift.ddp.probe`), False/"off" none."""
    if wire_plan is True or wire_plan == "auto":
        return True, False
    if wire_plan is False or wire_plan == "off":
        return False, False
    if wire_plan == "measure":
        return True, True
    raise ConfigError(f"wire_plan must be True, False, 'auto', 'measure' or 'off', got {wire_plan!r}")


def _road_builder(compressor: str, ratio, *, granularity, seed, weights, on_nonfinite, net, wire_plan, min_numel,
                  process_group, options):
    def build():
        transport = DistTransport(process_group, weights)
        comp = make_compressor(compressor, ratio, seed=seed, rank=transport.rank, world_size=transport.world_size,
                               weight=(weights[transport.rank] if weights is not None else None), **options)
        plan = WirePlan(net, transport.world_size, enabled=wire_mode(wire_plan)[0], min_numel=min_numel)
        return transport, Road(comp, plan=plan, net=net, on_nonfinite=on_nonfinite, party="rank")
    return build


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: str, ratio: float | None = None, *,
             granularity: str = "layer", seed: int = 0, weights: Sequence[float] | None = None,
             on_nonfinite: str = "error", bandwidth_gbps: float = 1.0, latency_us: float = 50.0,
             wire_plan: bool | str = True, min_numel: int | None = None, lags: bool = False, optimizer=None,
             metrics_path=None, process_group=None, merge_small: bool = True, **options: Any) -> GradsiftState:
    """Register ``compressor`` (a spec string) as ``model``'s communication hook; return its state.

    Must be called on every rank, before the first backward pass. ``weights``
    (one per rank) give a weighted mean; ``on_nonfinite`` is ``"error"`` or
    ``"skip"`` (then skip the optimizer step when ``state.end_step()`` returns
    True). ``bandwidth_gbps``/``latency_us`` describe the link for the wire plan
    (``wire_plan=False``: every tensor compressed as the method says;
    ``"measure"``: the plan is kept only if timed steps beat steps with every
    tensor whole, :mod:`gradsift.ddp.probe`) and the alpha-beta estimates. ``lags=True`` plans LAGS-SGD's per-layer ratios after a
    few profiled steps (``ratio`` is then ``1/c_u``) and prints the plan on rank 0.
    ``optimizer``: with momentum correction (``dgc``, or ``memory=momentum``) the
    optimizer's momentum is taken over and set to 0 so it is applied once (without
    it, a one-time warning). ``metrics_path``: rank 0 appends one JSON line of
    telemetry per step. ``merge_small`` (per-layer buckets; LAGS Sec. 5): a bucket
    whose payloads are smaller than what the link moves in one message latency
    waits, already selected, and goes in the next bucket's message (every tensor
    keeps its own selection: the same means, fewer messages; ``last["messages"]``
    counts them). Other keyword options go to the compressor (as in
    :func:`gradsift.make_compressor`).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"gradsift.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                          f"{type(model).__name__}: wrap it first, model = DistributedDataParallel(model)")
    _check_common(granularity, on_nonfinite)
    measure = wire_mode(wire_plan)[1]
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    _check_bucketing(model, named, granularity)
    group = process_group if process_group is not None else getattr(model, "process_group", None)
    net = NetworkModel(bandwidth_gbps, latency_us)
    build = _road_builder(compressor, ratio, granularity=granularity, seed=seed, weights=weights,
                          on_nonfinite=on_nonfinite, net=net, wire_plan=wire_plan, min_numel=min_numel,
                          process_group=group, options=options)
    state = GradsiftState(None, None, named, granularity, compressor, ratio, build, measure=measure,
                          merge_small=merge_small)
    if state.compressor.inner.ROUNDS > 1:  # builds the road and checks the configuration on every rank, now
        raise ConfigError(f"{state.compressor.name} needs {state.compressor.inner.ROUNDS} dependent all-reduces per "
                          "step, which a DDP hook can only chain from future callbacks (they hang on gloo with "
                          "several buckets): in DDP use PyTorch's hook, --torch-hook powersgd:rank=R")
    state.explicit_momentum = "momentum" in options or "momentum" in parse_spec(compressor)[1]
    if optimizer is not None:
        state.adopt_optimizer(optimizer)
    elif getattr(state.compressor, "memory_name", None) == "momentum" and state.rank == 0:
        warnings.warn(f"gradsift: {state.compressor.name} applies momentum "
                      f"{state.compressor.memory_options['momentum']:g} itself (momentum correction): pass "
                      "optimizer= to register so it takes the optimizer's momentum over, or use an optimizer "
                      "without momentum, or momentum is applied twice", RuntimeWarning, stacklevel=2)
    if lags:
        state.lags = DdpLags(state, model.module)
    if metrics_path is not None:
        state.write_metrics(metrics_path)
    model.register_comm_hook(state, gradsift_hook)
    return state


def hook_state(module: torch.nn.Module, compressor: str, ratio: float | None = None, *, granularity: str = "layer",
               seed: int = 0, weights: Sequence[float] | None = None, on_nonfinite: str = "error",
               bandwidth_gbps: float = 1.0, latency_us: float = 50.0, wire_plan: bool | str = True,
               min_numel: int | None = None, process_group=None, merge_small: bool = True,
               **options: Any) -> GradsiftState:
    """A hook state for frameworks that wrap the model in DDP themselves (options as :func:`register`'s).

    Pass it with :func:`gradsift_hook`: ``model.register_comm_hook(state, gradsift_hook)``.
    ``module`` is the model before wrapping. The process group, the compressor
    and the cross-rank configuration check are set up at the first hook call
    (a blocking all-gather then). Whole-model compression needs the wrapper
    built with ``bucket_cap_mb`` large enough for one bucket; the hook checks.
    """
    _check_common(granularity, on_nonfinite)
    measure = wire_mode(wire_plan)[1]
    make_compressor(compressor, ratio, **options)  # bad specs fail now, not inside backward
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    net = NetworkModel(bandwidth_gbps, latency_us)
    build = _road_builder(compressor, ratio, granularity=granularity, seed=seed, weights=weights,
                          on_nonfinite=on_nonfinite, net=net, wire_plan=wire_plan, min_numel=min_numel,
                          process_group=process_group, options=options)
    return GradsiftState(None, None, named, granularity, compressor, ratio, build, measure=measure,
                         merge_small=merge_small)


__all__ = ["ConfigMismatch", "DdpLags", "GradsiftState", "control_device", "gradsift_hook", "hook_state", "register"]
