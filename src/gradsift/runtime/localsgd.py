"""Local SGD in the simulator: every worker steps alone, the models are averaged every ``period`` steps.

The baseline a PyTorch user already has: DDP's ``post_localSGD_hook`` with ``PostLocalSGDState`` (plain all-reduce
for the first ``start`` steps) and ``PeriodicModelAverager`` (the models averaged every ``period`` steps after), the
optimizer's state kept per worker. DiLoCo (Douillard et al. 2023) adds an outer step: the averaged change of the
models since the last sync (the *pseudo-gradient*) goes through an outer Nesterov optimizer instead of being
applied as it is (``outer="nesterov"``, ``outer_lr`` 0.7 and ``outer_momentum`` 0.9 as its paper).

What the workers exchange at a sync goes through the same road every gradient takes (:class:`gradsift.runtime.rank.Rank`
over the in-process group), so a sparsifier can compress it with error feedback (``compressor`` other than
``dense``): each worker sends its pseudo-gradient (the global model minus its own), what it did not send stays in
its memory for the next sync, and the global model moves by the mean. Spec (the method's name in a race):
``local:period=8[,start=0][,outer=average|nesterov][,outer_lr=0.7][,outer_momentum=0.9][,compressor=topk]``.

Between syncs the workers' models differ; an evaluation reads their average (what a sync would give). Step
records carry the simulator's fields: ``est_comm_s`` is a sync's alpha-beta time on its step (zero between),
``compute_s`` the slowest worker's.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable

import torch

from ..compressors import parse_spec
from ..core.road import Group
from ..core.telemetry import run_summary, step_record
from ..errors import ConfigError
from ..route.netmodel import NetworkModel
from ..tasks import make_task
from ..transport.local import LocalGroup
from .rank import Rank
from .runconfig import RunConfig, make_optimizer, set_lr

LOCAL_OPTIONS = {"period": 8, "start": 0, "outer": "average", "outer_lr": 0.7, "outer_momentum": 0.9,
                 "compressor": "dense"}


def local_options(spec: str) -> dict[str, Any]:
    """The options of a ``local:...`` spec, checked (one-line errors)."""
    name, opts = parse_spec(spec) if ":" in spec or spec == "local" else (spec, {})
    if name != "local":
        raise ConfigError(f"not a local SGD spec: {spec!r} (local:period=H,...)")
    bad = set(opts) - set(LOCAL_OPTIONS)
    if bad:
        raise ConfigError(f"local: unknown option {sorted(bad)[0]!r}; allowed: {', '.join(LOCAL_OPTIONS)}")
    o = {**LOCAL_OPTIONS, **opts}
    for key in ("period", "start"):
        if isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < (1 if key == "period" else 0):
            raise ConfigError(f"local: {key} must be an integer >= {1 if key == 'period' else 0}, got {o[key]!r}")
    if o["outer"] not in ("average", "nesterov"):
        raise ConfigError(f"local: outer must be average or nesterov, got {o['outer']!r}")
    for key in ("outer_lr", "outer_momentum"):
        if isinstance(o[key], bool) or not isinstance(o[key], (int, float)) or not 0 <= o[key] <= 10:
            raise ConfigError(f"local: {key} must be a number in [0, 10], got {o[key]!r}")
    return o


class LocalSGD:
    """``cfg.workers`` workers, each with its own model and optimizer, synced every ``period`` steps (module
    docstring). The simulator's interface for :func:`gradsift.experiments.runner.train_to_dir`."""

    def __init__(self, cfg: RunConfig, spec: str):
        cfg.validate()
        self.o = local_options(spec)
        self.task = make_task(cfg.task, cfg.workers, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data,
                              **cfg.task_options)
        self.cfg = cfg.resolved(type(self.task))
        self.spec, self.n = spec, self.cfg.workers
        self.model = self.task.build_model()
        self.named = [(k, p) for k, p in self.model.named_parameters() if p.requires_grad]
        decays = getattr(self.task, "decays", None)
        self.workers = [copy.deepcopy(self.model) for _ in range(self.n)]
        self.optimizers = [make_optimizer(self.cfg, [(k, p) for k, p in w.named_parameters() if p.requires_grad],
                                          decays=decays) for w in self.workers]
        self.net = NetworkModel(self.cfg.bandwidth_gbps, self.cfg.latency_us)
        group = LocalGroup(self.n)
        tensors = [(k, tuple(p.shape), p.dtype) for k, p in self.named]
        settings = dataclasses.replace(self.cfg, compressor=self.o["compressor"]).settings("sim", simulated=True)
        self.ranks = [Rank(settings, tensors, runtime="sim", dense_bytes=0) for _ in range(self.n)]
        routing = None
        for w, rank in enumerate(self.ranks):
            rank.build(group.endpoint(w), routing=routing, global_rank=w, global_world=self.n)
            routing = routing or rank.routing
        if self.ranks[0].compressor.inner.ROUNDS > 1:
            raise ConfigError(f"local: {self.o['compressor']} runs several rounds; a sync takes one-round methods")
        self.outer_m = [torch.zeros_like(p) for _, p in self.named]
        self.updates = self.iteration = self.skipped = 0
        self.dense_bytes = sum(p.numel() * p.element_size() for _, p in self.named)

    # ------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        s = self.iteration
        self.iteration += 1
        t0 = time.perf_counter()
        losses, compute = [], []
        for w, (model, opt) in enumerate(zip(self.workers, self.optimizers)):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = self.task.loss(model, self.task.batch(w, s))
            loss.backward()
            losses.append(float(loss.detach()))
            compute.append(time.perf_counter() - t)
        fields: dict[str, Any] = {"density": 0.0, "k_ratio": 0.0, "bytes_per_worker": 0.0,
                                  "wire_bytes_per_worker": 0.0, "est_comm_s": 0.0, "select_s": 0.0}
        if s < self.o["start"]:  # post-local SGD's first phase: every step's gradients all-reduced
            self._average_gradients()
            fields.update(density=1.0, k_ratio=1.0, bytes_per_worker=float(self.dense_bytes),
                          est_comm_s=self.net.allreduce_s(self.dense_bytes, self.n))
            fields["wire_bytes_per_worker"] = 2 * (self.n - 1) / self.n * self.dense_bytes
        for model, opt in zip(self.workers, self.optimizers):
            if self.cfg.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.clip_norm)
            set_lr(self.cfg, opt, self.updates)
            opt.step()
        self.updates += 1
        if s >= self.o["start"] and (s + 1 - self.o["start"]) % self.o["period"] == 0:
            fields.update(self._sync())
        evaluate = self.updates % self.cfg.eval_every == 0 or self.iteration >= self.cfg.steps
        self._average_into_model()
        rec = step_record(self.task, self.model, self.updates,
                          sum(losses) / len(losses), evaluate, fields)
        rec["compute_s"] = max(compute)
        rec["est_step_s"] = rec["est_step_serial_s"] = max(compute) + fields["select_s"] + fields["est_comm_s"]
        rec["wall_s"] = time.perf_counter() - t0
        return rec

    def _average_gradients(self) -> None:
        for ps in zip(*(w.parameters() for w in self.workers)):
            if ps[0].grad is None:
                continue
            mean = torch.stack([p.grad for p in ps]).mean(0)
            for p in ps:
                p.grad = mean.clone()

    def _average_into_model(self) -> None:
        with torch.no_grad():
            for i, (_, p) in enumerate(self.named):
                p.copy_(torch.stack([list(w.parameters())[i] for w in self.workers]).mean(0))

    def _sync(self) -> dict[str, Any]:
        """Every worker's pseudo-gradient (global model minus its own) through its road; the global model moves by
        the mean (averaging) or by the outer Nesterov step; every worker starts again from the global model."""
        roads = [r.road for r in self.ranks]
        params = [[p for p in w.parameters() if p.requires_grad] for w in self.workers]
        for i, (key, g) in enumerate(self.named):
            deltas = [(g.detach() - params[w][i].detach()) for w in range(self.n)]
            trips = [road.start(Group.of(key, d), rank.transport) for road, rank, d in zip(roads, self.ranks, deltas)]
            outs = [road.finish(t, t.pending.wait()) for road, t in zip(roads, trips)]
            mean = outs[0][0].view_as(g)
            with torch.no_grad():
                if self.o["outer"] == "nesterov":
                    m = self.outer_m[i]
                    m.mul_(self.o["outer_momentum"]).add_(mean)
                    g.sub_(self.o["outer_lr"] * (mean + self.o["outer_momentum"] * m))
                else:
                    g.sub_(mean)
        tallies: list = []
        for rank in self.ranks:
            rank.close_step(lambda tally: tallies.append(tally) or tally.fields())
        with torch.no_grad():
            for w in self.workers:
                for p, (_, g) in zip((p for p in w.parameters() if p.requires_grad), self.named):
                    p.copy_(g)
        fields = tallies[0].fields()
        fields["select_s"] = max(t.fields()["select_s"] for t in tallies)
        return {k: fields[k] for k in ("density", "k_ratio", "bytes_per_worker", "wire_bytes_per_worker",
                                       "est_comm_s", "select_s")}

    # ------------------------------------------------------------ a run
    def run(self, steps: int | None = None, on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
        steps = steps or self.cfg.steps
        records = []
        while self.iteration < steps:
            rec = self.step()
            records.append(rec)
            if on_record:
                on_record(rec)
            v = rec.get(self.task.metric)
            if self.cfg.stop_at is not None and v is not None and (
                    v >= self.cfg.stop_at if self.task.higher_is_better else v <= self.cfg.stop_at):
                break
        return records

    def notices(self) -> list[str]:
        return []

    def summary(self, records: list[dict[str, Any]], wall_s: float, extra: dict[str, Any] | None = None) -> dict:
        out = {"runtime": "simulator", "metric": self.task.metric, "higher_is_better": self.task.higher_is_better,
               "parameters": sum(p.numel() for _, p in self.named), "baseline": self.spec, **(extra or {})}
        return run_summary({**self.cfg.as_dict(), "compressor": self.spec}, records, wall_s, self.dense_bytes, 0,
                           extra=out)
