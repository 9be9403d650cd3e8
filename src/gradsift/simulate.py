"""N virtual workers in one process: synchronous data-parallel SGD on one model.

Each step, every worker computes its gradient on its own batch, compresses it
with its own compressor (its own memory and state), the in-process transport
aggregates the payloads, every worker observes the mean, and one optimizer
steps once on the mean gradient. The workers run one after another; the
reported compute and selection times are the slowest worker's, since real
workers run in parallel. Deterministic for a seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .compressors import make_compressor
from .compressors.base import NonFiniteGradient, is_finite
from .netmodel import NetworkModel, serial_step_s
from .payload import SPARSE, Payload
from .runconfig import RunConfig, make_optimizer, momentum_handoff
from .tasks import make_task
from .transport.local import LocalTransport


# ------------------------------------------------------------ shared helpers
def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def tensor_keys(named: Sequence[tuple[str, nn.Parameter]], granularity: str) -> list[str]:
    """Compression keys: one per parameter ("layer") or the single key ``"model"``."""
    return ["model"] if granularity == "model" else [n for n, _ in named]


def compression_inputs(grads: Sequence[torch.Tensor], granularity: str) -> list[torch.Tensor]:
    """The tensors a worker compresses: its gradients as they are (compressors flatten them and
    may look at their shape), or all of them flattened into one in parameter order."""
    if granularity == "model":
        return [torch.cat([g.reshape(-1) for g in grads])]
    return list(grads)


def split_means(means: Sequence[torch.Tensor], shapes: Sequence[torch.Size], granularity: str) -> list[torch.Tensor]:
    if granularity == "model":
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        return [m.view(s) for m, s in zip(means[0].split(sizes), shapes)]
    return [m.view(s) for m, s in zip(means, shapes)]


@dataclass
class StepStats:
    """Telemetry of one aggregation, summed over tensors and averaged over workers."""

    density: float = 0.0
    k_ratio: float = 0.0
    bytes_per_worker: float = 0.0
    wire_bytes_per_worker: float = 0.0
    est_comm_s: float = 0.0
    comm_per_tensor: list[float] = field(default_factory=list)
    delta: dict[str, float] | None = None


def payload_stats(per_worker: Sequence[Sequence[Payload]]) -> tuple[float, float, float]:
    """(density, k_ratio, bytes) averaged over workers; k_ratio is achieved/target count."""
    n = len(per_worker)
    dens = kr = byt = 0.0
    for ps in per_worker:
        numel = sum(p.numel for p in ps)
        count = sum(p.count for p in ps)
        target = sum(p.target for p in ps)
        dens += count / max(numel, 1)
        kr += count / max(target, 1)
        byt += sum(p.nbytes for p in ps)
    return dens / n, kr / n, byt / n


class Simulator:
    """Synchronous data-parallel training of ``cfg.workers`` virtual workers."""

    def __init__(self, cfg: RunConfig, *, task=None, compressor_options: dict[str, Any] | None = None):
        cfg.validate()
        self.task = task or make_task(cfg.task, cfg.workers, seed=cfg.seed, batch_size=cfg.batch_size,
                                      data=cfg.data, **cfg.task_options)
        self.cfg = cfg.resolved(type(self.task))
        self.n = self.cfg.workers
        self.model = self.task.build_model()
        self.named = trainable(self.model)
        self.params = [p for _, p in self.named]
        self.shapes = [p.shape for p in self.params]
        self.keys = tensor_keys(self.named, self.cfg.granularity)
        extra, opt_name = momentum_handoff(self.cfg)
        self.optimizer = make_optimizer(self.cfg, self.params, opt_name)
        extra.update(compressor_options or {})
        if self.cfg.value_dtype is not None:
            extra.setdefault("value_dtype", self.cfg.value_dtype)
        self.compressors = [
            make_compressor(self.cfg.compressor, self.cfg.ratio, seed=self.cfg.seed, rank=w, world_size=self.n,
                            weight=self.cfg.weights[w] if self.cfg.weights else None, **extra)
            for w in range(self.n)
        ]
        self.transport = LocalTransport(self.n, self.cfg.weights)
        self.net = NetworkModel(self.cfg.bandwidth_gbps, self.cfg.latency_us)
        self.iteration = 0  # data position: batches consumed per worker
        self.updates = 0  # optimizer steps taken
        self.skipped = 0
        self.total_numel = sum(p.numel() for p in self.params)
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        self.dumped: list[torch.Tensor] = []
        from .layerwise import ReadyClock

        self.clock = ReadyClock(self.named)
        self.timing: list[tuple[float, float, dict[str, float]]] = []
        self.lags = None
        if self.cfg.lags:
            from .layerwise import SimLags

            self.lags = SimLags(self)

    # ------------------------------------------------------------- one step
    def worker_gradients(self, worker: int, step: int) -> tuple[list[torch.Tensor], float, float]:
        """(gradients, batch loss, seconds) of one worker at the current parameters.

        Also records the forward time, the backward time and when each gradient
        became ready (for the pipelined time model and LAGS), in ``self.timing``.
        """
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        batch = self.task.batch(worker, step)
        loss = self.task.loss(self.model, batch)
        t1 = time.perf_counter()
        self.clock.start()
        loss.backward()
        ready, backward = self.clock.stop()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        dt = time.perf_counter() - t0
        self.timing.append((t1 - t0, backward, ready))
        if worker == self.n - 1:
            self.inject_fault([grads], step)
        return grads, float(loss.detach()), dt

    def inject_fault(self, grads_per_worker: list[list[torch.Tensor]], step: int) -> None:
        """``--fault-nan-step S``: the last worker's gradient holds a NaN at step S (tests the guard)."""
        if self.cfg.fault_nan_step is not None and step + 1 == self.cfg.fault_nan_step:
            grads_per_worker[-1][0].view(-1)[0] = float("nan")

    def step(self) -> dict[str, Any] | None:
        """One synchronous step; returns its metrics record, or None if it was skipped."""
        s = self.iteration
        self.iteration += 1
        grads, losses, compute = [], [], []
        self.timing = []
        t0 = time.perf_counter()
        fast = self.task.all_gradients(self.model, s)
        if fast is not None:
            grads, losses = fast
            compute = [(time.perf_counter() - t0) / self.n] * self.n
            self.inject_fault(grads, s)
        else:
            for w in range(self.n):
                g, l, dt = self.worker_gradients(w, s)
                grads.append(g)
                losses.append(l)
                compute.append(dt)

        bad = [w for w in range(self.n) if not all(is_finite(g) for g in grads[w])]
        if bad:
            if self.cfg.on_nonfinite == "skip":
                self.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                return None
            raise NonFiniteGradient(
                f"non-finite gradient on worker {bad[0]} at step {self.updates + 1}; "
                "nothing was stored (use --on-nonfinite skip to skip such steps)"
            )

        self.last_grads = grads  # for instrumentation (reproductions)
        if self.cfg.dump_grads:
            self.dumped.append(torch.cat([g.reshape(-1) for g in grads[0]]).to(torch.float32))
        flats = [compression_inputs(g, self.cfg.granularity) for g in grads]
        payloads: list[list[Payload]] = []
        select = []
        per_tensor_select = [0.0] * len(self.keys)
        for w, comp in enumerate(self.compressors):
            ps = []
            total = 0.0
            for i, (k, f) in enumerate(zip(self.keys, flats[w])):
                t0 = time.perf_counter()
                ps.append(comp.compress(k, f, check_finite=False))
                dt = time.perf_counter() - t0
                total += dt
                per_tensor_select[i] = max(per_tensor_select[i], dt)
            payloads.append(ps)
            select.append(total)

        stats = self.aggregate_and_apply(payloads, flats if self.cfg.delta_telemetry else None)
        self.updates += 1
        record = self.record(stats, losses, max(compute), max(select))
        record.update(self.time_model(stats, per_tensor_select, max(select)))
        if self.lags is not None:
            self.lags.observe_step(s, per_tensor_select)
        for obs in self.observers:
            obs(record)
        return record

    def aggregate_and_apply(self, payloads: list[list[Payload]], inputs=None) -> StepStats:
        """Aggregate each tensor, let every worker observe, set the mean gradient, step."""
        means = []
        stats = StepStats()
        stats.comm_per_tensor = []
        for i, key in enumerate(self.keys):
            column = [[payloads[w][i]] for w in range(self.n)]
            agg = self.transport.aggregate(column)
            means.append(agg.means[0])
            has_sparse = payloads[0][i].kind == SPARSE
            stats.wire_bytes_per_worker += agg.traffic.wire_bytes
            t = self.net.group_s(agg.traffic, has_sparse)
            stats.est_comm_s += t
            stats.comm_per_tensor.append(t)
        if inputs is not None:
            stats.delta = self.delta_per_tensor(payloads)
        for w, comp in enumerate(self.compressors):
            if comp.OBSERVES:
                for i, key in enumerate(self.keys):
                    comp.observe(key, payloads[w][i], means[i])
        self.last_payloads, self.last_means = payloads, means  # for instrumentation (reproductions)
        stats.density, stats.k_ratio, stats.bytes_per_worker = payload_stats(payloads)
        for p, m in zip(self.params, split_means(means, self.shapes, self.cfg.granularity)):
            p.grad = m.to(p.dtype)
        if self.cfg.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm)
        self.optimizer.step()
        return stats

    def delta_per_tensor(self, payloads: list[list[Payload]]) -> dict[str, float]:
        """LAGS eq. (21) per tensor: ||sum of residuals||^2 / ((1 - k/d) ||sum of accumulated||^2)."""
        from .layerwise import delta_l

        out = {}
        for i, key in enumerate(self.keys):
            residuals = [getattr(c, "residual", {}).get(key) for c in self.compressors]
            if any(r is None for r in residuals):
                continue
            sent = sum(payloads[w][i].to_dense(residuals[w].dtype) for w in range(self.n))
            res = sum(residuals)
            p0 = payloads[0][i]
            out[key] = delta_l(sent, res, p0.target, p0.numel)
        return out

    def time_model(self, stats: StepStats, per_tensor_select: list[float], select_s: float) -> dict[str, Any]:
        """Serial (SLGS) and pipelined (layer-wise, as DDP overlaps buckets) step-time estimates, S_max.

        Uses the slowest worker's forward and backward times and its gradient
        ready times; each tensor communicates, in backward order on one link,
        once it is ready and selected (``gradsift.layerwise.pipelined_step_s``).
        """
        from .layerwise import pipelined_step_s, s_max

        if not self.timing:  # closed-form gradient tasks: no autograd timing
            return {}
        fwd, bwd, ready = max(self.timing, key=lambda t: t[0] + t[1])
        serial = fwd + bwd + select_s + stats.est_comm_s
        out: dict[str, Any] = {"forward_s": fwd, "backward_s": bwd, "est_step_serial_s": serial,
                               "s_max": s_max(fwd, bwd, stats.est_comm_s)}
        if self.cfg.granularity == "layer" and ready:
            order = sorted(range(len(self.keys)), key=lambda i: ready.get(self.keys[i], bwd))
            step, _ = pipelined_step_s(fwd, bwd, [ready.get(self.keys[i], bwd) for i in order],
                                       [per_tensor_select[i] for i in order],
                                       [stats.comm_per_tensor[i] for i in order])
            out["est_step_pipelined_s"] = step
            out["est_step_s"] = step
        else:
            out["est_step_s"] = serial
        if stats.delta is not None:
            out["delta"] = stats.delta
        return out

    def record(self, stats: StepStats, losses: list[float], compute_s: float, select_s: float) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "step": self.updates,
            "loss": self.task.probe_loss(self.model),
            "batch_loss": sum(losses) / len(losses),
        }
        last = self.iteration >= self.cfg.steps
        if self.updates % self.cfg.eval_every == 0 or last:
            rec.update(self.task.evaluate(self.model))
        rec.update(
            density=stats.density,
            k_ratio=stats.k_ratio,
            bytes_per_worker=stats.bytes_per_worker,
            wire_bytes_per_worker=stats.wire_bytes_per_worker,
            select_s=select_s,
            compute_s=compute_s,
            est_comm_s=stats.est_comm_s,
            est_step_s=serial_step_s(compute_s, select_s, stats.est_comm_s),
        )
        extra = getattr(self.compressors[0].inner, "telemetry", None)
        if extra is not None:
            rec.update(extra(self.compressors))
        return rec

    # --------------------------------------------------------------- a run
    def run(self, steps: int | None = None, on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
        steps = steps or self.cfg.steps
        records = []
        try:
            while self.iteration < steps:
                rec = self.step()
                if rec is not None:
                    records.append(rec)
                    if on_record:
                        on_record(rec)
        finally:
            if self.cfg.dump_grads and self.dumped:
                self.save_dumped_gradients(self.cfg.dump_grads)
        return records

    def save_dumped_gradients(self, path: str) -> None:
        """``--dump-grads``: worker 0's raw gradient of every step, flat float32, as a [steps, numel] tensor."""
        torch.save(torch.stack(self.dumped), path)

    def dense_bytes(self) -> int:
        """What one worker would send per step without compression."""
        el = torch.empty((), dtype=self.params[0].dtype).element_size()
        return self.total_numel * el

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "compressors": [c.state_dict() for c in self.compressors],
            "iteration": self.iteration,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        for c, s in zip(self.compressors, sd["compressors"]):
            c.load_state_dict(s)
        self.iteration, self.updates, self.skipped = sd["iteration"], sd["updates"], sd["skipped"]


def run_summary(cfg: RunConfig, records: list[dict[str, Any]], wall_s: float, dense_bytes: int,
                skipped: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``: the config, the last record, and run totals."""
    total_bytes = sum(r["bytes_per_worker"] for r in records)
    total_wire = sum(r["wire_bytes_per_worker"] for r in records)
    out = {
        "config": cfg.as_dict(),
        "final": records[-1] if records else None,
        "totals": {
            "steps": len(records),
            "skipped_steps": skipped,
            "bytes_per_worker": total_bytes,
            "wire_bytes_per_worker": total_wire,
            "dense_bytes_per_worker": dense_bytes * len(records),
            "compression": (dense_bytes * len(records) / total_bytes) if total_bytes else float("inf"),
            "mean_density": sum(r["density"] for r in records) / max(len(records), 1),
            "mean_k_ratio": sum(r["k_ratio"] for r in records) / max(len(records), 1),
            "est_time_s": sum(r["est_step_s"] for r in records),
            "est_comm_s": sum(r["est_comm_s"] for r in records),
            "compute_s": sum(r["compute_s"] for r in records),
            "select_s": sum(r["select_s"] for r in records),
            "wall_s": wall_s,
        },
    }
    if extra:
        out.update(extra)
    return out
