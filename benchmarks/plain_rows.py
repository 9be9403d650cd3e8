"""The compiled pass's two spec builders, timed against each other in one process: top-k (error feedback, the
default wire) over a model's layer shapes, one call per 25 MiB bucket, alternating per round between the
column-at-a-time builder (``plain_call``, what top-k's groups use) and the row-at-a-time one (``many_compiled``),
each step divided by one read pass over the same tensors taken in the same round.

    .venv/bin/python benchmarks/plain_rows.py [--model resnet50] [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradsift.kernels.many as many
from gradsift.experiments.model_bench import compress_step, model_shapes, random_buckets
from gradsift.memory.factory import make_compressor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    label, shapes = model_shapes(a.model, None)
    pools = random_buckets(shapes)
    plain, rows = make_compressor("topk", 0.01), make_compressor("topk", 0.01)
    real = many.columns

    def by_rows(comp, pool):
        many.columns = lambda x: False
        try:
            compress_step(comp, pool)
        finally:
            many.columns = real

    for i in range(20):  # (the guesses settle)
        compress_step(plain, pools[i % 2])
        by_rows(rows, pools[i % 2])
    times = {"read": [], "plain": [], "rows": []}
    for i in range(a.rounds):
        pool = pools[i % 2]
        t0 = time.perf_counter()
        for group in pool:
            for _, g in group:
                g.sum()
        times["read"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compress_step(plain, pool)
        times["plain"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        by_rows(rows, pool)
        times["rows"].append(time.perf_counter() - t0)
    med = statistics.median
    passes = {k: med([t / r for t, r in zip(times[k], times["read"])]) for k in ("plain", "rows")}
    saved = med([b - p for p, b in zip(times["plain"], times["rows"])])
    print(f"{label}, {len(shapes)} tensors, top-k 1%, one thread: column builder {passes['plain']:.2f} read passes, "
          f"row builder {passes['rows']:.2f}; saved {1e3 * saved:.2f} ms a step (median of {a.rounds} rounds)")


if __name__ == "__main__":
    main()
