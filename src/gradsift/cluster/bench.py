"""Measured speed-ups on shaped links, against what a PyTorch user already has, and fault tolerance.

``gradsift cluster bench --out DIR [--quick] [--no-faults] [--no-target]`` builds clusters of
2 and 4 hosts at 100 Mbit/s and 1 Gbit/s (``tc tbf`` per uplink), calibrates the
alpha-beta model on each from a measured all-reduce/all-gather sweep, and per
task (``wordlm``, communication-bound; ``charlm``, compute-bound at 1 Gbit/s)
times every method with one thread per rank: plain DDP (no hook), PyTorch's
``fp16``/``bf16`` compression hooks and ``powerSGD_hook`` (ranks 1, 2, 4; one
bucket on gloo), and gradsift's methods (1% unless said; the measured wire plan
for the sparsifiers, the papers' exact setting for LAGS vs SLGS).
Then, on 2 hosts at 100 Mbit/s, every method trains ``wordlm`` until it
reaches the perplexity plain DDP ends at (time to target, a quality-against-time
plot), and the three faults run. It writes ``DIR/cluster.md``,
``DIR/cluster.json``, ``DIR/throughput.png`` and ``DIR/quality-vs-time.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..experiments.runner import Progress
from ..route.measure import Measurement
from ..runtime.records import write_json
from . import report
from .faults import run_faults
from .hosts import Cluster, ClusterError, Link, TearDown
from .runs import SHAKESPEARE, Bench, calibrate, combine_runs, curve, failure, step_stats, time_to, train_on

BASELINES = [  # label, train options
    ("DDP", ["--torch-hook", "ddp"]),
    ("fp16 hook", ["--torch-hook", "fp16"]),
    ("bf16 hook", ["--torch-hook", "bf16"]),
    ("PowerSGD r1", ["--torch-hook", "powersgd:rank=1"]),
    ("PowerSGD r2", ["--torch-hook", "powersgd:rank=2"]),
    ("PowerSGD r4", ["--torch-hook", "powersgd:rank=4"]),
]
GRADSIFT = [
    ("topk", ["--compressor", "topk"]),
    ("topk gather", ["--compressor", "topk", "--sparse-collective", "gather"]),  # the all-gather route alone
    ("topk scatter", ["--compressor", "topk", "--sparse-collective", "scatter"]),  # the owners' route alone (no plan)
    ("topk 0.1%", ["--compressor", "topk", "--ratio", "0.001"]),
    ("sidco", ["--compressor", "sidco"]),
    ("dgc", ["--compressor", "dgc"]),
    ("gsb", ["--compressor", "gsb"]),
    ("regtopk", ["--compressor", "regtopk"]),
    ("rtopk", ["--compressor", "rtopk"]),
    # LAGS-SGD Sec. 6.1: the same ratio on every layer, pipelined with backprop (one bucket per layer) vs SLGS,
    # one whole-model top-k after backprop; the papers' exact setting (no wire plan) for both
    ("LAGS equal c", ["--compressor", "topk", "--bucket-cap-mb", "0.01", "--wire-plan", "off"]),
    ("SLGS", ["--compressor", "topk", "--granularity", "model", "--wire-plan", "off"]),
    ("LAGS adaptive", ["--compressor", "topk", "--lags"]),
    # sharded models: FSDP2's own exchange against gradsift on its reduce-scatter; HSDP with two ranks a host
    # (sharded over the host's unshaped loopback, replicated across the shaped link)
    ("FSDP", ["--runtime", "fsdp", "--torch-hook", "fsdp"]),
    ("FSDP topk", ["--runtime", "fsdp", "--compressor", "topk"]),
    ("HSDP", ["--runtime", "hsdp", "--replicas", "{hosts}", "--torch-hook", "fsdp"]),
    ("HSDP topk", ["--runtime", "hsdp", "--replicas", "{hosts}", "--compressor", "topk"]),
]
# the sweep runs these with the measured wire plan (gradsift.route.measure): compressing only where a real step says it
# pays; not the papers' exact settings above (wire plan off) nor LAGS (its own per-layer ratios)
MEASURED = ["topk", "topk gather", "topk 0.1%", "sidco", "dgc", "gsb", "regtopk", "rtopk"]
# the measured plan's steps (gradsift.route.measure: 3 warm-up, then 4 rounds of blocks of 3 steps compressed, whole
# and, for fp16 values as gsb's, whole in the gradient's own dtype): left out of every method's medians
PROBE_STEPS = Measurement.steps_for(narrow=True)
SWEEP_STEPS = 54
WARMUP_STEPS = 3  # first steps of every run left out of the medians (allocations, caches)
SWEEP_TASKS = ["wordlm", "charlm"]
TIME_TO_TARGET = ["DDP", "fp16 hook", "PowerSGD r1", "PowerSGD r2", "PowerSGD r4", "topk", "topk 0.1%", "sidco",
                  "dgc", "regtopk"]


def methods(quick: bool, only: Sequence[str] | None = None) -> list[tuple[str, list[str]]]:
    everything = BASELINES + GRADSIFT
    if only:
        known = [m[0] for m in everything]
        unknown = [o for o in only if o not in known]
        if unknown:
            raise ClusterError(f"cluster bench: unknown method {unknown[0]!r}; the methods are: {', '.join(known)}")
        return [m for m in everything if m[0] in only]
    if quick:
        return [m for m in everything if m[0] in ("DDP", "PowerSGD r2", "topk", "sidco")]
    return everything


def sweep_rates(quick: bool, rates: Sequence[str] | None) -> list[str]:
    return list(rates) if rates else (["100mbit"] if quick else ["100mbit", "1gbit"])


def sweep(bench: Bench, results: dict[str, Any], advance, rates: Sequence[str] | None = None,
          only: Sequence[str] | None = None, repeats: int = 1, tasks: Sequence[str] | None = None,
          host_counts: Sequence[int] | None = None, steps: int | None = None, paired: int | None = None) -> None:
    """Every method on every cluster, ``steps`` steps a run (default ``SWEEP_STEPS``); the full version gives
    gradsift's methods the measured wire plan, the quick one runs too few steps for it and keeps the alpha-beta
    plan. Every method's medians are over the same steps (:func:`median_window`), so no method is timed on a
    different stretch of training or of the machine's day than another.
    With ``repeats`` > 1 every method runs that many times, in interleaved rounds (each round runs every method
    once, so a slow spell of the machine falls on all of them alike), and a row is the median run
    (:func:`~gradsift.cluster.runs.combine_runs`). With ``paired`` (a block length) every gradsift method's run
    also times plain DDP in its own processes (``gradsift train --paired-ddp``, :class:`gradsift.experiments.pairing.Pairing`):
    its row gets ``paired_speedup``, DDP's step over the method's with both drawn from the same process starts."""
    quick = bench.quick
    hosts_list = list(host_counts or ([2] if quick else [2, 4]))
    tasks = list(tasks or (["wordlm"] if quick else ["wordlm", "charlm"]))
    steps = 6 if quick else (steps or SWEEP_STEPS)
    chosen = methods(quick, only)
    skip = median_window(quick, chosen)
    results.update(median_after=skip, sweep_steps=steps)
    for hosts in hosts_list:
        for rate in sweep_rates(quick, rates):
            key = f"{hosts}x{rate}"
            with TearDown(Cluster(hosts=hosts, name="gsb", links=[Link(rate=rate) for _ in range(hosts)])) as c:
                cal = calibrate(c, bench.out / f"calibration-{key}.json")
                results["calibration"][key] = cal
                advance(1, f"calibrated {key}")
                for task in tasks:
                    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in chosen}
                    for rnd in range(repeats):
                        for label, extra in chosen:
                            name = label.replace(" ", "-").replace("%", "pct")
                            d = bench.out / "runs" / key / task / (name if repeats == 1 else f"{name}-run{rnd + 1}")
                            measured = measured_plan(label, quick)
                            plan = ["--wire-plan", "measure"] if measured else []
                            if paired and (label, extra) in GRADSIFT:
                                plan += ["--paired-ddp", str(paired)]
                            hsdp = "hsdp" in extra  # two ranks a host: one replica a host
                            args = [a.replace("{hosts}", str(hosts)) for a in [*extra, *plan]]
                            res, recs = train_on(c, bench, steps, args, d, cal["fit"], task=task,
                                                 nproc=2 if hsdp else 1)
                            ok = all(rc == 0 for rc, _, _ in res) and bool(recs)
                            st = step_stats(recs, skip=skip, net=cal["fit"],
                                            world=hosts) if ok else {}
                            if measured and ok:
                                st["wire_probe"] = probe_choice(d)
                            runs[label].append({"ok": ok, **st, "error": None if ok else failure(res)})
                            advance(1, f"{key} {task} {label}" + (f" (round {rnd + 1}/{repeats})" if repeats > 1
                                                                   else ""))
                    for label, _ in chosen:
                        row = runs[label][0] if repeats == 1 else combine_runs(runs[label])
                        results["sweep"].append({"task": task, "hosts": hosts, "rate": rate, "method": label, **row})


def measured_plan(label: str, quick: bool) -> bool:
    """Whether the sweep runs this method with the measured wire plan (the quick bench runs too few steps)."""
    return label in MEASURED and not quick


def median_window(quick: bool, chosen: Sequence[tuple[str, list[str]]]) -> int:
    """How many first steps every run of a sweep leaves out of its medians: the warm-up (3), or, when any method
    runs with the measured wire plan, its PROBE_STEPS measuring steps -- for every method alike."""
    return PROBE_STEPS if any(measured_plan(label, quick) for label, _ in chosen) else WARMUP_STEPS


def probe_choice(run_dir: Path) -> str | None:
    """What the measured wire plan chose in a run ("compressed", "whole" or "whole-native"), from its summary."""
    try:
        routing = json.loads((run_dir / "summary.json").read_text()).get("routing") or {}
        return (routing.get("measured") or {}).get("choice")
    except (OSError, ValueError):
        return None


def time_to_target(bench: Bench, results: dict[str, Any], advance) -> None:
    quick = bench.quick
    hosts, rate, task = 2, "100mbit", "wordlm"
    ddp_steps = 40 if quick else 300
    budget = 2 * ddp_steps
    every = max(ddp_steps // 12, 1)
    chosen = [m for m in BASELINES + GRADSIFT if m[0] in (["DDP", "PowerSGD r2", "topk"] if quick else TIME_TO_TARGET)]
    runs: dict[str, list[dict]] = {}
    with TearDown(Cluster(hosts=hosts, name="gst", links=[Link(rate=rate) for _ in range(hosts)])) as c:
        key = f"{hosts}x{rate}"
        cal = results["calibration"].get(key) or calibrate(c, bench.out / "calibration-tt.json")
        target = None
        for label, extra in chosen:
            steps = ddp_steps if label == "DDP" else budget
            stop = [] if target is None or label == "DDP" else ["--stop-at", f"{target:.6g}"]
            d = bench.out / "runs" / "target" / label.replace(" ", "-").replace("%", "pct")
            res, recs = train_on(c, bench, steps, [*extra, *stop], d, cal["fit"], task=task, eval_every=every)
            runs[label] = recs if all(rc == 0 for rc, _, _ in res) else []
            if label == "DDP":
                ppl = [r["perplexity"] for r in recs if r.get("perplexity") is not None]
                target = ppl[-1] if ppl else None
            advance(1, f"time to target: {label}")
    rows = [{"method": label, **time_to(recs, target)} for label, recs in runs.items()]
    results["time_to_target"] = {"task": task, "hosts": hosts, "rate": rate, "target": target, "ddp_steps": ddp_steps,
                                 "budget_steps": budget, "rows": rows,
                                 "curves": {label: curve(recs) for label, recs in runs.items()}}


def check_options(repeats: int = 1, tasks: Sequence[str] | None = None,
                  host_counts: Sequence[int] | None = None, steps: int | None = None,
                  paired: int | None = None) -> None:
    """The sweep's limits, checked before anything runs: one ``ClusterError`` line naming what is allowed."""
    if steps is not None and not PROBE_STEPS + 5 <= steps <= 2000:
        raise ClusterError(f"cluster bench: --steps must be between {PROBE_STEPS + 5} (the measured wire plan's "
                           f"{PROBE_STEPS} steps and 5 to time) and 2000, got {steps}")
    if paired is not None and not 1 <= paired <= 100:
        raise ClusterError(f"cluster bench: --paired is a block length in steps, between 1 and 100, got {paired}")
    if not 1 <= repeats <= 20:
        raise ClusterError(f"cluster bench: --repeats must be between 1 and 20, got {repeats}")
    bad = [t for t in tasks or () if t not in SWEEP_TASKS]
    if bad:
        raise ClusterError(f"cluster bench: unknown task {bad[0]!r}; the tasks are: {', '.join(SWEEP_TASKS)}")
    if any(not 2 <= h <= 8 for h in host_counts or ()):
        raise ClusterError(f"cluster bench: --host-counts must be between 2 and 8, got {list(host_counts or [])}")


