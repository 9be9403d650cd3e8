"""``gradsift bench hook``: what the DDP hook itself costs, where the network is free.

Every method runs on the same model in the same processes (loopback ranks of gloo, one thread each by default; or
one GPU a rank over NCCL) -- in turns of a few steps each where all their models fit in memory at once (half of it
spare), else one method after another: plain DDP, PyTorch's fp16/bf16 hooks, PowerSGD (``powersgd``: rank
2, compressing from the first step) and gradsift's methods as a user registers them
(``gradsift.ddp.register(ddp, spec, ratio=..., optimizer=opt)``, every other setting at its default). A step is
``zero_grad``, forward, ``backward`` and ``optimizer.step()`` between barriers; its time is the slowest rank's, and
the table gives the median over the timed steps as a ratio to plain DDP's -- ratios taken in one run, so a busy
machine moves both sides.

The breakdown of a gradsift step comes from the hook's own telemetry (``state.last``, averaged over the ranks):
``select + memory`` (``select_s``: error feedback, momentum correction or Adam's direction fused with the
selection, one pass), ``coding`` (``code_s``: the values' cast, index coding, packing, issuing the collectives),
``decoding`` (``decode_s``: unpacking and summing what arrived, in the collectives' callback, beside backward for
all but the last bucket) and ``waiting``: the step less the model's own step without DDP (``compute``, timed in the
same processes), less select + memory and coding -- the collectives in flight, the decoding that ends the step,
DDP's own bucket copies.

Models: :mod:`gradsift.experiments.hook_models`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .hook_models import MODELS, SHAPE_MODELS, build
from .model_bench import ModelBenchError, model_shapes
BASELINES = ("ddp", "fp16", "bf16", "powersgd")
DEFAULT_METHODS = ("ddp", "fp16", "powersgd", "topk", "randomk", "rtopk", "dgc", "redsync", "gaussiank", "sidco",
                   "regtopk", "gsb")
PARTS = ("select_ms", "code_ms", "decode_ms")


def is_baseline(method: str) -> bool:
    """Whether ``method`` is one of PyTorch's (no gradsift hook, so no breakdown)."""
    return method.split(":")[0] in BASELINES


class HookBenchError(ValueError):
    """Bad ``gradsift bench hook`` input, or a rank that failed; one line."""


