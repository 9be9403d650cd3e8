"""Hugging Face Accelerate with gradsift: prepare, then register; gradient accumulation with
``accelerator.accumulate`` (DDP's ``no_sync`` on the micro-batches between syncs). The lines to add are marked.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --out runs/acc

(on GPUs also `accelerate launch --multi_gpu --num_processes 2 ...`; on CPU `accelerate launch --cpu` starts one
process, and its multi-CPU launch goes through mpirun with `--mpirun_hostfile`).

Writes DIR/metrics.jsonl (one line per optimizer step). ``--save-at N`` saves the whole state after step N with
``accelerator.save_state`` into DIR/state -- every rank's gradsift memory with it, registered for checkpointing
(4) -- and ``--resume`` continues from there. Launched as one process it says so in one line and exits 2: there is
no gradient exchange to compress. Needs ``pip install 'gradsift[hf]'``.
"""

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import gradsift.ddp  # (1) import
from gradsift.errors import ConfigError


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--save-at", type=int, default=0, help="save the state (DIR/state) after this optimizer step")
    ap.add_argument("--resume", action="store_true", help="continue from DIR/state")
    args = ap.parse_args()
    out = Path(args.out)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state = gradsift.ddp.register(model, args.compressor, ratio=args.ratio, optimizer=optimizer.optimizer,
                                  metrics_path=out / "metrics.jsonl")  # (2) register on the prepared model
    accelerator.register_for_checkpointing(state.all_ranks())  # (4) every rank's memory in save_state

    steps = skip = 0
    if args.resume:
        accelerator.load_state(out / "state")
        steps = state.step  # optimizer steps done
        skip = steps * args.accumulate % len(loader)  # the micro-batches of this epoch already trained on
    while steps < args.steps:
        batches, skip = (accelerator.skip_first_batches(loader, skip) if skip else loader), 0
        for xb, yb in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                accelerator.backward(loss)  # the hook runs on the micro-batch that syncs
                if accelerator.sync_gradients:
                    steps += 1
                    if state.end_step(loss=loss):  # (3) close each optimizer step, once, and honour a skip
                        optimizer.zero_grad()
                        continue
                optimizer.step()  # (Accelerate steps only on a sync micro-batch)
                optimizer.zero_grad()
                if accelerator.sync_gradients and steps == args.save_at:
                    accelerator.save_state(out / "state")
            if steps >= args.steps and accelerator.sync_gradients:
                break
    if accelerator.is_main_process:
        t = state.totals
        print(f"gradsift: {t['steps']} optimizer steps, loss {loss.item():.3f}, {t['compression']:.1f}x fewer "
              f"payload bytes and {t['wire_compression']:.1f}x fewer wire bytes than dense all-reduce")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except ConfigError as e:  # one process (nothing to compress), a model gradsift cannot hook: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        code = 2
    gradsift.ddp.finish(code)
