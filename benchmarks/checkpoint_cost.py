"""What a step's rollback point costs error feedback: ``checkpoint`` and ``compress_many`` of the 82 tensors the MLP
of ``benchmarks/hook_cost.py`` compresses (5.5M entries, top-k 1%), one thread, beside a clone of every residual
(what the checkpoint did before it kept the tensors themselves).

    .venv/bin/python benchmarks/checkpoint_cost.py --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradsift import make_compressor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--spec", default="topk")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [256 * 256] * 80 + [1000 * 256, 2560]
    keys = [f"t{i}" for i in range(len(sizes))]
    c = make_compressor(args.spec, 0.01, world_size=2)
    g = torch.Generator().manual_seed(0)
    ms: dict[str, list[float]] = {"checkpoint": [], "compress_many": [], "clone of every residual": []}
    for step in range(args.steps):
        grads = [torch.randn(n, generator=g) for n in sizes]
        t0 = time.perf_counter()
        token = c.checkpoint(keys)
        t1 = time.perf_counter()
        c.compress_many(keys, grads)
        t2 = time.perf_counter()
        copies = [c.residual[k].clone() for k in keys]
        t3 = time.perf_counter()
        del token, copies
        if step >= 5:
            for name, dt in zip(ms, (t1 - t0, t2 - t1, t3 - t2)):
                ms[name].append(dt * 1e3)
    print(f"{args.spec}, {len(keys)} tensors, {sum(sizes):,} entries, one thread, median of {args.steps - 5} steps")
    for name, v in ms.items():
        print(f"  {name}: {statistics.median(v):.2f} ms")


if __name__ == "__main__":
    main()
