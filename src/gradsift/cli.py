"""The ``gradsift`` command line.

Bad input ends with one line on stderr and exit code 2; a non-finite gradient
during training with exit code 1. No tracebacks for either.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from .compressors import available, parse_value
from .compressors.base import NonFiniteGradient, OptionError
from .runconfig import GRANULARITIES, NONFINITE, OPTIMIZERS, ConfigError, RunConfig
from .ddp import ConfigMismatch
from .experiments.bench import BenchError
from .launch import CollectiveTimeout
from .tasks import TaskError, available_tasks

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

DEMO_STEPS = 200


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _task_option(text: str) -> tuple[str, Any]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), parse_value(value)


def add_run_options(p: argparse.ArgumentParser, *, compressor: bool = True) -> None:
    p.add_argument("--task", default="digits-cnn", help="training task (see `gradsift list`)")
    if compressor:
        p.add_argument("--compressor", default="topk", help="compressor spec, e.g. topk or sidco:dist=gp")
    p.add_argument("--ratio", type=_float, default=0.01, help="fraction of entries sent, in (0, 1] (default 0.01)")
    p.add_argument("--workers", type=_positive_int, default=None, help="number of workers (default 4)")
    p.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default: the task's)")
    p.add_argument("--seed", type=_positive_int, default=0)
    p.add_argument("--lr", type=_float, default=None, help="learning rate (default: the task's)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="batch size per worker")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None)
    p.add_argument("--momentum", type=_float, default=0.9)
    p.add_argument("--weight-decay", type=_float, default=0.0)
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer",
                   help="compress each parameter tensor (layer) or the whole model flattened (model)")
    p.add_argument("--value-dtype", choices=("fp32", "fp16"), default=None,
                   help="wire dtype of sent values (default: the gradient's; fp16 for gsb)")
    p.add_argument("--bandwidth-gbps", type=_float, default=1.0, help="network model bandwidth (Gbit/s)")
    p.add_argument("--latency-us", type=_float, default=50.0, help="network model latency per message (us)")
    p.add_argument("--eval-every", type=_positive_int, default=None, help="evaluate the task metric every N steps")
    p.add_argument("--on-nonfinite", choices=NONFINITE, default="error",
                   help="a NaN/Inf gradient stops the run (error) or skips that step on every worker (skip)")
    p.add_argument("--clip-norm", type=_float, default=None, help="clip the aggregated gradient's norm")
    p.add_argument("--data", default=None, help="data file for tasks that read one (charlm)")
    p.add_argument("--task-option", type=_task_option, action="append", default=[], metavar="KEY=VALUE",
                   help="task option (repeatable)")
    p.add_argument("--fault-nan-step", type=_positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lags", action="store_true",
                   help="LAGS-SGD: per-layer ratios from measured backward times and the network model (ratio = 1/c_u)")
    p.add_argument("--delta-telemetry", action="store_true",
                   help="record LAGS's delta^(l) (eq. 21) per layer in metrics.jsonl (simulator)")
    p.add_argument("--dump-grads", default=None, metavar="PATH",
                   help="save worker 0's raw gradient of every step (flat float32, [steps, numel]) for `bench select`")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def config_from_args(a: argparse.Namespace, compressor: str | None = None) -> RunConfig:
    cfg = RunConfig(
        task=a.task,
        compressor=compressor if compressor is not None else a.compressor,
        ratio=a.ratio,
        workers=a.workers if a.workers is not None else (None if getattr(a, "runtime", "sim") == "ddp" else 4),
        steps=a.steps,
        seed=a.seed,
        lr=a.lr,
        batch_size=a.batch_size,
        optimizer=a.optimizer,
        momentum=a.momentum,
        weight_decay=a.weight_decay,
        granularity=a.granularity,
        value_dtype=a.value_dtype,
        bandwidth_gbps=a.bandwidth_gbps,
        latency_us=a.latency_us,
        eval_every=a.eval_every,
        on_nonfinite=a.on_nonfinite,
        data=a.data,
        task_options=dict(a.task_option),
        clip_norm=a.clip_norm,
        fault_nan_step=a.fault_nan_step,
        dump_grads=getattr(a, "dump_grads", None),
        lags=getattr(a, "lags", False),
        delta_telemetry=getattr(a, "delta_telemetry", False),
    )
    return cfg.validate()


def check_specs(cfg: RunConfig, specs: Sequence[str]) -> None:
    """Build every compressor and the task once, so bad input fails before any training."""
    from .compressors import make_compressor
    from .tasks import make_task

    for spec in specs:
        extra = {"value_dtype": cfg.value_dtype} if cfg.value_dtype else {}
        make_compressor(spec, cfg.ratio, world_size=cfg.workers, **extra)
    make_task(cfg.task, cfg.workers, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data, **cfg.task_options)


def print_table(rows: list[list[str]], header: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(*header)
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def fmt_option(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# --------------------------------------------------------------- commands
def cmd_list(a: argparse.Namespace) -> int:
    print("compressors:")
    for name, cls in available().items():
        opts = ", ".join(f"{k}={fmt_option(v)}" for k, v in cls.OPTIONS.items())
        print(f"  {name:<12} {cls.SUMMARY}" + (f"  [options: {opts}]" if opts else ""))
    print("tasks:")
    for name, cls in available_tasks().items():
        print(f"  {name:<12} {cls.SUMMARY}")
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from .experiments.compare import fmt_bytes
    from .experiments.runner import Progress, train_to_dir

    if a.runtime == "ddp":
        return cmd_train_ddp(a)
    for flag in ("checkpoint_every", "resume"):
        if getattr(a, flag) is not None:
            raise UsageError(f"gradsift train: --{flag.replace('_', '-')} needs --runtime ddp")
    cfg = config_from_args(a)
    check_specs(cfg, [cfg.compressor])
    out = Path(a.out)
    summary = train_to_dir(cfg, out, progress=Progress(not a.quiet))
    fin = summary["final"] or {}
    tot = summary["totals"]
    metric = summary["metric"]
    rows = [
        ["final " + metric, f"{fin.get(metric, float('nan')):.4g}" if fin.get(metric) is not None else "n/a"],
        ["final loss", f"{fin.get('loss', float('nan')):.4g}"],
        ["steps (skipped)", f"{tot['steps']} ({tot['skipped_steps']})"],
        ["bytes per worker (total)", fmt_bytes(tot["bytes_per_worker"])],
        ["wire bytes per worker (total)", fmt_bytes(tot["wire_bytes_per_worker"])],
        ["compression", f"{tot['compression']:.1f}x"],
        ["estimated time", f"{tot['est_time_s']:.3f} s"],
        ["wall time", f"{tot['wall_s']:.1f} s"],
    ]
    if not a.quiet:
        print_table(rows, ["", f"{cfg.compressor} on {cfg.task}"])
    print(f"wrote {out / 'metrics.jsonl'} and {out / 'summary.json'}")
    return 0


def cmd_train_ddp(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .experiments.runner import Progress
    from .launch import train_ddp

    cfg = config_from_args(a)
    if cfg.delta_telemetry:
        raise UsageError("gradsift train: --delta-telemetry is computed by the simulator (it needs every worker's memory)")
    try:
        res = train_ddp(cfg, a.out, checkpoint_every=a.checkpoint_every, resume=a.resume,
                        bucket_cap_mb=a.bucket_cap_mb, timeout_s=a.timeout, lags=cfg.lags,
                        progress=Progress(not a.quiet))
        if dist.get_rank() == 0:
            print(f"wrote {Path(a.out) / 'metrics.jsonl'} and {Path(a.out) / 'summary.json'}")
        del res
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
                pass
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from .experiments.compare import run_compare
    from .experiments.runner import Progress

    cfg = config_from_args(a, compressor=a.compressors[0])
    check_specs(cfg, a.compressors)
    res = run_compare(cfg, a.compressors, Path(a.out), progress=Progress(not a.quiet))
    print(f"report: {res['report']}")
    print(f"plot:   {res['plot']}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .experiments.compare import run_compare
    from .experiments.runner import Progress

    specs = list(available())
    cfg = RunConfig(task="digits-cnn", compressor=specs[0], ratio=0.01, workers=8, steps=a.steps,
                    seed=a.seed, eval_every=20).validate()
    out = Path(a.out)
    print(f"gradsift demo: {len(specs)} compressors on digits-cnn, 8 simulated workers, ratio 0.01, "
          f"{a.steps} steps each")
    res = run_compare(cfg, specs, out, progress=Progress(not a.quiet),
                      title="gradsift demo: every compressor on digits-cnn")
    print(f"report: {res['report']}")
    print(f"plot:   {res['plot']}")
    return 0


def cmd_bench_select(a: argparse.Namespace) -> int:
    from .experiments.bench import run_select_bench
    from .experiments.runner import Progress

    for r in a.ratios:
        if not (0 < r <= 1):
            raise UsageError(f"gradsift bench select: --ratios must be in (0, 1], got {r}")
    for n in a.sizes:
        if n < 1:
            raise UsageError(f"gradsift bench select: --sizes must be >= 1, got {n}")
    if a.calls < 4:
        raise UsageError(f"gradsift bench select: --calls must be >= 4, got {a.calls}")
    run_select_bench(a.compressors, a.sizes, a.ratios, a.dist, a.calls, Path(a.out), progress=Progress(not a.quiet))
    out = Path(a.out)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and {out / 'bench.png'}")
    return 0


def cmd_reproduce(a: argparse.Namespace) -> int:
    from .experiments.reproduce import EXPERIMENTS, run_reproduce
    from .experiments.runner import Progress

    names = a.names
    if names != ["all"]:
        bad = [n for n in names if n not in EXPERIMENTS]
        if bad or "all" in names:
            raise UsageError(f"gradsift reproduce: unknown experiment {(bad or ['all'])[0]!r}; "
                             f"available: all, {', '.join(EXPERIMENTS)}")
    if a.data is not None and not Path(a.data).is_file():
        raise UsageError(f"gradsift reproduce: --data {a.data!r} is not a readable file")
    if not 0.0 < a.scale <= 1.0:
        raise UsageError(f"gradsift reproduce: --scale must be in (0, 1], got {a.scale}")
    if a.quick and a.scale != 1.0:
        raise UsageError("gradsift reproduce: --scale applies to the full-size versions, not with --quick")
    command = ("gradsift reproduce " + " ".join(names) + f" --out {a.out}" + (" --quick" if a.quick else "")
               + (f" --scale {a.scale:g}" if a.scale != 1.0 else "") + (" --reuse" if a.reuse else ""))
    report = run_reproduce(names, Path(a.out), quick=a.quick, progress=Progress(not a.quiet), data=a.data,
                           command=command, scale=a.scale, reuse=a.reuse)
    print(f"report: {report}")
    return 0


def cmd_cluster(a: argparse.Namespace) -> int:
    from .cluster import Cluster, ClusterError, Link, TearDown, check_environment, run_on_cluster

    try:
        if a.action == "down":
            Cluster(hosts=1, name=a.name).down()
            print(f"cluster {a.name!r} is down")
            return 0
        check_environment()
        if a.action == "bench":
            from .experiments.cluster_bench import run_cluster_bench
            from .experiments.runner import Progress

            report = run_cluster_bench(Path(a.out), quick=a.quick, data=a.data, progress=Progress(not a.quiet))
            print(f"report: {report}")
            return 0
        links = [Link(rate=a.rate) for _ in range(a.hosts)]
        if a.delay_ms or a.loss_pct:
            if not 0 <= a.impair_host < a.hosts:
                raise UsageError(f"gradsift cluster: --impair-host must be in [0, {a.hosts}), got {a.impair_host}")
            links[a.impair_host] = Link(rate=a.rate, delay_ms=a.delay_ms, loss_pct=a.loss_pct)
        if a.action == "up":
            c = Cluster(hosts=a.hosts, name=a.name, links=links).up()
            print(f"cluster {a.name!r} is up: hosts {', '.join(c.host_ns(i) for i in range(c.hosts))} at "
                  f"{', '.join(c.ip(i) for i in range(c.hosts))}; `gradsift cluster down` removes it")
            return 0
        if a.action in ("run", "calibrate"):
            attached = Cluster.load_state(a.name) is not None
            cluster = Cluster.attach(a.name) if attached else Cluster(hosts=a.hosts, name=a.name, links=links)
            ctx = _NullCtx(cluster) if attached else TearDown(cluster)
            with ctx as c:
                if a.action == "calibrate":
                    from .experiments.cluster_bench import calibrate

                    cal = calibrate(c, Path(a.out))
                    print(f"latency {cal['fit']['latency_us']:.1f} us, bandwidth {cal['fit']['bandwidth_gbps']:.4f} "
                          f"Gbit/s ({c.hosts} hosts); samples in {a.out}")
                    return 0
                args = list(a.train_args)
                if args and args[0] == "--":
                    args = args[1:]
                res = run_on_cluster(c, ["gradsift", "train", "--runtime", "ddp", *args], nproc=a.nproc_per_host,
                                     max_restarts=a.max_restarts)
                for i, (rc, out, err) in enumerate(res):
                    for line in err.splitlines():
                        if line.startswith("gradsift: error:"):
                            print(f"host {i}: {line}", file=sys.stderr)
                    sys.stdout.write(out)
                bad = [rc for rc, _, _ in res if rc]
                return 1 if bad else 0
    except ClusterError as e:
        print(f"gradsift: error: {e}", file=sys.stderr)
        return 1
    raise UsageError(f"gradsift cluster: unknown action {a.action!r}")  # pragma: no cover


class _NullCtx:
    def __init__(self, c):
        self.c = c

    def __enter__(self):
        return self.c

    def __exit__(self, *exc):
        return None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="gradsift", description="Communication-efficient data-parallel training by gradient sparsification.")
    sub = p.add_subparsers(dest="command", parser_class=OneLineParser)
    sub.required = True

    sp = sub.add_parser("list", help="registered compressors and tasks")
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("train", help="train with one compressor (simulator, or DDP under torchrun)")
    add_run_options(sp)
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--runtime", choices=("sim", "ddp"), default="sim",
                    help="sim: N simulated workers in this process; ddp: one rank of torchrun's process group")
    sp.add_argument("--checkpoint-every", type=_positive_int, default=None, help="(ddp) checkpoint every N steps")
    sp.add_argument("--resume", default=None, metavar="PATH", help="(ddp) resume from a checkpoint file or folder")
    sp.add_argument("--bucket-cap-mb", type=_float, default=None, help="(ddp) DDP bucket size")
    sp.add_argument("--timeout", type=_float, default=120.0, help="(ddp) collective timeout in seconds")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("compare", help="the same run with several compressors; report and curves")
    add_run_options(sp, compressor=False)
    sp.add_argument("--compressors", nargs="+", required=True, metavar="SPEC",
                    help="compressor specs separated by spaces")
    sp.add_argument("--out", required=True)
    sp.set_defaults(func=cmd_compare)

    bp = sub.add_parser("bench", help="benchmarks")
    bsub = bp.add_subparsers(dest="bench", parser_class=OneLineParser)
    bsub.required = True
    sp = bsub.add_parser("select", help="selection time vs torch.topk and one read pass, and achieved/target count")
    sp.add_argument("--compressors", nargs="+", required=True, metavar="SPEC")
    sp.add_argument("--sizes", nargs="+", type=_positive_int, default=[262144, 2621440])
    sp.add_argument("--ratios", nargs="+", type=_float, default=[0.1, 0.01, 0.001])
    sp.add_argument("--dist", default="gaussian", help="gaussian, laplace, student-t (3 dof), or a .pt file of gradients")
    sp.add_argument("--calls", type=_positive_int, default=20)
    sp.add_argument("--out", required=True)
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_bench_select)

    sp = sub.add_parser("reproduce", help="run the papers' headline experiments at laptop scale; REPORT.md")
    sp.add_argument("names", nargs="+", metavar="NAME", help="experiment names, or all")
    sp.add_argument("--out", required=True)
    sp.add_argument("--quick", action="store_true", help="CI-sized versions (about 15 s each)")
    sp.add_argument("--scale", type=float, default=1.0,
                    help="full-size configurations with every training budget times this (0, 1]; default 1")
    sp.add_argument("--data", default=None, help="text file for the charlm parts (default ../shared/data/tinyshakespeare.txt)")
    sp.add_argument("--reuse", action="store_true",
                    help="take finished simulated runs already in DIR whose configuration matches instead of "
                         "training them again (resume an interrupted report; numbers come from the code that made them)")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_reproduce)

    sp = sub.add_parser("cluster", help="hosts in network namespaces on shaped links (root)")
    sp.add_argument("action", choices=("up", "run", "down", "calibrate", "bench"))
    sp.add_argument("--name", default="gs", help="cluster name (namespace prefix)")
    sp.add_argument("--hosts", type=_positive_int, default=4)
    sp.add_argument("--rate", default="100mbit", help="uplink rate per host (tc tbf), e.g. 100mbit, 1gbit")
    sp.add_argument("--delay-ms", type=_float, default=0.0, help="one-way delay on one host's link")
    sp.add_argument("--loss-pct", type=_float, default=0.0, help="packet loss (%%) on one host's link")
    sp.add_argument("--impair-host", type=_positive_int, default=1, help="which host gets --delay-ms/--loss-pct")
    sp.add_argument("--nproc-per-host", type=_positive_int, default=1)
    sp.add_argument("--max-restarts", type=_positive_int, default=0)
    sp.add_argument("--out", default="runs/cluster", help="(bench, calibrate) output")
    sp.add_argument("--data", default=None, help="(bench) text file for charlm")
    sp.add_argument("--quick", action="store_true", help="(bench) a small version")
    sp.add_argument("--quiet", action="store_true")
    sp.add_argument("train_args", nargs="*", help="(run) after --: `gradsift train` options")
    sp.set_defaults(func=cmd_cluster)

    sp = sub.add_parser("demo", help="compare every compressor on digits-cnn (the main job)")
    sp.add_argument("--out", default="runs/demo")
    sp.add_argument("--steps", type=_positive_int, default=DEMO_STEPS)
    sp.add_argument("--seed", type=_positive_int, default=0)
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"{e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OptionError, ConfigError, TaskError, BenchError) as e:
        print(f"gradsift: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (NonFiniteGradient, ConfigMismatch, CollectiveTimeout) as e:
        print(f"gradsift: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("gradsift: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
