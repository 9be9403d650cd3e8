"""Measured speed-ups on shaped links, and fault tolerance, on a namespace cluster.

``gradsift cluster bench --out DIR [--quick]`` builds clusters of 2 and 4 hosts
at 100 Mbit/s and 1 Gbit/s, calibrates the alpha-beta model on each from a
measured all-reduce/all-gather sweep, trains ``charlm`` with every method for a
fixed step budget (one thread per rank), measures time to a target perplexity
at 100 Mbit/s, and injects the three faults. It writes ``DIR/cluster.md``
(tables), ``DIR/cluster.json`` and ``DIR/throughput.png``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..experiments.runner import Progress
from ..records import read_metrics, write_json
from .hosts import Cluster, ClusterError, Link, TearDown, parse_rate, run_on_cluster

SHAKESPEARE = Path(__file__).resolve().parents[4] / "shared" / "data" / "tinyshakespeare.txt"

METHODS = [  # label, compressor args (ratio 0.01 unless set)
    ("dense", ["--compressor", "dense"]),
    ("topk", ["--compressor", "topk"]),
    ("sidco", ["--compressor", "sidco"]),
    ("gsb", ["--compressor", "gsb"]),
    ("regtopk", ["--compressor", "regtopk"]),
    ("rtopk", ["--compressor", "rtopk"]),
    ("dgc", ["--compressor", "dgc"]),
    ("SLGS (topk, model)", ["--compressor", "topk", "--granularity", "model"]),
    ("LAGS (topk, --lags)", ["--compressor", "topk", "--lags"]),
]


@dataclass
class Bench:
    out: Path
    data: Path
    quick: bool
    progress: Progress
    task_options: Sequence[str] = ()

    def train_args(self, steps: int, extra: Sequence[str], out: Path, net: dict[str, float] | None = None) -> list[str]:
        args = ["gradsift", "train", "--runtime", "ddp", "--task", "charlm", "--data", str(self.data),
                "--steps", str(steps), "--ratio", "0.01", "--lr", "1.0", "--clip-norm", "0.25",
                "--eval-every", str(max(steps, 1)), "--bucket-cap-mb", "1", "--out", str(out), "--quiet",
                "--timeout", "120"]
        for opt in self.task_options:
            args += ["--task-option", opt]
        if net:
            args += ["--bandwidth-gbps", f"{net['bandwidth_gbps']:.6g}", "--latency-us", f"{net['latency_us']:.6g}"]
        return args + list(extra)


def calibrate(cluster: Cluster, out: Path) -> dict[str, Any]:
    """Measured collective sweep on the cluster and the alpha-beta fit (``gradsift.netbench``)."""
    res = run_on_cluster(cluster, ["gradsift.cluster.netbench", "--out", str(out), "--reps", "5"], timeout_s=600)
    if any(rc for rc, _, _ in res):
        raise ClusterError(f"calibration failed: {[e[-300:] for rc, _, e in res if rc][0]}")
    return json.loads(Path(out).read_text())


def train_on(cluster: Cluster, bench: Bench, label: str, steps: int, extra: Sequence[str], out: Path,
             net: dict[str, float] | None = None, **kw) -> tuple[list[tuple[int, str, str]], list[dict]]:
    res = run_on_cluster(cluster, bench.train_args(steps, extra, out, net), timeout_s=kw.pop("timeout_s", 1800),
                         **kw)
    recs = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    return res, recs


def _failure(res: Sequence[tuple[int, str, str]]) -> str:
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


def step_stats(recs: Sequence[dict], skip: int = 3) -> dict[str, float]:
    rs = list(recs[skip:]) or list(recs)
    if not rs:
        return {}
    return {
        "step_s": statistics.median(r["step_s"] for r in rs),
        "comm_s": statistics.median(r["comm_s"] for r in rs),
        "compute_s": statistics.median(r["compute_s"] for r in rs),
        "est_step_s": statistics.median(r["est_step_s"] for r in rs),
        "bytes_per_worker": statistics.mean(r["bytes_per_worker"] for r in rs),
        "wire_bytes_per_worker": statistics.mean(r["wire_bytes_per_worker"] for r in rs),
    }


def run_cluster_bench(out: Path, *, quick: bool = False, data: str | None = None,
                      progress: Progress | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_path = Path(data) if data else SHAKESPEARE
    if not data_path.is_file():
        raise ClusterError(f"charlm needs its text file: {data_path} does not exist (pass --data)")
    progress = progress or Progress(False)
    bench = Bench(out, data_path, quick, progress,
                  task_options=("hidden=128", "seq_len=32") if quick else ())
    hosts_list = [2] if quick else [2, 4]
    rates = ["100mbit"] if quick else ["100mbit", "1gbit"]
    methods = [m for m in METHODS if m[0] in ("dense", "topk")] if quick else METHODS
    steps = 6 if quick else 20
    results: dict[str, Any] = {"sweep": [], "calibration": {}, "faults": {}, "time_to_target": []}
    total = len(hosts_list) * len(rates) * (len(methods) + 1)
    with progress.task("cluster bench", total) as advance:
        for hosts in hosts_list:
            for rate in rates:
                key = f"{hosts}x{rate}"
                with TearDown(Cluster(hosts=hosts, name="gsb", links=[Link(rate=rate) for _ in range(hosts)])) as c:
                    cal = calibrate(c, out / f"calibration-{key}.json")
                    results["calibration"][key] = cal
                    advance(1, f"calibrated {key}")
                    for label, extra in methods:
                        d = out / "runs" / f"{key}-{label.split()[0]}" / ("lags" if "lags" in " ".join(extra) else
                                                                        ("slgs" if "model" in extra else "run"))
                        res, recs = train_on(c, bench, label, steps, extra, d, cal["fit"])
                        ok = all(rc == 0 for rc, _, _ in res)
                        st = step_stats(recs) if ok else {}
                        results["sweep"].append({"hosts": hosts, "rate": rate, "method": label, "ok": ok, **st,
                                                 "error": None if ok else _failure(res)})
                        advance(1, f"{key} {label}")
        # time to target at 100 Mbit/s
        hosts = 2 if quick else 4
        tt_steps = 12 if quick else 150
        with TearDown(Cluster(hosts=hosts, name="gsb", links=[Link(rate="100mbit") for _ in range(hosts)])) as c:
            cal = results["calibration"].get(f"{hosts}x100mbit") or calibrate(c, out / "calibration-tt.json")
            runs = {}
            for label in (["dense", "topk"] if quick else ["dense", "topk", "sidco", "gsb"]):
                d = out / "runs" / f"target-{label}"
                args = ["--compressor", label, "--eval-every", str(max(tt_steps // 15, 1))]
                res, recs = train_on(c, bench, label, tt_steps, args, d, cal["fit"])
                runs[label] = recs
            target = _target(runs.get("dense", []))
            for label, recs in runs.items():
                results["time_to_target"].append({"method": label, "target": target, **_time_to(recs, target)})
        results["faults"] = run_faults(bench, out, quick)
    write_json(out / "cluster.json", results)
    plot_throughput(out, results)
    return write_cluster_md(out, results, quick)


def _target(dense: Sequence[dict]) -> float | None:
    ppl = [r["perplexity"] for r in dense if r.get("perplexity") is not None]
    if not ppl:
        return None
    return ppl[min(len(ppl) - 1, (2 * len(ppl)) // 3)] * 1.02  # what dense reaches two thirds into its run


def _time_to(recs: Sequence[dict], target: float | None) -> dict[str, Any]:
    t = 0.0
    for r in recs:
        t += r["step_s"]
        if target is not None and r.get("perplexity") is not None and r["perplexity"] <= target:
            return {"seconds": t, "steps": r["step"], "reached": True}
    return {"seconds": t, "steps": recs[-1]["step"] if recs else 0, "reached": False}


# ------------------------------------------------------------------ faults
def _worker_pids(cluster: Cluster, host: int) -> list[int]:
    """PIDs of training workers (not torchrun agents) in a host namespace."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.host_ns(host)], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "gradsift" in cmd and "torchrun" not in cmd and "--relay" not in cmd:
            out.append(int(pid))
    return out


