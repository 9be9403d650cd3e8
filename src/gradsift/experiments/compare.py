"""``gradsift compare``: the same run with several compressors, a report and curves."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any, Sequence

from ..runtime.runconfig import RunConfig
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
    dense = next((r for r in runs if r["spec"] == "dense"), None)
    for r in runs:
        if dense is not None:  # what dense all-reduce moved over the same steps: the wire compression's baseline
            d = dense["summary"]["totals"]
            r = {**r, "dense_wire": d["wire_bytes_per_worker"] / max(d["steps"], 1) * r["summary"]["totals"]["steps"]}
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
            "wire_compression": (r["dense_wire"] / tot["wire_bytes_per_worker"]
                                 if r.get("dense_wire") and tot["wire_bytes_per_worker"] else None),
            "density": tot["mean_density"],
            "k_ratio": tot["mean_k_ratio"],
            "est_time_s": tot["est_time_s"],
            "est_comm_s": tot["est_comm_s"],
            "select_s": tot["select_s"],
            "wall_s": tot["wall_s"],
            "sent": sent_as(s),
            "optimizer": f"{s['config']['optimizer']} (lr {s['config']['lr']:g})",
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
    lines.append(f"| compressor | final {metric} | final loss | sent | density | bytes/worker/step | wire bytes/worker/step "
                 f"| wire compression | payload compression | k_ratio | est. time (s) | est. comm (s) | selection (s) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        final = f"diverged at step {r['diverged_at']}" if r["diverged_at"] else fmt_metric(r["final"])
        wire_c = f"{r['wire_compression']:.1f}x" if r["wire_compression"] else "-"
        lines.append(
            f"| `{r['spec']}` | {final} | {fmt_metric(r['final_loss'])} | {r['sent']} | {r['density']:.4f} "
            f"| {fmt_bytes(r['bytes_per_step'])} | {fmt_bytes(r['wire_per_step'])} | {wire_c} | {r['compression']:.1f}x "
            f"| {r['k_ratio']:.3f} | {r['est_time_s']:.3f} | {r['est_comm_s']:.3f} | {r['select_s']:.3f} |"
        )
    pick = which_to_pick(rows, cfg)
    if pick:
        lines += ["", "## Which to pick", "", pick]
    lines += [
        "",
        "Wire compression is what dense all-reduce moved / what the method's collectives moved per worker (what "
        "costs time on a link: indices, headers and all-gather's growth with the workers included); payload "
        "compression is dense bytes / the values and indices a worker contributes (dense = every gradient value "
        "in the gradient's dtype). Density is the share of entries sent. k_ratio is the achieved / target count of selected entries. Estimated time "
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


def which_to_pick(rows: Sequence[dict[str, Any]], cfg: dict[str, Any]) -> str:
    """A recommendation read off the measured table: among the runs that end at dense's quality (accuracy within
    2 points; a loss-like metric within 5%), the fastest in estimated time on this link model, and why each other
    run loses (quality, or time: communication or selection). Empty without a dense run to compare with."""
    dense = next((r for r in rows if r["spec"] == "dense" and r["final"] is not None), None)
    if dense is None:
        return ""
    metric = dense["metric"]
    higher = metric not in ("loss", "opt_gap", "perplexity")
    tol = 0.02 if higher else 0.05 * abs(dense["final"])

    def at_dense(r):
        return r["final"] is not None and (r["final"] >= dense["final"] - tol if higher else
                                           r["final"] <= dense["final"] + tol)

    good = sorted((r for r in rows if at_dense(r)), key=lambda r: r["est_time_s"])
    best = good[0]
    link = f"{cfg['bandwidth_gbps']:g} Gbit/s and {cfg['latency_us']:g} us per message"
    if best is dense:
        done = [r for r in rows if r is not dense and r["final"] is not None]
        near = max(done, key=lambda r: r["final"] if higher else -r["final"], default=None)
        out = [f"On this link model ({link}, {cfg['workers']} workers) no compressed run reached dense's {metric} "
               f"({fmt_metric(dense['final'])}) in this budget: **dense all-reduce** is the pick here"
               + (f"; the closest, `{near['spec']}`, ends at {fmt_metric(near['final'])} in {near['est_time_s']:.2f} "
                  f"s against dense's {dense['est_time_s']:.2f} s." if near
                  else ".")]
    else:
        out = [f"On this link model ({link}, {cfg['workers']} workers) **`{best['spec']}`** reaches dense's {metric} "
               f"({fmt_metric(best['final'])} against {fmt_metric(dense['final'])}) in the least estimated time: "
               f"{best['est_time_s']:.2f} s against dense's {dense['est_time_s']:.2f} s"
               + (f", moving {best['wire_compression']:.1f}x fewer bytes." if best.get("wire_compression") else ".")]
    why = []
    for r in rows:
        if r is best or r is dense and best is dense:
            continue
        if r["final"] is None:
            why.append(f"`{r['spec']}` diverged")
        elif not at_dense(r):
            why.append(f"`{r['spec']}` ends at {fmt_metric(r['final'])}")
        else:
            cost = "communication" if r["est_comm_s"] - best["est_comm_s"] >= r["select_s"] - best["select_s"] \
                else "selection"
            why.append(f"`{r['spec']}` is slower ({r['est_time_s']:.2f} s; more {cost})")
    out.append("The others: " + "; ".join(why) + ".")
    if best.get("optimizer") and best["optimizer"] != dense.get("optimizer"):
        out.append(f"`{best['spec']}` stepped with {best['optimizer']}, the others with {dense['optimizer']} (the "
                   "line above the table): part of its lead may be the optimizer's, not the selection's.")
    out.append(f"Equal {metric} means within {'2 points' if higher else '5%'} of dense's, one seed, this task "
               "and budget: a guide for this setting, not a ranking for yours (a slower link favours the sparser "
               "methods; a bigger model, selection's cost).")
    return " ".join(out)


def line_styles(n: int) -> list[dict[str, Any]]:
    """n line styles, no two alike in colour for up to 20 lines (tab20, its dark shades first), the dash pattern
    cycling too, so lines that cross or overlap stay apart."""
    import matplotlib.pyplot as plt

    tab20 = plt.get_cmap("tab20").colors
    colors = list(tab20[0::2]) + list(tab20[1::2])
    dashes = ["-", "--", "-.", ":"]
    return [{"color": colors[i % 20], "linestyle": dashes[i % 4]} for i in range(n)]


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
