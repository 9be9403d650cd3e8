"""Command-line options shared by the commands, and the one-line error contract."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..route.owners import SCATTER_KEEP
from ..runtime.settings import SETTINGS
from ..compressors import parse_value
from ..compressors.base import COMMON_OPTIONS
from ..errors import OptionError
from ..options import Option
from ..memory.factory import make_compressor
from ..runtime.localsgd import local_options
from ..tasks import make_task
from ..runtime.runconfig import RUN_OPTIONS, RunConfig, split_ratio

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


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


def _checked(flag: str, option: Option):
    """An argparse type for a number option: the text parsed, then checked by the declaration (one line)."""
    parse = _float if option.kind == "number" else _positive_int

    def convert(text: str):
        try:
            return option.check(flag, parse(text))
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def add_declared(p: argparse.ArgumentParser, name: str, option: Option, *, also: str = "", **overrides: Any) -> None:
    """``--name`` from an option's declaration: its choices or type (checked by it), default and help (``also``:
    what the command line adds to the declaration's words, e.g. a different default)."""
    kw: dict[str, Any] = {"default": option.default, "help": option.doc + (f" ({also})" if also else "")}
    if option.kind == "choice":
        kw["choices"] = [c for c in option.choices if isinstance(c, str)]
    elif option.kind in ("number", "integer"):
        kw["type"] = _checked(name, option)
    p.add_argument("--" + name.replace("_", "-"), **{**kw, **overrides})


