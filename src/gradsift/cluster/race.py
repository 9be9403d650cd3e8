"""``gradsift cluster race``: measured time to dense's final quality on real processes over shaped links.

The simulator's race (:mod:`gradsift.experiments.race`) models time; this one measures it. On ``hosts`` network
namespace hosts with ``rate`` uplinks (one rank a host, one thread a rank), plain DDP trains the task's budget;
the target is its final validation loss plus 2% (its perplexity to the power 1.02); every other method trains with
the same data until it reaches the target, for at most ``factor`` times DDP's steps. Wall time to the target is the
sum of the measured step times up to it (forward, backward, communication, optimizer; evaluations excluded). The
methods: DDP, PyTorch's bf16 hook, ``powerSGD_hook`` (ranks 1 and 2), post-local SGD (the models averaged every 8
steps), gradsift's top-k and SIDCo at 1% (their recipes, the wire plan on), and gradsift's local SGD every 8 steps
(:mod:`gradsift.local`): DiLoCo's outer Nesterov step on dense changes, and top-k 1% of the changes with the models
averaged, with DiLoCo's step, or with SparseLoCo's decayed error feedback (and top-k 10% of them, averaged or with
SparseLoCo's). Writes ``race.md`` (a table with
the command) and ``race.json`` into the output folder.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..runtime.records import write_json
from .hosts import Cluster, ClusterError, Link, TearDown
from .report import plot_quality_vs_time
from .runs import Bench, calibrate, curve, failure, time_to, train_on

METHODS = [("DDP", ["--torch-hook", "ddp"]), ("fp16 hook", ["--torch-hook", "fp16"]),
           ("bf16 hook", ["--torch-hook", "bf16"]),
           ("PowerSGD r1", ["--torch-hook", "powersgd:rank=1"]), ("PowerSGD r2", ["--torch-hook", "powersgd:rank=2"]),
           ("local SGD H=8", ["--torch-hook", "localsgd:period=8"]), ("topk 1%", ["--compressor", "topk"]),
           ("sidco 1%", ["--compressor", "sidco"]),
           ("DiLoCo H=8", ["--compressor", "local:period=8,outer=nesterov"]),
           ("sparse local SGD H=8", ["--compressor", "local:period=8,compressor=topk"]),
           ("sparse DiLoCo H=8", ["--compressor", "local:period=8,outer=nesterov,compressor=topk"]),
           ("SparseLoCo H=8", ["--compressor", "local:period=8,outer=ef,compressor=topk"]),
           ("sparse local SGD H=8 10%", ["--compressor", "local:period=8,compressor=topk,ratio=0.1"]),
           ("SparseLoCo H=8 10%", ["--compressor", "local:period=8,outer=ef,compressor=topk,ratio=0.1"])]


def race_on_cluster(bench: Bench, *, task: str = "charlm", hosts: int = 4, rate: str = "100mbit",
                    steps: int = 300, factor: float = 2.0, only: Sequence[str] | None = None, advance=None) -> dict:
    """The race (module docstring); ``only`` limits the methods to those labels (DDP always runs)."""
    chosen = [m for m in METHODS if not only or m[0] in only or m[0] == "DDP"]
    unknown = [o for o in only or () if o not in [m[0] for m in METHODS]]
    if unknown:
        raise ClusterError(f"cluster race: unknown method {unknown[0]!r}; the methods are: "
                           f"{', '.join(m[0] for m in METHODS)}")
    every = max(steps // 10, 1)
    rows, curves, target = [], {}, None
    with TearDown(Cluster(hosts=hosts, name="gsr", links=[Link(rate=rate) for _ in range(hosts)])) as c:
        cal = calibrate(c, bench.out / "calibration.json")
        for label, extra in chosen:
            budget = steps if label == "DDP" else int(math.ceil(factor * steps))
            stop = [] if target is None or label == "DDP" else ["--stop-at", f"{math.exp(target):.6g}"]
            d = bench.out / "runs" / label.replace(" ", "-").replace("%", "pct").replace("=", "")
            res, recs = train_on(c, bench, budget, [*extra, *stop], d, cal["fit"], task=task, eval_every=every)
            if any(rc for rc, _, _ in res):
                rows.append({"method": label, "failed": failure(res)})
                continue
            if label == "DDP":
                losses = [r["valid_loss"] for r in recs if r.get("valid_loss") is not None]
                if not losses:
                    raise ClusterError("cluster race: DDP ended without an evaluation")
                target = losses[-1] * 1.02
            hit = time_to(recs, math.exp(target))
            step_s = sorted(r["step_s"] for r in recs[3:]) or [0.0]
            rows.append({"method": label, **hit, "median_step_s": step_s[len(step_s) // 2],
                         "final_valid_loss": next((r["valid_loss"] for r in reversed(recs)
                                                   if r.get("valid_loss") is not None), None)})
            curves[label] = curve(recs)
            if advance:
                advance(1, f"race: {label}")
    return {"task": task, "hosts": hosts, "rate": rate, "ddp_steps": steps, "factor": factor,
            "target_valid_loss": target, "calibration": cal["fit"], "rows": rows, "curves": curves}


def write_race(out: Path, res: dict[str, Any], command: str) -> Path:
    write_json(out / "race.json", res)
    ddp = next((r for r in res["rows"] if r["method"] == "DDP" and r.get("reached")), None)
    lines = [f"# Measured race to DDP's quality: {res['task']}, {res['hosts']} hosts at {res['rate']}", "",
             f"`{command}`", "",
             f"DDP trains {res['ddp_steps']} steps; the target is its final validation loss + 2% "
             f"({res['target_valid_loss']:.4f}); the others train up to {res['factor']:g}x its steps. Measured wall "
             "time (evaluations excluded), one rank a host, links calibrated at "
             f"{res['calibration']['bandwidth_gbps']:.4g} Gbit/s and {res['calibration']['latency_us']:.0f} us.", "",
             "| method | reached | steps | time to target | vs DDP | median step | final validation loss |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "failed" in r:
            lines.append(f"| {r['method']} | failed: {r['failed']} | | | | | |")
            continue
        vs = f"{r['seconds'] / ddp['seconds']:.2f}x" if ddp and r["reached"] else ""
        lines.append(f"| {r['method']} | {'yes' if r['reached'] else 'no'} | {r['steps']} | "
                     f"{r['seconds']:.1f} s{'' if r['reached'] else ' (not reached)'} | {vs} | "
                     f"{1e3 * r['median_step_s']:.0f} ms | {r['final_valid_loss']:.4f} |")
    if plot_race(out, res):
        lines += ["", "![validation perplexity against measured wall time](race.png)"]
    path = out / "race.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_race(out: Path, res: dict[str, Any]) -> bool:
    """``race.png``: every method's validation perplexity against its measured wall time, the target dashed;
    False when no method has an evaluated step."""
    if not any(res["curves"].values()):
        return False
    target = res.get("target_valid_loss")
    plot_quality_vs_time(out / "race.png", res["curves"], math.exp(target) if target is not None else None,
                         "target (DDP's final + 2%)", f"{res['task']}, {res['hosts']} hosts at {res['rate']}")
    return True
