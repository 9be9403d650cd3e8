"""``gradsift compare``: the same run with several compressors, a report and curves."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any, Sequence

from ..runconfig import RunConfig
from .runner import Progress, read_metrics, train_to_dir, write_json


def safe_name(spec: str) -> str:
    """A folder name for a spec: ``sidco:dist=gp,stages=3`` -> ``sidco_dist-gp_stages-3``."""
    s = spec.strip().replace(":", "_").replace(",", "_").replace("=", "-")
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("._-")
    return s or "run"


def unique_names(specs: Sequence[str]) -> list[str]:
    names, seen = [], {}
    for spec in specs:
        base = safe_name(spec)
        n = seen.get(base, 0)
        seen[base] = n + 1
        names.append(base if n == 0 else f"{base}-{n + 1}")
    return names


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024.0
    return f"{b:.2f} TiB"


def fmt_metric(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def sent_as(summary: dict[str, Any]) -> str:
    """What a run sent, in a few words: as the method named, or what the wire plan changed."""
    r = summary.get("routing")
    if not r:
        return "as named" if summary.get("baseline") is None else summary["baseline"]
    parts = []
    changed = r.get("changed") or {}
    for route in ("whole", "densify"):
        n = sum(1 for v in changed.values() if v["route"] == route)
        if n:
            parts.append(f"{n}/{r['tensors']} tensors {'whole' if route == 'whole' else 'densified'}")
    if r.get("mode") in ("whole", "aside"):
        first = next((e["step"] for e in r.get("events", []) if e["mode"] in ("whole", "aside")), None)
        parts.append(f"every tensor whole from step {first + 1}" if first is not None else "every tensor whole")
    if r.get("mode") == "aside":
        parts.append("then DDP's own all-reduce")
    return "; ".join(parts) if parts else "as named"


def run_compare(base: RunConfig, specs: Sequence[str], out: Path, *, progress: Progress | None = None,
                title: str | None = None) -> dict[str, Any]:
    """Run ``base`` once per compressor spec into ``out/<name>``; the report, plot and ``compare.json`` are
    rewritten after every run, so an interrupted comparison leaves a valid report of what finished."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    progress = progress or Progress(False)
    runs: list[dict[str, Any]] = []
    names = unique_names(specs)
    t0 = time.perf_counter()
    for i, (spec, name) in enumerate(zip(specs, names)):
        cfg = dataclasses.replace(base, compressor=spec)
        summary = train_to_dir(cfg, out / name, progress=progress, label=f"[{i + 1}/{len(specs)}] {spec}",
                               tolerate_divergence=True)
        runs.append({"spec": spec, "name": name, "summary": summary})
        pending = list(specs[i + 1:])
        write_report(out, runs, title=title, pending=pending)
        plot_curves(out, runs)
        write_json(out / "compare.json", [{"spec": r["spec"], "name": r["name"], "summary": r["summary"]} for r in runs])
        elapsed = time.perf_counter() - t0
        progress.note(f"{i + 1}/{len(specs)} done ({spec}: {fmt_metric((summary['final'] or {}).get(summary['metric']))}"
                      f" {summary['metric']}), {elapsed:.0f} s so far"
                      + (f", about {elapsed / (i + 1) * len(pending):.0f} s left" if pending else ""))
    return {"runs": runs, "report": out / "report.md", "plot": out / "curves.png"}


def report_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        s = r["summary"]
        metric = s["metric"]
        fin = s["final"] or {}
        tot = s["totals"]
        steps = max(tot["steps"], 1)
        diverged = s.get("status") == "diverged"
        rows.append({
            "spec": r["spec"],
            "metric": metric,
            "diverged_at": s.get("diverged_at") if diverged else None,
            "final": None if diverged else fin.get(metric),
            "final_loss": fin.get("loss"),
            "bytes_per_step": tot["bytes_per_worker"] / steps,
            "wire_per_step": tot["wire_bytes_per_worker"] / steps,
            "compression": tot["compression"],
            "density": tot["mean_density"],
            "k_ratio": tot["mean_k_ratio"],
            "est_time_s": tot["est_time_s"],
            "est_comm_s": tot["est_comm_s"],
            "select_s": tot["select_s"],
            "wall_s": tot["wall_s"],
            "sent": sent_as(s),
        })
    return rows


