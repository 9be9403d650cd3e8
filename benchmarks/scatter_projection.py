"""Projection: a step's communication time by route, from the alpha-beta model, N = 2 ... 1024.

    .venv/bin/python benchmarks/scatter_projection.py --out docs/img/scatter-projection

For models of 25M, 350M and 1.3B parameters (fp32 gradients in DDP's default 25 MiB buckets, one group each),
top-k at 1% and 0.1%, links of 10 and 100 Gbit/s with 10 us per message: the time of dense ring all-reduce, of
the all-gather route, of the scatter route (one all-to-all, then one all-gather of the owners' selections), and
which the wire plan picks (gradsift.route.plan.WirePlan.decide, on one bucket-sized tensor). Sizes are the wire
format's (gradsift.transport.wire: headers, int32 indices or positions, fp32 values, padding, the per-owner
slack). Writes NAME.md (tables) and NAME.png (curves).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gradsift import make_compressor
from gradsift.route.netmodel import NetworkModel
from gradsift.payload import Partition
from gradsift.route.plan import WirePlan
from gradsift.transport.wire import HEADER_BYTES, POSITION_DTYPE, pad

MODELS = {"25M": 25_000_000, "350M": 350_000_000, "1.3B": 1_300_000_000}
RATIOS = (0.01, 0.001)
LINKS = (10.0, 100.0)
WORLDS = [2 ** i for i in range(1, 11)]
LATENCY_US = 10.0
SELECT_GBPS = 200.0  # links of 10-100 Gbit/s are GPU clusters: selection reads at ~200 GB/s, not a CPU thread's 2.5
BUCKET = 25 * 2 ** 20 // 4  # fp32 entries in DDP's default bucket


def step_times(params: int, ratio: float, gbps: float, n: int) -> dict[str, float]:
    """Seconds of communication per step for each route, and the plan's pick per bucket."""
    net = NetworkModel(gbps, LATENCY_US)
    comp = make_compressor("topk", ratio)
    plan = WirePlan(net, n, min_numel=0, select_gbps=SELECT_GBPS)
    full, rest = divmod(params, BUCKET)
    buckets = [BUCKET] * full + ([rest] if rest else [])
    t = {"dense": 0.0, "gather": 0.0, "scatter": 0.0, "plan": 0.0}
    picks = set()
    for d in buckets:
        k = max(1, round(ratio * d))
        dense = net.allreduce_s(4 * (d + 1), n)
        gather = net.allgather_s(HEADER_BYTES + pad(k * 4) + pad(k * 4), n)
        part = Partition("b", d, n, 1, 0, 1)
        ds, os_ = part.dest_slots(k), part.own_slots(k)
        ib = POSITION_DTYPE.itemsize
        scatter = (net.alltoall_s(HEADER_BYTES + pad(ds * ib) + pad(ds * 4), n)
                   + net.allgather_s(HEADER_BYTES + pad(os_ * ib) + pad(os_ * 4), n))
        route = plan.decide(comp, f"b{d}", (d,)).route
        picks.add({"sparse": "gather", "densify": "dense", "dense": "dense"}.get(route, route))
        t["dense"] += dense
        t["gather"] += gather
        t["scatter"] += scatter
        t["plan"] += {"sparse": gather, "scatter": scatter}.get(route, dense)
    t["pick"] = "/".join(sorted(picks))
    return t


def fmt(s: float) -> str:
    return f"{1e3 * s:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/img/scatter-projection")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"Communication per step (ms), alpha-beta model, {LATENCY_US:g} us a message; fp32 gradients in 25 MiB "
             "buckets; top-k. In brackets what the wire plan picks per bucket, its selection priced at "
             f"{SELECT_GBPS:g} GB/s (a GPU's; at a CPU thread's 2.5 GB/s it sends whole wherever selecting a bucket "
             "costs more than the bytes it saves).", ""]
    curves = {}
    for gbps in LINKS:
        for ratio in RATIOS:
            lines += [f"**{gbps:g} Gbit/s, ratio {ratio:g}**", "",
                      "| N | " + " | ".join(f"{m} dense / gather / scatter (plan)" for m in MODELS) + " |",
                      "|---|" + "---|" * len(MODELS)]
            for n in WORLDS:
                cells = []
                for m, params in MODELS.items():
                    t = step_times(params, ratio, gbps, n)
                    curves.setdefault((gbps, ratio, m), []).append((n, t))
                    cells.append(f"{fmt(t['dense'])} / {fmt(t['gather'])} / {fmt(t['scatter'])} ({t['pick']})")
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    (out.with_suffix(".md")).write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(LINKS), len(RATIOS), figsize=(13, 9), sharex=True)
    styles = {"dense": "-", "gather": "--", "scatter": ":"}
    colors = dict(zip(MODELS, ("tab:blue", "tab:orange", "tab:green")))
    for i, gbps in enumerate(LINKS):
        for j, ratio in enumerate(RATIOS):
            ax = axes[i][j]
            for m in MODELS:
                pts = curves[(gbps, ratio, m)]
                for route, ls in styles.items():
                    ax.plot([n for n, _ in pts], [1e3 * t[route] for _, t in pts], ls, color=colors[m],
                            label=f"{m} {route}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{gbps:g} Gbit/s, ratio {ratio:g}")
            ax.set_xlabel("workers N")
            ax.set_ylabel("ms per step (model)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
