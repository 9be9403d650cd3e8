"""A user's own transformer script (benchmarks/user_transformer.py) raced on namespace hosts with shaped links: the
time each way of communicating takes to reach DDP's final held-out loss + 2%. Root (it makes network namespaces).

    .venv/bin/python benchmarks/user_race.py --data ../shared/data/tinyshakespeare.txt --out DIR \
        [--hosts 4] [--rate 100mbit] [--steps 300] [--factor 2] \
        [--methods ddp fp16 postlocal topk local local:ratio=0.1]

DDP trains ``--steps`` and sets the target (or ``--target`` gives an earlier run's, and DDP is left out); every other method trains up to ``--factor`` times that (its cosine
schedule that long) and stops at the first evaluation at or under the target. A method is its name with the
script's options after a colon (``local:ratio=0.1,outer=nesterov``). Writes ``DIR/race.md`` and each run's log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradsift.cluster.hosts import Cluster, Link, TearDown, run_on_cluster

SCRIPT = Path(__file__).with_name("user_transformer.py")
NAMES = {"ddp": "DDP", "fp16": "PyTorch's fp16 hook", "postlocal": "PyTorch's post-local SGD",
         "topk": "gradsift.ddp top-k", "local": "gradsift.local (sparse local SGD)"}


def flags(method: str) -> tuple[str, list[str]]:
    """``"local:ratio=0.1,outer=nesterov"`` -> ("local", ["--ratio", "0.1", "--outer", "nesterov"])."""
    name, _, opts = method.partition(":")
    out = ["--method", name]
    for kv in filter(None, opts.split(",")):
        k, _, v = kv.partition("=")
        out += [f"--{k.replace('_', '-')}", v]
    return name, out


def read(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--methods", nargs="+", default=["ddp", "fp16", "postlocal", "topk", "local"])
    ap.add_argument("--target", type=float, default=None, help="a target from an earlier run's DDP (then no ddp)")
    a = ap.parse_args()
    if (a.target is None) != (a.methods[0] == "ddp"):
        print("user_race: the first method must be ddp (it sets the target), or --target given and no ddp",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    longer = int(a.steps * a.factor)
    rows, logs, target = [], [], a.target
    cluster = Cluster(hosts=a.hosts, name="usr", links=[Link(rate=a.rate) for _ in range(a.hosts)])
    with TearDown(cluster) as c:
        for i, method in enumerate(a.methods):
            name, args = flags(method)
            log = out / f"{i}-{method.replace(':', '_').replace(',', '_').replace('=', '')}.jsonl"
            log.unlink(missing_ok=True)
            steps = a.steps if target is None else longer
            args += ["--data", str(Path(a.data).resolve()), "--record", str(log), "--steps", str(steps),
                     "--schedule-steps", str(steps)]
            if target is not None:
                args += ["--stop-at", f"{target:.6f}"]
            res = run_on_cluster(c, [str(SCRIPT), *args], module=False, timeout_s=1200)
            if any(rc for rc, _, _ in res):
                print(f"{method}: failed\n{res[0][2][-2000:]}", file=sys.stderr)
                return 1
            got = read(log)
            logs.append((method, log))
            if target is None:
                target = got[-1]["loss"] * 1.02
            hit = next((r for r in got if r["loss"] <= target), None)
            rows.append((method, name, hit, got[-1]))
            print(f"{method}: {'reached at step %d, %.1f s' % (hit['step'], hit['time_s']) if hit else 'not reached'}"
                  f" (last {got[-1]['loss']:.4f} at {got[-1]['step']})", flush=True)
    ddp_t = rows[0][2]["time_s"] if rows[0][1] == "ddp" and rows[0][2] else None
    post = next((r[2]["time_s"] for r in rows if r[1] == "postlocal" and r[2]), None)
    lines = [f"# A user's transformer script on {a.hosts} hosts at {a.rate}", "",
             f"`{' '.join(['benchmarks/user_race.py', *sys.argv[1:]])}`", "",
             f"DDP trains {a.steps} steps; the target is its final held-out loss + 2% ({target:.4f}"
             f"{', from an earlier run' if a.target is not None else ''}); the others train up "
             f"to {longer} steps (their schedule that long) and stop there. Time: the steps' measured wall time on rank 0, "
             "evaluations excluded.", "",
             "| method | reached | steps | time to target | vs DDP | vs post-local SGD | last held-out loss |",
             "|---|---|---|---|---|---|---|"]
    for method, name, hit, last in rows:
        label = NAMES[name] + (f" ({method.partition(':')[2]})" if ":" in method else "")
        t = hit["time_s"] if hit else None
        lines.append(f"| {label} | {'yes' if hit else 'no'} | {hit['step'] if hit else last['step']} | "
                     f"{f'{t:.1f} s' if t else '--'} | {f'{t / ddp_t:.2f}x' if t and ddp_t else '--'} | "
                     f"{f'{t / post:.2f}x' if t and post else '--'} | {last['loss']:.4f} |")
    (out / "race.md").write_text("\n".join(lines) + "\n")
    plot(out / "race.png", [(m, read(log)) for m, log in logs], target, f"{a.hosts} hosts at {a.rate}")
    print("\n".join(lines))
    return 0


def plot(path: Path, runs: list[tuple[str, list[dict]]], target: float, where: str) -> None:
    """Held-out loss against measured time, one line per method, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, got in runs:
        name, _, opts = method.partition(":")
        ax.plot([r["time_s"] for r in got], [r["loss"] for r in got], marker=".",
                label=NAMES[name] + (f" ({opts})" if opts else ""))
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label="DDP's final + 2%")
    ax.set_xlabel("measured wall time of the steps (s)")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.set_title(f"a user's transformer script, {where}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
