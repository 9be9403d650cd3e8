"""``cluster.md`` and the plots of ``gradsift cluster bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hosts import parse_rate


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}"


def plot(out: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["sweep"] if r.get("ok")]
    cells = sorted({(r["task"], r["hosts"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(cells)), figsize=(6 * max(1, len(cells)), 4.5), squeeze=False)
    for j, (task, hosts) in enumerate(cells):
        ax = axes[0][j]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((parse_rate(r["rate"]) / 1e9, 1.0 / r["step_s"]) for r in rows
                         if r["task"] == task and r["hosts"] == hosts and r["method"] == method and r.get("step_s"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("steps per second (measured)")
        ax.set_title(f"{task}, {hosts} hosts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    tt = results.get("time_to_target") or {}
    if tt.get("curves"):
        plot_quality_vs_time(out / "quality-vs-time.png", tt["curves"], tt.get("target"), "target (plain DDP's final)",
                             f"{tt['task']}, {tt['hosts']} hosts, {tt['rate']}")


def plot_quality_vs_time(path: Path, curves: dict[str, list], target: float | None, target_label: str,
                         title: str) -> None:
    """Every method's validation perplexity against its measured wall time (``curves``: method -> [(s, ppl)]),
    ``target`` dashed, written to ``path`` (the cluster bench's and the cluster race's plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=method)
    if target:
        ax.axhline(target, color="k", lw=0.8, ls="--", label=target_label)
    ax.set_xlabel("wall time (s, sum of measured steps)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def window(results: dict[str, Any]) -> str:
    """Which steps the sweep's medians cover (results of older benches: their own rule)."""
    after, steps = results.get("median_after"), results.get("sweep_steps")
    if after is None:
        return ("Per method: medians over the steps after the first 3 (after the first 13 for the methods run with "
                "the measured wire plan: its warm-up and timed steps; `plan` says what it chose, `compressed` or "
                "`whole`)")
    why = ("warm-up, and the measured wire plan's warm-up and timed steps for the methods run with it; `plan` says "
           "what it chose: `compressed`, `whole`, or `whole-native` (fp16 values sent whole in the gradient's own "
           "dtype instead)" if after > 3 else "warm-up")
    return (f"Per method: medians over steps {after + 1}-{steps} of every run, the same steps for every method "
            f"(the first {after}: {why})")


def write(out: Path, results: dict[str, Any], quick: bool) -> Path:
    lines = ["# Measured on shaped links (network namespaces on one machine)", ""]
    lines += ["Calibrated alpha-beta model per cluster (fit to a measured all-reduce/all-gather sweep):", "",
              "| cluster | latency (us) | bandwidth (Gbit/s) |", "|---|---|---|"]
    for key, cal in results["calibration"].items():
        lines.append(f"| {key} | {cal['fit']['latency_us']:.0f} | {cal['fit']['bandwidth_gbps']:.3f} |")
    lines += ["", window(results) + ", one thread per rank. `comm in flight` is "
              "the measured wall time with a collective of the step in flight, step by step the least over the ranks "
              "(a rank that reaches a collective first also counts its wait for the others; not observable for "
              "DDP's own all-reduce); `model` the calibrated alpha-beta time of the bytes the run moved; `wire eff.` = model / "
              "measured. Speed-up = plain DDP's step time / the method's." + (
                  f" Every method ran {results['repeats']} times in interleaved rounds: each figure is the median "
                  "over its runs, `step` also gives the fastest and slowest run in brackets."
                  if results.get("repeats", 1) > 1 else ""), ""]
    paired = any(r.get("paired_speedup") is not None for r in results["sweep"])
    if paired:
        lines += [f"`same processes`: each gradsift run also stepped with DDP's own all-reduce (a second DDP wrapper "
                  f"of the same model, no hook), alternating blocks of {results.get('paired')} steps once the hook "
                  "had settled; DDP's median step over the method's, in the same processes (free of the compute "
                  "speed a process draws at start)" + (", median over the runs [least-most]"
                                                       if results.get("repeats", 1) > 1 else "") + ".", ""]
    for task in dict.fromkeys(r["task"] for r in results["sweep"]):
        lines += [f"### {task}", "", "| hosts | rate | method | step (ms) | compute (ms) | selection (ms) "
                  "| comm in flight (ms) | model (ms) | wire eff. | sent/worker/step | plan | speed-up vs DDP |"
                  + (" same processes |" if paired else ""),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if paired else "")]
        rows = [r for r in results["sweep"] if r["task"] == task]
        dense = {(r["hosts"], r["rate"]): r.get("step_s") for r in rows if r["method"] == "DDP" and r.get("ok")}
        for r in rows:
            if not r.get("ok"):
                lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | failed: {str(r.get('error'))[:80]} "
                             "| | | | | | | | |" + (" |" if paired else ""))
                continue
            d = dense.get((r["hosts"], r["rate"]))
            eff = "-" if r.get("wire_efficiency") is None else f"{r['wire_efficiency']:.2f}"
            speedup = f"{d / r['step_s']:.2f}x" if d else "-"
            step = _ms(r["step_s"])
            if len(r.get("step_s_runs") or []) > 1:
                step += f" [{_ms(min(r['step_s_runs']))}-{_ms(max(r['step_s_runs']))}]"
            lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | {step} | {_ms(r['compute_s'])} "
                         f"| {_ms(r['select_s'])} | {_ms(r.get('comm_s'))} | {_ms(r.get('model_comm_s'))} | {eff} "
                         f"| {r['bytes_per_worker'] / 1024:.1f} KiB | {r.get('wire_probe') or '-'} | {speedup} |"
                         + (f" {paired_cell(r)} |" if paired else ""))
        lines.append("")
    tt = results.get("time_to_target") or {}
    if tt.get("rows"):
        lines += [f"### Time to a target perplexity ({tt['task']}, {tt['hosts']} hosts, {tt['rate']})", "",
                  f"Target {tt['target']:.4g}: plain DDP's held-out perplexity after its {tt['ddp_steps']} steps. "
                  "Every method gets the same data order and up to "
                  f"{tt['budget_steps']} steps; seconds are the sum of its measured step times.", "",
                  "| method | reached | steps | seconds | vs DDP |", "|---|---|---|---|---|"]
        ddp_s = next((r["seconds"] for r in tt["rows"] if r["method"] == "DDP" and r["reached"]), None)
        for r in tt["rows"]:
            vs = f"{ddp_s / r['seconds']:.2f}x" if (ddp_s and r["reached"]) else "-"
            lines.append(f"| {r['method']} | {'yes' if r['reached'] else 'no'} | {r['steps']} | {r['seconds']:.1f} "
                         f"| {vs} |")
        lines += ["", "![quality against wall time](quality-vs-time.png)", ""]
    lines += faults_lines(results.get("faults", {}))
    lines += ["", "![throughput](throughput.png)", ""]
    p = out / "cluster.md"
    p.write_text("\n".join(lines))
    return p


