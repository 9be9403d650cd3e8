"""DDP's own all-reduce beside gradsift's hook: where the hook stands aside, and ``--paired-ddp`` timing.

:class:`PlainDDP` is a second ``DistributedDataParallel`` wrapper of the module the hook wraps, with no hook;
``gradsift train --runtime ddp`` (:mod:`gradsift.launch.loop`) steps through it once the hook would only repeat
DDP's all-reduce (:meth:`gradsift.ddp.state.GradsiftState.stand_aside`), and :class:`Pairing` alternates it with
the run's own steps to time both in the same processes.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..compressors.base import NonFiniteGradient
from ..payload import is_finite


def wrap(model: torch.nn.Module, device: torch.device, bucket_cap_mb: float | None) -> DDP:
    """``model`` in ``DistributedDataParallel`` on its device (the GPU's index where there is one)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)


def stood_aside(last: dict[str, Any], rank: int, updates: int) -> dict[str, Any]:
    """What the records of the steps after the hook stood aside carry: the bytes and the alpha-beta estimate of
    its last step (every later step moves the same), nothing measured inside the hook. Says so once on rank 0."""
    if rank == 0:
        print(f"gradsift: every tensor goes whole from step {updates + 1} on: DDP's own all-reduce takes the steps "
              "(the hook would only repeat it)", file=sys.stderr)
    keep = ("density", "k_ratio", "bytes_per_worker", "wire_bytes_per_worker", "est_comm_s", "overflow")
    return {k: last[k] for k in keep if k in last}


class PlainDDP:
    """DDP's own all-reduce on the module gradsift's hook wraps: a second ``DistributedDataParallel`` wrapper with
    no hook, as ``--torch-hook ddp`` builds it, made at its first use (a collective: every rank reaches it at the
    same step). A wrapper handles the backward pass of its own forward only; the other's reducer stays idle.
    Used when the hook stands aside (:meth:`GradsiftState.stand_aside`) and for ``--paired-ddp``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, bucket_cap_mb: float | None):
        self.model, self.device, self.bucket_cap_mb = model, device, bucket_cap_mb
        self._wrapper: DDP | None = None

    def wrapper(self) -> DDP:
        """The plain wrapper, made at the first call."""
        if self._wrapper is None:
            self._wrapper = wrap(self.model, self.device, self.bucket_cap_mb)
        return self._wrapper

    def skip_nonfinite(self, loss: torch.Tensor, on_nonfinite: str, step: int) -> bool:
        """The hook's rule for a non-finite gradient, after DDP's own all-reduce: the sum is non-finite on every
        rank alike, so every rank raises (``"error"``) or skips the step (``"skip"``, returns True) without a
        collective. One read pass (each gradient's min and max, which NaN and Inf reach) and one host read."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None and p.grad.numel()]
        if not grads or is_finite(torch.cat([torch.stack(torch.aminmax(g.reshape(-1))) for g in grads])):
            return False
        if on_nonfinite == "skip":
            for g in grads:
                g.zero_()
            return True
        who = f"rank {dist.get_rank()}" if not is_finite(loss.detach()) else "a rank"
        raise NonFiniteGradient(f"non-finite gradient on {who} at step {step} (summed by DDP's own all-reduce); the "
                                "step was not applied (use --on-nonfinite skip to skip such steps)")


class Pairing:
    """``--paired-ddp BLOCK``: gradsift's hook and DDP's own all-reduce timed in the same processes.

    A fresh process on a small shared machine draws its compute speed at start (``docs/results.md``: charlm's
    forward pass 1.3x apart from one start to the next, fixed for the life of the process), so two runs compare
    their draws as much as their communication. Here one run holds both: DDP's own all-reduce through a second
    wrapper of the same module (:class:`PlainDDP`), and once the hook has settled (:attr:`GradsiftState.settled`,
    after the first ``WARMUP`` steps) and ``LEAD`` steps more, the steps alternate in blocks of ``BLOCK``:
    gradsift's, then DDP's, and so on.
    gradsift's steps are what ``gradsift train`` runs without pairing: where the hook stands aside they too go
    by DDP's own all-reduce (their records say ``ddp_allreduce``), and the pair then times the same thing.
    Both sides train the one model (a timing run: its curve is not the method's alone). The records of the
    alternating steps say which side ran (``paired``); :meth:`summary` gives both medians and DDP's over
    gradsift's (above 1: gradsift's step is faster).
    """

    WARMUP = 3
    LEAD = 2  # steps after settling left out of both sides: the hook's last steps before it stands aside, and
    # the plain wrapper's construction (a collective), which would otherwise fall on one side's first block

    def __init__(self, block: int, state, plain: PlainDDP | None):
        self.block, self.state, self.plain, self.first = block, state, plain, None

    def side(self, it: int) -> str | None:
        """Which wrapper runs step ``it``: None before the pairing starts, then "gradsift" or "ddp"."""
        if self.first is None:
            if it < self.WARMUP or not self.state.settled:
                return None
            self.first = it + self.LEAD
            if self.plain is not None:
                self.plain.wrapper()  # built now, on every rank alike, in neither side's steps
        if it < self.first:
            return None
        return "gradsift" if (it - self.first) // self.block % 2 == 0 else "ddp"

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        times = {k: [r["step_s"] for r in records if r.get("paired") == k] for k in ("gradsift", "ddp")}
        out: dict[str, Any] = {"block": self.block, "gradsift_steps": len(times["gradsift"]),
                               "ddp_steps": len(times["ddp"])}
        if times["gradsift"] and times["ddp"]:
            g, d = statistics.median(times["gradsift"]), statistics.median(times["ddp"])
            out.update(gradsift_step_ms=1e3 * g, ddp_step_ms=1e3 * d, speedup=d / g)
        else:
            out["speedup"] = None  # the run ended before both sides ran
        return out
