"""What a PyTorch user has without gradsift, measured the same way: DDP's own all-reduce and PyTorch's hooks.

A benchmark tool, outside the library core: ``gradsift train --runtime ddp --torch-hook SPEC``
(:func:`gradsift.experiments.ddp_runs.train`) and the cluster bench. ``torch_baseline(model, spec)``
sets one of them up on a DDP model and returns a state with the interface the training loop uses of
:class:`~gradsift.ddp.state.GradsiftState` (``end_step()``, ``last``, ``totals``), so they are timed and
counted alike:

``ddp``        no hook: DDP's built-in all-reduce (fp32). Communication time is
               not observable from outside, so ``comm_s`` is not reported.
``fp16``       ``fp16_compress_hook``: cast to fp16, all-reduce, cast back.
``bf16``       ``bf16_compress_hook``: the same in bfloat16.
``powersgd``   ``powerSGD_hook`` (Vogels et al. 2019) with ``rank`` (2), vanilla
               all-reduce for the first ``start`` steps and warm start on, as its
               documentation recommends. On gloo it runs with one bucket: the hook
               launches its second all-reduce from a future callback, which aborts
               on gloo once there are several buckets ("Received data size doesn't
               match expected size"); the run says so.

``localsgd``   post-local SGD (Lin et al. 2020; ``post_localSGD_hook`` with ``PostLocalSGDState``): gradients
               all-reduced for the first ``start`` steps (0), then every rank steps alone and
               ``PeriodicModelAverager`` averages the models every ``period`` steps (8) after the
               optimizer's step; the optimizer's state stays per rank.

``fsdp``       (``--runtime fsdp`` or ``hsdp``) FSDP2's own exchange: its dense reduce-scatter, timed through
               a custom reduce-scatter that calls exactly what FSDP's default calls; for HSDP a native
               2-D mesh, whose dense all-reduce across replicas is FSDP's own (not observable).

Bytes are counted as the hooks move them: fp32 or 16-bit values of every entry;
for PowerSGD, per tensor its P and Q factors (``(n + m) r`` values) where its
``min_compression_rate`` test compresses it and every entry where it does not.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

from ..compressors.powersgd import beside_others
from ..compressors.registry import parse_spec
from ..errors import ConfigError
from ..payload import allreduce_wire_bytes
from ..runtime.telemetry import Totals, union_length

BASELINES = ("ddp", "fp16", "bf16", "powersgd", "localsgd", "fsdp")
MIN_COMPRESSION_RATE = 2  # PowerSGD's default
POWERSGD_NOTE = ("PowerSGD on gloo runs with one DDP bucket: its second all-reduce is launched from a future callback, "
                 "which aborts on gloo with several buckets")


def parse_baseline(spec: str, steps: int | None = None) -> tuple[str, dict[str, int]]:
    """``"powersgd:rank=2,start=30"`` -> ("powersgd", {"rank": 2, "start": 30}); one-line errors."""
    name, opts = parse_spec(spec)
    if name not in BASELINES:
        raise ConfigError(f"--torch-hook must be one of {', '.join(BASELINES)} (powersgd:rank=R,start=S), got {spec!r}")
    allowed = {"rank", "start"} if name == "powersgd" else {"period", "start"} if name == "localsgd" else set()
    bad = set(opts) - allowed
    if bad:
        raise ConfigError(f"--torch-hook {name}: unknown option {sorted(bad)[0]!r}" +
                          (f"; allowed: {', '.join(sorted(allowed))}" if allowed else " (it takes none)"))
    for k, v in opts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if (name, k) == ("localsgd", "start") else 1):
            raise ConfigError(f"--torch-hook {name}: {k} must be an integer >= 1, got {v!r}")
    if name == "localsgd":
        opts.setdefault("period", 8)
        opts.setdefault("start", 0)
    if name == "powersgd":  # (rank: PyTorch's matrix_approximation_rank, gradsift's approx_rank)
        own = beside_others(steps)
        opts.setdefault("rank", own["approx_rank"])
        opts.setdefault("start", own["start"])
        opts["start"] = max(2, opts["start"])  # PowerSGD needs >= 2 with error feedback / warm start
    return name, opts


class TorchHookState:
    """A PyTorch baseline on a DDP model, with gradsift's per-step telemetry."""

    def __init__(self, model, name: str, opts: dict[str, int]):
        self.name, self.opts = name, opts
        self.named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.world_size = dist.get_world_size(model.process_group)
        self.rank = dist.get_rank(model.process_group)
        self.numel = sum(p.numel() for _, p in self.named)
        self.lags = None
        self.error = None
        self.step = 0
        self.last: dict[str, Any] = {}
        self.totals = Totals(sum(p.numel() * p.element_size() for _, p in self.named), self.world_size)
        self._intervals: list[list[float]] = []
        self._values = 0  # values this step's buckets sent
        self._bytes = 0
        self.inner = None
        if name == "powersgd":
            self.inner = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=opts["rank"],
                                            start_powerSGD_iter=opts["start"], warm_start=True,
                                            use_error_feedback=True, min_compression_rate=MIN_COMPRESSION_RATE)
        self.averager = None
        if name == "localsgd":
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            self.inner = plsgd.PostLocalSGDState(process_group=None, subgroup=None,
                                                 start_localSGD_iter=max(1, opts["start"]),
                                                 post_local_gradient_allreduce=False)
            self.averager = PeriodicModelAverager(period=opts["period"], warmup_steps=opts["start"])
            self.params = [p for _, p in self.named]
        if name != "ddp":
            model.register_comm_hook(self, timed_torch_hook)

    def attach(self, optimizer) -> None:
        """(localsgd) average the models after the optimizer's step, timed into this step's ``comm_s``."""
        if self.averager is None:
            return

        def after(opt, args, kwargs) -> None:
            t0 = time.perf_counter()
            self.averager.average_parameters(self.params)
            if self.last:
                self.last["comm_s"] = (self.last.get("comm_s") or 0.0) + time.perf_counter() - t0

        optimizer.register_step_post_hook(after)

    def hook(self, bucket):
        t0 = time.perf_counter()
        interval = [t0, t0]
        self._intervals.append(interval)
        values, item = self.bucket_values(bucket)
        self._values += values
        self._bytes += values * item
        if self.name == "fp16":
            fut = default_hooks.fp16_compress_hook(None, bucket)
        elif self.name == "bf16":
            fut = default_hooks.bf16_compress_hook(None, bucket)
        elif self.name == "localsgd":
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd

            fut = plsgd.post_localSGD_hook(self.inner, bucket)
        else:
            fut = psgd.powerSGD_hook(self.inner, bucket)

        def done(f):
            interval[1] = time.perf_counter()
            return f.value()

        return fut.then(done)

    def bucket_values(self, bucket) -> tuple[int, int]:
        """(values this rank contributes for the bucket, bytes per value), as the hook moves them."""
        if self.name in ("fp16", "bf16"):
            return bucket.buffer().numel(), 2
        if self.name == "localsgd":  # gradients all-reduced before the local steps begin, then none
            return (bucket.buffer().numel(), 4) if self.inner.iter < self.inner.start_localSGD_iter else (0, 4)
        if self.inner.iter < self.inner.start_powerSGD_iter:
            return bucket.buffer().numel(), 4
        values = 0
        for t in bucket.gradients():
            n, m = t.shape[0], t.numel() // max(t.shape[0], 1)
            r = min(n, m, self.opts["rank"])
            values += (n + m) * r if (n + m) * r * MIN_COMPRESSION_RATE < n * m else t.numel()
        return values, 4

    def end_step(self, backward_start: float | None = None, loss=None) -> bool:
        if self.name == "ddp":
            self._values, self._bytes = self.numel, 4 * self.numel
        if self.averager is not None:  # this step's optimizer step ends with the models averaged
            t, warm, period = self.averager.step, self.averager.warmup_steps, self.averager.period
            if t >= warm and (t - warm) % period == 0:
                self._values, self._bytes = self._values + self.numel, self._bytes + 4 * self.numel
        fields = {"density": self._values / max(self.numel, 1), "k_ratio": 1.0, "bytes_per_worker": float(self._bytes),
                  "wire_bytes_per_worker": allreduce_wire_bytes(self._bytes, self.world_size),
                  "select_s": 0.0, "est_comm_s": 0.0, "overflow": 0, "skipped": False,
                  "buckets": len(self._intervals)}
        if self.name != "ddp":
            fields["comm_s"] = union_length([tuple(iv) for iv in self._intervals])
            fields["tail_wait_s"] = 0.0
        self.last = fields
        self.step += 1
        self.totals.add(fields, False)
        self._intervals, self._values, self._bytes = [], 0, 0
        return False

    def state_dict(self) -> dict[str, Any]:
        """Checkpoints of baseline runs carry no compressor state (PowerSGD's error and factors are not saved)."""
        return {"baseline": self.name, "options": dict(self.opts), "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("baseline") != self.name:
            raise ValueError(f"checkpoint was taken with baseline {sd.get('baseline')!r}, this run uses {self.name!r}")
        self.step = int(sd.get("step", 0))

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.opts.items())
        return f"torch:{self.name}" + (f":{opts}" if opts else "")


