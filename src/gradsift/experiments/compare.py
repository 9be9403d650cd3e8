"""``gradsift compare``: the same run with several compressors, a report and curves."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Sequence

from ..compressors import compressor_class, parse_spec
from ..route.plan import SELECT_GBPS
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


PLOT_EVERY_S = 20.0  # a comparison's plot is redrawn at most this often while it runs (run_compare)


def run_compare(base: RunConfig, specs: Sequence[str], out: Path, *, progress: Progress | None = None,
                title: str | None = None) -> dict[str, Any]:
    """Run ``base`` once per compressor spec into ``out/<name>``; the report and ``compare.json`` are rewritten
    after every run, so an interrupted comparison leaves a valid report of what finished, and the plot after the
    first run, the last, and any run ending ``PLOT_EVERY_S`` or more after the last drawing (a drawing costs about
    a second: a third of a short comparison's time when drawn after each of its 13 runs)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    progress = progress or Progress(False)
    runs: list[dict[str, Any]] = []
    names = unique_names(specs)
    t0 = drawn = time.perf_counter()
    for i, (spec, name) in enumerate(zip(specs, names)):
        cfg = base.for_method(spec)
        summary = train_to_dir(cfg, out / name, progress=progress, label=f"[{i + 1}/{len(specs)}] {spec}",
                               tolerate_divergence=True)
        runs.append({"spec": spec, "name": name, "summary": summary})
        pending = list(specs[i + 1:])
        write_report(out, runs, title=title, pending=pending)
        if i == 0 or not pending or time.perf_counter() - drawn >= PLOT_EVERY_S:
            plot_curves(out, runs)
            drawn = time.perf_counter()
        write_json(out / "compare.json", [{"spec": r["spec"], "name": r["name"], "summary": r["summary"]} for r in runs])
        elapsed = time.perf_counter() - t0
        progress.note(f"{i + 1}/{len(specs)} done ({spec}: {fmt_metric((summary['final'] or {}).get(summary['metric']))}"
                      f" {summary['metric']}), {elapsed:.0f} s so far"
                      + (f", about {elapsed / (i + 1) * len(pending):.0f} s left" if pending else ""))
    return {"runs": runs, "report": out / "report.md", "plot": out / "curves.png"}


def selection_s(spec: str, numel: int) -> float:
    """A selection's price: the method's ``SELECT_PASSES`` read passes over ``numel`` fp32 entries at the wire plan's
    nominal 2.5 GB/s (a local SGD sync: its compressor's) -- what the compiled kernels take on a DDP bucket, not the
    simulator's per-tensor Python overhead, which on a small model dwarfs it; deterministic, so a busy machine does
    not move a verdict."""
    name, opts = parse_spec(spec) if ":" in spec else (spec, {})
    if name == "local":
        name = parse_spec(str(opts.get("compressor", "dense")))[0]
    return compressor_class(name).SELECT_PASSES * numel * 4 / (SELECT_GBPS * 1e9)


def reached(q: float | None, target: float, higher: bool) -> bool:
    return q is not None and (q >= target if higher else q <= target)


def step_times(records: list[dict[str, Any]], compute: float, base_gbps: float, gbps: float,
               select: float = 0.0, groups: int = 1) -> list[float]:
    """Each step's modelled time on a link of ``gbps`` (gradsift.experiments.race's docstring); the run was priced at ``base_gbps``;
    ``select``: a selection's price, on every step that sent something; ``groups``: the simulator's groups a step
    (one per tensor), whose message latencies are counted once, as one DDP bucket's."""
    out = []
    for r in records:
        wire = r.get("wire_bytes_per_worker", 0.0) * 8
        latency = max(0.0, r.get("est_comm_s", 0.0) - wire / (base_gbps * 1e9)) / max(groups, 1)
        sent = select if r.get("bytes_per_worker", 0.0) > 0 else 0.0
        out.append(compute + sent + latency + wire / (gbps * 1e9))
    return out


def modelled_times(out: Path | None, runs: Sequence[dict[str, Any]],
                   compute_s: float | None = None) -> dict[str, tuple[float, float | None, int | None]]:
    """Per run: (modelled time of the whole run, modelled time to dense's quality or None, steps to it or None).

    Every run's step costs the same computation -- dense's fastest step (every method trains the same model on the
    same batches; the fastest is what a step costs with nothing else running, so neither what else the machine does
    while one run trains nor while dense trains moves the times) -- plus its selection as
    the wire plan prices it (:func:`selection_s`) and its collectives' alpha-beta time. Dense's quality: its final accuracy minus 1 point, or its final
    validation loss (else the task metric) plus 2%. ``compute_s``: another computation a step instead (what the
    times would be on a machine that computes faster or slower)."""
    if out is None:
        return {}
    recs = {}
    for r in runs:
        path = Path(out) / r["name"] / "metrics.jsonl"
        recs[r["spec"]] = read_metrics(path) if path.exists() else []
    metric = runs[0]["summary"]["metric"]
    higher = runs[0]["summary"].get("higher_is_better", True)
    # a language model's validation loss where dense's records have one (training records lack it), else the metric
    key = metric if higher else ("valid_loss" if any("valid_loss" in x for x in recs.get("dense", [])) else metric)
    target = None
    last = next((x[key] for x in reversed(recs.get("dense", [])) if x.get(key) is not None), None)
    if last is not None:
        target = last - 0.01 if higher else last * 1.02
    computes = [x.get("compute_s", 0.0) for x in recs.get("dense", [])]
    out_t = {}
    for spec, rs in recs.items():
        if not rs:
            continue
        c = compute_s
        if c is None:
            c = min(computes) if computes else min(x.get("compute_s", 0.0) for x in rs)
        run = next(r for r in runs if r["spec"] == spec)
        sel = selection_s(spec, int(run["summary"].get("parameters") or 0))
        gbps = float(run["summary"].get("config", {}).get("bandwidth_gbps") or 1.0)
        t, hit_t, hit = 0.0, None, None
        for x, dt in zip(rs, step_times(rs, c, gbps, gbps, sel)):  # every message's latency counted, as run
            t += dt
            if hit is None and target is not None and reached(x.get(key), target, higher):
                hit_t, hit = t, x["step"]
        out_t[spec] = (t, hit_t, hit)
    return out_t


def report_rows(runs: Sequence[dict[str, Any]], out: Path | None = None,
                compute_s: float | None = None) -> list[dict[str, Any]]:
    """A report's rows, one a run (``compute_s``: as :func:`modelled_times` takes it)."""
    rows = []
    dense = next((r for r in runs if r["spec"] == "dense"), None)
    times = modelled_times(out, runs, compute_s)
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
        modelled = times.get(r["spec"])
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
            "est_time_s": modelled[0] if modelled else tot["est_time_s"],
            "time_to_target_s": modelled[1] if modelled else None,
            "steps_to_target": modelled[2] if modelled else None,
            "est_comm_s": tot["est_comm_s"],
            "select_s": tot["select_s"],
            "wall_s": tot["wall_s"],
            "sent": sent_as(s),
            "optimizer": f"{s['config']['optimizer']} (lr {s['config']['lr']:g})",
        })
    return rows


