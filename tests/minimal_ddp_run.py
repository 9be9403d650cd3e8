"""A user's DDP script with one gradsift call: `register(ddp, "topk", ratio=0.01, optimizer=opt)`.

No end_step(), no finish(): the optimizer's step closes gradsift's, a NaN gradient (rank 1 at --nan-step) skips the
step on every rank, and the process ends at the interpreter's own shutdown. Prints one JSON line per rank: the
telemetry totals and a checksum of the weights (equal on every rank when the skip held them together).

    torchrun --standalone --nproc-per-node 2 tests/minimal_ddp_run.py --steps 30 --nan-step 5
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift.ddp

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--nan-step", type=int, default=-1)
args = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = gradsift.ddp.register(model, "topk", ratio=0.01, optimizer=opt)

gen = torch.Generator().manual_seed(1000 + rank)
teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
for step in range(args.steps):
    x = torch.randn(64, 32, generator=gen)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
    if step == args.nan_step and rank == 1:
        loss = loss * float("nan")
    loss.backward()
    opt.step()

weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(json.dumps({"rank": rank, "steps": state.totals["steps"], "skipped": state.totals["skipped_steps"],
                  "bytes_per_worker": state.totals["bytes_per_worker"], "finite": bool(weights.isfinite().all()),
                  "checksum": float(weights.double().sum()), "loss": loss.item()}), flush=True)