def run_cluster_bench(out: Path, *, quick: bool = False, data: str | None = None, progress: Progress | None = None,
                      faults: bool = True, rates: Sequence[str] | None = None,
                      only: Sequence[str] | None = None, repeats: int = 1, tasks: Sequence[str] | None = None,
                      host_counts: Sequence[int] | None = None, target: bool = True,
                      steps: int | None = None, paired: int | None = None) -> Path:
    """The whole bench (module docstring). ``rates`` limits the sweep to those link rates, ``only`` to those
    methods (labels of ``BASELINES``/``GRADSIFT``), ``repeats`` runs each of them that many times (see
    :func:`sweep`), ``tasks`` and ``host_counts`` to those tasks and cluster sizes, ``steps`` sets the sweep's
    steps a run (default ``SWEEP_STEPS``; not the quick bench's, nor time to target's); time to target trains
    wordlm on 2 hosts at 100 Mbit/s, so it runs only when the sweep includes that cell (and ``target``).
    ``paired``: see :func:`sweep`."""
    check_options(repeats, tasks, host_counts, steps, paired)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_path = Path(data) if data else SHAKESPEARE
    if not data_path.is_file():
        raise ClusterError(f"the language tasks need their text file: {data_path} does not exist (pass --data)")
    progress = progress or Progress(False)
    bench = Bench(out, data_path, quick, progress, task_options={
        "wordlm": ("embed=64", "hidden=64", "vocab=4000"), "charlm": ("hidden=128", "seq_len=32")} if quick else None)
    results: dict[str, Any] = {"sweep": [], "calibration": {}, "faults": {}, "time_to_target": {}, "repeats": repeats,
               "paired": paired}
    with_target = (target and "100mbit" in sweep_rates(quick, rates) and 2 in (host_counts or [2])
                   and "wordlm" in (tasks or ["wordlm"]))
    n_tasks = len(tasks) if tasks else (1 if quick else 2)
    n_hosts = len(host_counts) if host_counts else (1 if quick else 2)
    n_cells = n_hosts * len(sweep_rates(quick, rates)) * (1 + n_tasks * len(methods(quick, only)) * repeats)
    total = n_cells + (3 if quick else len(TIME_TO_TARGET)) * with_target + (1 if faults else 0)
    with progress.task("cluster bench", total) as advance:
        sweep(bench, results, advance, rates, only, repeats, tasks, host_counts, steps, paired)
        if with_target:
            time_to_target(bench, results, advance)
        write_json(out / "cluster.json", results)  # what is done so far survives a failure in the faults
        if faults:
            results["faults"] = run_faults(bench, out, quick)
            advance(1, "faults")
    write_json(out / "cluster.json", results)
    report.plot(out, results)
    return report.write(out, results, quick)