class FsdpOwnState:
    """FSDP2's own gradient exchange (``--torch-hook fsdp``), timed and counted as gradsift's is."""

    def __init__(self, model, replicas: int = 1):
        from torch.distributed.fsdp import FSDPModule

        self.lags, self.error, self.step = None, None, 0
        self.last: dict[str, Any] = {}
        self.replicas = replicas
        self.numel = sum(p.numel() for p in model.parameters())
        self.totals = Totals(self.numel * 4)
        self._intervals: list[list[float]] = []
        self._bytes = 0
        self._world = dist.get_world_size() // replicas  # the reduce-scatter's ranks
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(_TimedReduceScatter(self))

    def record(self, started: float, nbytes: int) -> None:
        """One reduce-scatter, from ``started`` to now, of ``nbytes`` input bytes."""
        self._intervals.append([started, time.perf_counter()])
        self._bytes += nbytes

    def end_step(self, backward_start: float | None = None, loss=None) -> bool:
        sent = float(self._bytes)
        wire = (self._world - 1) / self._world * sent  # a ring reduce-scatter
        if self.replicas > 1:  # and the shard's all-reduce across replicas
            wire += allreduce_wire_bytes(sent / self._world, self.replicas)
        fields = {"density": 1.0, "k_ratio": 1.0, "bytes_per_worker": sent, "wire_bytes_per_worker": wire,
                  "select_s": 0.0, "est_comm_s": 0.0, "overflow": 0, "skipped": False,
                  "buckets": len(self._intervals), "tail_wait_s": 0.0}
        if self.replicas == 1:  # (HSDP's all-reduce across replicas runs inside FSDP: not observable)
            fields["comm_s"] = union_length([tuple(iv) for iv in self._intervals])
        self.last = fields
        self.step += 1
        self.totals.add(fields, False)
        self._intervals, self._bytes = [], 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": "fsdp", "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd.get("step", 0))

    def describe(self) -> str:
        return "torch:fsdp" if self.replicas == 1 else "torch:hsdp"