def add_run_options(p: argparse.ArgumentParser, *, compressor: bool = True, required: bool = False) -> None:
    """The options every run takes; ``required``: ``--task`` and ``--compressor`` have no default (``train``)."""
    if required:
        p.add_argument("--task", required=True, help="training task (see `gradsift list`), e.g. digits-cnn")
    else:
        p.add_argument("--task", default="digits-cnn", help="training task (see `gradsift list`; default digits-cnn)")
    if compressor:
        p.add_argument("--compressor", default=None if required else "topk",
                       help="compressor spec, e.g. topk or sidco:dist=gp; dense sends everything (see `gradsift list`)"
                            + ("" if required else " (default topk)"))
    p.add_argument("--ratio", type=_float, default=0.01,
                   help="fraction of entries sent, in (0, 1] (default 0.01); a compressor spec's own ratio, as in "
                        "topk:ratio=0.001, wins")
    add_declared(p, "workers", RUN_OPTIONS["workers"], default=None, also="default 4 in the simulator")
    add_declared(p, "steps", RUN_OPTIONS["steps"])
    add_declared(p, "seed", SETTINGS["seed"])
    for name in ("lr", "batch_size", "optimizer", "momentum", "weight_decay", "schedule", "warmup_steps"):
        add_declared(p, name, RUN_OPTIONS[name])
    p.add_argument("--no-recipe", action="store_true",
                   help="keep the optimizer as given (by default a sparsifier with memory trains with Nesterov "
                        "momentum under momentum SGD: the recipe measured in docs/results.md)")
    add_declared(p, "granularity", SETTINGS["granularity"])
    add_declared(p, "value_dtype", COMMON_OPTIONS["value_dtype"],
                 also="int4/int2: sparse values as 4- or 2-bit codes with a float32 scale per 64, the rounding kept "
                      "by the memory")
    add_declared(p, "bandwidth_gbps", SETTINGS["bandwidth_gbps"])
    add_declared(p, "latency_us", SETTINGS["latency_us"])
    add_declared(p, "eval_every", RUN_OPTIONS["eval_every"])
    add_declared(p, "probe_every", RUN_OPTIONS["probe_every"])
    add_declared(p, "on_nonfinite", SETTINGS["on_nonfinite"], default="error", also="default here: error")
    add_declared(p, "clip_norm", RUN_OPTIONS["clip_norm"])
    p.add_argument("--data", default=None, help="data file for tasks that read one (charlm)")
    p.add_argument("--task-option", type=_task_option, action="append", default=[], metavar="KEY=VALUE",
                   help="task option (repeatable)")
    p.add_argument("--fault-nan-step", type=_positive_int, default=None, help=argparse.SUPPRESS)
    add_declared(p, "wire_plan", SETTINGS["wire_plan"], default=None,
                 also="default: off in the simulator, auto with --runtime ddp; what the plan changed is printed and "
                      "recorded in summary.json")
    add_declared(p, "sum_order", SETTINGS["sum_order"])
    add_declared(p, "sparse_collective", SETTINGS["sparse_collective"])
    p.add_argument("--fsdp", action="store_true",
                   help="(simulator) FSDP's exchange: one group per FSDP unit in its shard layout, each shard summed "
                        "by its owner (the reference for --runtime fsdp); with --replicas R, HSDP's (--runtime hsdp)")
    add_declared(p, "scatter_keep", SETTINGS["scatter_keep"], metavar="X",
                 also="what keeping less costs in quality: docs/results.md, 'The scatter route'")
    p.add_argument("--lags", action="store_true",
                   help="LAGS-SGD: per-layer ratios from measured backward times and the network model (ratio = 1/c_u)")
    p.add_argument("--delta-telemetry", action="store_true",
                   help="record LAGS's delta^(l) (eq. 21) per layer in metrics.jsonl (simulator)")
    p.add_argument("--dump-grads", default=None, metavar="PATH",
                   help="save worker 0's raw gradient of every step (flat float32, [steps, numel]) for `bench select`")
    add_declared(p, "stop_at", RUN_OPTIONS["stop_at"], metavar="VALUE")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def config_from_args(a: argparse.Namespace, compressor: str | None = None) -> RunConfig:
    cfg = RunConfig(
        task=a.task,
        compressor=compressor if compressor is not None else a.compressor,
        ratio=a.ratio,
        workers=a.workers if a.workers is not None else (None if getattr(a, "runtime", "sim") != "sim" else 4),
        fsdp=getattr(a, "runtime", "sim") in ("fsdp", "hsdp") or bool(getattr(a, "fsdp", False)),
        replicas=(getattr(a, "replicas", None) or (2 if getattr(a, "runtime", "sim") == "hsdp" else 1)),
        steps=a.steps,
        seed=a.seed,
        lr=a.lr,
        batch_size=a.batch_size,
        optimizer=a.optimizer,
        momentum=a.momentum,
        weight_decay=a.weight_decay,
        schedule=getattr(a, "schedule", None),
        warmup_steps=getattr(a, "warmup_steps", None),
        recipe=not getattr(a, "no_recipe", False),
        granularity=a.granularity,
        value_dtype=a.value_dtype,
        bandwidth_gbps=a.bandwidth_gbps,
        latency_us=a.latency_us,
        eval_every=a.eval_every,
        probe_every=a.probe_every,
        on_nonfinite=a.on_nonfinite,
        data=a.data,
        task_options=dict(a.task_option),
        clip_norm=a.clip_norm,
        fault_nan_step=a.fault_nan_step,
        dump_grads=getattr(a, "dump_grads", None),
        lags=getattr(a, "lags", False),
        delta_telemetry=getattr(a, "delta_telemetry", False),
        wire_plan=getattr(a, "wire_plan", None),
        sum_order=getattr(a, "sum_order", "backend"),
        sparse_collective=getattr(a, "sparse_collective", "auto"),
        scatter_keep=getattr(a, "scatter_keep", SCATTER_KEEP),
        torch_hook=getattr(a, "torch_hook", None),
        stop_at=getattr(a, "stop_at", None),
        paired_ddp=getattr(a, "paired_ddp", None),
    )
    return cfg.validate()


def check_specs(cfg: RunConfig, specs: Sequence[str]) -> None:
    """Build every compressor and the task once, so bad input fails before any training."""
    for spec in specs:
        extra = {"value_dtype": cfg.value_dtype} if cfg.value_dtype else {}
        if spec.split(":")[0] == "local":  # local SGD: its options, and the compressor of its syncs
            spec = local_options(spec)["compressor"]
        make_compressor(*split_ratio(spec, cfg.ratio), world_size=cfg.workers, **extra)
    make_task(cfg.task, cfg.workers, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data, **cfg.task_options)
