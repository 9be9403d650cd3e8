"""Local SGD in the simulator: every worker steps alone, the models are averaged every ``period`` steps.

The baseline a PyTorch user already has: DDP's ``post_localSGD_hook`` with ``PostLocalSGDState`` (plain all-reduce
for the first ``start`` steps) and ``PeriodicModelAverager`` (the models averaged every ``period`` steps after), the
optimizer's state kept per worker. DiLoCo (Douillard et al. 2023) adds an outer step: the averaged change of the
models since the last sync (the *pseudo-gradient*) goes through an outer Nesterov optimizer instead of being
applied as it is (``outer="nesterov"``, ``outer_lr`` 0.7 and ``outer_momentum`` 0.9 as its paper); SparseLoCo's
error-feedback memory decays instead (``outer="ef"``).

Each worker is a :class:`~gradsift.runtime.localstate.LocalState` over the in-process group, the object
:func:`gradsift.local.register` runs on every real rank, so the two runtimes do the same arithmetic: what the
workers exchange at a sync goes through the same road every gradient takes, a sparsifier compresses it with error
feedback (``compressor`` other than ``dense``), what a worker did not send stays in its memory for the next sync,
and the global model takes the outer step. Spec (the method's name in a race):
``local:period=8[,start=0][,outer=average|nesterov|ef][,outer_lr=..][,outer_momentum=..][,compressor=topk][,ratio=R]
[,value_dtype=int2]``
(``start``: the warm-up steps whose gradients are averaged every step, ``warmup_steps`` of
:func:`gradsift.local.register`; ``ratio``: the sync's, else the run's).

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

from ..compressors import available, parse_spec
from ..compressors.base import COMMON_OPTIONS
from ..errors import OptionError
from ..options import Option, check_options
from .telemetry import run_summary, step_record
from ..errors import ConfigError
from ..route.netmodel import NetworkModel
from ..tasks import make_task
from ..transport.local import LocalGroup
from .localstate import OUTERS, LocalState, outer_defaults
from .runconfig import RunConfig, make_optimizer, set_lr

LOCAL_OPTIONS = {
    "period": Option.integer(8, lo=1, doc="inner steps between syncs"),
    "start": Option.integer(0, lo=0, doc="warm-up steps whose gradients are averaged every step (post-local SGD)"),
    "outer": Option.choice("average", OUTERS, doc="the outer step: the mean model (average), an outer Nesterov "
                                                  "step on the mean change (nesterov, DiLoCo's), or a decaying "
                                                  "error-feedback memory (ef, SparseLoCo's)"),
    "outer_lr": Option.number(None, lo=0.0, hi=10.0, optional=True, doc="the outer step's size (unset: the outer "
                                                                          "step's own, 1 or 0.7 for nesterov)"),
    "outer_momentum": Option.number(None, lo=0.0, hi=1.0, optional=True, doc="the outer momentum (unset: 0, 0.9 "
                                                                             "for nesterov, 0.95 for ef)"),
    "compressor": Option.choice("dense", available(), doc="the method that compresses what a sync sends"),
    "ratio": COMMON_OPTIONS["ratio"],
    "value_dtype": COMMON_OPTIONS["value_dtype"],
}


def local_options(spec: str) -> dict[str, Any]:
    """The options of a ``local:...`` spec, checked (one-line errors)."""
    name, opts = parse_spec(spec) if ":" in spec or spec == "local" else (spec, {})
    if name != "local":
        raise ConfigError(f"not a local SGD spec: {spec!r} (local:period=H,...)")
    try:
        o = check_options(LOCAL_OPTIONS, opts, "local")
    except OptionError as e:
        raise ConfigError(str(e)) from None
    try:
        o["outer_lr"], o["outer_momentum"] = outer_defaults(o["outer"], o["outer_lr"], o["outer_momentum"])
    except ConfigError as e:
        raise ConfigError(f"local: {str(e).replace('warmup_steps', 'start')}") from None
    return o


def sync_config(cfg: RunConfig, o: dict[str, Any]) -> RunConfig:
    """The run's configuration for what a sync sends: the spec's compressor, at the spec's ratio and value dtype
    where it names them (else the run's)."""
    return dataclasses.replace(cfg, compressor=o["compressor"], ratio=cfg.ratio if o["ratio"] is None else o["ratio"],
                               value_dtype=cfg.value_dtype if o["value_dtype"] is None else o["value_dtype"])


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
        group = LocalGroup(self.n, self.cfg.weights, self.cfg.sum_order)
        settings = sync_config(self.cfg, self.o).settings("sim", simulated=True)
        self.ranks = [LocalState(settings, [(k, p) for k, p in w.named_parameters() if p.requires_grad],
                                 period=self.o["period"], outer=self.o["outer"], outer_lr=self.o["outer_lr"],
                                 outer_momentum=self.o["outer_momentum"], warmup_steps=self.o["start"], runtime="sim")
                      for w in self.workers]
        for rank, opt in zip(self.ranks, self.optimizers):
            rank.optimizer = opt
        routing = None
        for w, rank in enumerate(self.ranks):
            rank.build(group.endpoint(w), routing=routing, global_rank=w, global_world=self.n)
            routing = routing or rank.routing
        self.updates = self.iteration = self.skipped = 0
        self.dense_bytes = sum(p.numel() * p.element_size() for _, p in self.named)

    # ------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        """Every worker's forward, backward and optimizer step (:meth:`LocalState.before_inner_step` and
        :meth:`~LocalState.after_inner_step` around it, as the optimizer's hooks run them on a real rank); a sync
        when one is due."""
        s = self.iteration
        self.iteration += 1
        t0 = time.perf_counter()
        losses, compute = [], []
        for w, (model, opt) in enumerate(zip(self.workers, self.optimizers)):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = self.task.loss(model, self.task.batch(w, s))
            loss.backward()
            if self.cfg.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.clip_norm)
            losses.append(float(loss.detach()))
            compute.append(time.perf_counter() - t)
        fields: dict[str, Any] = {"density": 0.0, "k_ratio": 0.0, "bytes_per_worker": 0.0,
                                  "wire_bytes_per_worker": 0.0, "est_comm_s": 0.0, "select_s": 0.0}
        if self.ranks[0].warming:  # post-local SGD's first phase: every step's gradients averaged
            self._average_gradients()
            fields.update(density=1.0, k_ratio=1.0, bytes_per_worker=float(self.dense_bytes),
                          est_comm_s=self.net.allreduce_s(self.dense_bytes, self.n))
            fields["wire_bytes_per_worker"] = 2 * (self.n - 1) / self.n * self.dense_bytes
        for rank, opt in zip(self.ranks, self.optimizers):
            rank.before_inner_step()
            set_lr(self.cfg, opt, self.updates)
            opt.step()
        self.updates += 1
        if [rank.after_inner_step() for rank in self.ranks][0]:
            fields.update(self._sync())
        evaluate = self.updates % self.cfg.eval_every == 0 or self.iteration >= self.cfg.steps
        self._average_into_model()
        rec = step_record(self.task, self.model, self.updates,
                          sum(losses) / len(losses), evaluate, fields, self.cfg.probe_every)
        rec["compute_s"] = max(compute)
        rec["est_step_s"] = rec["est_step_serial_s"] = max(compute) + fields["select_s"] + fields["est_comm_s"]
        rec["wall_s"] = time.perf_counter() - t0
        return rec

    def _average_gradients(self) -> None:
        """Every worker's gradients replaced by their mean: summed in worker order and divided, as an all-reduce
        of two ranks sums (the warm-up's, :class:`gradsift.local.DistLocalState`)."""
        for ps in zip(*(w.params for w in self.ranks)):
            if ps[0].grad is None:
                continue
            total = ps[0].grad.clone()
            for p in ps[1:]:
                total.add_(p.grad)
            total.div_(self.n)
            for p in ps:
                p.grad.copy_(total)

    def _average_into_model(self) -> None:
        """The model an evaluation reads: the workers' mean (between syncs they differ; after one they are equal)."""
        with torch.no_grad():
            for i, (_, p) in enumerate(self.named):
                p.copy_(torch.stack([r.params[i] for r in self.ranks]).mean(0))

    def _sync(self) -> dict[str, Any]:
        """Every worker's pseudo-gradient on its way before any is finished (one in-process exchange), then each
        worker's outer step (:meth:`LocalState.finish_sync`)."""
        trips = [rank.start_sync() for rank in self.ranks]
        skipped = [rank.finish_sync(t) for rank, t in zip(self.ranks, trips)][0]
        self.skipped += int(skipped)
        lasts = [rank.last for rank in self.ranks]
        fields = dict(lasts[0])
        fields["select_s"] = max(f["select_s"] for f in lasts)
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
