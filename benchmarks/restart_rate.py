"""How often torchrun's automatic restart recovers a 2-rank gradsift run on one node after a rank is SIGKILLed, and
whether the recovered run is bit-identical to an uninterrupted one.

    .venv/bin/python benchmarks/restart_rate.py --runs 10                  # the documented command
    .venv/bin/python benchmarks/restart_rate.py --runs 10 --shared-store  # no TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

Each run: ``torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT -m gradsift train --runtime ddp --task digits-mlp --compressor topk --steps 200 --checkpoint-every 50
--resume auto --timeout 60 --out DIR`` (``--standalone`` in place of the endpoint with ``--standalone``), rank 1's
worker SIGKILLed once the metrics reach step 120. A run recovers when torchrun exits 0 within ``--limit`` seconds,
``metrics.jsonl`` holds steps 1..200 once each and ``final_model.pt`` equals the uninterrupted run's bit for bit.
Prints each run's outcome and the count (docs/ddp-reference.md, "Restarts, on one node or many").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS, KILL_AT = 200, 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(tag: str, extra: bytes = b"") -> list[int]:
    """Pids whose environment carries this run's tag (and ``extra``, e.g. ``RANK=1``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RESTART_RATE_TAG={tag}".encode() in env and (not extra or extra in env):
            out.append(int(d.name))
    return out


def steps_done(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(l)["step"] for l in lines if l.strip().endswith("}")), default=0)


def one_run(out: Path, kill: bool, shared_store: bool, standalone: bool, limit: float) -> tuple[int | None, str, int]:
    """(torchrun's exit code or None on a hang, the last stderr line, the step rank 1 was killed at or 0)."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RESTART_RATE_TAG=tag)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rdzv = ["--standalone"] if standalone else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", *rdzv, "-m", "gradsift", "train",
           "--runtime", "ddp", "--task", "digits-mlp", "--compressor", "topk", "--steps", str(STEPS),
           "--checkpoint-every", "50", "--resume", "auto", "--timeout", "60", "--out", str(out)]
    log = out.parent / f"{out.name}.stderr"
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        deadline = time.monotonic() + limit
        killed, at = not kill, 0
        while p.poll() is None and time.monotonic() < deadline:
            if not killed and (done := steps_done(out / "metrics.jsonl")) >= KILL_AT:
                for pid in tagged(tag, b"RANK=1"):
                    os.kill(pid, signal.SIGKILL)
                    killed, at = True, done
            time.sleep(0.05)
        code = p.poll()
        if code is None:  # a hang: everything of this run goes
            for pid in tagged(tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            p.wait()
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip() and not set(l.strip()) <= {"="}]
    said = [l for l in lines if "gradsift: error" in l or "Error" in l or "refused" in l]
    lines = said or lines
    return code, (lines[-1][-160:] if lines else ""), at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--shared-store", action="store_true", help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset")
    ap.add_argument("--standalone", action="store_true", help="torchrun --standalone instead of a c10d endpoint")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds before a run counts as hung")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradsift-restarts-") as tmp:
        ref = Path(tmp) / "ref"
        code, last, _ = one_run(ref, False, False, a.standalone, a.limit)
        if code != 0:
            sys.exit(f"the uninterrupted run failed ({code}): {last}")
        want = torch.load(ref / "final_model.pt", weights_only=True)
        good = 0
        for i in range(a.runs):
            out = Path(tmp) / f"run{i}"
            t0 = time.monotonic()
            code, last, at = one_run(out, True, a.shared_store, a.standalone, a.limit)
            verdict = ("hung" if code is None else f"exit {code}") + \
                (f", killed at step {at}" if at else ", not killed")
            if code == 0 and at:
                got = torch.load(out / "final_model.pt", weights_only=True)
                steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
                same = all(torch.equal(want[k], got[k]) for k in want)
                whole = steps == list(range(1, STEPS + 1))
                good += same and whole
                verdict += f", {'bit-identical' if same else 'DIFFERENT'}, steps {'1..200' if whole else 'with gaps'}"
            else:
                verdict += f": {last}"
            print(f"run {i + 1}/{a.runs} ({time.monotonic() - t0:.0f} s): {verdict}", flush=True)
    how = "--standalone" if a.standalone else "c10d endpoint"
    store = "shared agent store" if a.shared_store else "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    print(f"recovered bit-identical: {good} of {a.runs} ({how}, {store})")


if __name__ == "__main__":
    main()
