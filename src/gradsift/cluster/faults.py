"""Faults on the namespace cluster: a killed rank that torchrun restarts, delay and loss, a cut link."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..launch.checkpoint import load_verified
from .hosts import Cluster, Link, TearDown, run_on_cluster
from .runs import Bench, calibrate, step_stats, train_on

def worker_pids(cluster: Cluster, host: int) -> list[int]:
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


def wait_for_step(metrics: Path, step: int, timeout_s: float = 600) -> bool:
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
        r1, _ = train_on(c, bench, steps, common, ref_dir, max_restarts=1)
        killed = {"pid": None}

        def killer(procs):
            if wait_for_step(kill_dir / "metrics.jsonl", kill_at):
                pids = worker_pids(c, 1)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed["pid"] = pids[0]

        r2, _ = train_on(c, bench, steps, common, kill_dir, max_restarts=1, on_start=killer)
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
            res, recs = train_on(c, bench, dsteps, ["--compressor", "topk"], fdir / label, cal["fit"])
            faults.setdefault("delay_loss", {})[label] = {"ok": all(rc == 0 for rc, _, _ in res), "fit": cal["fit"],
                                                          **step_stats(recs, skip=2, net=cal["fit"])}
    # 3. cut one link for longer than the collective timeout
    timeout = 15
    with TearDown(Cluster(hosts=2, name="gsc", links=[Link(rate="1gbit"), Link(rate="1gbit")])) as c:
        cdir = fdir / "cut"
        args = bench.train_args(200, ["--compressor", "topk", "--checkpoint-every", "3"], cdir)
        args[args.index("--timeout") + 1] = str(timeout)
        t_cut = {}

        def cutter(procs):
            if wait_for_step(cdir / "metrics.jsonl", 4):
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
                ck = load_verified(cdir / "checkpoints" / latest.read_text().strip())
                intact = {"iteration": ck["iteration"], "loads": True}
            except Exception as e:  # noqa: BLE001
                intact = {"loads": False, "error": str(e)[:200]}
        faults["cut_link"] = {"timeout_s": timeout, "exit_codes": [rc for rc, _, _ in res], "errors": lines,
                              "seconds_after_cut": (time.time() - t_cut["at"]) if "at" in t_cut else None,
                              "wall_s": time.time() - t0, "last_checkpoint": intact}
    return faults
