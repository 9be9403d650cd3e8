"""``gradsift race``: time to dense's final quality, every method against the baselines a PyTorch user has.

The protocol the field's audits ask for (Agarwal et al. 2022; Han et al. 2024):

1. dense fp32 trains the task's budget ``B`` steps, one run per seed; the **target** is its final quality, the mean
   over seeds: accuracy minus 1 point, or (a language model) validation loss plus 2%;
2. every other method trains with the same data order and the same learning-rate schedule (its horizon is ``B``
   for all) until it reaches the target, or for at most ``factor * B`` steps (3 by default), per seed, sent as a
   real run sends it (the wire plan on, as DDP's and FSDP's default: tiny tensors whole);
3. per method: the seeds that reached the target, the steps to it and the **time to it** on each link model, its
   quality where it stopped, the bytes a worker sent per step; a plot of quality against time with the target line.

Time is modelled, so a busy machine does not move it: every step costs the same computation (the median over the
dense runs of the slowest worker's forward and backward: every method trains the same model on the same batches),
plus the method's selection as the wire plan prices it (its ``SELECT_PASSES`` read passes over the model at a
nominal 2.5 GB/s, on every step that sends: what the compiled kernels take on a DDP bucket, not the simulator's
per-tensor Python overhead, which on a small model would dwarf it; PowerSGD's factor products are priced at
zero, in its favour), plus its collectives' alpha-beta time on the link (serial: communication after backward, for
every method alike; a step's collectives carry their message latency once, as one DDP bucket of a model this
small does, where the simulator sends each tensor apart). One set of runs is priced on every link of ``links``: the
latency part of a step's communication is what it was, the bytes go at the link's bandwidth (the wire plan decided
at the first link's model).

Methods (``methods``): any gradsift compressor spec (the method's recipe by default), and the baselines:
``dense`` (fp32 all-reduce), ``bf16`` (PyTorch's ``bf16_compress_hook``: values all-reduced in bf16), ``powersgd:
rank=R`` (PyTorch's ``powerSGD_hook``, compressing from 10% of the budget, as its ``start_powerSGD_iter``) and
``local:period=H`` (post-local SGD, :mod:`gradsift.runtime.localsgd`; ``outer=nesterov`` for DiLoCo's outer step,
``compressor=topk`` to sparsify what the syncs exchange).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from ..compressors import parse_spec
from ..compressors.powersgd import beside_others
from ..memory.spec import Spec
from ..memory.recipes import recipe_spec
from ..runtime.records import write_json
from ..errors import ConfigError
from ..route.plan import SELECT_GBPS
from ..runtime.localsgd import LocalSGD, local_options
from ..runtime.runconfig import RunConfig, make_optimizer, split_ratio
from ..runtime.simulate import Simulator
from ..tasks import task_class
from .compare import fmt_bytes, reached, selection_s, step_times, unique_names
from .runner import Progress, read_metrics, train_to_dir

DEFAULT_METHODS = ("dense", "bf16", "powersgd:rank=1", "powersgd:rank=2", "powersgd:rank=4", "local:period=8",
                   "topk", "sidco", "dgc")


def method_spec(method: str, budget: int) -> str:
    """The simulator's spec of a race method (the baselines' names mapped, a compressor spec as it is)."""
    name, opts = parse_spec(method) if ":" in method else (method, {})
    if name == "bf16":
        return "dense:value_dtype=bf16"
    if name == "powersgd":  # (rank=R: the --torch-hook baseline's name for approx_rank)
        if "rank" in opts:
            opts["approx_rank"] = opts.pop("rank")
        return str(Spec.of("powersgd", {**beside_others(budget), **opts}))
    if name == "local":
        local_options(method)
    return method


def check_methods(methods: Sequence[str], budget: int) -> list[str]:
    """Every method's spec, checked now (one line for an unknown one), not after the dense runs."""
    from ..memory.factory import make_compressor

    specs = []
    for m in methods:
        spec = method_spec(m, budget)
        if not spec.startswith("local"):
            try:
                make_compressor(*split_ratio(spec, 0.01))
            except (ConfigError, ValueError, KeyError) as e:
                raise ConfigError(f"race: method {m!r}: {str(e).splitlines()[0]}") from None
        specs.append(spec)
    return specs


def quality(task_metric: str, higher: bool, rec: dict[str, Any]) -> float | None:
    """The quality a target is set on: accuracy as it is; a language model's validation loss."""
    if higher:
        return rec.get(task_metric)
    return rec.get("valid_loss", rec.get(task_metric))


