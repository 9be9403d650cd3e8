"""A PyTorch FSDP2 (fully_shard) training script with gradsift; HSDP with --replicas. The lines to add are marked.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py --out runs/fsdp
    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py --replicas 2 --out runs/hsdp

Runs on CPU (gloo) or, with GPUs, NCCL. ``--save-at N`` saves a checkpoint after step N into DIR/ckpt (model and
optimizer sharded by torch.distributed.checkpoint, gradsift's state per rank beside them); ``--resume`` continues
from it with the error-feedback memory each rank had.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradsift.fsdp  # (1) import


class Net(nn.Module):
    def __init__(self, width: int = 128, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x).relu()
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--replicas", type=int, default=1, help="HSDP: replicas of the sharded model (1: plain FSDP)")
    ap.add_argument("--save-at", type=int, default=0, help="save a checkpoint (DIR/ckpt) after this step")
    ap.add_argument("--resume", action="store_true", help="continue from DIR/ckpt")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)  # the same initial model on every rank
    model = Net().to(device)

    replicate_group = None
    if args.replicas == 1:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:  # HSDP: shard inside each replica; gradsift compresses across the replicas
        mesh = init_device_mesh(device, (args.replicas, world // args.replicas),
                                mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        replicate_group = mesh["replicate"].get_group()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradsift.fsdp.register(model, args.compressor, ratio=args.ratio,  # (2) after the last fully_shard
                                   optimizer=optimizer, replicate_group=replicate_group)

    path = Path(args.out) / "ckpt"
    start = 0
    if args.resume:  # (3) checkpoints: the shards by dcp, gradsift's state per rank beside them
        msd, osd = get_state_dict(model, optimizer)
        ck = {"model": msd, "optim": osd}
        dcp.load(ck, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=ck["model"], optim_state_dict=ck["optim"])
        state.load_state_dict(torch.load(path / f"gradsift-rank{rank}.pt", weights_only=True))
        start = state.step

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for step in range(start, args.steps):
        gen.manual_seed(1000 * step + rank)  # (the same batches after a resume)
        x = torch.randn(64, 32, generator=gen)
        loss = nn.functional.cross_entropy(model(x.to(device)), (x @ teacher).argmax(1).to(device))
        loss.backward()  # each module's reduce-scatter goes through gradsift
        optimizer.step()  # closes gradsift's step first (a skipped step: no gradients, nothing moves)
        optimizer.zero_grad()
        if step + 1 == args.save_at:
            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            torch.save(state.state_dict(), path / f"gradsift-rank{rank}.pt")
    if rank == 0:
        t = state.totals
        print(f"gradsift: {t['steps']} steps, loss {loss.item():.3f}, {t['compression']:.1f}x fewer payload bytes "
              f"than the dense exchange")


if __name__ == "__main__":
    main()
