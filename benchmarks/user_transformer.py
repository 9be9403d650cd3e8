"""A user's own transformer script (not a gradsift task): a small character-level GPT on tiny Shakespeare in the
nanoGPT style -- AdamW, warm-up and cosine decay, ``clip_grad_norm_`` after ``backward()`` -- written as a user
writes it, with one line per way of communicating (``--method``):

* ``ddp``: ``DistributedDataParallel`` as it comes;
* ``fp16``: PyTorch's ``fp16_compress_hook``;
* ``postlocal``: PyTorch's post-local SGD (``post_localSGD_hook`` and ``PeriodicModelAverager`` every ``--period``);
* ``topk``: ``gradsift.ddp.register(model, "topk", ratio=..., optimizer=opt)``;
* ``local``: ``gradsift.local.register(model, "topk", ratio=..., period=..., optimizer=opt)`` on the plain module
  (``--local-spec`` another compressor spec, ``--outer`` the outer step).

Rank 0 appends one JSON line per evaluation to ``--record``: the step, the summed wall time of the steps so far
(evaluations excluded) and the held-out loss of its model (every ``--eval-every`` steps, a multiple of the period,
where local SGD's ranks have just synced). ``--stop-at``: stop at the first evaluation at or under it.

    torchrun --nproc-per-node 4 benchmarks/user_transformer.py --method local --data ../shared/data/tinyshakespeare.txt \
        --record run.jsonl

:mod:`benchmarks.user_race` runs it on namespace hosts on shaped links.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

METHODS = ("ddp", "fp16", "postlocal", "topk", "local")


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, d: int = 96, blocks: int = 3, heads: int = 4, block: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=METHODS, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--record", required=True, help="the JSON lines file rank 0 appends to")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--schedule-steps", type=int, default=None, help="the cosine schedule's length (default --steps)")
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--local-spec", default="topk")
    ap.add_argument("--outer", default="average")
    ap.add_argument("--eval-every", type=int, default=32)
    ap.add_argument("--stop-at", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    text = Path(a.data).read_text()[:400_000]
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    train, held, vocab, block, batch = ids[:cut], ids[cut:], len(chars), 64, 16

    torch.manual_seed(a.seed)
    net = CharGPT(vocab, block=block)
    model: nn.Module = net if a.method == "local" else DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    total = a.schedule_steps or a.steps
    warm = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (total - warm)))))
    averager = None
    if a.method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.method == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        model.register_comm_hook(pl.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1,
                                                      post_local_gradient_allreduce=False), pl.post_localSGD_hook)
        # (it averages at its calls warmup_steps + j * period: after steps 8, 16, ..., where gradsift's syncs fall)
        averager = PeriodicModelAverager(period=a.period, warmup_steps=a.period - 1)
    elif a.method == "topk":
        import gradsift.ddp

        gradsift.ddp.register(model, "topk", ratio=a.ratio, optimizer=opt)
    elif a.method == "local":
        import gradsift.local

        gradsift.local.register(model, a.local_spec, ratio=a.ratio, period=a.period, optimizer=opt, outer=a.outer)

    gen = torch.Generator().manual_seed(1000 * a.seed + rank)
    g = torch.Generator().manual_seed(7)
    at = torch.randint(0, len(held) - block - 1, (64,), generator=g)
    hx = torch.stack([held[i:i + block] for i in at])
    hy = torch.stack([held[i + 1:i + block + 1] for i in at])
    spent = 0.0
    log = Path(a.record)
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        at = torch.randint(0, len(train) - block - 1, (batch,), generator=gen)
        x = torch.stack([train[i:i + block] for i in at])
        y = torch.stack([train[i + 1:i + block + 1] for i in at])
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
        spent += time.perf_counter() - t0
        if step % a.eval_every == 0 or step == a.steps:
            with torch.no_grad():
                held_loss = float(F.cross_entropy(net(hx).reshape(-1, vocab), hy.reshape(-1)))
            verdict = torch.tensor([held_loss])
            dist.broadcast(verdict, 0)  # (every rank stops together, on rank 0's model)
            if rank == 0:
                with log.open("a") as f:
                    f.write(json.dumps({"step": step, "time_s": spent, "loss": held_loss}) + "\n")
            if a.stop_at is not None and float(verdict) <= a.stop_at:
                break
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