def run_race(base: RunConfig, methods: Sequence[str], out: Path, *, seeds: int = 3, factor: float = 3.0,
             links: Sequence[float] = (0.1, 10.0), progress: Progress | None = None,
             reuse: bool = False) -> dict[str, Any]:
    """The race (module docstring) into ``out``: ``race.md``, ``race.png``, ``race.json`` and one folder per run.
    ``reuse``: a run already in ``out`` that finished with exactly the same configuration is read, not trained
    again (its numbers are the code's that made it)."""
    out = Path(out)
    progress = progress or Progress(False)
    if seeds < 1 or factor < 1:
        raise ConfigError(f"race: seeds must be >= 1 and factor >= 1, got {seeds} and {factor}")
    if not links or any(not (g > 0 and math.isfinite(g)) for g in links):
        raise ConfigError(f"race: links must be bandwidths > 0 Gbit/s, got {list(links)}")
    # the methods travel as a real run sends them (DDP's and FSDP's default wire plan: tiny tensors whole)
    cfg = dataclasses.replace(base, bandwidth_gbps=links[0], compressor="dense",
                              wire_plan=base.wire_plan or "auto").validate()
    task = task_class(cfg.task)
    budget = cfg.resolved(task).steps
    higher = task.higher_is_better
    specs = check_methods(methods, budget)
    if "dense" not in specs:
        specs.insert(0, "dense")
    runs: dict[str, list[dict[str, Any]]] = {}
    names = dict(zip(specs, unique_names(specs)))

    def one(spec: str, seed: int, steps: int, stop_at: float | None) -> dict[str, Any]:
        c = cfg.for_method(spec, seed=seed, steps=steps, stop_at=stop_at, schedule_steps=budget)
        folder = out / names[spec] / f"seed{seed}"
        summary = finished(folder, c, c.compressor) if reuse else None
        if summary is None:
            sim = LocalSGD(c, spec) if spec.startswith("local") else Simulator(c)
            summary = train_to_dir(c, folder, progress=progress, label=f"{spec} seed {seed}", sim=sim,
                                   tolerate_divergence=True)
        return {"records": read_metrics(folder / "metrics.jsonl"), "status": summary.get("status", "completed"),
                "parameters": summary.get("parameters", 0)}

    runs["dense"] = [one("dense", cfg.seed + s, budget, None) for s in range(seeds)]
    finals = [quality(task.metric, higher, _last_eval(r["records"], task.metric) or {}) for r in runs["dense"]]
    if any(f is None for f in finals):
        raise ConfigError("race: dense ended without an evaluation; use an --eval-every that divides the budget")
    mean_final = statistics.fmean(finals)
    target = mean_final - 0.01 if higher else mean_final * 1.02
    stop = target if higher else (math.exp(target) if task.metric == "perplexity" else target)
    for spec in specs:
        if spec != "dense":
            runs[spec] = [one(spec, cfg.seed + s, int(round(factor * budget)), stop) for s in range(seeds)]
    # dense's fastest step: what a step computes with nothing else running (compare.modelled_times)
    compute = min(r["compute_s"] for run in runs["dense"] for r in run["records"])
    numel = runs["dense"][0]["parameters"]
    groups = _tensors(cfg)
    rows = [_row(spec, runs[spec], task, higher, target, compute, links, selection_s(spec, numel), groups)
            for spec in specs]
    result = {"task": cfg.task, "higher_is_better": higher, "workers": cfg.workers, "ratio": cfg.ratio,
              "budget": budget, "factor": factor,
              "seeds": seeds, "links_gbps": list(links), "latency_us": cfg.latency_us, "target": target,
              "dense_final": finals, "compute_s": compute, "rows": rows}
    write_json(out / "race.json", result)
    plot = _plot(out, specs, runs, task, higher, target, compute, links[0], numel, groups)
    (out / "race.md").write_text(_report(result, plot))
    return result


def _tensors(cfg: RunConfig) -> int:
    """How many groups the simulator sends a step: the task model's trainable tensors (one each)."""
    from ..tasks import make_task

    model = make_task(cfg.task, 1, data=cfg.data, **cfg.task_options).build_model()
    return sum(1 for p in model.parameters() if p.requires_grad)


def _last_eval(records: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r.get(metric) is not None), None)