@dataclass(frozen=True, kw_only=True)
class HookBench:
    """One ``gradsift bench hook`` run."""

    model: str | None = "mlp"
    shapes: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    ranks: int = 2
    steps: int = 20
    warm: int = 5
    ratio: float = 0.01
    threads: int = 1
    device: str = "cpu"
    profile: str | None = None  # a file for rank 0's cProfile of the first gradsift method's timed steps
    interleave: bool | None = None  # methods in turns of a few steps (None: where every method's model fits at once)

    def check(self) -> None:
        """Every method, model and size checked before any process starts."""
        from ..memory.factory import make_compressor
        from ..runtime.runconfig import split_ratio
        from .baselines import parse_baseline

        if self.ranks < 2 and self.device == "cpu":
            raise HookBenchError(f"--ranks must be at least 2 on the CPU, got {self.ranks}")
        if self.steps < 3 or self.warm < 1:
            raise HookBenchError(f"--steps must be >= 3 and --warm >= 1, got {self.steps} and {self.warm}")
        if not (0 < self.ratio <= 1):
            raise HookBenchError(f"--ratio must be in (0, 1], got {self.ratio}")
        if self.device == "cuda" and torch.cuda.device_count() < self.ranks:
            raise HookBenchError(f"--device cuda runs one rank a GPU: {self.ranks} ranks, "
                                 f"{torch.cuda.device_count()} GPUs seen")
        if "ddp" not in self.methods:
            raise HookBenchError("--methods must include ddp (every ratio is to plain DDP's step)")
        for m in self.methods:
            if is_baseline(m):
                parse_baseline(m, 0)
            else:
                make_compressor(*split_ratio(m, self.ratio), world_size=self.ranks)
        if self.shapes is None and self.model not in MODELS:
            raise HookBenchError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.shapes is not None or self.model in SHAPE_MODELS:
            from .bench import BenchError, check_fits

            try:
                named = model_shapes(None if self.shapes else self.model, self.shapes)[1]
                if self.device == "cpu":  # every rank on this machine: parameters, targets, gradients, DDP's
                    # buckets, momentum, error feedback's memory and the selection's room
                    what = f"--{'shapes' if self.shapes else 'model'} {self.label} on {self.ranks} ranks"
                    check_fits(self.ranks * sum(math.prod(s) for _, s in named), what, copies=8)
            except (ModelBenchError, BenchError) as e:
                raise HookBenchError(str(e)) from None

    @property
    def label(self) -> str:
        return Path(self.shapes).stem if self.shapes else str(self.model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Method:
    """One method's model, optimizer, hook and batches on this rank (None: the model alone, no DDP), stepped by
    :func:`_rank` in turn with the others."""

    def __init__(self, b: HookBench, method: str | None, rank: int, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        self.method, self.device = method, device
        net, self.opt, self.batch, self.loss_of = build(b.model, b.shapes, device)
        self.model, self.state = net, None
        if method is not None:
            name = method.split(":")[0]
            one_bucket = name == "powersgd" and device.type == "cpu"  # PowerSGD aborts on gloo with several buckets
            cap = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20 + 1 if one_bucket else 25
            self.model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
            if name in BASELINES:
                if name != "ddp":
                    from .baselines import torch_baseline

                    torch_baseline(self.model, method, steps=0)
            else:
                import gradsift.ddp

                self.state = gradsift.ddp.register(self.model, method, ratio=b.ratio, optimizer=self.opt)
        self.gen = torch.Generator().manual_seed(100 + rank)  # (every method sees the same batches)
        self.rows: list[list[float]] = []
        self.kernels = 0  # GPU kernels one step launches (0 on the CPU)

    def step(self, x) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss_of(self.model, x).backward()
        self.opt.step()

    def timed(self, keep: bool, prof=None) -> None:
        """One step between barriers; with ``keep``, its row [seconds, select_s, code_s, decode_s]."""
        x = self.batch(self.gen)
        _sync(self.device)
        dist.barrier()
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        self.step(x)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        last = self.state.last if self.state is not None else {}
        if keep:
            self.rows.append([seconds, *(float(last.get(k) or 0.0) for k in ("select_s", "code_s", "decode_s"))])


def _launches(step, device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _rank(rank: int, world: int, store: str, b: HookBench, out: str) -> None:
    """One rank: the model alone and every method, in turns of ``TURN`` timed steps after one untimed
    (``b.interleave``; else one method after another); rank 0 writes the medians to ``out`` (JSON)."""
    torch.set_num_threads(b.threads)
    cuda = b.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        names: list[str | None] = [None, *b.methods]
        first = next((m for m in b.methods if not is_baseline(m)), None)
        prof = None
        if b.profile and first is not None and rank == 0:
            import cProfile

            prof = cProfile.Profile()
        done: list[tuple[str | None, list[list[float]], int]] = []  # (method, rows, kernels)
        for batch in [names] if b.interleave else [[m] for m in names]:  # (interleaved: one batch of them all)
            live = [_Method(b, m, rank, device) for m in batch]
            for m in live:
                for _ in range(b.warm):
                    m.timed(False)
            for turn in range(-(-b.steps // TURN)):  # a turn: one step to warm the caches again, then TURN timed
                for m in live:
                    for it in range(1 + min(TURN, b.steps - turn * TURN)):
                        m.timed(it > 0, prof if (m.method == first and it > 0) else None)
            for m in live:
                m.kernels = _launches(lambda m=m: m.step(m.batch(m.gen)), device)
            done += [(m.method, m.rows, m.kernels) for m in live]
            del live  # (one method after another: its model goes before the next is built)
        if prof is not None:
            import io
            import pstats

            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(40)  # (where the time is spent, not only under what)
            Path(str(b.profile)).write_text(s.getvalue())
        results: dict[str, Any] = {"compute_ms": 1e3 * statistics.median(r[0] for r in done[0][1]), "rows": [],
                                   "interleaved": b.interleave}
        for method, rows, kernels in done[1:]:
            t = torch.tensor(rows, dtype=torch.float64, device=device)
            slowest = t[:, 0].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when every rank is done
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            parts = (t[:, 1:] / world).median(dim=0).values.tolist()
            row = {"method": method, "step_ms": 1e3 * float(slowest.median()), "kernels": kernels,
                   "steps_ms": [1e3 * v for v in slowest.tolist()],
                   **{k: 1e3 * v for k, v in zip(PARTS, parts)}}
            results["rows"].append(row)
            if rank == 0:
                print(f"gradsift: {method}: {row['step_ms']:.1f} ms a step", file=sys.stderr, flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


TURN = 4  # timed steps a method takes in a row (after one untimed: its memory back in the caches)
PARAM_BYTES = 32  # a method's bytes a parameter on a rank: weights, gradients, DDP's buckets, the optimizer's state,
# the memory and its spare, the selection's room (8 float32 copies)


def fits_at_once(b: HookBench) -> bool:
    """Whether every method's model fits on this machine at once, on every rank, with half the memory to spare: then
    :func:`run_hook_bench` interleaves them (turns of a few steps), so load that comes and goes hits them alike."""
    from .bench import available_bytes

    have = available_bytes()
    if have is None:
        return False
    net = build(b.model, b.shapes, torch.device("meta"))[0]
    numel = sum(p.numel() for p in net.parameters())
    return b.ranks * (len(b.methods) + 1) * PARAM_BYTES * numel <= have / 2


def run_hook_bench(b: HookBench, out: Path) -> dict[str, Any]:
    """Run ``b`` on ``b.ranks`` fresh processes; write ``hook.json``, ``hook.md`` and ``hook.png`` under ``out``;
    return the results."""
    import torch.multiprocessing as mp

    b.check()
    if b.interleave is None:
        b = replace(b, interleave=fits_at_once(b))
    env = {"OMP_NUM_THREADS": str(b.threads)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # (the ranks' math libraries read it when they start)
    try:
        with tempfile.TemporaryDirectory(prefix="gradsift-hook-") as d:
            tmp = Path(d)
            mp.start_processes(_rank, args=(b.ranks, str(tmp / "store"), b, str(tmp / "out.json")), nprocs=b.ranks,
                               join=True, start_method="spawn")
            res = json.loads((tmp / "out.json").read_text())
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise HookBenchError(f"a rank failed: {lines[-1] if lines else e}") from None
    except mp.ProcessExitedException as e:
        raise HookBenchError(f"a rank died: {e}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ddp = next(r for r in res["rows"] if r["method"] == "ddp")
    for r in res["rows"]:
        r["x_ddp"] = paired_ratio(r["steps_ms"], ddp["steps_ms"]) if b.interleave else r["step_ms"] / ddp["step_ms"]
        r["wait_ms"] = max(0.0, r["step_ms"] - res["compute_ms"] - r["select_ms"] - r["code_ms"])
    res["config"] = asdict(b)
    res["label"] = b.label
    res["where"] = (f"{b.ranks} ranks over NCCL, one GPU each ({torch.cuda.get_device_name(0)})" if b.device == "cuda"
                    else f"{b.ranks} loopback gloo ranks, {b.threads} thread{'s' if b.threads > 1 else ''} each")
    (out / "hook.json").write_text(json.dumps(res, indent=1))
    (out / "hook.md").write_text(table(res) + "\n")
    plot(res, out / "hook.png")
    return res


def paired_ratio(steps: list[float], ddp: list[float]) -> float:
    """A method's step over plain DDP's, paired by turn (interleaved runs): per turn of ``TURN`` steps, the median
    step over DDP's median step in the same turn, then the median of those ratios -- load that comes and goes on the
    machine hits both sides of each ratio alike, where a ratio of whole-run medians takes it as it fell."""
    med = statistics.median
    turns = [(steps[i:i + TURN], ddp[i:i + TURN]) for i in range(0, min(len(steps), len(ddp)), TURN)]
    return med(med(a) / med(d) for a, d in turns if a and d)


def table(res: dict[str, Any]) -> str:
    """The markdown table of a run (``hook.md``)."""
    b = res["config"]
    gpu = b["device"] == "cuda"
    turns = (f"methods in turns of {TURN} steps; x plain DDP: the median over turns of the step over DDP's in the "
             "same turn" if res.get("interleaved") else "one method after another")
    lines = [f"{res['label']}, {res['where']}: median of {b['steps']} steps after {b['warm']} ({turns}); ratio "
             f"{b['ratio']}; the model's own step without DDP {res['compute_ms']:.1f} ms",
             "",
             "| method | step ms | x plain DDP | select + memory ms | coding ms | waiting ms | decoding ms |"
             + (" GPU kernels a step |" if gpu else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if gpu else "")]
    for r in res["rows"]:
        own = not is_baseline(r["method"])
        cells = [r["method"], f"{r['step_ms']:.1f}", f"{r['x_ddp']:.2f}",
                 *(f"{r[k]:.1f}" if own else "" for k in ("select_ms", "code_ms")), f"{r['wait_ms']:.1f}",
                 f"{r['decode_ms']:.1f}" if own else "", *([str(r["kernels"])] if gpu else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """Each method's step as stacked bars (compute, select + memory, coding, waiting), plain DDP's step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"][::-1]
    fig, ax = plt.subplots(figsize=(9.5, 0.4 * len(rows) + 1.4))
    left = [0.0] * len(rows)
    names = [r["method"] for r in rows]
    for label, key in (("compute", None), ("select + memory", "select_ms"), ("coding", "code_ms"),
                       ("waiting", "wait_ms")):
        width = [res["compute_ms"] if key is None else r[key] for r in rows]
        width = [min(w, r["step_ms"] - lf) for w, r, lf in zip(width, rows, left)]
        ax.barh(names, width, left=left, label=label)
        left = [lf + w for lf, w in zip(left, width)]
    ddp = next(r["step_ms"] for r in rows if r["method"] == "ddp")
    ax.axvline(ddp, color="black", lw=1, ls="--", label="plain DDP")
    ax.set_xlabel("ms a step (median)")
    ax.set_title(f"{res['label']}: {res['where']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