def write_report(out: Path, runs: Sequence[dict[str, Any]], title: str | None = None,
                 pending: Sequence[str] = ()) -> Path:
    rows = report_rows(runs, out)
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
    """A recommendation read off the table: the run that reaches dense's quality first (its final accuracy minus 1
    point, or its loss plus 2%: ``time_to_target_s``, modelled with dense's computation for every run, so a busy
    machine does not move it); without those times, among the runs that end at dense's quality (accuracy within 2
    points, a loss-like metric within 5%) the fastest in estimated time. Runs within 5% of the best time tie, and
    the report says so. Why each other run loses (quality, or time: communication or selection). Empty without a
    dense run to compare with."""
    dense = next((r for r in rows if r["spec"] == "dense" and r["final"] is not None), None)
    if dense is None:
        return ""
    metric = dense["metric"]
    higher = metric not in ("loss", "opt_gap", "perplexity")
    tol = 0.02 if higher else 0.05 * abs(dense["final"])
    raced = any(r.get("time_to_target_s") is not None for r in rows)
    key = "time_to_target_s" if raced else "est_time_s"

    def at_dense(r):
        if raced:
            return r.get("time_to_target_s") is not None
        return r["final"] is not None and (r["final"] >= dense["final"] - tol if higher else
                                           r["final"] <= dense["final"] + tol)

    good = sorted((r for r in rows if at_dense(r)), key=lambda r: r[key])
    if not good:
        return ""
    best = good[0]
    ties = [r for r in good[1:] if r[key] <= 1.05 * best[key]]
    link = f"{cfg['bandwidth_gbps']:g} Gbit/s and {cfg['latency_us']:g} us per message"
    what = (f"dense's final {metric} minus a point" if higher else f"dense's final quality plus 2%") if raced else \
        f"dense's {metric}"
    if best is dense and not ties:
        done = [r for r in rows if r is not dense and r["final"] is not None]
        near = max(done, key=lambda r: r["final"] if higher else -r["final"], default=None)
        out = [f"On this link model ({link}, {cfg['workers']} workers) no compressed run reached {what} "
               f"sooner: **dense all-reduce** is the pick here"
               + (f"; the closest in {metric}, `{near['spec']}`, ends at {fmt_metric(near['final'])}." if near
                  else ".")]
    else:
        first = [best] + ties
        names = " and ".join(f"**`{r['spec']}`**" for r in first)
        out = [f"On this link model ({link}, {cfg['workers']} workers) {names} "
               + ("reach" if ties else "reaches") + f" {what} first: "
               + ", ".join(f"{r[key]:.2f} s" for r in first) + f" against dense's "
               + (f"{dense[key]:.2f} s" if dense.get(key) is not None else "(not reached)")
               + (f" ({'a tie: within 5% of each other' if ties else ''})" if ties else "")
               + (f", moving {best['wire_compression']:.1f}x fewer bytes." if best.get("wire_compression") and not ties
                  else ".")]
    why = []
    for r in rows:
        if r is best or r in ties or (r is dense and best is dense):
            continue
        if r["final"] is None:
            why.append(f"`{r['spec']}` diverged")
        elif not at_dense(r):
            why.append(f"`{r['spec']}` " + ("did not reach it" if raced else "ends at")
                       + f"{' (ends at' if raced else ''} {fmt_metric(r['final'])}{')' if raced else ''}")
        else:
            cost = "communication" if r["est_comm_s"] - best["est_comm_s"] >= r["select_s"] - best["select_s"] \
                else "selection"
            why.append(f"`{r['spec']}` is slower ({r[key]:.2f} s; more {cost})")
    if why:
        out.append("The others: " + "; ".join(why) + ".")
    if best.get("optimizer") and best["optimizer"] != dense.get("optimizer"):
        out.append(f"`{best['spec']}` stepped with {best['optimizer']}, the others with {dense['optimizer']} (the "
                   "line above the table): part of its lead may be the optimizer's, not the selection's.")
    out.append(("Times are modelled: every run's step costs dense's measured computation, plus its selection "
                "priced as the wire plan prices it and its collectives on the link model; " if raced else "")
               + "one seed, this task and budget: a guide for this setting, not a ranking for yours (a slower link "
               "favours the sparser methods; a bigger model, selection's cost; `gradsift race` runs several seeds "
               "and longer budgets).")
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
