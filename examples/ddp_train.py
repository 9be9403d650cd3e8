"""A plain PyTorch DDP training script with gradsift: the three lines to add are marked.

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
    args = ap.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")

    torch.manual_seed(0)  # same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = gradsift.ddp.register(model, args.compressor, ratio=args.ratio)  # (2) register the hook
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(1)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()  # the hook compresses, communicates, and writes the mean gradient
        if state.end_step():  # (3) close the step (True only when on_nonfinite="skip" skipped it)
            continue
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            s = state.last
            print(f"step {step:3d} loss {loss.item():.4f} sent {s['bytes_per_worker']:.0f} B/worker "
                  f"density {s['density']:.4f} comm {s['comm_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
    gradsift.ddp.finish()  # exit 0 every time (gloo can abort a rank at interpreter shutdown: docs/ddp.md)
