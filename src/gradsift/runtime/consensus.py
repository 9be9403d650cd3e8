"""What ranks agree on, outside any hook: the same configuration everywhere (one all-gather at registration decides
it, on every rank alike), and the small reductions a runtime needs (the measured plan's, LAGS's)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist


class ConfigMismatch(RuntimeError):
    """Ranks run different compressor configurations."""


def control_device(group=None) -> torch.device:
    """Where small control tensors must live for the group's backend (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_strings(text: str, group) -> list[str]:
    """Every rank's string, on every rank (two small blocking all-gathers)."""
    dev = control_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    outs = [torch.zeros(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return [bytes(o[: int(s.item())].cpu().tolist()).decode() for o, s in zip(outs, sizes)]


def average_over_ranks(values: list[float], group) -> list[float]:
    """The mean over ranks of a vector of floats (one blocking all-reduce; outside the hook)."""
    vec = torch.tensor(values, dtype=torch.float64, device=control_device(group))
    dist.all_reduce(vec, group=group)
    return (vec / dist.get_world_size(group)).cpu().tolist()


def max_over_ranks(values: list[float], group) -> list[float]:
    """The largest of every rank's values, element by element (one blocking all-reduce; outside any hook)."""
    t = torch.tensor(values, dtype=torch.float64, device=control_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path or 'config'}: {json.dumps(b, default=str)[:120]} vs {json.dumps(a, default=str)[:120]}"


def verify_same(description: dict[str, Any], group, rank: int) -> None:
    """Raise :class:`ConfigMismatch` on every rank if any rank's description differs from rank 0's."""
    text = json.dumps(description, sort_keys=True, default=str)
    texts = gather_strings(text, group)
    digests = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    if len(set(digests)) == 1:
        return
    ref = json.loads(texts[0])
    for r, t in enumerate(texts):
        if digests[r] != digests[0]:
            diff = _first_difference(ref, json.loads(t))
            raise ConfigMismatch(f"ranks run different gradsift configurations: rank {r} differs from rank 0 in {diff}"
                                 + (" (this rank)" if r == rank else ""))
