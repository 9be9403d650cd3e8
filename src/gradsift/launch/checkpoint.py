"""Checkpoints of a DDP run that verify themselves.

Rank 0 gathers every rank's compressor state and RNG streams and writes one
file: a header line (``GRADSIFT-CHECKPOINT``, then JSON with the gradsift
version, the content's length and SHA-256) followed by the content (the
``torch.save`` bytes). It is written atomically -- temporary file, fsync,
rename -- so a crash mid-save leaves the previous checkpoint, and ``latest``
then names the new one the same way.

A sharded model (``--runtime fsdp``/``hsdp``) keeps its parameters and optimizer state sharded: every rank
writes its shards with ``torch.distributed.checkpoint`` into a folder beside the file (``ckpt-N.dcp``), which
then holds everything else (every rank's compressor state and RNG streams, the configuration), names that folder
and lists the size and SHA-256 of every file in it; ``latest`` moves only after both are written. On resume the
shard files are checked against that list before any is read (the ranks share the reading), so a flipped byte or
a truncated shard is one line on every rank, like a damaged checkpoint file.

Loading reads tensors and plain data only (``torch.load(weights_only=True)``): the checksum proves a file
whole, not who wrote it, so a crafted file naming other objects is refused unread instead of running code.
Then it verifies before anything is applied: the header, the length
(truncation), the checksum (any flipped byte), that every tensor is finite,
that the world size, this rank's state and the run's configuration match
(``steps``, ``eval_every`` and the like may differ: a resumed run may go
further). Any failure is one :class:`CheckpointError` line naming the file and
what is wrong; every rank reads the same file and stops alike.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.consensus import control_device
from ..runtime.records import write_atomic
from ..runtime.runconfig import ConfigError, RunConfig

MAGIC = b"GRADSIFT-CHECKPOINT "
MAY_DIFFER = {"steps", "eval_every", "stop_at", "fault_nan_step", "dump_grads", "delta_telemetry", "workers",
              "paired_ddp"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message is one line naming the file."""


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then rename: a crash never leaves a torn file."""
    write_atomic(path, lambda f: torch.save(obj, f))


def save_verified(obj: Any, path: Path) -> None:
    """A checksummed checkpoint file (module docstring), written atomically."""
    from .. import __version__

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    header = json.dumps({"version": __version__, "length": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_atomic(path, lambda f: (f.write(MAGIC + header.encode() + b"\n"), f.write(data)))


def load_verified(path: Path) -> Any:
    """The checkpoint's content, after checking its header, length and checksum."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot be read ({e.strerror})") from None
    if not raw:
        raise CheckpointError(f"checkpoint {path} is empty")
    if not raw.startswith(MAGIC) or b"\n" not in raw[:4096]:
        raise CheckpointError(f"checkpoint {path} is not a gradsift checkpoint (no header)")
    head, data = raw[len(MAGIC):].split(b"\n", 1)
    try:
        meta = json.loads(head)
        length, digest = int(meta["length"]), str(meta["sha256"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path} has a damaged header") from None
    if len(data) != length:
        raise CheckpointError(f"checkpoint {path} is truncated or padded: {len(data)} bytes of content, its header "
                              f"says {length}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted: its content does not match its checksum")
    # weights_only: the content may hold tensors and plain data only. The checksum proves the file is whole, not
    # who wrote it: a full unpickler would run whatever code a crafted file names before anything is checked
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain data: refused "
                              "unread (loading them could run code)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable content is one clear error
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__})") from None


