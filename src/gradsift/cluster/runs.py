"""One training run on the namespace cluster, its calibration, and what the bench reads from its records."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import kernels
from ..experiments.runner import Progress
from ..route.netmodel import NetworkModel
from ..runtime.records import read_metrics
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
                "--probe-every", str(eval_every or max(steps, 1)),  # (rank 0's probe forward, only where evaluated)
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
    """One training run on every host. The compiled kernels are built here first (once a machine; the hosts share
    its cache): a first use builds them in about 5 s, which would otherwise land in a run's first timed step."""
    kernels.backend()
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
    """Medians over the steps after the first ``skip``; the alpha-beta time of the bytes moved; wire efficiency.
    A paired run's (``train --paired-ddp``) steps that DDP's own all-reduce took are not the method's: they give
    ``paired_ddp_step_s`` and ``paired_speedup`` (that median over the method's own over the same window)."""
    window = list(recs[skip:]) or list(recs)
    rs = [r for r in window if r.get("paired") != "ddp"]
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
    if all(r.get("comm_min_s") is not None for r in rs):  # per step the least over ranks (train's comm_min_s)
        out["comm_rank0_s"], out["comm_s"] = out["comm_s"], med(r["comm_min_s"] for r in rs)
    model = med(r["est_comm_s"] for r in rs)
    if not model and net:  # PyTorch's hooks: their bytes in one all-reduce of the calibrated link
        model = NetworkModel(net["bandwidth_gbps"], net["latency_us"]).allreduce_s(out["bytes_per_worker"], world)
    out["model_comm_s"] = model
    out["wire_efficiency"] = (model / out["comm_s"]) if out["comm_s"] else None
    ref = [r["step_s"] for r in window if r.get("paired") == "ddp"]
    own = [r["step_s"] for r in rs if r.get("paired") == "gradsift"]
    if ref and own:
        out["paired_ddp_step_s"] = med(ref)
        out["paired_speedup"] = med(ref) / med(own)
    return out


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of a method (``step_stats`` rows, each with ``ok``/``error``): every measured
    field is the median over the runs that finished; ``step_s_runs`` keeps each run's step time and ``runs`` their
    number; the wire plan's choice is the most common one, with its count when the runs disagreed. Processes on
    this machine differ by up to ~15% in compute speed from one start to the next, so one run per method cannot
    separate methods closer than that."""
    good = [r for r in runs if r.get("ok")]
    if not good:
        return {"ok": False, "error": next((r.get("error") for r in runs if r.get("error")), "no run finished"),
                "runs": 0}
    out: dict[str, Any] = {"ok": True, "error": None, "runs": len(good), "step_s_runs": [r["step_s"] for r in good]}
    if any(r.get("paired_speedup") is not None for r in good):
        out["paired_speedup_runs"] = [r.get("paired_speedup") for r in good]
    for key in ("step_s", "compute_s", "select_s", "est_step_s", "bytes_per_worker", "wire_bytes_per_worker",
                "comm_s", "comm_rank0_s", "model_comm_s", "wire_efficiency", "paired_ddp_step_s", "paired_speedup"):
        vals = [r[key] for r in good if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    choices = [r["wire_probe"] for r in good if r.get("wire_probe")]
    if choices:
        top = max(dict.fromkeys(choices), key=choices.count)
        out["wire_probe"] = top if choices.count(top) == len(good) else f"{top} {choices.count(top)}/{len(good)}"
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