def _wait_for_step(metrics: Path, step: int, timeout_s: float = 600) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return False


def run_faults(bench: Bench, out: Path, quick: bool) -> dict[str, Any]:
    """Kill-and-restart, delay + loss on one link, and a cut link longer than the timeout."""
    import torch

    faults: dict[str, Any] = {}
    steps, every, kill_at = (12, 4, 6) if quick else (30, 10, 15)
    fdir = out / "faults"
    # 1. kill one rank mid-run; torchrun restarts; training resumes from the last checkpoint
    with TearDown(Cluster(hosts=2, name="gsf", links=[Link(rate="1gbit"), Link(rate="1gbit")])) as c:
        ref_dir, kill_dir = fdir / "undisturbed", fdir / "killed"
        common = ["--compressor", "topk", "--checkpoint-every", str(every), "--resume", "auto"]
        r1, _ = train_on(c, bench, "undisturbed", steps, common, ref_dir, max_restarts=1)
        killed = {"pid": None}

        def killer(procs):
            if _wait_for_step(kill_dir / "metrics.jsonl", kill_at):
                pids = _worker_pids(c, 1)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed["pid"] = pids[0]

        r2, _ = train_on(c, bench, "killed", steps, common, kill_dir, max_restarts=1, on_start=killer)
        (fdir / "killed.stderr").write_text("\n\n".join(e for _, _, e in r2))
        same = None
        if (ref_dir / "final_model.pt").exists() and (kill_dir / "final_model.pt").exists():
            a = torch.load(ref_dir / "final_model.pt")
            b = torch.load(kill_dir / "final_model.pt")
            same = all(torch.equal(a[k], b[k]) for k in a)
        faults["kill_restart"] = {"killed_pid": killed["pid"], "killed_at_step": kill_at,
                                  "exit_codes": [rc for rc, _, _ in r2], "undisturbed_exit": [rc for rc, _, _ in r1],
                                  "same_parameters": same, "checkpoint_every": every, "steps": steps}
    # 2. 50 ms delay and 1% loss on one link
    dsteps = 5 if quick else 12
    base_link, bad_link = Link(rate="100mbit"), Link(rate="100mbit", delay_ms=50, loss_pct=1)
    for label, links in (("clean", [base_link, base_link]), ("delay50ms_loss1pct", [base_link, bad_link])):
        with TearDown(Cluster(hosts=2, name="gsd", links=links)) as c:
            cal = calibrate(c, fdir / f"calibration-{label}.json")
            res, recs = train_on(c, bench, label, dsteps, ["--compressor", "topk"], fdir / label, cal["fit"])
            faults.setdefault("delay_loss", {})[label] = {"ok": all(rc == 0 for rc, _, _ in res), "fit": cal["fit"],
                                                          **step_stats(recs, skip=2)}
    # 3. cut one link for longer than the collective timeout
    timeout = 15
    with TearDown(Cluster(hosts=2, name="gsc", links=[Link(rate="1gbit"), Link(rate="1gbit")])) as c:
        cdir = fdir / "cut"
        args = bench.train_args(200, ["--compressor", "topk", "--checkpoint-every", "3"], cdir)
        args[args.index("--timeout") + 1] = str(timeout)
        t_cut = {}

        def cutter(procs):
            if _wait_for_step(cdir / "metrics.jsonl", 4):
                t_cut["at"] = time.time()
                c.cut(1)
                time.sleep(timeout * 2.5)
                c.restore(1)

        t0 = time.time()
        res = run_on_cluster(c, args, timeout_s=600, on_start=cutter)
        lines = [[l for l in e.splitlines() if l.startswith("gradsift: error:")] for _, _, e in res]
        intact = None
        latest = cdir / "checkpoints" / "latest"
        if latest.exists():
            try:
                ck = torch.load(cdir / "checkpoints" / latest.read_text().strip(), weights_only=False)
                intact = {"iteration": ck["iteration"], "loads": True}
            except Exception as e:  # noqa: BLE001
                intact = {"loads": False, "error": str(e)[:200]}
        faults["cut_link"] = {"timeout_s": timeout, "exit_codes": [rc for rc, _, _ in res], "errors": lines,
                              "seconds_after_cut": (time.time() - t_cut["at"]) if "at" in t_cut else None,
                              "wall_s": time.time() - t0, "last_checkpoint": intact}
    return faults


