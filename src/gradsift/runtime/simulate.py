"""N virtual workers in one process: synchronous data-parallel SGD on one model.

Each step, every worker computes its gradient on its own batch; then, group by
group (one tensor, or the whole model with ``granularity="model"``), every
worker's :class:`~gradsift.runtime.road.Road` remembers, selects and starts the group
on its endpoint of the in-process transport, and finishes it once all workers
have started -- the same road the DDP hook runs, with a different transport.
One optimizer steps once on the mean gradient. The workers run one after another; the
reported compute and selection times are the slowest worker's (real workers run in parallel). Deterministic.
"""

from __future__ import annotations

import dataclasses

import time
from typing import Any, Callable

import torch
from torch import nn

from ..compressors.base import NonFiniteGradient
from ..memory.factory import make_compressor
from ..route.layerwise import LagsSchedule, ReadyClock, c_upper, delta_l, measure_selection, pipelined_step_s, s_max
from ..memory.momentum import take_over_momentum
from ..memory.adam_step import take_over_adam
from ..route.netmodel import NetworkModel
from .rank import Rank
from .road import Group, Layout, round_trip
from ..memory.recipes import momentum_recipe, recipe_spec
from .runconfig import ConfigError, RunConfig, make_optimizer, reached_stop, set_lr
from .sharding import ShardLayout
from ..tasks import make_task
from .telemetry import StepTally, run_summary, step_record
from ..transport.local import LocalGroup


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
        cfg, n = self.cfg, self.n
        if cfg.lags and cfg.fsdp:
            raise ConfigError("--lags compresses layer by layer: not with FSDP's exchange")
        # FSDP's exchange (RunConfig.fsdp): one group per FSDP unit, in the layout FSDP hands its reduce-scatter;
        # HSDP's (replicas > 1): each replica reduces its shards densely, the replicas' shards go through the roads
        self.replicas = cfg.replicas if cfg.fsdp else 1
        if n % self.replicas:
            raise ConfigError(f"--replicas {self.replicas} does not divide the {n} workers")
        shards = n // self.replicas
        self.layout = ShardLayout(self.model, names, shards) if cfg.fsdp else Layout(names, cfg.granularity)
        self.optimizer = make_optimizer(cfg, self.named, decays=getattr(self.task, "decays", None))
        if cfg.wire_plan == "measure":
            raise ConfigError("--wire-plan measure times real steps, so it is for --runtime ddp; the simulator plans "
                              "with the alpha-beta model (--wire-plan auto)")
        # (FSDP's exchange keeps error feedback under Adam, as gradsift.fsdp.register: Settings.of)
        spec, said = (recipe_spec(cfg.compressor, self.optimizer, adam=not cfg.fsdp) if cfg.recipe
                      else (cfg.compressor, None))
        if spec is not cfg.compressor:  # (a recipe's memory; the run's config says what ran)
            cfg = self.cfg = dataclasses.replace(cfg, compressor=str(spec))
        settings = cfg.settings(cfg.runtime, simulated=True, **(compressor_options or {}))
        nesterov = momentum_recipe(cfg.compressor, self.optimizer) if cfg.recipe else None
        self.recipe = "\n".join(line for line in (said, nesterov) if line) or None  # (said by the CLI)
        self.net = NetworkModel(cfg.bandwidth_gbps, cfg.latency_us)
        hsdp = self.replicas > 1
        shapes = self.layout.shard_shapes(self.params) if hsdp else self.layout.shapes(self.params)
        tensors = [(k, s, self.params[0].dtype) for k, s in zip(self.layout.keys, shapes)]
        dense = sum(p.numel() * p.element_size() for p in self.params) // (shards if hsdp else 1)
        groups = [LocalGroup(self.replicas if hsdp else n, cfg.weights, cfg.sum_order)
                  for _ in range(shards if hsdp else 1)]
        self.ranks: list[Rank] = []
        routing = None  # one route owner among the workers
        for w in range(n):
            replica, shard = divmod(w, shards) if hsdp else (w, 0)
            rank = Rank(settings, tensors, runtime=cfg.runtime, dense_bytes=dense)
            rank.build(groups[shard].endpoint(replica), routing=routing, flag_only=hsdp, global_rank=w,
                       global_world=n, aside="the simulator has no DDP to stand aside for")
            routing = routing or rank.routing
            self.ranks.append(rank)
        self.routing = routing
        self.roads = [r.road for r in self.ranks]
        self.endpoints = [r.transport for r in self.ranks]
        take_over_momentum(self.compressors, self.optimizer)  # momentum correction applies the momentum itself
        # memory=adam: the workers apply Adam and clip their own gradients; the optimizer takes the mean direction
        self.adam = take_over_adam(self.compressors, self.optimizer, tensors=len(self.layout.keys), clip=cfg.clip_norm)
        self.iteration = 0  # data position: batches consumed per worker
        self.updates = 0  # optimizer steps taken
        self.skipped = 0
        self.total_numel = sum(p.numel() for p in self.params)
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        self.dumped: list[torch.Tensor] = []
        self.clock = ReadyClock(self.named)
        self.timing: list[tuple[float, float, dict[str, float]]] = []
        self.lags = SimLags(self) if cfg.lags else None

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
        # DDP (find_unused_parameters) leaves a parameter no worker used as it was, memory included (gradsift.runtime.unused)
        everywhere = set.intersection(*(set(u) for u in self.unused)) if not self.cfg.fsdp else set()
        if everywhere:
            for road in self.roads:
                road.unused.save(self.layout, [n for n, _ in self.named if n in everywhere],
                                 [p.numel() for p in self.params], self.params[0].device)
        means: list[torch.Tensor | None] = []
        trips_per_group = []
        for i, key in enumerate(self.layout.keys):  # a group is one tensor (or the whole model)
            firsts: list = [None] * self.n
            parts = []
            for party in self._parties(i, inputs):  # (HSDP: one exchange per shard, among the replicas)
                trips, out = self._exchange(key, party)
                for (w, _), t in zip(party, trips):
                    firsts[w] = t
                parts.append(out)
            trips_per_group.append(firsts)
            means.append(parts[0] if len(parts) == 1 or any(p is None for p in parts) else
                         torch.cat([p.reshape(-1) for p in parts]))
        self.last_payloads = [[trips[w].payloads[0] for trips in trips_per_group] for w in range(self.n)]
        self.last_means = means
        for road in self.roads:
            road.unused.restore(everywhere)
        if self.replicas > 1 and any(road.skipped for road in self.roads):  # (HSDP) every worker agrees
            for road in self.roads:
                road.nonfinite("a worker", [])
        tallies: list = []  # (each worker's tally, its fields; the rank gets a copy to add to)
        skipped = [rank.close_step(lambda t: dict(tallies.append((t, t.fields())) or tallies[-1][1]))
                   for rank in self.ranks][0]
        if skipped:  # skipped on every worker alike
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            if self.replicas > 1 and self.cfg.on_nonfinite == "error":
                raise NonFiniteGradient(f"non-finite gradient at step {self.updates + 1}: the step was not applied "
                                        "on any worker (to skip such steps: on_nonfinite='skip', or --on-nonfinite skip)")
            return None
        delta = self.delta_per_tensor() if self.cfg.delta_telemetry else None
        for (name, p), m in zip(self.named, self.layout.views(means, self.shapes)):
            p.grad = None if name in everywhere else m.to(p.dtype)
        if self.cfg.clip_norm is not None and not self.adam:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm)
        set_lr(self.cfg, self.optimizer, self.updates)
        self.optimizer.step()
        self.updates += 1
        select_per_key = [max(trips[w].select_s[0] for w in range(self.n)) for trips in trips_per_group]
        record = self.record(tallies, trips_per_group, losses, max(compute), select_per_key, delta)
        if self.lags is not None:
            self.lags.observe_step(s)
        for obs in self.observers:
            obs(record)
        return record

    def _parties(self, i: int, inputs: list[list[torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """The exchanges of group ``i``: every worker's input in one; under HSDP one per shard, among the replicas,
        each replica's input its dense mean (FSDP's reduce-scatter inside the replica, :meth:`_replica_mean`)."""
        if self.replicas == 1:
            return [[(w, inputs[w][i]) for w in range(self.n)]]
        shards = self.n // self.replicas
        shape = self.ranks[0].tensors[i][1]
        means = [self._replica_mean([inputs[r * shards + j][i] for j in range(shards)]).view(shards, -1)
                 for r in range(self.replicas)]
        return [[(r * shards + j, means[r][j].view(shape)) for r in range(self.replicas)] for j in range(shards)]

    @staticmethod
    def _replica_mean(xs: list[torch.Tensor]) -> torch.Tensor:
        """The mean FSDP's reduce-scatter gives inside a replica of ``len(xs)`` ranks: each input divided by FSDP's
        pre-divide factor, summed in rank order, divided by the rest (the same bits as gloo's for 2 shards)."""
        n, pre = len(xs), 1
        while n % pre == 0 and n / pre > pre:
            pre *= 2
        total = xs[0] / pre
        for x in xs[1:]:
            total = total + x / pre
        return total / (n // pre) if n // pre > 1 else total

    def _exchange(self, key: str, party: list[tuple[int, torch.Tensor]]) -> tuple[list, torch.Tensor | None]:
        """One group among the workers of ``party`` (worker, input): their first trips and the mean (None: the
        step is skipped)."""
        firsts, outs = round_trip([self.roads[w] for w, _ in party], [Group.of(key, x) for _, x in party],
                                  [self.endpoints[w] for w, _ in party])
        return firsts, outs[0][0] if outs[0] is not None else None

    def delta_per_tensor(self) -> dict[str, float]:
        """LAGS eq. (21) per tensor: ||sum of residuals||^2 / ((1 - k/d) ||sum of accumulated||^2)."""
        out = {}
        for i, key in enumerate(self.layout.keys):
            residuals = [c.residual_of(key) for c in self.compressors]
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

    def record(self, tallies: list[tuple[StepTally, dict[str, Any]]], trips_per_group, losses: list[float],
               compute_s: float, select_per_key: list[float], delta: dict[str, float] | None) -> dict[str, Any]:
        fields = dict(tallies[0][1])
        fields["select_s"] = max(f["select_s"] for _, f in tallies)
        evaluate = self.updates % self.cfg.eval_every == 0 or self.iteration >= self.cfg.steps
        rec = step_record(self.task, self.model, self.updates, sum(losses) / len(losses), evaluate, fields,
                          self.cfg.probe_every)
        rec["compute_s"] = compute_s
        rec.update(self.time_model(fields, [r.est_comm_s for r in tallies[0][0].reports], select_per_key, compute_s))
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
        once it is ready and selected (:func:`gradsift.route.layerwise.pipelined_step_s`).
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
                    if reached_stop(self.cfg, self.task, rec):
                        break
        finally:
            if self.cfg.dump_grads and self.dumped:
                self.save_dumped_gradients(self.cfg.dump_grads)
        return records

    def save_dumped_gradients(self, path: str) -> None:
        """``--dump-grads``: worker 0's raw gradient of every step, flat float32, as a [steps, numel] tensor."""
        torch.save(torch.stack(self.dumped), path)

    def notices(self) -> list[str]:
        """What the recipe changed and what the wire plan sends other than the method named, one line per kind."""
        recipe = [self.recipe.replace("recipe=False", "--no-recipe")] if self.recipe else []
        return recipe + self.routing.notices(self.compressors[0], self.cfg.compressor, "--wire-plan off")

    def dense_bytes(self) -> int:
        """What one worker would send per step without compression."""
        return self.total_numel * self.params[0].element_size()

    def summary(self, records: list[dict[str, Any]], wall_s: float, extra: dict[str, Any] | None = None) -> dict:
        out = {"runtime": "simulator", "metric": self.task.metric, "higher_is_better": self.task.higher_is_better,
               "parameters": self.total_numel, "routing": self.routing.summary(self.compressors[0]),
               "memory": self.ranks[0].memory_summary(), **(extra or {})}
        if self.lags is not None:
            out["lags"] = self.lags.report()
        return run_summary(self.cfg.as_dict(), records, wall_s, self.dense_bytes(), self.skipped, extra=out)

    def state_dict(self) -> dict[str, Any]:
        """The model, the optimizer, every worker's rank state (:meth:`gradsift.runtime.rank.Rank.state_dict`), the data
        position."""
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "ranks": [r.state_dict() for r in self.ranks],
                "iteration": self.iteration, "updates": self.updates, "skipped": self.skipped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        for rank, saved in zip(self.ranks, sd["ranks"]):
            rank.load_state_dict(saved)
        self.iteration, self.updates, self.skipped = sd["iteration"], sd["updates"], sd["skipped"]
