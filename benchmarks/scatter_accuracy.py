"""Accuracy of the scatter route against the all-gather route, 16 simulated workers, 3 seeds.

    .venv/bin/python benchmarks/scatter_accuracy.py --data ../shared/data/tinyshakespeare.txt --out runs/scatter-acc

Top-k 1% with error feedback, every tensor compressed (--wire-plan off), each route forced: mnist1d-cnn with 128
channels (600 steps), charlm (300 steps) and gptlm (600 steps, AdamW); the scatter route with the owners keeping
1x and 4x k (--keeps). The scatter route's mean holds the sum's k largest (the owners' re-selection) where the
all-gather route's holds every worker's k; what the owners hold back arrives later. Writes OUT/table.md (final
metric per seed, mean and spread), OUT/curves.png, and the runs' metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from gradsift.experiments.runner import Progress, train_to_dir
from gradsift.runtime.records import OutputDir, read_metrics
from gradsift.runtime.runconfig import RunConfig

TASKS = {"mnist1d-cnn": dict(task="mnist1d-cnn", task_options={"channels": 128}),
         "charlm": dict(task="charlm"), "gptlm": dict(task="gptlm")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/scatter-acc")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--reuse", action="store_true", help="take runs already in OUT instead of training them again")
    ap.add_argument("--keeps", nargs="+", type=float, default=[1.0, 4.0],
                    help="scatter runs with the owners keeping these many times k (--scatter-keep)")
    a = ap.parse_args()
    routes = [("gather", 1.0)] + [("scatter" if keep == 1 else f"scatter x{keep:g}", keep) for keep in a.keeps]
    out = Path(a.out)
    results: dict[tuple[str, str], list[float]] = {}
    with OutputDir(out, overwrite=not a.reuse, reuse=a.reuse):
        for task in a.tasks:
            for seed in a.seeds:
                for route, keep in routes:
                    cfg = RunConfig(**TASKS[task], compressor="topk", ratio=0.01, workers=a.workers, seed=seed,
                                    data=a.data, wire_plan="off", sparse_collective=route.split()[0],
                                    scatter_keep=keep)
                    d = out / f"{task}-{route.replace(' ', '')}-s{seed}"
                    if (d / "summary.json").exists() and a.reuse:  # (an earlier invocation's run)
                        s = json.loads((d / "summary.json").read_text())
                        results.setdefault((task, route), []).append(s["final"][s["metric"]])
                        continue
                    s = train_to_dir(cfg, d, progress=Progress(True), label=f"{task} {route} seed {seed}")
                    results.setdefault((task, route), []).append(s["final"][s["metric"]])
                    print(f"{task} {route} seed {seed}: {s['metric']} {s['final'][s['metric']]:.4g}", file=sys.stderr)
        lines = [f"Top-k 1%, error feedback, {a.workers} simulated workers, every tensor compressed; final metric.", "",
                 "| task | route | " + " | ".join(f"seed {s}" for s in a.seeds) + " | mean | spread (max-min) |",
                 "|---|---|" + "---|" * (len(a.seeds) + 2)]
        for (task, route), vals in results.items():
            lines.append(f"| {task} | {route} | " + " | ".join(f"{v:.4g}" for v in vals)
                         + f" | {statistics.mean(vals):.4g} | {max(vals) - min(vals):.3g} |")
        (out / "table.md").write_text("\n".join(lines) + "\n")
        (out / "results.json").write_text(json.dumps({f"{t}/{r}": v for (t, r), v in results.items()}, indent=1))
        plot(out, a.tasks, a.seeds, [r for r, _ in routes])
    print("\n".join(lines))


def plot(out: Path, tasks, seeds, routes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for route, color in zip(routes, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            for seed in seeds:
                recs = read_metrics(out / f"{task}-{route.replace(' ', '')}-s{seed}" / "metrics.jsonl")
                metric = "accuracy" if "accuracy" in recs[-1] else "perplexity"
                pts = [(r["step"], r[metric]) for r in recs if r.get(metric) is not None]
                ax.plot(*zip(*pts), color=color, alpha=0.8, label=route if seed == seeds[0] else None)
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        if metric == "perplexity":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=90)


if __name__ == "__main__":
    main()
