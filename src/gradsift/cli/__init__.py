"""The ``gradsift`` command line.

Bad input ends with one line on stderr and exit code 2; a non-finite gradient
during training with exit code 1. No tracebacks for either.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ..compressors.base import InputError, NonFiniteGradient, OptionError
from ..payload.indexcode import CorruptPayload
from ..ddp import ConfigMismatch
from ..kernels import KernelUnavailable
from ..experiments.bench import BenchError
from ..runtime.records import OutputError
from ..launch import CollectiveTimeout, exit_process
from ..runtime.runconfig import RUN_OPTIONS, ConfigError
from ..tasks import TaskError
from .cluster import cmd_cluster
from .commands import (DEMO_STEPS, DEMO_WORKERS, cmd_bench_hook, cmd_bench_select, cmd_compare, cmd_demo, cmd_list,
                       cmd_race, cmd_reproduce, cmd_train)
from .options import (EXIT_BAD_INPUT, EXIT_FAILED, OneLineParser, UsageError, _float, _positive_int, add_declared,
                      add_run_options)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="gradsift", description="Communication-efficient data-parallel training by gradient sparsification.")
    sub = p.add_subparsers(dest="command", parser_class=OneLineParser)
    sub.required = True

    sp = sub.add_parser("list", help="registered compressors and tasks")
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("train", help="train with one compressor (simulator, or DDP under torchrun)")
    add_run_options(sp, required=True)
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.add_argument("--runtime", choices=("sim", "ddp", "fsdp", "hsdp"), default="sim",
                    help="sim: N simulated workers in this process; ddp: one rank of torchrun's process group; fsdp: "
                         "the same with the model sharded by FSDP2 (fully_shard), gradsift on its reduce-scatter; "
                         "hsdp: sharded inside each of --replicas replicas, gradsift across them")
    add_declared(sp, "replicas", RUN_OPTIONS["replicas"], default=None, also="with --runtime hsdp; default 2")
    sp.add_argument("--checkpoint-every", type=_positive_int, default=None, help="(ddp) checkpoint every N steps")
    sp.add_argument("--resume", default=None, metavar="PATH",
                    help="(ddp) resume from a checkpoint file or folder; auto: from the latest checkpoint under --out "
                         "if there is one, else from the start (for torchrun --max-restarts)")
    sp.add_argument("--bucket-cap-mb", type=_float, default=None, help="(ddp) DDP bucket size")
    sp.add_argument("--timeout", type=_float, default=120.0, help="(ddp) collective timeout in seconds")
    sp.add_argument("--torch-hook", default=None, metavar="BASELINE",
                    help="(ddp) a PyTorch baseline instead of a gradsift compressor: ddp (no hook), fp16, bf16, "
                         "powersgd[:rank=R,start=S] (default rank 2, plain all-reduce for the first 10%% of steps), "
                         "localsgd[:period=H,start=S] (post-local SGD: the models averaged every H steps, default 8)")
    add_declared(sp, "paired_ddp", RUN_OPTIONS["paired_ddp"], metavar="BLOCK",
                 help="(ddp) time the hook against DDP's own all-reduce in the same processes: once the hook has "
                      "settled, alternate BLOCK steps of each (a second DDP wrapper of the same model, no hook); "
                      "summary.json's paired_ddp gives both medians and their ratio (a timing run: the model "
                      "trains on both)")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("compare", help="the same run with several compressors; report and curves")
    add_run_options(sp, compressor=False)
    sp.add_argument("--compressors", nargs="+", required=True, metavar="SPEC",
                    help="compressor specs separated by spaces")
    sp.add_argument("--out", required=True)
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.set_defaults(func=cmd_compare)

    sp = sub.add_parser("race", help="time to dense's final quality: every method against the 16-bit hook, "
                                      "PowerSGD and local SGD, several seeds; race.md and race.png")
    add_run_options(sp, compressor=False)
    sp.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                    help="compressor specs and baselines: dense, bf16, powersgd:rank=R, local:period=H[,outer=nesterov]"
                         "[,compressor=SPEC] (default: dense bf16 powersgd:rank=1 powersgd:rank=2 powersgd:rank=4 "
                         "local:period=8 topk sidco dgc)")
    sp.add_argument("--seeds", type=_positive_int, default=3, help="seeds per method (default 3)")
    sp.add_argument("--factor", type=_float, default=3.0, help="the others train up to this many times dense's steps")
    sp.add_argument("--links", nargs="+", type=_float, default=[0.1, 10.0], metavar="GBPS",
                    help="link bandwidths the runs are priced at, Gbit/s (the first one also sets the wire plan)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.add_argument("--reuse", action="store_true",
                    help="read runs already in --out that finished with the same configuration instead of training "
                         "them again (a race priced anew, or resumed)")
    sp.set_defaults(func=cmd_race)

    bp = sub.add_parser("bench", help="benchmarks")
    bsub = bp.add_subparsers(dest="bench", parser_class=OneLineParser)
    bsub.required = True
    sp = bsub.add_parser("select", help="selection time vs torch.topk and one read pass, and achieved/target count")
    sp.add_argument("--compressors", nargs="+", required=True, metavar="SPEC")
    sp.add_argument("--sizes", nargs="+", type=_positive_int, default=[262144, 2621440])
    sp.add_argument("--ratios", nargs="+", type=_float, default=[0.1, 0.01, 0.001])
    sp.add_argument("--dist", default="gaussian", help="gaussian, laplace, student-t (3 dof), or a .pt file of gradients")
    sp.add_argument("--model", default=None, metavar="NAME",
                    help="time every tensor of a model's layer shapes per step instead: resnet50, bert-base, gpt2-small")
    sp.add_argument("--shapes", default=None, metavar="FILE",
                    help="the same for the shapes in a JSON file (a list of shapes, or of [name, shape] pairs)")
    sp.add_argument("--calls", type=_positive_int, default=20, help="calls per cell (with --model: steps)")
    sp.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's setting)")
    sp.add_argument("--kernels", choices=("auto", "compiled", "eager"), default="auto",
                    help="selection kernels: compiled (C, built on first use), eager (torch ops), auto")
    sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live: cpu, or cuda (eager kernels, synchronized after every call)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_bench_select)

    sp = bsub.add_parser("hook", help="the DDP hook's own cost on loopback ranks: every method's step against plain "
                                      "DDP's, PyTorch's fp16 and PowerSGD hooks, with a breakdown")
    from ..experiments.hook_bench import DEFAULT_METHODS, MODELS as HOOK_MODELS

    sp.add_argument("--model", default=None, metavar="NAME",
                    help=f"{', '.join(HOOK_MODELS)} (default mlp; mlp, transformer and resnet50 train real layers, "
                         "the others are those layer shapes under a quadratic loss)")
    sp.add_argument("--shapes", default=None, metavar="FILE",
                    help="layer shapes from a JSON file (a list of shapes, or of [name, shape] pairs) instead")
    sp.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="SPEC",
                    help="ddp, fp16, bf16, powersgd[:rank=R] and gradsift specs (default: all of them; ddp required)")
    sp.add_argument("--ratio", type=_float, default=0.01)
    sp.add_argument("--ranks", type=_positive_int, default=2, help="processes (default 2)")
    sp.add_argument("--threads", type=_positive_int, default=1, help="torch threads a rank (default 1)")
    sp.add_argument("--steps", type=_positive_int, default=20, help="timed steps a method (default 20)")
    sp.add_argument("--warm", type=_positive_int, default=5, help="untimed steps first (default 5)")
    sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo on loopback; cuda: NCCL, one GPU a rank (adds the GPU kernels a step)")
    sp.add_argument("--profile", default=None, metavar="FILE",
                    help="rank 0's cProfile of the first gradsift method's timed steps, to this file")
    sp.add_argument("--out", required=True)
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.set_defaults(func=cmd_bench_hook)

    sp = sub.add_parser("reproduce", help="run the papers' headline experiments at laptop scale; REPORT.md")
    from ..experiments.reproduce import EXPERIMENTS

    sp.add_argument("names", nargs="+", metavar="NAME",
                    help=f"experiment names ({', '.join(EXPERIMENTS)}), or all")
    sp.add_argument("--out", required=True)
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
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
    sp.add_argument("action", choices=("up", "run", "down", "calibrate", "bench", "race"))
    sp.add_argument("--name", default="gs", help="cluster name (namespace prefix)")
    sp.add_argument("--hosts", type=_positive_int, default=4)
    sp.add_argument("--rate", default="100mbit", help="uplink rate per host (tc tbf), e.g. 100mbit, 1gbit")
    sp.add_argument("--delay-ms", type=_float, default=0.0, help="one-way delay on one host's link")
    sp.add_argument("--loss-pct", type=_float, default=0.0, help="packet loss (%%) on one host's link")
    sp.add_argument("--impair-host", type=_positive_int, default=1, help="which host gets --delay-ms/--loss-pct")
    sp.add_argument("--nproc-per-host", type=_positive_int, default=1)
    sp.add_argument("--max-restarts", type=_positive_int, default=0)
    sp.add_argument("--out", default="runs/cluster", help="(bench, calibrate) output")
    sp.add_argument("--overwrite", action="store_true", help="clear a non-empty output folder first")
    sp.add_argument("--data", default=None, help="(bench) text file for charlm")
    sp.add_argument("--quick", action="store_true", help="(bench) a small version")
    sp.add_argument("--no-faults", action="store_true", help="(bench) skip the fault injections")
    sp.add_argument("--no-target", action="store_true", help="(bench) skip the time-to-target runs")
    sp.add_argument("--sweep-rates", nargs="+", default=None, metavar="RATE",
                    help="(bench) sweep only these link rates (time to target runs only with 100mbit)")
    sp.add_argument("--methods", nargs="+", default=None, metavar="LABEL",
                    help="(bench) sweep only these methods, e.g. DDP topk \"LAGS equal c\"")
    sp.add_argument("--repeats", type=_positive_int, default=1,
                    help="(bench) run every method this many times in interleaved rounds; rows are the median run")
    sp.add_argument("--tasks", nargs="+", default=None, choices=("wordlm", "charlm", "gptlm"),
                    help="(bench) sweep only these tasks (wordlm, charlm); (race) the first is the race's task")
    sp.add_argument("--factor", type=_float, default=2.0,
                    help="(race) the others train up to this many times DDP's steps (--steps, default 300)")
    sp.add_argument("--host-counts", nargs="+", type=_positive_int, default=None, metavar="N",
                    help="(bench) sweep only clusters of these sizes (2 to 8 hosts)")
    sp.add_argument("--steps", type=_positive_int, default=None,
                    help="(bench) steps of every sweep run (default 28; more steps, steadier medians)")
    sp.add_argument("--paired", type=_positive_int, default=None, metavar="BLOCK",
                    help="(bench) also time every gradsift method against DDP's own all-reduce in the same "
                         "processes (train --paired-ddp BLOCK): a column of speed-ups free of process-start draws")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(train_args=[])  # (run) `gradsift train` options, after --
    sp.set_defaults(func=cmd_cluster)

    sp = sub.add_parser("demo", help="compare every compressor on digits-cnn (the main job)")
    sp.add_argument("--out", default="runs/demo")
    sp.add_argument("--steps", type=_positive_int, default=DEMO_STEPS)
    sp.add_argument("--workers", type=_positive_int, default=DEMO_WORKERS)
    sp.add_argument("--seed", type=_positive_int, default=0)
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_demo)
    return p


def say(line: str) -> None:
    """One line to stderr in one write: the ranks of a job failing alike share a pipe, and a line written in pieces
    interleaves with a peer's (two ranks' errors were seen run together on one line)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        sys.stderr.write(line + "\n")
        return
    os.write(fd, (line + "\n").encode())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if argv[:1] == ["cluster"] and "--" in argv:  # `gradsift cluster run ... -- <gradsift train options>`
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    try:
        args = parser.parse_args(argv)
        if rest:
            args.train_args = rest
        return int(args.func(args) or 0)
    except UsageError as e:
        say(f"{e}")
        return EXIT_BAD_INPUT
    except (OptionError, InputError, ConfigError, TaskError, BenchError, KernelUnavailable, OutputError) as e:
        say(f"gradsift: error: {e}")
        return EXIT_BAD_INPUT
    except (NonFiniteGradient, CorruptPayload, ConfigMismatch, CollectiveTimeout) as e:
        say(f"gradsift: error: {e}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("gradsift: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The ``gradsift`` command and ``python -m gradsift``: :func:`main`, then end the process
    (:func:`gradsift.launch.exit_process`: no interpreter shutdown after a process group was joined). A reader
    that closed the pipe (``gradsift list | head -1``) ends it quietly, with the shell's status for SIGPIPE."""
    try:
        code = main()
    except BrokenPipeError:  # (what is left to flush goes nowhere, not into a second traceback at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    exit_process(code)


if __name__ == "__main__":  # pragma: no cover
    console()
