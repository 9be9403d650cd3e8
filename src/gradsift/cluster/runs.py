"""One training run on the namespace cluster, its calibration, and what the bench reads from its records."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..experiments.runner import Progress
from ..netmodel import NetworkModel
from ..records import read_metrics
from .hosts import Cluster, ClusterError, run_on_cluster

SHAKESPEARE = Path(__file__).resolve().parents[4] / "shared" / "data" / "tinyshakespeare.txt"

TASK_ARGS = {  # what every run of a task passes (the charlm settings of the earlier benches)
    "wordlm": [],
    "charlm": ["--lr", "1.0", "--clip-norm", "0.25"],
}


@dataclass
class Bench:
    out: Path
    data: Path
    quick: bool
    progress: Progress
    task_options: dict[str, Sequence[str]] | None = None  # per task: --task-option values

    def train_args(self, steps: int, extra: Sequence[str], out: Path, net: dict[str, float] | None = None,
                   task: str = "charlm", eval_every: int | None = None) -> list[str]:
        args = ["gradsift", "train", "--runtime", "ddp", "--task", task, "--data", str(self.data),
                "--steps", str(steps), "--eval-every", str(eval_every or max(steps, 1)), "--bucket-cap-mb", "1",
                "--out", str(out), "--quiet", "--timeout", "180", *TASK_ARGS.get(task, [])]
        if "--ratio" not in extra and "--torch-hook" not in extra:
            args += ["--ratio", "0.01"]
        for opt in (self.task_options or {}).get(task, ()):
            args += ["--task-option", opt]
        if net:
            args += ["--bandwidth-gbps", f"{net['bandwidth_gbps']:.6g}", "--latency-us", f"{net['latency_us']:.6g}"]
        return args + list(extra)


def calibrate(cluster: Cluster, out: Path) -> dict[str, Any]:
    """Measured collective sweep on the cluster and the alpha-beta fit (``gradsift.cluster.netbench``)."""
    res = run_on_cluster(cluster, ["gradsift.cluster.netbench", "--out", str(out), "--reps", "5"], timeout_s=600)
    if any(rc for rc, _, _ in res):
        raise ClusterError(f"calibration failed: {[e[-300:] for rc, _, e in res if rc][0]}")
    return json.loads(Path(out).read_text())


def train_on(cluster: Cluster, bench: Bench, steps: int, extra: Sequence[str], out: Path,
             net: dict[str, float] | None = None, task: str = "charlm", eval_every: int | None = None,
             **kw) -> tuple[list[tuple[int, str, str]], list[dict]]:
    res = run_on_cluster(cluster, bench.train_args(steps, extra, out, net, task, eval_every),
                         timeout_s=kw.pop("timeout_s", 3600), **kw)
    recs = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    return res, recs


def failure(res: Sequence[tuple[int, str, str]]) -> str:
    """The most telling line of a failed cluster run: gradsift's own error, else the worker's exit."""
    for rc, _, err in res:
        for line in err.splitlines():
            if line.startswith("gradsift: error:"):
                return line
    for rc, _, err in res:
        for line in err.splitlines():
            if "exitcode" in line or "Error" in line:
                return line.strip()
    return f"exit codes {[rc for rc, _, _ in res]}"


def step_stats(recs: Sequence[dict], skip: int = 3, net: dict[str, float] | None = None,
               world: int = 2) -> dict[str, Any]:
    """Medians over the steps after the first ``skip``; the alpha-beta time of the bytes moved; wire efficiency."""
    rs = list(recs[skip:]) or list(recs)
    if not rs:
        return {}
    med = statistics.median
    out: dict[str, Any] = {
        "step_s": med(r["step_s"] for r in rs),
        "compute_s": med(r["compute_s"] for r in rs),
        "select_s": med(r["select_s"] for r in rs),
        "est_step_s": med(r["est_step_s"] for r in rs),
        "bytes_per_worker": statistics.mean(r["bytes_per_worker"] for r in rs),
        "wire_bytes_per_worker": statistics.mean(r["wire_bytes_per_worker"] for r in rs),
        "comm_s": med(r["comm_s"] for r in rs) if all(r.get("comm_s") is not None for r in rs) else None,
    }
    model = med(r["est_comm_s"] for r in rs)
    if not model and net:  # PyTorch's hooks: their bytes in one all-reduce of the calibrated link
        model = NetworkModel(net["bandwidth_gbps"], net["latency_us"]).allreduce_s(out["bytes_per_worker"], world)
    out["model_comm_s"] = model
    out["wire_efficiency"] = (model / out["comm_s"]) if out["comm_s"] else None
    return out


def time_to(recs: Sequence[dict], target: float | None, metric: str = "perplexity") -> dict[str, Any]:
    """Wall time (sum of step times) and steps until the metric first reaches ``target`` (lower is better)."""
    t = 0.0
    for r in recs:
        t += r["step_s"]
        if target is not None and r.get(metric) is not None and r[metric] <= target:
            return {"seconds": t, "steps": r["step"], "reached": True}
    return {"seconds": t, "steps": recs[-1]["step"] if recs else 0, "reached": False}


def curve(recs: Sequence[dict], metric: str = "perplexity") -> list[tuple[float, float]]:
    """(wall seconds, metric) at every evaluated step."""
    t, pts = 0.0, []
    for r in recs:
        t += r["step_s"]
        if r.get(metric) is not None:
            pts.append((t, r[metric]))
    return pts