def rng_state() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain data (what a ``weights_only`` load accepts)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = st["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


def _dcp():
    """``torch.distributed.checkpoint`` (the module, its exception, get_state_dict, set_state_dict), imported where a
    sharded model is saved or loaded: importing it costs every other run about a second."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, CheckpointException, get_state_dict, set_state_dict


def save_checkpoint(directory: Path, iteration: int, updates: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state, cfg: RunConfig) -> Path | None:
    """Gather every rank's compressor state and RNG streams; rank 0 writes one file atomically."""
    mine = {"compressor": state.state_dict(), "rng": rng_state()}
    world = dist.get_world_size()
    gathered: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    path = None
    sharded = None
    manifest = None
    if cfg.fsdp:  # a sharded model and optimizer: every rank writes its shards (torch.distributed.checkpoint)
        sharded = f"ckpt-{iteration:08d}.dcp"
        dcp, _, get_state_dict, _ = _dcp()
        dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))),
                 checkpoint_id=str(directory / sharded))
        dist.barrier()  # every rank's shards are on disk
        if dist.get_rank() == 0:
            manifest = {p.name: [p.stat().st_size, file_digest(p)] for p in sorted((directory / sharded).iterdir())}
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"ckpt-{iteration:08d}.pt"
        save_verified({"iteration": iteration, "updates": updates,
                       "model": None if sharded else model.state_dict(),
                       "optimizer": None if sharded else optimizer.state_dict(), "sharded": sharded,
                       "shards": manifest, "ranks": gathered, "config": cfg.as_dict(), "world_size": world}, path)
        write_atomic(directory / "latest", lambda f: f.write((path.name + "\n").encode()))
    dist.barrier()
    return path


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_shards(path: Path, folder: Path, manifest: dict[str, list] | None) -> None:
    """Every file of a sharded checkpoint's folder against the sizes and checksums its file lists, the reading
    shared among the ranks; every rank raises the same one-line :class:`CheckpointError` on the first mismatch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = None
    if manifest is None:  # (written before the shards were checksummed: read as it is, said once)
        if rank == 0:
            print(f"gradsift: checkpoint {path} lists no checksums for its sharded model (an older gradsift wrote "
                  "it): its shards are read unverified", file=sys.stderr)
        return
    names = sorted(manifest)
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        size, digest = manifest[name]
        f = folder / name
        if name not in present or not f.is_file():
            mine = f"checkpoint {path}: its sharded model {folder.name} has no file {name}"
        elif f.stat().st_size != size:
            mine = f"checkpoint {path}: shard {folder.name}/{name} is truncated or padded: {f.stat().st_size} " \
                   f"bytes, the checkpoint lists {size}"
        elif file_digest(f) != digest:
            mine = f"checkpoint {path}: shard {folder.name}/{name} is corrupted: its content does not match its " \
                   "checksum"
        if mine:
            break
    said: list[Any] = [None] * world
    dist.all_gather_object(said, mine)
    first = next((s for s in said if s), None)
    if first:
        raise CheckpointError(first)


def resolve_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        latest = p / "latest"
        if not latest.exists():
            raise CheckpointError(f"--resume {path!r}: no checkpoint in that folder (no 'latest' file)")
        p = p / latest.read_text().strip()
    if not p.is_file():
        raise CheckpointError(f"--resume {path!r}: no such checkpoint file")
    return p


def _nonfinite(obj: Any, where: str = "") -> str | None:
    """The first place in ``obj`` holding a non-finite floating-point tensor, or None."""
    if isinstance(obj, torch.Tensor):
        obj = obj.to_local() if hasattr(obj, "to_local") else obj  # (a sharded tensor: this rank's shard)
        if obj.is_floating_point() and obj.numel() and not bool(torch.isfinite(obj).all()):
            return where or "a tensor"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        bad = _nonfinite(v, f"{where}.{k}" if where else str(k))
        if bad:
            return bad
    return None


def config_difference(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    for key in sorted(set(saved) | set(mine)):
        if key in MAY_DIFFER:
            continue
        if saved.get(key) != mine.get(key):
            return f"{key} {saved.get(key)!r}, this run uses {mine.get(key)!r}"
    return None


def load_checkpoint(path: Path, model, optimizer, state, cfg: RunConfig) -> tuple[int, int]:
    """Verify, then restore the model, the optimizer, this rank's compressor state and RNG streams."""
    ck = load_verified(path)
    if not isinstance(ck, dict) or not {"iteration", "updates", "model", "optimizer", "ranks", "config",
                                        "world_size"} <= set(ck):
        raise CheckpointError(f"checkpoint {path} does not hold a gradsift training state")
    world, rank = dist.get_world_size(), dist.get_rank()
    elastic = ck["world_size"] != world or len(ck["ranks"]) != world
    if elastic and (ck.get("sharded") or len(ck["ranks"]) != ck["world_size"]):
        raise CheckpointError(f"checkpoint {path} was written by {ck['world_size']} ranks, this run has {world}"
                              + (": a sharded model resumes at its own world size" if ck.get("sharded") else ""))
    diff = config_difference(ck["config"], cfg.as_dict())
    if diff:
        raise CheckpointError(f"checkpoint {path} was made with another configuration: {diff}")
    bad = _nonfinite({"model": ck["model"], "optimizer": ck["optimizer"], "ranks": ck["ranks"]})
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite values in {bad}")
    mine = ck["ranks"][rank % len(ck["ranks"])]
    saved_rank = mine.get("compressor", {}).get("rank", rank)
    if not elastic and saved_rank != rank:
        raise CheckpointError(f"checkpoint {path}: the state in rank {rank}'s slot belongs to rank {saved_rank}")
    if ck.get("sharded"):  # this rank's shards, from the torch.distributed.checkpoint folder beside the file
        verify_shards(path, path.parent / ck["sharded"], ck.get("shards"))
        dcp, CheckpointException, get_state_dict, set_state_dict = _dcp()
        msd, osd = get_state_dict(model, optimizer)
        both = {"model": msd, "optimizer": osd}
        try:
            dcp.load(both, checkpoint_id=str(path.parent / ck["sharded"]))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line for a missing or damaged folder
            raise CheckpointError(f"checkpoint {path}: its sharded model {ck['sharded']} could not be read "
                                  f"({type(e).__name__})") from None
        set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])
        flag = torch.tensor([float(_nonfinite(both) is not None)], device=control_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops alike
        if flag.item():
            raise CheckpointError(f"checkpoint {path}: its sharded model holds non-finite values")
    else:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
    if elastic:  # another world size: the memory folded (GradsiftState.load_elastic), this rank's streams afresh
        state.load_elastic([r["compressor"] for r in ck["ranks"]])
        if rank == 0:
            print(f"gradsift: resuming {ck['world_size']} ranks' checkpoint on {world}: what the ranks still had to "
                  "send (error feedback's memory, the owners' residuals) folded onto every rank, nothing lost; "
                  "compressor state and data order afresh", file=sys.stderr)
    else:
        state.load_state_dict(mine["compressor"])
        set_rng_state(mine["rng"])
    return int(ck["iteration"]), int(ck["updates"])
