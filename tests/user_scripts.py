"""Training scripts written as users write them (not gradsift tasks), for the tests that check gradsift trains them.

:func:`char_transformer` is a small character-level transformer script in the nanoGPT style: AdamW, warm-up and
cosine decay, ``clip_grad_norm_`` after ``backward()``; gradsift is one ``register(...)`` line, or none. It runs on
each rank of a process group (:func:`ddp_helpers.spawn`) and returns the held-out loss.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"


def char_data(block: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, held-out ids, vocabulary size) of tiny Shakespeare, the last tenth held out."""
    text = SHAKESPEARE.read_text()[:300_000]
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(chars)


def _user_transformer():
    """benchmarks/user_transformer.py, the script the measured race runs: its model is the one these tests train."""
    spec = importlib.util.spec_from_file_location("user_transformer", Path(__file__).resolve().parents[1] /
                                                  "benchmarks" / "user_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def CharTransformer(vocab: int, d: int = 64, **kwargs) -> nn.Module:
    """The user script's character-level GPT (token and position embeddings, pre-norm blocks of
    ``nn.MultiheadAttention`` and an MLP, a head), at d 64 here."""
    return _user_transformer().CharGPT(vocab, d=d, **kwargs)


def char_transformer(rank: int, world: int, steps: int = 120, spec: str | None = None, ratio: float = 0.01,
                     clip: float | None = 1.0, clip_value: float | None = None, lr: float = 3e-3, batch: int = 16,
                     block: int = 64, seed: int = 0, **settings) -> dict:
    """Train on every rank; returns ``{"loss": held-out loss (the same on every rank), "state": gradsift's state or
    None}``. ``spec`` None: plain DDP. ``clip``: ``clip_grad_norm_``'s max_norm after backward (None: no clip);
    ``clip_value``: ``clip_grad_value_``'s, after it."""
    train, held, vocab = char_data(block)
    torch.manual_seed(seed)
    model = DDP(CharTransformer(vocab, block=block))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    state = None
    if spec is not None:
        import gradsift.ddp

        state = gradsift.ddp.register(model, spec, ratio=ratio, optimizer=opt, **settings)
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    for _ in range(steps):
        at = torch.randint(0, len(train) - block - 1, (batch,), generator=gen)
        x = torch.stack([train[i:i + block] for i in at])
        y = torch.stack([train[i + 1:i + block + 1] for i in at])
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        sched.step()
    model.eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        at = torch.randint(0, len(held) - block - 1, (64,), generator=g)
        x = torch.stack([held[i:i + block] for i in at])
        y = torch.stack([held[i + 1:i + block + 1] for i in at])
        out = float(F.cross_entropy(model.module(x).reshape(-1, vocab), y.reshape(-1)))
    t = torch.tensor([out])
    dist.broadcast(t, 0)
    return {"loss": float(t), "state": state}


def small_mlp(rank: int, world: int, spec: str | None, optimizer: str = "sgdm", *, scaler_init: float | None = None,
              steps: int = 60, ratio: float = 0.05) -> dict:
    """A plain classification script (a 3-layer MLP on a random teacher, each rank its own data); ``scaler_init``:
    fp16 autocast with ``torch.amp.GradScaler`` of that initial scale (unscale_, step, update). Returns the held-out
    loss and the scaler's final scale."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DDP(net)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgdm"
           else torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    if spec is not None:
        import gradsift.ddp

        gradsift.ddp.register(model, spec, ratio=ratio, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_init) if scaler_init else None
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(1)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    x = torch.randn(2000, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        held = float(F.cross_entropy(net(x), (x @ teacher).argmax(1)))
    return {"loss": held, "scale": scaler.get_scale() if scaler is not None else None}


STYLES = ("plain", "clip_norm", "clip_value", "no_sync", "bf16", "fp16_scaler", "scheduler", "groups", "frozen",
          "zero_keep", "compile")
OPTIMIZERS = ("sgd", "sgdm", "adam", "adamw")


def styled_mlp(rank: int, world: int, spec: str | None, optimizer: str, style: str, *, steps: int = 60,
               ratio: float = 0.1) -> float:
    """:func:`small_mlp`'s script written in one of the ways people write training loops (``style``, one of
    :data:`STYLES`): plain; ``clip_grad_norm_`` or ``clip_grad_value_`` after backward; two micro-batches with
    ``no_sync()``; bf16 autocast; fp16 autocast with a GradScaler; a learning-rate scheduler; two parameter groups of
    different lr and weight decay; a frozen parameter; ``zero_grad(set_to_none=False)``; ``torch.compile`` of the
    DDP model (after gradsift's register, as a script adds it). ``optimizer``: one of
    :data:`OPTIMIZERS`. Returns the held-out loss (rank 0's model; every rank's is the same)."""
    import contextlib

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if style == "frozen":
        net[0].bias.requires_grad_(False)
    model = DDP(net)
    lr = {"sgd": 0.2, "sgdm": 0.05, "adam": 3e-3, "adamw": 3e-3}[optimizer]
    if style == "groups":
        params = [{"params": list(net[0].parameters()) + list(net[2].parameters()), "lr": lr, "weight_decay": 0.01},
                  {"params": list(net[4].parameters()), "lr": lr / 2, "weight_decay": 0.0}]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=lr), "sgdm": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=lr),
           "adamw": lambda: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)}[optimizer]()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * steps)) if style == "scheduler" else None
    if spec is not None:
        import gradsift.ddp

        gradsift.ddp.register(model, spec, ratio=ratio, optimizer=opt)
    forward = torch.compile(model) if style == "compile" else model
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if style == "fp16_scaler" else None
    cast = {"bf16": torch.bfloat16, "fp16_scaler": torch.float16}.get(style)
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(1)
        opt.zero_grad(set_to_none=style != "zero_keep")
        parts = [(x[:32], y[:32]), (x[32:], y[32:])] if style == "no_sync" else [(x, y)]
        for i, (xb, yb) in enumerate(parts):
            quiet = model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext()
            with quiet, torch.autocast("cpu", dtype=cast or torch.float32, enabled=cast is not None):
                loss = F.cross_entropy(forward(xb), yb) / len(parts)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if style == "clip_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if style == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
    x = torch.randn(2000, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(F.cross_entropy(net(x), (x @ teacher).argmax(1)))
