"""What a worker receives per step: the all-gather route against the scatter route, at N = 2, 4, 8, 16.

    .venv/bin/python benchmarks/scatter_bytes.py --data ../shared/data/tinyshakespeare.txt

The simulator runs wordlm (5.5M parameters) with top-k 1%, every tensor compressed (--wire-plan off), two steps per
setting, each route forced (--sparse-collective gather | scatter). Reported: the wire bytes a worker receives per
step (what the transport counts: headers, positions or indices, values, padding, every slot of the fixed
capacities), the same in entries (8 bytes an entry: an int32 index or position and an fp32 value), and that over k
(the entries one worker selects in a step, summed over the tensors).
"""

from __future__ import annotations

import argparse

from gradsift.compressors.base import target_count
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--workers", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--ratio", type=float, default=0.01)
    a = ap.parse_args()
    print("| N | k per worker | all-gather: received per step | entries / k | scatter: received per step "
          "| entries / k |")
    print("|---|---|---|---|---|---|")
    for n in a.workers:
        row = []
        for route in ("gather", "scatter"):
            cfg = RunConfig(task="wordlm", compressor="topk", ratio=a.ratio, workers=n, steps=2, data=a.data,
                            wire_plan="off", sparse_collective=route, eval_every=1000)
            sim = Simulator(cfg)
            rec = sim.run()[-1]
            k = sum(target_count(a.ratio, p.numel()) for p in sim.params)
            received = rec["wire_bytes_per_worker"]
            row.append((k, received))
        k = row[0][0]
        cells = [f"{b / 2**20:.2f} MiB | {b / 8 / k:.2f}" for _, b in row]
        print(f"| {n} | {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
