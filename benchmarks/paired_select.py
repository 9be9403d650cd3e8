"""Two methods' steps alternating in one process over a model's layer shapes: the median of their paired ratios.

    .venv/bin/python benchmarks/paired_select.py --model resnet50 --methods topk sidco --rounds 100

Each method compresses every tensor of the model once per step as ``gradsift bench select --model`` does (the same
step: one ``compress_many`` per 25 MiB bucket, default memory, ratio 0.01, one thread), after 20 untimed steps; the
two methods alternate, so each pair of steps sees the same machine. Printed: each method's median step, the ratio of
the medians and the median of the per-round ratios (second over first) -- the figure that tells a few percent apart
on a machine whose speed drifts by more than that between runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradsift.experiments.model_bench import MODELS, compress_step, model_shapes, random_buckets
from gradsift.memory.factory import make_compressor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--methods", nargs=2, default=["topk", "sidco"], metavar="SPEC")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)
    _, shapes = model_shapes(a.model, None)
    pools = random_buckets(shapes)
    comps = [make_compressor(spec, a.ratio) for spec in a.methods]
    for i in range(20):
        for c in comps:
            compress_step(c, pools[i % 2])
    times: list[list[float]] = [[], []]
    for i in range(a.rounds):
        for j, c in enumerate(comps):
            t0 = time.perf_counter()
            compress_step(c, pools[i % 2])
            times[j].append(time.perf_counter() - t0)
    med = [statistics.median(t) * 1e3 for t in times]
    paired = statistics.median(b / a for a, b in zip(*times))
    print(f"{a.model}: {a.methods[0]} {med[0]:.2f} ms, {a.methods[1]} {med[1]:.2f} ms a step; ratio of the medians "
          f"{med[1] / med[0]:.3f}, median of the paired ratios {paired:.3f} ({a.rounds} rounds)")


if __name__ == "__main__":
    main()