# ------------------------------------------------------------------ report
def plot_throughput(out: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["sweep"] if r.get("ok")]
    hosts = sorted({r["hosts"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(hosts)), figsize=(6 * max(1, len(hosts)), 4), squeeze=False)
    for j, h in enumerate(hosts):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(((_rate_gbps(r["rate"]), 1.0 / r["step_s"]) for r in rows
                          if r["hosts"] == h and r["method"] == method and r.get("step_s")))
            if pts:
                axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        axes[0][j].set_xscale("log")
        axes[0][j].set_xlabel("link rate (Gbit/s)")
        axes[0][j].set_ylabel("steps per second (measured)")
        axes[0][j].set_title(f"charlm, {h} hosts")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)


def _rate_gbps(rate: str) -> float:
    return parse_rate(rate) / 1e9


def write_cluster_md(out: Path, results: dict[str, Any], quick: bool) -> Path:
    lines = ["# Measured on shaped links (network namespaces on one machine)", ""]
    lines += ["Calibrated alpha-beta model per cluster (least squares over a measured all-reduce/all-gather sweep):", "",
              "| cluster | latency (us) | bandwidth (Gbit/s) |", "|---|---|---|"]
    for key, cal in results["calibration"].items():
        lines.append(f"| {key} | {cal['fit']['latency_us']:.0f} | {cal['fit']['bandwidth_gbps']:.3f} |")
    lines += ["", "Per method: medians over the steps after the first 3 (one thread per rank). Speed-up = dense's "
              "step time / the method's. `model est.` is the calibrated alpha-beta estimate for the same run "
              "(measured compute + selection + modelled communication, overlapped with backward for per-layer runs).",
              "", "| hosts | rate | method | step (ms) | compute (ms) | comm in flight (ms) | model est. (ms) "
              "| sent/worker/step | speed-up vs dense |", "|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["hosts"], r["rate"]): r.get("step_s") for r in results["sweep"] if r["method"] == "dense" and r.get("ok")}
    for r in results["sweep"]:
        if not r.get("ok"):
            lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | failed: {str(r.get('error'))[:80]} | | | | | |")
            continue
        d = dense.get((r["hosts"], r["rate"]))
        speedup = f"{d / r['step_s']:.2f}x" if d else "-"
        lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | {1e3 * r['step_s']:.0f} | {1e3 * r['compute_s']:.0f} "
                     f"| {1e3 * r['comm_s']:.0f} | {1e3 * r['est_step_s']:.0f} | {r['bytes_per_worker'] / 1024:.1f} KiB "
                     f"| {speedup} |")
    if results["time_to_target"]:
        tgt = results["time_to_target"][0]["target"]
        lines += ["", f"Time to a target perplexity of {tgt:.3g} at 100 Mbit/s (the target is what dense reaches two "
                      "thirds into its run):", "", "| method | reached | steps | seconds |", "|---|---|---|---|"]
        for r in results["time_to_target"]:
            lines.append(f"| {r['method']} | {'yes' if r['reached'] else 'no'} | {r['steps']} | {r['seconds']:.1f} |")
    f = results.get("faults", {})
    if f:
        lines += ["", "## Faults", ""]
        k = f.get("kill_restart")
        if k:
            lines.append(f"1. **Kill one rank** (SIGKILL to rank 1's worker at step {k['killed_at_step']}, torchrun "
                         f"`--max-restarts 1`, checkpoints every {k['checkpoint_every']} steps, `--resume auto`): exit "
                         f"codes {k['exit_codes']}; final parameters {'identical to' if k['same_parameters'] else 'DIFFERENT from'} "
                         f"the undisturbed run's.")
        dl = f.get("delay_loss")
        if dl and "clean" in dl and "delay50ms_loss1pct" in dl:
            a, b = dl["clean"], dl["delay50ms_loss1pct"]
            lines.append(f"2. **50 ms delay and 1% loss on one link** (2 hosts, 100 Mbit/s, topk): training "
                         f"{'continues' if b.get('ok') else 'FAILED'}; step time {1e3 * a.get('step_s', 0):.0f} ms -> "
                         f"{1e3 * b.get('step_s', 0):.0f} ms; the model calibrated on the impaired link predicts "
                         f"{1e3 * b.get('est_step_s', 0):.0f} ms (latency {b['fit']['latency_us'] / 1e3:.0f} ms, "
                         f"{1e3 * b['fit']['bandwidth_gbps']:.1f} Mbit/s effective).")
        cl = f.get("cut_link")
        if cl:
            errs = [e[0] if e else "(no gradsift error line)" for e in cl["errors"]]
            lines.append(f"3. **Cut one link for {cl['timeout_s'] * 2.5:.0f} s** (timeout {cl['timeout_s']} s): exit codes "
                         f"{cl['exit_codes']}; every rank's error: {errs}; last checkpoint {cl['last_checkpoint']}.")
    lines += ["", "![throughput](throughput.png)", ""]
    p = out / "cluster.md"
    p.write_text("\n".join(lines))
    return p
