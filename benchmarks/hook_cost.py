"""The hook's own cost where the network is free: 2 loopback gloo ranks, one thread each, a model of many tensors.

Each step of plain DDP, PyTorch's fp16 hook, PowerSGD (rank 2) and gradsift's methods (``register(ddp, spec,
ratio=0.01, optimizer=opt)``, the defaults) is timed on both ranks; the table is the median step over the timed steps
as a ratio to plain DDP's, all measured in one process group, one after the other, so the ratios are taken in one
run. Models (not gradsift tasks): ``mlp`` -- an EmbeddingBag, 80 Linear(256, 256) and a head (163 tensors, 5.3M
parameters), momentum SGD; ``transformer`` -- 12 blocks of d 128 (150 tensors), AdamW.

    OMP_NUM_THREADS=1 python benchmarks/hook_cost.py --model mlp --steps 30
    OMP_NUM_THREADS=1 python benchmarks/hook_cost.py --model transformer --methods ddp topk --profile prof.txt

``--profile FILE`` writes rank 0's cProfile of the first gradsift method's timed steps (cumulative time).
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


def build(model: str):
    if model == "mlp":
        net = Mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            ids = torch.randint(0, 1000, (32, 8), generator=gen)
            return ids, torch.randint(0, 10, (32,), generator=gen)

        def loss(m, b):
            return nn.functional.cross_entropy(m(b[0]), b[1])
        return net, opt, batch, loss
    from user_scripts import CharTransformer

    net = CharTransformer(65, d=128, blocks=12)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)

    def batch(gen):
        x = torch.randint(0, 65, (8, 64), generator=gen)
        return x, torch.randint(0, 65, (8, 64), generator=gen)

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]).reshape(-1, 65), b[1].reshape(-1))
    return net, opt, batch, loss


def run_method(rank: int, method: str, model: str, steps: int, warm: int, profile: str | None) -> list[float]:
    torch.manual_seed(0)
    net, opt, batch, loss_of = build(model)
    ddp = DDP(net)
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
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, b).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
        Path(profile).write_text(s.getvalue())
    return times[warm:]


def job(rank: int, world: int, args, out: str) -> None:
    results = {}
    profiled = False
    for method in args.methods:
        want = args.profile if (args.profile and method not in BASELINES and not profiled) else None
        profiled = profiled or want is not None
        times = run_method(rank, method, args.model, args.steps, args.warm, want)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when both ranks are done
        results[method] = statistics.median(t.tolist())
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--methods", nargs="+", default=["ddp", "fp16", "powersgd", "topk", "sidco", "dgc", "regtopk"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    from ddp_helpers import spawn

    out = Path(tempfile.mkdtemp()) / "out.json"
    spawn(job, 2, args, str(out))
    res = json.loads(out.read_text())
    base = res.get("ddp")
    print(f"{args.model}, 2 loopback gloo ranks, one thread each, median of {args.steps} steps")
    print("| method | step ms | x plain DDP |")
    print("|---|---|---|")
    for m, s in res.items():
        print(f"| {m} | {s * 1e3:.1f} | {s / base:.2f} |" if base else f"| {m} | {s * 1e3:.1f} | |")


if __name__ == "__main__":
    main()