def write_report(out: Path, runs: Sequence[dict[str, Any]], title: str | None = None,
                 pending: Sequence[str] = ()) -> Path:
    rows = report_rows(runs)
    cfg = runs[0]["summary"]["config"]
    metric = rows[0]["metric"]
    lines = [f"# {title or 'gradsift compare'}", ""]
    lines.append(
        f"Task `{cfg['task']}`, {cfg['workers']} workers, {cfg['steps']} steps, ratio {cfg['ratio']}, "
        f"batch {cfg['batch_size']} per worker, optimizer {cfg['optimizer']} (lr {cfg['lr']}), "
        f"granularity `{cfg['granularity']}`, seed {cfg['seed']}. Estimated times use the alpha-beta "
        f"model at {cfg['bandwidth_gbps']} Gbit/s and {cfg['latency_us']} us latency (ring collectives). "
        + ("Wire plan on (`--wire-plan auto`): the `sent` column says what went other than the method names it."
           if cfg.get("wire_plan") == "auto" else "Wire plan off: every tensor is sent exactly as the method "
           "named says (its own rules included: DGC sends 1-D tensors whole).")
    )
    other = [(r["spec"], c["optimizer"], c["lr"]) for r in runs if (c := r["summary"]["config"])
             and (c["optimizer"], c["lr"]) != (cfg["optimizer"], cfg["lr"])]
    if other:
        lines += ["", "Optimizer where a run's differs: " + "; ".join(f"`{s}` {o} (lr {lr:g})" for s, o, lr in other)
                  + " -- a method that holds top entries back for several steps (rTop-k) steps with plain SGD, the "
                  "task's momentum folded into the step (`docs/methods/rtopk.md`)."]
    lines.append("")
    lines.append(f"| compressor | final {metric} | final loss | sent | bytes/worker/step | wire bytes/worker/step "
                 f"| compression | k_ratio | est. time (s) | est. comm (s) | selection (s) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        final = f"diverged at step {r['diverged_at']}" if r["diverged_at"] else fmt_metric(r["final"])
        lines.append(
            f"| `{r['spec']}` | {final} | {fmt_metric(r['final_loss'])} | {r['sent']} "
            f"| {fmt_bytes(r['bytes_per_step'])} | {fmt_bytes(r['wire_per_step'])} | {r['compression']:.1f}x "
            f"| {r['k_ratio']:.3f} | {r['est_time_s']:.3f} | {r['est_comm_s']:.3f} | {r['select_s']:.3f} |"
        )
    lines += [
        "",
        "Compression is dense bytes / sent bytes per worker over the run (dense = every gradient value in "
        "the gradient's dtype). k_ratio is the achieved / target count of selected entries. Estimated time "
        "is measured compute + measured selection + modelled communication, summed over steps. A run that "
        "produced a non-finite gradient is marked diverged; its other columns cover the steps before that.",
        "",
        "![curves](curves.png)",
        "",
        "The curves: the task metric against optimizer steps (quality per step), against the bytes each worker "
        "sent so far (quality per byte: what slow links pay for), and against the estimated time.",
        "",
    ]
    if pending:
        lines += [f"**Partial report:** {len(pending)} run(s) still to come: " + ", ".join(f"`{p}`" for p in pending)
                  + ".", ""]
    path = Path(out) / "report.md"
    path.write_text("\n".join(lines))
    return path


def line_styles(n: int) -> list[dict[str, Any]]:
    """n distinguishable line styles: 10 colours, then the same colours dashed, then dotted."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    dashes = ["-", "--", ":", "-."]
    return [{"color": colors[i % 10], "linestyle": dashes[(i // 10) % 4]} for i in range(n)]


def plot_curves(out: Path, runs: Sequence[dict[str, Any]]) -> Path:
    """The task metric against steps, cumulative bytes sent per worker, and estimated time; one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = runs[0]["summary"]["metric"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    log = metric in ("opt_gap", "perplexity")
    styles = line_styles(len(runs))
    for r, style in zip(runs, styles):
        recs = read_metrics(Path(out) / r["name"] / "metrics.jsonl")
        pts, elapsed, sent = [], 0.0, 0.0
        for rec in recs:
            elapsed += rec["est_step_s"]
            sent += rec["bytes_per_worker"]
            if rec.get(metric) is not None:
                pts.append((rec["step"], sent, elapsed, rec[metric]))
        if not pts:
            continue
        steps, sents, times, vals = zip(*pts)
        for ax, x in zip(axes, (steps, sents, times)):
            ax.plot(x, vals, label=r["spec"], marker=".", **style)
    for ax, xl in zip(axes, ("optimizer step", "bytes sent per worker (cumulative)", "estimated time (s)")):
        ax.set_xlabel(xl)
        ax.set_ylabel(metric)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(out) / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
