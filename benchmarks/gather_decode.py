"""Decoding a gather route's delivery, timed in one process: every rank's buffer of a bucket's top-k 1% segments (the
163-tensor MLP's layer shapes, or a model's from ``gradsift bench``'s list) decoded tensor by tensor and summed
(``unpack_gather`` of each row, then ``combine_sparse_many``), against the one compiled call (``add_gathered`` with
``mean``: each tensor zeroed, summed and divided in turn), alternating per round, into the same float32 bucket; the
two give the same bits (checked).

    .venv/bin/python benchmarks/gather_decode.py [--ranks 3] [--model mlp] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradsift.experiments.model_bench import model_shapes
from gradsift.memory.factory import make_compressor
from gradsift.transport.base import combine_sparse_many
from gradsift.transport.gather import add_gathered, pack_gather, unpack_gather

MLP = [("bag", (1000, 256))] + [(f"layers.{i}.weight", (256, 256)) for i in range(80)] + [("head", (10, 256))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--model", default="mlp", help="mlp (its matrices), or a model gradsift bench select knows")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shapes = MLP if a.model == "mlp" else model_shapes(a.model, None)[1]
    keys = [k for k, _ in shapes]
    per_rank = []
    for r in range(a.ranks):
        gen = torch.Generator().manual_seed(r)
        grads = [torch.randn(s, generator=gen) for _, s in shapes]
        per_rank.append(make_compressor("topk", 0.01).compress_many(keys, grads))
    mine = per_rank[0]
    rows = torch.cat([pack_gather(ps, 0, "cpu") for ps in per_rank]).view(a.ranks, -1)
    numels = [p.numel for p in mine]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    out = torch.zeros(sum(numels))

    def each() -> None:
        parts = [[] for _ in mine]
        for r in range(a.ranks):
            for i, (_, _, vals, idx) in enumerate(unpack_gather(rows[r], mine, r)):
                parts[i].append((vals, idx))
        combine_sparse_many(parts, numels, torch.float32, None, "cpu", out, starts)

    def once() -> None:
        add_gathered(out, rows, mine, starts, mean=True)  # (each tensor zeroed, summed and divided in turn)

    each()
    want = out.clone()
    once()
    assert torch.equal(out, want), "the one call gave other bits"
    times: dict[str, list[float]] = {"each": [], "once": []}
    for _ in range(a.rounds):
        for name, fn in (("each", each), ("once", once)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    entries = sum(p.count for ps in per_rank for p in ps)
    print(f"{a.model}, {len(shapes)} tensors, {a.ranks} ranks, top-k 1% ({entries} entries): tensor by tensor "
          f"{med['each']:.2f} ms, one call {med['once']:.2f} ms (median of {a.rounds}, same bits)")


if __name__ == "__main__":
    main()
