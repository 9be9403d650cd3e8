"""The ``gradsift`` commands other than ``cluster``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..compressors import available
from ..runtime.records import OutputDir
from ..runtime.runconfig import RunConfig
from ..tasks import available_tasks
from .options import UsageError, check_specs, config_from_args

DEMO_STEPS = 150
DEMO_WORKERS = 4


def print_table(rows: list[list[str]], header: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(*header)
    for r in rows:
        t.add_row(*r)
    Console().print(t)


# --------------------------------------------------------------- commands
def cmd_list(a: argparse.Namespace) -> int:
    print("compressors:")
    for name, cls in available().items():
        opts = ", ".join(f"{k}={o.default_text()}" for k, o in cls.OPTIONS.items())
        print(f"  {name:<12} {cls.SUMMARY}" + (f"  [options: {opts}]" if opts else ""))
    print("tasks:")
    for name, cls in available_tasks().items():
        print(f"  {name:<12} {cls.SUMMARY}")
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from ..experiments.runner import Progress, train_to_dir
    from ..runtime.localsgd import LocalSGD
    from ..runtime.simulate import Simulator

    if a.compressor is None:
        if a.torch_hook is None:
            raise UsageError("gradsift train: --compressor is required: a spec such as topk, sidco or dgc (dense sends "
                             "everything; `gradsift list` names them), or --torch-hook BASELINE with --runtime ddp")
        a.compressor = "dense"  # a PyTorch baseline runs instead of a gradsift compressor
    if a.replicas is not None and a.runtime != "hsdp" and not (a.runtime == "sim" and getattr(a, "fsdp", False)):
        raise UsageError("gradsift train: --replicas needs --runtime hsdp (or the simulator's --fsdp)")
    if a.runtime in ("ddp", "fsdp", "hsdp"):
        return cmd_train_ddp(a)
    for flag in ("checkpoint_every", "resume", "torch_hook", "paired_ddp"):
        if getattr(a, flag) is not None:
            raise UsageError(f"gradsift train: --{flag.replace('_', '-')} needs --runtime ddp")
    cfg = config_from_args(a)
    check_specs(cfg, [cfg.compressor])
    out = Path(a.out)
    sim = LocalSGD(cfg, cfg.compressor) if cfg.compressor.split(":")[0] == "local" else Simulator(cfg)
    for line in [cfg.folded_momentum(type(sim.task)), *sim.notices()]:
        if line:
            print(line, file=sys.stderr)
    with OutputDir(out, overwrite=a.overwrite):
        summary = train_to_dir(cfg, out, progress=Progress(not a.quiet), sim=sim)
    if not a.quiet:
        print_summary(summary, f"{cfg.compressor} on {cfg.task}")
    print(f"wrote {out / 'metrics.jsonl'} and {out / 'summary.json'}")
    return 0


def print_summary(summary: dict[str, Any], title: str) -> None:
    """The run's summary as a table (both runtimes)."""
    from ..experiments.compare import fmt_bytes, sent_as

    fin = summary["final"] or {}
    tot = summary["totals"]
    metric = summary["metric"]

    def num(key: str) -> str:
        return f"{fin[key]:.4g}" if fin.get(key) is not None else "n/a"

    rows = [["final " + metric, num(metric)]]
    if metric != "loss":
        rows.append(["final loss", num("loss")])
    rows += [
        ["steps (skipped)", f"{tot['steps']} ({tot['skipped_steps']})"],
        ["bytes per worker (total)", fmt_bytes(tot["bytes_per_worker"])],
        ["wire bytes per worker (total)", fmt_bytes(tot["wire_bytes_per_worker"])],
        ["compression (payload bytes)", f"{tot['compression']:.1f}x"],
        ["sent", sent_as(summary)],
        ["estimated time", f"{tot['est_time_s']:.3f} s"],
        ["wall time", f"{tot['wall_s']:.1f} s"],
    ]
    if tot.get("step_s") is not None:
        rows.insert(-1, ["measured step time (total)", f"{tot['step_s']:.3f} s"])
    print_table(rows, ["", title])


