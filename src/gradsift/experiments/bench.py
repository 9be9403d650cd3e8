"""``gradsift bench select``: selection speed and estimation quality, as ratios taken in one process.

For every (size, ratio) cell the same tensors are timed, call by call in
rounds, with: one read pass (``torch.linalg.vector_norm(x, 1)``), ``torch.topk``
on |x| (exact top-k), DGC's selection (the sampled-threshold reference), and
every compressor asked for (selection alone: no memory, no finiteness check,
plus ``observe`` for methods that look at the round's aggregate, with the input
standing in for it). Each round gives one ratio per reference, so load that
comes and goes hits numerator and denominator alike; a cell reports the median
ratio and its min-max over rounds, and the compressor's own time median and
min-max. ``k_ratio`` is the mean achieved / target count over the second half
of the calls (after threshold methods have adapted). A cell whose min-max
spread exceeds 2x is flagged: the machine was busy.

Inputs: ``gaussian``, ``laplace``, ``student-t`` (3 degrees of freedom) draws,
or a file saved by ``gradsift train --dump-grads`` (a [steps, numel] tensor, or
one flat tensor): its rows are used in turn, each tiled or cropped to the size.

``device="cuda"`` times the same on the GPU (inputs made on the CPU, then
moved): every call is followed by ``torch.cuda.synchronize()`` before the clock
is read, so a time is the whole selection, launches and the count read back
included. Selection there runs the eager kernels (``backend`` says ``eager``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import kernels
from ..memory.factory import make_compressor

DISTS = ("gaussian", "laplace", "student-t")
POOL = 4  # distinct input tensors per configuration, used in turn
BUSY = 2.0  # a min-max spread above this (on cells over 1 ms) says the machine was busy


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


def selection_call(spec: str, ratio: float) -> tuple[Callable[[torch.Tensor], None], list[float]]:
    """A function running one selection of ``spec`` and the k_ratio list it fills."""
    comp = make_compressor(spec, ratio, feedback=False) if "feedback=" not in spec and "memory=" not in spec \
        else make_compressor(spec, ratio)
    ratios: list[float] = []

    def call(x: torch.Tensor) -> None:
        # a 2-D view: compressors flatten it anyway, and DGC sends 1-D tensors (biases) dense
        p = comp.compress("bench", x.view(1, -1), check_finite=False)
        if comp.OBSERVES:  # REGTOP-k and GSB look at the round's aggregate; the input stands in for it
            comp.observe("bench", p, x)
        ratios.append(p.count / max(p.target, 1))

    return call, ratios


def measure_cell(specs: Sequence[str], xs: Sequence[torch.Tensor], ratio: float, calls: int,
                 warmup: int = 2) -> dict[str, dict[str, list[float]]]:
    """Times of every method, call by call in rounds: {name: {"t": [...], "k_ratio": [...]}}."""
    size = xs[0].numel()
    sync = torch.cuda.synchronize if xs[0].is_cuda else (lambda: None)
    k = max(1, round(ratio * size))
    fns: dict[str, tuple[Callable[[torch.Tensor], None], list[float]]] = {
        "read": (lambda x: torch.linalg.vector_norm(x, 1), []),
        "torch.topk": (lambda x: torch.topk(x.abs(), k, sorted=False), []),
        "dgc": selection_call("dgc", ratio),
    }
    for spec in specs:
        fns[spec] = selection_call(spec, ratio)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + calls):
        x = xs[i % len(xs)]
        for name, (fn, _) in fns.items():
            sync()
            t0 = time.perf_counter()
            fn(x)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: {"t": times[name], "k_ratio": fns[name][1][warmup:]} for name in fns}


def cell_records(spec: str, m: dict[str, dict[str, list[float]]], size: int, ratio: float, dist: str,
                 threads: int, device: str = "cpu") -> dict[str, Any]:
    t = m[spec]["t"]
    rounds = list(zip(t, m["torch.topk"]["t"], m["dgc"]["t"], m["read"]["t"]))
    vs = {name: [r[0] / r[j] for r in rounds] for j, name in ((1, "topk"), (2, "dgc"), (3, "read"))}
    kr = m[spec]["k_ratio"]
    half = kr[len(kr) // 2:] or kr
    med = statistics.median
    return {"compressor": spec, "size": size, "ratio": ratio, "dist": dist, "threads": threads,
            "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "backend": kernels.backend() if device == "cpu" else "eager", "median_s": med(t), "min_s": min(t),
            "max_s": max(t),
            "vs_topk": med(vs["topk"]), "vs_topk_range": [min(vs["topk"]), max(vs["topk"])],
            "vs_dgc": med(vs["dgc"]), "vs_dgc_range": [min(vs["dgc"]), max(vs["dgc"])],
            "read_passes": med(vs["read"]), "read_passes_range": [min(vs["read"]), max(vs["read"])],
            "k_ratio": sum(half) / len(half), "topk_median_s": med(m["torch.topk"]["t"]),
            "topk_read_passes": med(a / b for a, b in zip(m["torch.topk"]["t"], m["read"]["t"])),
            "dgc_median_s": med(m["dgc"]["t"]), "read_pass_s": med(m["read"]["t"]),
            "busy": max(t) > BUSY * min(t) and med(t) > 1e-3}


def available_bytes() -> int | None:
    """The memory this machine can still give (``MemAvailable``), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(numel: int, what: str, copies: int = 4) -> None:
    """Refuse, in one ``BenchError`` line and before allocating, a bench whose tensors cannot fit: ``copies`` fp32
    copies of ``numel`` entries (the gradients, error feedback's memory, the selection's room)."""
    need, have = copies * 4 * int(numel), available_bytes()
    if have is not None and need > have:
        raise BenchError(f"{what}: {numel:,} entries need about {need / 2**30:.1f} GiB (gradients, error feedback's "
                         f"memory and the selection's room), and this machine has {have / 2**30:.1f} GiB available")


