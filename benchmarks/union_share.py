"""How much the workers' top-k entries overlap: the all-gather route's mean against what the workers sent.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/union_share.py --data ../shared/data/tinyshakespeare.txt \\
        --workers 8 --tasks mnist1d-cnn:100 charlm:60 gptlm:80

By all-gather, the round's mean holds the union of every worker's k entries; the scatter route's owners keep
``scatter_keep`` x k of the sum. Where the union is near N x k (the workers pick different entries), keeping fewer
drops most of what the all-gather would apply. Top-k 1% with error feedback, every tensor compressed, the all-gather
forced, seed 0, TASK:STEPS for each task; over the second half of the steps it prints the mean's nonzero entries in
units of one worker's k and as a share of every entry sent. The count is taken by wrapping the simulator's sparse
sum (``combine_sparse_many``), which the training does not otherwise expose.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import gradsift.transport.local as local
from gradsift.experiments.runner import train_to_dir
from gradsift.runtime.runconfig import RunConfig

OPTIONS = {"mnist1d-cnn": {"channels": 128}}  # the scatter accuracy runs' model (benchmarks/scatter_accuracy.py)


def measure(task: str, workers: int, steps: int, data: str) -> dict:
    rounds: list[tuple[int, int]] = []  # per aggregation: (nonzeros of the means, entries sent)
    now = [0, 0]
    combine, aggregate = local.combine_sparse_many, local.LocalGroup.aggregate

    def counted_combine(parts, numels, dtype, weights, device):
        out = combine(parts, numels, dtype, weights, device)
        now[0] += sum(int(torch.count_nonzero(m)) for m in out)
        now[1] += sum(int(v.numel()) for tensor_parts in parts for v, _ in tensor_parts)
        return out

    def counted_aggregate(self, *a, **kw):
        delivery = aggregate(self, *a, **kw)
        rounds.append((now[0], now[1]))
        now[0] = now[1] = 0
        return delivery

    local.combine_sparse_many, local.LocalGroup.aggregate = counted_combine, counted_aggregate
    try:
        cfg = RunConfig(task=task, task_options=OPTIONS.get(task, {}), compressor="topk", ratio=0.01,
                        workers=workers, seed=0, steps=steps, data=data, wire_plan="off", sparse_collective="gather")
        with tempfile.TemporaryDirectory() as tmp:
            train_to_dir(cfg, Path(tmp) / "run")
    finally:
        local.combine_sparse_many, local.LocalGroup.aggregate = combine, aggregate
    tail = rounds[len(rounds) // 2:]
    union, sent = sum(u for u, _ in tail), sum(s for _, s in tail)
    return {"task": task, "workers": workers, "steps": steps, "union_over_k": round(union / (sent / workers), 2),
            "union_over_sent": round(union / sent, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tasks", nargs="+", default=["mnist1d-cnn:100", "charlm:60", "gptlm:80"], metavar="TASK:STEPS")
    a = ap.parse_args()
    print("| task | workers | steps | the mean's entries (x k) | share of the entries sent |")
    print("|---|---|---|---|---|")
    for spec in a.tasks:
        task, _, steps = spec.partition(":")
        r = measure(task, a.workers, int(steps or 100), a.data)
        print(f"| {task} | {r['workers']} | {r['steps']} | {r['union_over_k']:.2f} | {r['union_over_sent']:.0%} |",
              flush=True)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
