"""A plain PyTorch DDP training script with gradsift: the two lines to add are marked.

Run on one machine with two processes (CPU, gloo):

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --compressor sidco --ratio 0.01

or across machines with torchrun's own multi-node flags (--nnodes, --rdzv-endpoint, ...).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift.ddp  # (1) import


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--save", default=None, metavar="PREFIX", help="save a checkpoint at the end: PREFIX-rank<R>.pt")
    ap.add_argument("--resume", default=None, metavar="PREFIX", help="start from the checkpoint PREFIX-rank<R>.pt")
    args = ap.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")

    torch.manual_seed(0)  # same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # (2) register the hook; optimizer.step() then closes gradsift's step (telemetry, a non-finite step skipped)
    state = gradsift.ddp.register(model, args.compressor, ratio=args.ratio, optimizer=optimizer)
    if args.resume:  # every rank its own file: gradsift's state holds this rank's error-feedback memory
        ck = torch.load(f"{args.resume}-rank{rank}.pt", weights_only=False)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradsift"])

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(1)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()  # the hook compresses, communicates, and writes the mean gradient
        optimizer.step()  # closes gradsift's step first (a skipped step: no gradients, nothing moves)
        if rank == 0 and step % 10 == 0:
            s = state.last
            print(f"step {step:3d} loss {loss.item():.4f} sent {s['bytes_per_worker']:.0f} B/worker "
                  f"density {s['density']:.4f} comm {s['comm_s'] * 1e3:.1f} ms")
    if args.save:
        torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict(),
                    "gradsift": state.state_dict()}, f"{args.save}-rank{rank}.pt")


if __name__ == "__main__":
    main()