def check_device(device: str) -> None:
    """A device the bench can time on here, or one ``BenchError`` line."""
    if device not in ("cpu", "cuda"):
        raise BenchError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA GPU, and torch sees none here")


def run_select_bench(specs: Sequence[str], sizes: Sequence[int], ratios: Sequence[float], dist: str, calls: int,
                     out: Path, progress=None, threads: int | None = None,
                     device: str = "cpu") -> list[dict[str, Any]]:
    check_device(device)
    rows = None if dist in DISTS else load_rows(dist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:  # fail early on a bad spec
        make_compressor(spec, 0.01)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    records: list[dict[str, Any]] = []
    from .runner import Progress

    progress = progress or Progress(False)
    try:
        label = f"{threads} threads, {kernels.backend()} kernels" if device == "cpu" else \
            f"{torch.cuda.get_device_name()}, eager kernels"
        with progress.task(f"bench select ({label})",
                           len(sizes) * len(ratios)) as advance:
            for size in sizes:
                xs = [x.to(device) for x in make_inputs(dist, size, min(POOL, calls), rows=rows)]
                for ratio in ratios:
                    m = measure_cell(specs, xs, ratio, calls)
                    records += [cell_records(spec, m, size, ratio, dist, threads, device) for spec in specs]
                    advance(1, f"n={size} r={ratio}")
    finally:
        torch.set_num_threads(before)
    (out / "bench.json").write_text(json.dumps(records, indent=2) + "\n")
    write_bench_md(out, records, calls)
    plot_bench(out, records)
    return records


def busy_note(records: list[dict[str, Any]]) -> str | None:
    busy = [r for r in records if r["busy"]]
    if not busy:
        return None
    return (f"{len(busy)} of {len(records)} cells had a min-max spread above {BUSY:g}x (e.g. `{busy[0]['compressor']}` "
            f"n={busy[0]['size']} r={busy[0]['ratio']}: {1e3 * busy[0]['min_s']:.2f}-{1e3 * busy[0]['max_s']:.2f} ms): "
            "the machine was busy; ratios within a round stay comparable, absolute times do not")


def where(r: dict[str, Any]) -> str:
    """Where a record was timed, in words: the CPU's threads, or the GPU (synchronized after every call)."""
    if r.get("device", "cpu") == "cpu":
        return f"{r['threads']} torch threads"
    return f"on {r.get('gpu', 'the GPU')} (CUDA, synchronized after every call)"


def write_bench_md(out: Path, records: list[dict[str, Any]], calls: int) -> Path:
    r0 = records[0]
    lines = ["# Selection benchmark", "",
             f"{calls} calls per cell after 2 warm-up calls, timed in rounds (every method once per round) in one "
             f"process, {where(r0)}, `{r0['backend']}` selection kernels. `vs topk` and `vs dgc` = "
             "time / torch.topk's (exact top-k on |x|) and / DGC's selection time in the same round (DGC is timed every "
             "round as a second yardstick, asked for or not), median [min, max] over rounds (below 1 is faster); "
             "`read passes` = time / one read pass (`torch.linalg.vector_norm(x, 1)`); "
             "k_ratio = achieved / target count over the second half of the calls.", "",
             "| dist | size | ratio | compressor | median ms [min, max] | vs topk | vs dgc | read passes | k_ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        d = Path(r["dist"]).name if r["dist"] not in DISTS else r["dist"]
        lines.append(
            f"| {d} | {r['size']} | {r['ratio']} | `{r['compressor']}` | {1e3 * r['median_s']:.2f} "
            f"[{1e3 * r['min_s']:.2f}, {1e3 * r['max_s']:.2f}]{' (busy)' if r['busy'] else ''} | {r['vs_topk']:.3f} "
            f"[{r['vs_topk_range'][0]:.3f}, {r['vs_topk_range'][1]:.3f}] | {r['vs_dgc']:.2f} "
            f"[{r['vs_dgc_range'][0]:.2f}, {r['vs_dgc_range'][1]:.2f}] | {r['read_passes']:.1f} | {r['k_ratio']:.3f} |")
    cells = {(r["size"], r["ratio"]): r["topk_read_passes"] for r in records}
    lines += ["", "torch.topk itself costs " + ", ".join(f"{v:.0f} read passes (n={s}, r={q})"
                                                         for (s, q), v in sorted(cells.items())) + "."]
    note = busy_note(records)
    if note:
        lines += ["", f"**Warning:** {note}."]
    lines += ["", "![bench](bench.png)", ""]
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
            axes[0][j].errorbar(x, [r["vs_topk"] for r in rs], marker="o", label=spec, capsize=2,
                                yerr=[[r["vs_topk"] - r["vs_topk_range"][0] for r in rs],
                                      [r["vs_topk_range"][1] - r["vs_topk"] for r in rs]])
            axes[1][j].plot(x, [r["k_ratio"] for r in rs], marker="o", label=spec)
        axes[0][j].set_title(f"ratio {ratio}")
        axes[0][j].set_ylabel("time / torch.topk")
        axes[1][j].set_ylabel("achieved / target count")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log")
            ax.set_xlabel("size")
            ax.grid(alpha=0.3)
        axes[0][j].axhline(1.0, color="k", lw=0.8)
        axes[0][j].set_yscale("log")
        axes[1][j].axhline(1.0, color="k", lw=0.8)
        krs = [r["k_ratio"] for r in records if r["ratio"] == ratio and r["k_ratio"] > 0]
        if krs and max(krs) / min(krs) > 10:  # log only where counts are off by more than tenfold (RedSync, ...)
            axes[1][j].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p = Path(out) / "bench.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