def cmd_train_ddp(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..experiments.ddp_runs import train
    from ..experiments.runner import Progress

    cfg = config_from_args(a)
    if cfg.delta_telemetry:
        raise UsageError("gradsift train: --delta-telemetry is computed by the simulator (it needs every worker's memory)")
    # the process group is never destroyed here: the process ends with it alive (gradsift.launch.exit_process says
    # why destroying it while an error's traceback holds the DDP model can deadlock)
    res = train(cfg, a.out, checkpoint_every=a.checkpoint_every, resume=a.resume, bucket_cap_mb=a.bucket_cap_mb,
                timeout_s=a.timeout, lags=cfg.lags, progress=Progress(not a.quiet), overwrite=a.overwrite)
    if dist.get_rank() == 0:
        from ..tasks import task_class

        if (line := cfg.folded_momentum(task_class(cfg.task))) is not None:
            print(line, file=sys.stderr)
        if not a.quiet and res["summary"] is not None:
            print_summary(res["summary"], f"{cfg.compressor if cfg.torch_hook is None else cfg.torch_hook} on "
                                          f"{cfg.task} ({a.runtime}, {dist.get_world_size()} ranks)")
        print(f"wrote {Path(a.out) / 'metrics.jsonl'} and {Path(a.out) / 'summary.json'}")
    return 0


def bench_model(a: argparse.Namespace) -> int:
    """``gradsift bench select --model NAME | --shapes FILE``: a whole model's tensors per step."""
    from .. import kernels
    from ..experiments.bench import BenchError, check_fits
    from ..experiments.model_bench import ModelBenchError, model_shapes, run_model_bench
    from ..experiments.runner import Progress

    if a.model is not None and a.shapes is not None:
        raise UsageError("gradsift bench select: give --model or --shapes, not both")
    if a.device != "cpu":
        raise UsageError("gradsift bench select: --model and --shapes time on the CPU (--device cpu)")
    try:
        label, shapes = model_shapes(a.model, a.shapes)
        check_fits(sum(math.prod(s) for _, s in shapes), f"--{'model' if a.model else 'shapes'} {label}")
    except (ModelBenchError, BenchError) as e:
        raise UsageError(f"gradsift bench select: {e}") from None
    with kernels.using(a.kernels), OutputDir(a.out, overwrite=a.overwrite):
        run_model_bench(a.compressors, label, shapes, a.ratios, a.calls, Path(a.out), threads=a.threads,
                        progress=Progress(not a.quiet))
    print(f"wrote {Path(a.out) / 'bench.md'}")
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from ..experiments.compare import run_compare
    from ..experiments.runner import Progress

    cfg = config_from_args(a, compressor=a.compressors[0])
    check_specs(cfg, a.compressors)
    with OutputDir(a.out, overwrite=a.overwrite):
        res = run_compare(cfg, a.compressors, Path(a.out), progress=Progress(not a.quiet))
    print(f"report: {res['report']}")
    print(f"plot:   {res['plot']}")
    return 0


def cmd_race(a: argparse.Namespace) -> int:
    from ..experiments.race import DEFAULT_METHODS, run_race
    from ..experiments.runner import Progress

    if a.steps is not None and a.steps < 1:
        raise UsageError(f"gradsift race: the budget (--steps) must be >= 1, got {a.steps}")
    if a.factor < 1:
        raise UsageError(f"gradsift race: --factor must be >= 1, got {a.factor}")
    methods = a.methods or list(DEFAULT_METHODS)
    cfg = config_from_args(a, compressor="dense")
    with OutputDir(a.out, overwrite=a.overwrite, reuse=a.reuse):
        res = run_race(cfg, methods, Path(a.out), seeds=a.seeds, factor=a.factor, links=a.links,
                       progress=Progress(not a.quiet), reuse=a.reuse)
    print(f"report: {Path(a.out) / 'race.md'} (target {res['target']:.4g})")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from ..experiments.compare import run_compare
    from ..experiments.runner import Progress

    # PowerSGD compresses from step start on (PyTorch's start_powerSGD_iter, 1000 by default, is longer than the
    # demo: it would be dense all along)
    start = max(a.steps // 10, 1)
    specs = [f"powersgd:start={start}" if n == "powersgd" else n for n in available()]
    cfg = RunConfig(task="digits-cnn", compressor=specs[0], ratio=0.01, workers=a.workers, steps=a.steps,
                    seed=a.seed, eval_every=max(a.steps // 10, 1)).validate()
    out = Path(a.out)
    others = [x for x in specs if x != "dense"]
    print(f"gradsift demo: {len(others)} compressors and dense all-reduce on digits-cnn, {a.workers} simulated "
          f"workers, ratio 0.01, {a.steps} steps each (PowerSGD compressing from step {start}); the report in {out} "
          "is rewritten after every run and ends with which to pick")
    with OutputDir(out, overwrite=True):  # the demo's folder is its own: each demo replaces the last
        res = run_compare(cfg, specs, out, progress=Progress(not a.quiet),
                          title="gradsift demo: every compressor against dense on digits-cnn")
    print(f"report: {res['report']}")
    print(f"plot:   {res['plot']}")
    return 0


def cmd_bench_select(a: argparse.Namespace) -> int:
    from .. import kernels
    from ..experiments.bench import BenchError, busy_note, check_device, check_fits, run_select_bench, where
    from ..experiments.runner import Progress

    for r in a.ratios:
        if not (0 < r <= 1):
            raise UsageError(f"gradsift bench select: --ratios must be in (0, 1], got {r}")
    for n in a.sizes:
        if n < 1:
            raise UsageError(f"gradsift bench select: --sizes must be >= 1, got {n}")
    if a.calls < 4:
        raise UsageError(f"gradsift bench select: --calls must be >= 4, got {a.calls}")
    if a.threads is not None and a.threads < 1:
        raise UsageError(f"gradsift bench select: --threads must be >= 1, got {a.threads}")
    try:  # before the output folder is made
        check_device(a.device)
        for n in a.sizes:
            check_fits(n, f"--sizes {n}")
    except BenchError as e:
        raise UsageError(f"gradsift bench select: {e}") from None
    if a.model is not None or a.shapes is not None:
        return bench_model(a)
    with kernels.using(a.kernels), OutputDir(a.out, overwrite=a.overwrite):
        records = run_select_bench(a.compressors, a.sizes, a.ratios, a.dist, a.calls, Path(a.out),
                                   progress=Progress(not a.quiet), threads=a.threads, device=a.device)
    note = busy_note(records)
    if note:
        print(f"gradsift: warning: {note}", file=sys.stderr)
    out = Path(a.out)
    print(f"{where(records[0])}, {records[0]['backend']} kernels; wrote {out / 'bench.json'}, "
          f"{out / 'bench.md'} and {out / 'bench.png'}")
    return 0


def cmd_bench_hook(a: argparse.Namespace) -> int:
    from ..experiments.hook_bench import HookBench, HookBenchError, run_hook_bench

    if a.model is not None and a.shapes is not None:
        raise UsageError("gradsift bench hook: give --model or --shapes, not both")
    b = HookBench(model=a.model if a.model or a.shapes else "mlp", shapes=a.shapes, methods=tuple(a.methods),
                  ranks=a.ranks, steps=a.steps, warm=a.warm, ratio=a.ratio, threads=a.threads, device=a.device,
                  profile=a.profile)
    try:
        b.check()  # before the output folder is made
        with OutputDir(a.out, overwrite=a.overwrite):
            res = run_hook_bench(b, Path(a.out))
    except HookBenchError as e:
        raise UsageError(f"gradsift bench hook: {e}") from None
    from ..experiments.hook_bench import table

    print(table(res))
    print(f"wrote {Path(a.out) / 'hook.md'}, hook.json and hook.png")
    return 0


def cmd_reproduce(a: argparse.Namespace) -> int:
    from ..experiments.reproduce import EXPERIMENTS, run_reproduce
    from ..experiments.runner import Progress

    names = a.names
    bad = [n for n in names if n not in EXPERIMENTS and n != "all"]
    if bad:
        raise UsageError(f"gradsift reproduce: unknown experiment {bad[0]!r}; available: all, {', '.join(EXPERIMENTS)}")
    if "all" in names and len(names) > 1:
        raise UsageError("gradsift reproduce: 'all' runs every experiment; give it alone, or name experiments")
    if a.data is not None and not Path(a.data).is_file():
        raise UsageError(f"gradsift reproduce: --data {a.data!r} is not a readable file")
    if not 0.0 < a.scale <= 1.0:
        raise UsageError(f"gradsift reproduce: --scale must be in (0, 1], got {a.scale}")
    if a.quick and a.scale != 1.0:
        raise UsageError("gradsift reproduce: --scale applies to the full-size versions, not with --quick")
    if a.reuse and a.overwrite:
        raise UsageError("gradsift reproduce: --reuse takes the finished runs in --out and --overwrite clears them "
                         "first: give one of the two")
    command = ("gradsift reproduce " + " ".join(names) + f" --out {a.out}" + (" --quick" if a.quick else "")
               + (f" --scale {a.scale:g}" if a.scale != 1.0 else "") + (" --reuse" if a.reuse else ""))
    # a report folder: rerunning updates its sections; --reuse also takes a folder whose run was interrupted
    updating = (Path(a.out) / "report.json").exists() or a.reuse
    with OutputDir(a.out, overwrite=a.overwrite, reuse=updating and not a.overwrite):
        report = run_reproduce(names, Path(a.out), quick=a.quick, progress=Progress(not a.quiet), data=a.data,
                               command=command, scale=a.scale, reuse=a.reuse)
    print(f"report: {report}")
    return 0
