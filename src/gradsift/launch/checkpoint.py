"""Checkpoints of a DDP run: every rank's compressor state and RNG streams, written atomically by rank 0."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..ddp import GradsiftState
from ..runconfig import ConfigError, RunConfig


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file, fsync, then rename: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])


def save_checkpoint(directory: Path, iteration: int, updates: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: GradsiftState, cfg: RunConfig) -> Path | None:
    """Gather every rank's compressor state and RNG streams; rank 0 writes one file atomically."""
    mine = {"compressor": state.state_dict(), "rng": rng_state()}
    world = dist.get_world_size()
    gathered: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    path = None
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"ckpt-{iteration:08d}.pt"
        atomic_save({
            "iteration": iteration,
            "updates": updates,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ranks": gathered,
            "config": cfg.as_dict(),
            "world_size": world,
        }, path)
        tmp = directory / ".latest.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, directory / "latest")
    dist.barrier()
    return path


def resolve_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        latest = p / "latest"
        if not latest.exists():
            raise ConfigError(f"--resume {path!r}: no checkpoint in that folder (no 'latest' file)")
        p = p / latest.read_text().strip()
    if not p.is_file():
        raise ConfigError(f"--resume {path!r}: no such checkpoint file")
    return p


def load_checkpoint(path: Path, model, optimizer, state: GradsiftState) -> tuple[int, int]:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck["world_size"] != dist.get_world_size():
        raise ConfigError(f"checkpoint {path} was written by {ck['world_size']} ranks, this run has "
                          f"{dist.get_world_size()}")
    model.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
    mine = ck["ranks"][dist.get_rank()]
    state.load_state_dict(mine["compressor"])
    set_rng_state(mine["rng"])
    return int(ck["iteration"]), int(ck["updates"])