def finished(folder: Path, cfg: RunConfig, spec: str) -> dict[str, Any] | None:
    """The summary of a run in ``folder`` that finished with exactly ``cfg`` (resolved), else None."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    resolved = cfg.resolved(task_class(cfg.task))
    want = json.loads(json.dumps({**resolved.as_dict(), "compressor": spec}))
    if resolved.recipe and not spec.startswith("local"):  # the config a run records is the spec its recipe built
        optimizer = make_optimizer(resolved, [torch.nn.Parameter(torch.zeros(1))])
        want["compressor"] = str(recipe_spec(spec, optimizer)[0])
    ok = summary.get("config") == want and summary.get("status") in ("completed", "diverged")
    return summary if ok and (folder / "metrics.jsonl").exists() else None


def _row(spec: str, runs: list[dict[str, Any]], task, higher: bool, target: float, compute: float,
         links: Sequence[float], select: float, groups: int) -> dict[str, Any]:
    per_seed = []
    for run in runs:
        recs = run["records"]
        hit = next((i for i, r in enumerate(recs) if reached(quality(task.metric, higher, r), target, higher)), None)
        times = {g: step_times(recs, compute, links[0], g, select, groups) for g in links}
        last = _last_eval(recs, task.metric) or {}
        per_seed.append({"steps": None if hit is None else recs[hit]["step"],
                         "time_s": {g: None if hit is None else sum(t[:hit + 1]) for g, t in times.items()},
                         "quality": quality(task.metric, higher, last), "status": run["status"],
                         "bytes": statistics.fmean(r.get("bytes_per_worker", 0.0) for r in recs) if recs else 0.0})
    hits = [s for s in per_seed if s["steps"] is not None]
    return {"method": spec, "reached": len(hits), "seeds": len(per_seed),
            "steps": statistics.fmean(s["steps"] for s in hits) if hits else None,
            "time_s": {g: statistics.fmean(s["time_s"][g] for s in hits) if hits else None for g in links},
            "quality": statistics.fmean(q for s in per_seed if (q := s["quality"]) is not None)
            if any(s["quality"] is not None for s in per_seed) else None,
            "bytes_per_step": statistics.fmean(s["bytes"] for s in per_seed), "per_seed": per_seed}


def _plot(out: Path, specs, runs, task, higher, target, compute, gbps, numel, groups) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .compare import line_styles

    fig, ax = plt.subplots(figsize=(8, 5))
    for spec, style in zip(specs, line_styles(len(specs))):
        recs = runs[spec][0]["records"]
        times = step_times(recs, compute, gbps, gbps, selection_s(spec, numel), groups)
        pts = [(sum(times[:i + 1]), quality(task.metric, higher, r)) for i, r in enumerate(recs)
               if quality(task.metric, higher, r) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=spec, **style)
    ax.axhline(target, color="black", linewidth=1, linestyle=":", label="target")
    ax.set_xlabel(f"modelled time (s) at {gbps:g} Gbit/s")
    ax.set_ylabel("accuracy" if higher else "validation loss")
    ax.set_title(f"{task.name}: quality against time (first seed)")
    ax.legend(fontsize=8)
    path = out / "race.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _report(res: dict[str, Any], plot: Path) -> str:
    links = res["links_gbps"]
    what = "accuracy" if res["higher_is_better"] else "validation loss"
    lines = [f"# Race to dense's quality: {res['task']}, {res['workers']} workers, ratio {res['ratio']}", "",
             f"Dense trains {res['budget']} steps ({res['seeds']} seeds: final {what} "
             f"{', '.join(f'{f:.4g}' for f in res['dense_final'])}); the target is {what} "
             f"{'>=' if what == 'accuracy' else '<='} {res['target']:.4g}. Every other method trains up to "
             f"{res['factor']:g}x that budget with the same data and schedule, and stops at the target. Time is "
             f"modelled: {1e3 * res['compute_s']:.2f} ms of computation a step for every method (dense's fastest step), "
             f"plus the method's selection (its read passes at {SELECT_GBPS:g} GB/s), plus its collectives (their "
             f"message latency once a step, as one DDP bucket) on a link of {', '.join(f'{g:g}' for g in links)}"
             f" Gbit/s and {res['latency_us']:g} us (serial, alpha-beta).", "",
             "| method | reached | steps to target | " + " | ".join(f"time at {g:g} Gbit/s" for g in links)
             + " | quality where it stopped | bytes/worker/step |",
             "|---|---|---|" + "---|" * len(links) + "---|---|"]
    for row in res["rows"]:
        t = [f"{row['time_s'][g]:.3g} s" if row["time_s"][g] is not None else "not reached" for g in links]
        steps = f"{row['steps']:.0f}" if row["steps"] is not None else "not reached"
        q = f"{row['quality']:.4g}" if row["quality"] is not None else "n/a"
        lines.append(f"| `{row['method']}` | {row['reached']}/{row['seeds']} | {steps} | " + " | ".join(t)
                     + f" | {q} | {fmt_bytes(row['bytes_per_step'])} |")
    lines += ["", "Steps and times are means over the seeds that reached the target; a method that reached it in "
              "fewer than all seeds is not a sure way there.", ""]
    for g in links:
        sure = [r for r in res["rows"] if r["reached"] == r["seeds"] and r["time_s"][g] is not None]
        if sure:
            best = min(sure, key=lambda r: r["time_s"][g])
            lines.append(f"At {g:g} Gbit/s the first to dense's quality in every seed: `{best['method']}` "
                         f"({best['time_s'][g]:.3g} s).")
    lines += ["", f"![quality against time]({plot.name})", ""]
    return "\n".join(lines)
