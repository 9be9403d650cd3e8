"""How fast one fresh process runs charlm, start after start: the machine's own scatter, no DDP, no gradsift hook.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/process_draw.py [--starts 6] [--data ../shared/data/tinyshakespeare.txt]

Each start is a new Python process that builds charlm's model (seed 0, the same batches every time), runs 25
forward and backward passes on one thread and prints the median of the last 20 in CPU time (``time.thread_time``:
the thread ran that long, it did not wait). On the 2-vCPU machine of ``docs/results.md`` the forward pass drew
27-35 ms from start to start: a bench row needs many steps and several runs before a few percent means anything.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def one_start(data: str) -> None:
    import torch

    from gradsift.tasks import make_task

    torch.set_num_threads(1)
    task = make_task("charlm", 1, seed=0, data=data)
    model = task.build_model()
    fwd, bwd = [], []
    for it in range(25):
        batch = task.batch(0, it)
        t0 = time.thread_time()
        loss = task.loss(model, batch)
        t1 = time.thread_time()
        loss.backward()
        fwd.append(t1 - t0)
        bwd.append(time.thread_time() - t1)
        model.zero_grad(set_to_none=True)
    print(f"{1e3 * statistics.median(fwd[5:]):.1f} {1e3 * statistics.median(bwd[5:]):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=6)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not Path(a.data).is_file():
        print(f"process_draw: {a.data} does not exist (pass --data PATH)", file=sys.stderr)
        return 2
    if a.one:
        one_start(a.data)
        return 0
    if a.starts < 1:
        print(f"process_draw: --starts must be at least 1, got {a.starts}", file=sys.stderr)
        return 2
    rows = []
    for i in range(a.starts):
        out = subprocess.run([sys.executable, __file__, "--one", "--data", a.data], capture_output=True, text=True)
        if out.returncode:
            print(f"process_draw: start {i + 1} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        f, b = map(float, out.stdout.split())
        rows.append((f, b))
        print(f"start {i + 1}: forward {f:.1f} ms, backward {b:.1f} ms", flush=True)
    fs = [r[0] for r in rows]
    print(f"forward over {len(rows)} starts: {min(fs):.1f}-{max(fs):.1f} ms (slowest / fastest {max(fs) / min(fs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
