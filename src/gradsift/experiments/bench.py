"""``gradsift bench select``: selection speed and estimation quality, as ratios taken in one process.

For every (compressor, size, ratio) the same tensors are timed with the
compressor's selection (no error feedback, no finiteness check: selection
alone, plus ``observe`` for the methods that use the round's aggregate, with the
input standing in for it), with ``torch.topk`` on |x| (exact top-k) and with one read pass
(``torch.linalg.vector_norm(x, 1)``, the floor). Each time is the median over
``calls`` calls after two warm-up calls. ``k_ratio`` is the mean achieved /
target count over the second half of the calls (after threshold methods have
adapted).

Inputs: ``gaussian``, ``laplace``, ``student-t`` (3 degrees of freedom) draws,
or a file saved by ``gradsift train --dump-grads`` (a [steps, numel] tensor, or
one flat tensor): its rows are used in turn, each tiled or cropped to the size.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..factory import make_compressor

DISTS = ("gaussian", "laplace", "student-t")
POOL = 4  # distinct input tensors per configuration, used in turn


class BenchError(ValueError):
    """Bad benchmark input; one line."""


def load_rows(path: str) -> list[torch.Tensor]:
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"--dist: {path!r} is neither one of {', '.join(DISTS)} nor a readable .pt file")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear error
        raise BenchError(f"--dist: cannot load {path!r} as a tensor file ({type(e).__name__})") from None
    if isinstance(obj, (list, tuple)):
        rows = [torch.as_tensor(t).reshape(-1) for t in obj]
    elif isinstance(obj, torch.Tensor):
        rows = [r.reshape(-1) for r in obj] if obj.dim() == 2 else [obj.reshape(-1)]
    else:
        raise BenchError(f"--dist: {path!r} holds a {type(obj).__name__}, expected a tensor")
    rows = [r.to(torch.float32) for r in rows if r.numel()]
    if not rows:
        raise BenchError(f"--dist: {path!r} holds no values")
    return rows


def fit_size(row: torch.Tensor, size: int) -> torch.Tensor:
    """Tile or crop a flat tensor to ``size`` elements."""
    if row.numel() >= size:
        return row[:size].clone()
    reps = -(-size // row.numel())
    return row.repeat(reps)[:size].clone()


def make_inputs(dist: str, size: int, count: int, seed: int = 0, rows: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if rows is not None:
            out.append(fit_size(rows[i % len(rows)], size))
        elif dist == "gaussian":
            out.append(torch.randn(size, generator=g))
        elif dist == "laplace":
            u = torch.rand(size, generator=g).clamp_(1e-12, 1 - 1e-12) - 0.5
            out.append(-u.sign() * torch.log1p(-2 * u.abs()))
        elif dist == "student-t":
            z = torch.randn(size, generator=g)
            chi2 = torch.randn(3, size, generator=g).square().sum(0)
            out.append(z / (chi2 / 3).sqrt())
        else:
            raise BenchError(f"unknown distribution {dist!r}")
    return out


def median_time(fn, calls: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn(0)
    ts = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_one(spec: str, xs: Sequence[torch.Tensor], ratio: float, calls: int) -> tuple[float, float]:
    """(median seconds, mean k_ratio over the second half) of one compressor's selection."""
    comp = make_compressor(spec, ratio, feedback=False) if "feedback=" not in spec else make_compressor(spec, ratio)
    ratios: list[float] = []

    def call(i: int) -> None:
        x = xs[i % len(xs)]
        # a 2-D view: compressors flatten it anyway, and DGC sends 1-D tensors (biases) dense
        p = comp.compress("bench", x.view(1, -1), check_finite=False)
        if comp.OBSERVES:  # REGTOP-k and GSB look at the round's aggregate; the input stands in for it
            comp.observe("bench", p, x)
        ratios.append(p.count / max(p.target, 1))

    t = median_time(call, calls)
    timed = ratios[2:]
    half = timed[len(timed) // 2:] or timed
    return t, sum(half) / len(half)


def run_select_bench(specs: Sequence[str], sizes: Sequence[int], ratios: Sequence[float], dist: str, calls: int,
                     out: Path, progress=None) -> list[dict[str, Any]]:
    rows = None if dist in DISTS else load_rows(dist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:  # fail early on a bad spec
        make_compressor(spec, 0.01)
    records: list[dict[str, Any]] = []
    total = len(sizes) * len(ratios) * len(specs)
    from .runner import Progress

    progress = progress or Progress(False)
    with progress.task("bench select", total) as advance:
        for size in sizes:
            xs = make_inputs(dist, size, min(POOL, calls), rows=rows)
            read = median_time(lambda i: torch.linalg.vector_norm(xs[i % len(xs)], 1), calls)
            for ratio in ratios:
                k = max(1, round(ratio * size))
                topk = median_time(lambda i: torch.topk(xs[i % len(xs)].abs(), k, sorted=False), calls)
                for spec in specs:
                    t, kr = bench_one(spec, xs, ratio, calls)
                    records.append({"compressor": spec, "size": size, "ratio": ratio, "dist": dist,
                                    "median_s": t, "topk_median_s": topk, "read_pass_s": read, "k_ratio": kr})
                    advance(1, f"{spec} n={size} r={ratio}")
    (out / "bench.json").write_text(json.dumps(records, indent=2) + "\n")
    write_bench_md(out, records, calls)
    plot_bench(out, records)
    return records


def write_bench_md(out: Path, records: list[dict[str, Any]], calls: int) -> Path:
    lines = ["# Selection benchmark", "",
             f"Median of {calls} calls after 2 warm-up calls, one process, "
             f"{torch.get_num_threads()} torch threads. `vs topk` = time / torch.topk's time on |x| "
             "(below 1 is faster than exact top-k); `vs read` = time / one read pass "
             "(`torch.linalg.vector_norm(x, 1)`); k_ratio = achieved / target count over the second half of "
             "the calls.", "",
             "| dist | size | ratio | compressor | median (ms) | vs topk | vs read | k_ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {Path(r['dist']).name if r['dist'] not in DISTS else r['dist']} | {r['size']} | {r['ratio']} "
                     f"| `{r['compressor']}` | {r['median_s'] * 1e3:.3f} | {r['median_s'] / r['topk_median_s']:.3f} "
                     f"| {r['median_s'] / r['read_pass_s']:.1f} | {r['k_ratio']:.3f} |")
    lines += ["", "Reference rows: torch.topk costs "
              + ", ".join(sorted({f"{r['topk_median_s'] / r['read_pass_s']:.0f}x (n={r['size']}, r={r['ratio']})"
                                  for r in records}, key=lambda s: s)) + " read passes.", "",
              "![bench](bench.png)", ""]
    p = Path(out) / "bench.md"
    p.write_text("\n".join(lines))
    return p


def plot_bench(out: Path, records: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(dict.fromkeys(r["compressor"] for r in records))
    ratios = sorted({r["ratio"] for r in records}, reverse=True)
    fig, axes = plt.subplots(2, len(ratios), figsize=(4.5 * len(ratios), 7), squeeze=False)
    for j, ratio in enumerate(ratios):
        for spec in specs:
            rs = sorted((r for r in records if r["compressor"] == spec and r["ratio"] == ratio), key=lambda r: r["size"])
            if not rs:
                continue
            x = [r["size"] for r in rs]
            axes[0][j].plot(x, [r["median_s"] / r["topk_median_s"] for r in rs], marker="o", label=spec)
            axes[1][j].plot(x, [r["k_ratio"] for r in rs], marker="o", label=spec)
        axes[0][j].set_title(f"ratio {ratio}")
        axes[0][j].set_ylabel("time / torch.topk")
        axes[1][j].set_ylabel("achieved / target count")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log")
            ax.set_xlabel("size")
            ax.grid(alpha=0.3)
        axes[0][j].axhline(1.0, color="k", lw=0.8)
        axes[1][j].axhline(1.0, color="k", lw=0.8)
        axes[1][j].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p = Path(out) / "bench.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
