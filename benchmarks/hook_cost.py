"""The hook's own cost where the network is free: 2 loopback gloo ranks, one thread each, a model of many tensors.

Each step of plain DDP, PyTorch's fp16 hook, PowerSGD (rank 2) and gradsift's methods (``register(ddp, spec,
ratio=0.01, optimizer=opt)``, the defaults) is timed on both ranks; the table is the median step over the timed steps
as a ratio to plain DDP's, all measured in one process group, one after the other, so the ratios are taken in one
run. Models (not gradsift tasks): ``mlp`` -- an EmbeddingBag, 80 Linear(256, 256) and a head (163 tensors, 5.3M
parameters), momentum SGD; ``transformer`` -- 12 blocks of d 128 (150 tensors), AdamW.

    OMP_NUM_THREADS=1 python benchmarks/hook_cost.py --model mlp --steps 30
    OMP_NUM_THREADS=1 python benchmarks/hook_cost.py --model transformer --methods ddp topk --profile prof.txt
    python benchmarks/hook_cost.py --device cuda --model transformer

``--ops FILE`` appends, for each gradsift method, one step's operators (and GPU kernels) by count from PyTorch's
profiler. ``--profile FILE`` writes rank 0's cProfile of the first gradsift method's timed steps (cumulative time).
``--device cuda`` runs one rank over NCCL on GPU 0 (the hook runs as at any world size; only the exchange is
trivial), times steps between CUDA synchronizations and adds the GPU kernels one step launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

BASELINES = ("ddp", "fp16", "powersgd")


class Mlp(nn.Module):
    def __init__(self, layers: int = 80, d: int = 256, vocab: int = 1000, classes: int = 10):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.bag(ids)
        for lin in self.layers:
            x = x + 0.1 * torch.tanh(lin(x))  # (bounded: gradients neither explode nor vanish over 80 layers)
        return self.head(x)


def build(model: str, device: torch.device):
    if model == "mlp":
        net = Mlp().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            ids = torch.randint(0, 1000, (32, 8), generator=gen)
            return ids.to(device), torch.randint(0, 10, (32,), generator=gen).to(device)

        def loss(m, b):
            return nn.functional.cross_entropy(m(b[0]), b[1])
        return net, opt, batch, loss
    from user_scripts import CharTransformer

    net = CharTransformer(65, d=128, blocks=12).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)

    def batch(gen):
        x = torch.randint(0, 65, (8, 64), generator=gen)
        return x.to(device), torch.randint(0, 65, (8, 64), generator=gen).to(device)

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]).reshape(-1, 65), b[1].reshape(-1))
    return net, opt, batch, loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launches(step, device: torch.device, ops: str | None = None, write: bool = True) -> int:
    """The GPU kernels one call of ``step`` launches (0 on the CPU); with ``ops``, the step's operators and kernels
    by count are appended to that file (where ``write``: every rank profiles its step, one writes)."""
    if device.type != "cuda" and not ops:
        return 0
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, acc_events=True) as prof:
        step()
        _sync(device)
    if ops and write:
        with open(ops, "a") as f:
            f.write(prof.key_averages().table(sort_by="count", row_limit=60) + "\n")
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run_method(rank: int, method: str, model: str, steps: int, warm: int, profile: str | None,
               device: torch.device, ops: str | None = None) -> tuple[list[float], int]:
    torch.manual_seed(0)
    net, opt, batch, loss_of = build(model, device)
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    if method in BASELINES:
        if method != "ddp":
            from gradsift.experiments.baselines import torch_baseline

            torch_baseline(ddp, method, steps=0)
    else:
        import gradsift.ddp

        gradsift.ddp.register(ddp, method, ratio=0.01, optimizer=opt)
    gen = torch.Generator().manual_seed(100 + rank)
    times = []
    prof = None
    for it in range(warm + steps):
        if it == warm and profile and rank == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        b = batch(gen)
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, b).backward()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(int(__import__("os").environ.get("GS_PROF_LINES", "45")))
        Path(profile).write_text(s.getvalue())
    b = batch(gen)

    def one_step():
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, b).backward()
        opt.step()
    if ops and rank == 0:
        with open(ops, "a") as f:
            f.write(f"## {method}\n")
    return times[warm:], launches(one_step, device, ops, rank == 0)


def job(rank: int, world: int, args, out: str) -> None:
    results = {}
    profiled = False
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    for method in args.methods:
        want = args.profile if (args.profile and method not in BASELINES and not profiled) else None
        profiled = profiled or want is not None
        times, kernels = run_method(rank, method, args.model, args.steps, args.warm, want, device,
                                    args.ops if method not in BASELINES else None)
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when every rank is done
        results[method] = (statistics.median(t.tolist()), kernels)
        if rank == 0:
            print(f"{method}: {results[method][0] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--methods", nargs="+", default=["ddp", "fp16", "powersgd", "topk", "sidco", "dgc", "regtopk"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ops", default=None, help="append each gradsift method's step, operators by count, to this file")
    args = ap.parse_args()
    from ddp_helpers import spawn

    out = Path(tempfile.mkdtemp()) / "out.json"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("hook_cost.py: --device cuda needs a CUDA GPU; torch sees none")
        spawn(job, 1, args, str(out), backend="nccl")
        where = f"1 rank over NCCL on {torch.cuda.get_device_name(0)}"
    else:
        spawn(job, 2, args, str(out))
        where = "2 loopback gloo ranks, one thread each"
    res = json.loads(out.read_text())
    base = res["ddp"][0] if "ddp" in res else None
    print(f"{args.model}, {where}, median of {args.steps} steps")
    print("| method | step ms | x plain DDP | GPU kernels a step |")
    print("|---|---|---|---|")
    for m, (s, k) in res.items():
        ratio = f"{s / base:.2f}" if base else ""
        print(f"| {m} | {s * 1e3:.1f} | {ratio} | {k if args.device == 'cuda' else ''} |")


if __name__ == "__main__":
    main()
