"""Measure collectives on the current process group; fit the alpha-beta model to them.

Run under torchrun (``python -m gradsift.netbench --out FILE``): every rank
times ring all-reduce and all-gather of a sweep of sizes (median of several
repetitions, after a warm-up), rank 0 writes the times and the fitted model.
The fit is least squares of

    all-reduce:  t = 2(N-1) alpha + 2(N-1)/N * S / beta
    all-gather:  t = (N-1) alpha + (N-1) S / beta

over both sweeps (weighted by 1/t so small and large messages count alike),
giving latency alpha (us) and bandwidth beta (Gbit/s) for :class:`gradsift.route.netmodel.NetworkModel`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = [1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22]


def fit_alpha_beta(samples: list[dict], world: int) -> dict[str, float]:
    """Fit latency alpha and bandwidth beta to measured collective times, robustly.

    The bandwidth comes from the large messages (the slope of time against the
    model's byte term, least squares over the upper half of the sizes), the
    latency from the small ones (the median of what is left per message after
    the byte term). Small collectives on loaded machines are noisy; a joint
    least-squares fit lets a few of them distort the bandwidth.
    """
    n = world

    def terms(s):  # (messages, bytes term) of the ring model
        if s["op"] == "all_reduce":
            return 2 * (n - 1), 2 * (n - 1) / n * s["bytes"]
        return (n - 1), (n - 1) * s["bytes"]

    sizes = sorted({s["bytes"] for s in samples})
    big = [s for s in samples if s["bytes"] >= sizes[len(sizes) // 2]]
    xs = [terms(s)[1] for s in big]
    ys = [s["seconds"] for s in big]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    inv_beta = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 1e-15) if var > 0 else 1e-15
    small = [s for s in samples if s["bytes"] <= sizes[max(0, len(sizes) // 2 - 1)]]
    per_msg = sorted(max(0.0, (s["seconds"] - terms(s)[1] * inv_beta) / terms(s)[0]) for s in small)
    alpha = per_msg[len(per_msg) // 2] if per_msg else 0.0
    return {"latency_us": alpha * 1e6, "bandwidth_gbps": 8.0 / inv_beta / 1e9}


def measure(sizes=SIZES, reps: int = 5) -> list[dict]:
    out = []
    world = dist.get_world_size()
    for op in ("all_reduce", "all_gather"):
        for size in sizes:
            x = torch.ones(size // 4, dtype=torch.float32)
            buf = torch.empty(x.numel() * world, dtype=torch.float32)
            times = []
            for r in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather_into_tensor(buf, x)
                dt = time.perf_counter() - t0
                if r:
                    times.append(dt)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append({"op": op, "bytes": size, "seconds": float(t)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-bytes", type=int, default=SIZES[-1])
    a = ap.parse_args()
    from ..launch import exit_process, init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    samples = measure([s for s in SIZES if s <= a.max_bytes], a.reps)
    if dist.get_rank() == 0:
        fit = fit_alpha_beta(samples, dist.get_world_size())
        Path(a.out).write_text(json.dumps({"world_size": dist.get_world_size(), "samples": samples, "fit": fit},
                                          indent=2) + "\n")
    exit_process(0)  # the group left alive to os._exit, as gradsift train does (docs/ddp-reference.md, "Ending
    # the process")


if __name__ == "__main__":
    main()