try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - a torch without FSDP2
    _ReduceScatter = object


class _TimedReduceScatter(_ReduceScatter):
    """FSDP's default reduce-scatter (``reduce_scatter_tensor`` with FSDP's op), timed."""

    def __init__(self, state: FsdpOwnState):
        self.state = state

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        self.state.record(t0, input_tensor.numel() * input_tensor.element_size())
        return None


def timed_torch_hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's hook, timed (a plain function: DDP inspects its name and signature)."""
    return state.hook(bucket)


timed_torch_hook.__annotations__ = {"state": TorchHookState, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}


def torch_baseline(model, spec: str, steps: int | None = None) -> TorchHookState:
    """Set up the PyTorch baseline ``spec`` (``ddp``, ``fp16``, ``bf16``, ``powersgd:rank=R,start=S``) on ``model``."""
    name, opts = parse_baseline(spec, steps)
    return TorchHookState(model, name, opts)


class Baseline:
    """``--torch-hook SPEC`` for the training loop (:func:`gradsift.launch.train_ddp`'s ``baseline``): builds the
    baseline's state on the loop's DDP model, and says how the model must be bucketed."""

    def __init__(self, spec: str, steps: int | None = None):
        self.spec = spec
        self.name = parse_baseline(spec, steps)[0]  # a bad spec fails before any process group work

    def one_bucket(self, cfg) -> bool:
        return self.name == "powersgd" and dist.get_backend() == "gloo"

    def note(self, cfg) -> str | None:
        return POWERSGD_NOTE if self.one_bucket(cfg) else None

    def __call__(self, model, cfg, optimizer=None) -> TorchHookState:
        if self.name == "fsdp":
            return FsdpOwnState(model, cfg.replicas)  # type: ignore[return-value]
        if self.one_bucket(cfg) and dist.get_rank() == 0:
            print(f"gradsift: note: {POWERSGD_NOTE}", file=sys.stderr)
        state = torch_baseline(model, self.spec, cfg.steps)
        if optimizer is not None:
            state.attach(optimizer)
        return state
