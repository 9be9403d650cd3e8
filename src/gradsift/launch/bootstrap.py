"""Joining the process group torchrun describes, and turning what a failed collective raised into one line."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..compressors.base import NonFiniteGradient
from ..ddp import ConfigMismatch
from ..runconfig import ConfigError

DEFAULT_TIMEOUT_S = 120.0


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes in the environment (no-op if already joined)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("--runtime ddp runs under torchrun (RANK and WORLD_SIZE are not set), e.g. "
                          "torchrun --standalone --nproc-per-node 2 -m gradsift train --runtime ddp ...")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("GRADSIFT_DEVICE", "") == "cuda" else "gloo"
    warn_shared_store_restarts()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def warn_shared_store_restarts(env: dict[str, str] | None = None) -> str | None:
    """Warn (rank 0) when torchrun may restart workers on several nodes over its shared, unprefixed store.

    Returns the warning text, or None when the set-up is safe (see docs/ddp.md, "Restarts across machines").
    """
    env = os.environ if env is None else env
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and int(env.get("GROUP_WORLD_SIZE", "1")) > 1):
        text = ("gradsift: warning: torchrun may restart workers on several nodes while they share the agent's "
                "store; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 or a restart can hang in init_process_group")
        if env.get("RANK", "0") == "0":
            print(text, file=sys.stderr)
        return text
    return None


def device_for_rank() -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def model_bucket_mb(model: torch.nn.Module) -> float:
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return total / 2**20 * 1.05 + 0.01


def explain(e: BaseException, state, timeout_s: float) -> BaseException:
    """Turn what a failed backward/collective raised into gradsift's own one-line errors."""
    if state is not None and state.error is not None:
        return state.error
    text = str(e)
    if isinstance(e, (NonFiniteGradient, ConfigMismatch, ConfigError)):
        return e
    if "NonFiniteGradient" in text or "non-finite gradient" in text:
        line = next((l for l in text.splitlines() if "non-finite gradient" in l), text.splitlines()[0])
        return NonFiniteGradient(line.split("NonFiniteGradient:")[-1].strip())
    low = text.lower()
    if "timed out" in low or "timeout" in low or "connection closed" in low or "connection reset" in low:
        first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
        return CollectiveTimeout(f"a collective did not complete within the {timeout_s:g} s timeout "
                                 f"(a peer is unreachable or has died): {first}")
    return e


