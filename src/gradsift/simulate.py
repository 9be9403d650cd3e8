"""N virtual workers in one process: synchronous data-parallel SGD on one model.

Each step, every worker computes its gradient on its own batch; then, group by
group (one tensor, or the whole model with ``granularity="model"``), every
worker's :class:`~gradsift.road.Road` remembers, selects and starts the group
on its endpoint of the in-process transport, and finishes it once all workers
have started -- the same road the DDP hook runs, with a different transport.
One optimizer steps once on the mean gradient. The workers run one after
another; the reported compute and selection times are the slowest worker's,
since real workers run in parallel. Deterministic for a seed.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from .factory import make_compressor
from .momentum import take_over_momentum
from .layerwise import LagsSchedule, ReadyClock, c_upper, delta_l, measure_selection, pipelined_step_s, s_max
from .netmodel import NetworkModel
from .plan import WirePlan, check_collective, check_sharded
from .road import Group, Layout, Road
from .routing import Routing
from .runconfig import ConfigError, RunConfig, make_optimizer
from .sharding import ShardLayout
from .tasks import make_task
from .telemetry import StepTally, run_summary, step_record
from .transport.local import LocalGroup


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class SimLags:
    """LAGS-SGD in the simulator: profile a few steps, plan per-layer ratios, apply them to every worker."""

    def __init__(self, sim: "Simulator"):
        self.sim = sim
        self.schedule = LagsSchedule(list(sim.layout.keys), {k: p.numel() for k, p in zip(sim.layout.keys, sim.params)},
                                     sim.net, sim.n, c_upper(sim.cfg.ratio))

    def observe_step(self, it: int) -> None:
        sim = self.sim
        if not self.schedule.wants(it) or not sim.timing:
            return
        fwd, bwd, ready = max(sim.timing, key=lambda t: t[0] + t[1])
        if self.schedule.add(fwd, bwd, ready):
            keys = self.schedule.keys
            cfg = sim.cfg
            select = measure_selection(lambda: make_compressor(cfg.compressor, cfg.ratio, feedback=False),
                                       [self.schedule.numels[k] for k in keys])
            ratios = self.schedule.plan(dict(zip(keys, select)))
            for road in sim.roads:
                for k, r in ratios.items():
                    road.compressor.inner.set_layer_ratio(k, r)

    def report(self) -> dict[str, Any]:
        return self.schedule.report()


class Simulator:
    """Synchronous data-parallel training of ``cfg.workers`` virtual workers."""

    def __init__(self, cfg: RunConfig, *, task=None, compressor_options: dict[str, Any] | None = None):
        cfg.validate()
        self.task = task or make_task(cfg.task, cfg.workers, seed=cfg.seed, batch_size=cfg.batch_size,
                                      data=cfg.data, **cfg.task_options)
        self.cfg = cfg.resolved(type(self.task))
        self.n = self.cfg.workers
        self.unused: list[list[str]] = [[] for _ in range(self.n)]  # per worker: parameters left without a gradient
        self.model = self.task.build_model()
        self.named = trainable(self.model)
        self.params = [p for _, p in self.named]
        self.shapes = [p.shape for p in self.params]
        names = [name for name, _ in self.named]
        # FSDP's exchange (RunConfig.fsdp): one group per FSDP unit, in the layout FSDP hands its reduce-scatter
        self.layout = ShardLayout(self.model, names, self.n) if self.cfg.fsdp else Layout(names, self.cfg.granularity)
        self.optimizer = make_optimizer(self.cfg, self.params)
        extra = dict(compressor_options or {})
        if self.cfg.value_dtype is not None:
            extra.setdefault("value_dtype", self.cfg.value_dtype)
        self.net = NetworkModel(self.cfg.bandwidth_gbps, self.cfg.latency_us)
        plan = self.cfg.plan_for("sim")
        if plan == "measure":
            raise ConfigError("--wire-plan measure times real steps, so it is for --runtime ddp; the simulator plans "
                              "with the alpha-beta model (--wire-plan auto)")
        shapes = self.layout.shapes(self.params)
        self.routing = Routing(WirePlan(self.net, self.n, enabled=plan == "auto" and not self.cfg.fsdp,
                                        sparse_collective=self.cfg.sparse_collective,
                                        scatter_keep=self.cfg.scatter_keep, sharded=self.cfg.fsdp),
                               [(k, s, self.params[0].dtype) for k, s in zip(self.layout.keys, shapes)],
                               aside="the simulator has no DDP to stand aside for")
        self.roads = [
            Road(make_compressor(self.cfg.compressor, self.cfg.ratio, seed=self.cfg.seed, rank=w, world_size=self.n,
                                 weight=self.cfg.weights[w] if self.cfg.weights else None, **extra),
                 self.routing, net=self.net, on_nonfinite=self.cfg.on_nonfinite, party="worker")
            for w in range(self.n)
        ]
        take_over_momentum(self.compressors, self.optimizer)  # momentum correction applies the momentum itself
        check_collective(self.compressors[0], self.cfg.sparse_collective, self.cfg.scatter_keep)
        if self.cfg.fsdp:
            check_sharded(self.compressors[0])
        self.group = LocalGroup(self.n, self.cfg.weights, self.cfg.sum_order)
        self.endpoints = [self.group.endpoint(w) for w in range(self.n)]
        self.iteration = 0  # data position: batches consumed per worker
        self.updates = 0  # optimizer steps taken
        self.skipped = 0
        self.total_numel = sum(p.numel() for p in self.params)
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        self.dumped: list[torch.Tensor] = []
        self.clock = ReadyClock(self.named)
        self.timing: list[tuple[float, float, dict[str, float]]] = []
        self.lags = SimLags(self) if self.cfg.lags else None

    @property
    def compressors(self) -> list:
        return [r.compressor for r in self.roads]

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
        self.unused[worker] = [n for (n, _), p in zip(self.named, self.params) if p.grad is None]
        self.timing.append((t1 - t0, backward, ready))
        return grads, float(loss.detach()), time.perf_counter() - t0

    def gradients(self, s: int) -> tuple[list[list[torch.Tensor]], list[float], list[float]]:
        """Every worker's gradients (parameter order), batch losses and compute seconds for step ``s``."""
        self.timing = []
        self.unused = [[] for _ in range(self.n)]
        t0 = time.perf_counter()
        fast = self.task.all_gradients(self.model, s)
        if fast is not None:
            grads, losses = fast
            compute = [(time.perf_counter() - t0) / self.n] * self.n
        else:
            grads, losses, compute = [], [], []
            for w in range(self.n):
                g, loss, dt = self.worker_gradients(w, s)
                grads.append(g)
                losses.append(loss)
                compute.append(dt)
        if self.cfg.fault_nan_step is not None and s + 1 == self.cfg.fault_nan_step:
            grads[-1][0].view(-1)[0] = float("nan")  # --fault-nan-step: the last worker's gradient (tests the guard)
        return grads, losses, compute

    def step(self) -> dict[str, Any] | None:
        """One synchronous step; returns its metrics record, or None if it was skipped."""
        s = self.iteration
        self.iteration += 1
        grads, losses, compute = self.gradients(s)
        self.last_grads = grads  # for instrumentation (reproductions); a group summed in place ends holding the mean
        if self.cfg.dump_grads:
            self.dumped.append(torch.cat([g.reshape(-1) for g in grads[0]]).to(torch.float32))
        inputs = [self.layout.inputs(g) for g in grads]
        # DDP (find_unused_parameters) leaves a parameter no worker used as it was, memory included (gradsift.unused)
        everywhere = set.intersection(*(set(u) for u in self.unused)) if not self.cfg.fsdp else set()
        if everywhere:
            for road in self.roads:
                road.unused.save(self.layout, [n for n, _ in self.named if n in everywhere],
                                 [p.numel() for p in self.params], self.params[0].device)
        means: list[torch.Tensor | None] = []
        trips_per_group = []
        for i, key in enumerate(self.layout.keys):  # a group is one tensor (or the whole model)
            trips = [road.start(Group.of(key, inputs[w][i]), self.endpoints[w]) for w, road in enumerate(self.roads)]
            trips_per_group.append(trips)
            while True:  # more than one round only for methods with dependent collectives (PowerSGD)
                deliveries = [t.pending.wait() for t in trips]
                nexts = [road.advance(t, d) for road, t, d in zip(self.roads, trips, deliveries)]
                if nexts[0] is None:
                    break
                trips = nexts
            outs = [road.finish(t, d) for road, t, d in zip(self.roads, trips, deliveries)]
            means.append(outs[0][0] if outs[0] is not None else None)
        self.last_payloads = [[trips[w].payloads[0] for trips in trips_per_group] for w in range(self.n)]
        self.last_means = means
        for road in self.roads:
            road.unused.restore(everywhere)
        closed = [road.close_step() for road in self.roads]
        self.routing.after_step(self.compressors[0], step=self.updates, skipped=closed[0][0])
        if closed[0][0]:  # skipped on every worker alike
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            return None
        delta = self.delta_per_tensor() if self.cfg.delta_telemetry else None
        for (name, p), m in zip(self.named, self.layout.views(means, self.shapes)):
            p.grad = None if name in everywhere else m.to(p.dtype)
        if self.cfg.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm)
        self.optimizer.step()
        self.updates += 1
        select_per_key = [max(trips[w].select_s[0] for w in range(self.n)) for trips in trips_per_group]
        record = self.record([t for _, t in closed], trips_per_group, losses, max(compute), select_per_key, delta)
        if self.lags is not None:
            self.lags.observe_step(s)
        for obs in self.observers:
            obs(record)
        return record

    def delta_per_tensor(self) -> dict[str, float]:
        """LAGS eq. (21) per tensor: ||sum of residuals||^2 / ((1 - k/d) ||sum of accumulated||^2)."""
        out = {}
        for i, key in enumerate(self.layout.keys):
            residuals = [c.residual.get(key) for c in self.compressors]
            if any(r is None for r in residuals):
                continue
            sent = sum(self.last_payloads[w][i].to_dense(residuals[w].dtype) for w in range(self.n))
            p0 = self.last_payloads[0][i]
            out[key] = delta_l(sent, sum(residuals), p0.target, p0.numel)
        return out

    def sent_per_tensor(self) -> dict[str, int]:
        """Entries worker 0 sent this step, per parameter (a whole-model payload split at the parameters' bounds):
        where a whole-model top-k (SLGS) spends its k, against the k a per-layer plan gives each layer."""
        out: dict[str, int] = {}
        for i, key in enumerate(self.layout.keys):
            p = self.last_payloads[0][i]
            if key != "model":
                out[key] = p.numel if p.indices is None else p.count
                continue
            sizes = [int(torch.Size(s).numel()) for s in self.shapes]
            if p.indices is None:
                out.update(zip(self.layout.names, sizes))
                continue
            bounds = torch.tensor(sizes).cumsum(0)
            counts = torch.bincount(torch.bucketize(p.indices, bounds, right=True), minlength=len(sizes))
            out.update(zip(self.layout.names, counts[:len(sizes)].tolist()))
        return out

    def record(self, tallies: list[StepTally], trips_per_group, losses: list[float], compute_s: float,
               select_per_key: list[float], delta: dict[str, float] | None) -> dict[str, Any]:
        fields = tallies[0].fields()
        fields["select_s"] = max(t.fields()["select_s"] for t in tallies)
        evaluate = self.updates % self.cfg.eval_every == 0 or self.iteration >= self.cfg.steps
        rec = step_record(self.task, self.model, self.updates, sum(losses) / len(losses), evaluate, fields)
        rec["compute_s"] = compute_s
        rec.update(self.time_model(fields, [r.est_comm_s for r in tallies[0].reports], select_per_key, compute_s))
        if delta is not None:
            rec["delta"] = delta
            rec["sent_per_tensor"] = self.sent_per_tensor()
        rec.update(self.compressors[0].inner.telemetry(self.compressors))
        return rec

    def time_model(self, fields: dict[str, Any], comm_per_group: list[float], select_per_key: list[float],
                   compute_s: float) -> dict[str, Any]:
        """Serial (SLGS) and pipelined (layer-wise, as DDP overlaps buckets) step-time estimates, S_max.

        Uses the slowest worker's forward and backward times and its gradient
        ready times; each tensor communicates, in backward order on one link,
        once it is ready and selected (:func:`gradsift.layerwise.pipelined_step_s`).
        """
        serial = compute_s + fields["select_s"] + fields["est_comm_s"]
        if not self.timing:  # closed-form gradient tasks: no autograd timing
            return {"est_step_s": serial}
        fwd, bwd, ready = max(self.timing, key=lambda t: t[0] + t[1])
        keys = self.layout.keys
        out: dict[str, Any] = {"forward_s": fwd, "backward_s": bwd,
                               "est_step_serial_s": fwd + bwd + fields["select_s"] + fields["est_comm_s"],
                               "s_max": s_max(fwd, bwd, fields["est_comm_s"])}
        if self.cfg.granularity == "layer" and ready:
            order = sorted(range(len(keys)), key=lambda i: ready.get(keys[i], bwd))
            step, _ = pipelined_step_s(fwd, bwd, [ready.get(keys[i], bwd) for i in order],
                                       [select_per_key[i] for i in order], [comm_per_group[i] for i in order])
            out["est_step_pipelined_s"] = out["est_step_s"] = step
        else:
            out["est_step_s"] = out["est_step_serial_s"]
        return out

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
                    v = rec.get(self.task.metric)
                    if self.cfg.stop_at is not None and v is not None and (
                            v >= self.cfg.stop_at if self.task.higher_is_better else v <= self.cfg.stop_at):
                        break
        finally:
            if self.cfg.dump_grads and self.dumped:
                self.save_dumped_gradients(self.cfg.dump_grads)
        return records

    def save_dumped_gradients(self, path: str) -> None:
        """``--dump-grads``: worker 0's raw gradient of every step, flat float32, as a [steps, numel] tensor."""
        torch.save(torch.stack(self.dumped), path)

    def notices(self) -> list[str]:
        """What the wire plan sends other than the method named, one line per kind (empty when nothing)."""
        return self.routing.notices(self.compressors[0], self.cfg.compressor, "--wire-plan off")

    def dense_bytes(self) -> int:
        """What one worker would send per step without compression."""
        return self.total_numel * self.params[0].element_size()

    def summary(self, records: list[dict[str, Any]], wall_s: float, extra: dict[str, Any] | None = None) -> dict:
        out = {"runtime": "simulator", "metric": self.task.metric, "higher_is_better": self.task.higher_is_better,
               "parameters": self.total_numel, "routing": self.routing.summary(self.compressors[0]), **(extra or {})}
        if self.lags is not None:
            out["lags"] = self.lags.report()
        return run_summary(self.cfg.as_dict(), records, wall_s, self.dense_bytes(), self.skipped, extra=out)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "compressors": [c.state_dict() for c in self.compressors],
            "owners": [road.owners.state_dict() for road in self.roads],
            "iteration": self.iteration,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        for c, s in zip(self.compressors, sd["compressors"]):
            c.load_state_dict(s)
        for road, owned in zip(self.roads, sd.get("owners", [None] * self.n)):
            road.owners.load_state_dict(owned)
        for road in self.roads:
            road.step = sd["updates"]
        self.iteration, self.updates, self.skipped = sd["iteration"], sd["updates"], sd["skipped"]