def paired_cell(row: dict[str, Any]) -> str:
    """DDP's step over the method's in the same processes, with the spread over runs."""
    v = row.get("paired_speedup")
    if v is None:
        return "-"
    runs = [x for x in row.get("paired_speedup_runs") or [] if x is not None]
    return f"{v:.2f}x" + (f" [{min(runs):.2f}-{max(runs):.2f}]" if len(runs) > 1 else "")


def faults_lines(f: dict[str, Any]) -> list[str]:
    if not f:
        return []
    lines = ["## Faults", ""]
    k = f.get("kill_restart")
    if k:
        lines.append(f"1. **Kill one rank** (SIGKILL to rank 1's worker at step {k['killed_at_step']}, torchrun "
                     f"`--max-restarts 1`, checkpoints every {k['checkpoint_every']} steps, `--resume auto`): exit "
                     f"codes {k['exit_codes']}; final parameters {'identical to' if k['same_parameters'] else 'DIFFERENT from'} "
                     f"the undisturbed run's.")
    dl = f.get("delay_loss")
    if dl and "clean" in dl and "delay50ms_loss1pct" in dl:
        a, b = dl["clean"], dl["delay50ms_loss1pct"]
        lines.append(f"2. **50 ms delay and 1% loss on one link** (2 hosts, 100 Mbit/s, topk): training "
                     f"{'continues' if b.get('ok') else 'FAILED'}; step time {1e3 * a.get('step_s', 0):.0f} ms -> "
                     f"{1e3 * b.get('step_s', 0):.0f} ms; the model calibrated on the impaired link predicts "
                     f"{1e3 * b.get('est_step_s', 0):.0f} ms (latency {b['fit']['latency_us'] / 1e3:.0f} ms, "
                     f"{1e3 * b['fit']['bandwidth_gbps']:.1f} Mbit/s effective).")
    cl = f.get("cut_link")
    if cl:
        errs = [e[0] if e else "(no gradsift error line)" for e in cl["errors"]]
        lines.append(f"3. **Cut one link for {cl['timeout_s'] * 2.5:.0f} s** (timeout {cl['timeout_s']} s): exit codes "
                     f"{cl['exit_codes']}; every rank's error: {errs}; last checkpoint {cl['last_checkpoint']}.")
    return lines
