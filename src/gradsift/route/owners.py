"""The owner's side of the scatter route: one worker's regions of every scattered tensor.

Each step, for a tensor sent by the scatter route (:mod:`gradsift.transport.wire`), the owner of a region receives
every worker's entries in that region. :meth:`Owners.reduce` adds them, in worker order, to what the owner held
back of that region before (the owner-side residual: SparDL's "global residual"), keeps the ``own_slots`` entries
of largest magnitude (exact, ties to the lowest position) for the all-gather, and holds the rest back for the next
step. Nothing is lost: what every worker sent equals, over the run, what the owners selected plus what they hold.
The values kept go out in the payload's wire dtype; their rounding stays in the residual, as error feedback keeps
the rounding of fp16 values. The residual is this worker's state: checkpointed, rolled back with a skipped step.

The owner selects the largest entries of the *sum*, so the round's mean holds about k entries (a global top-k of
what was sent, as gTop-k and Ok-Topk), where the all-gather route's mean holds every worker's k: entries that the
sum does not rank among its k largest arrive a step or more later. Both transports call :meth:`reduce` with the
same inputs in the same order, so they give the same bits.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..compressors.base import clone_state, restore
from ..compressors.topk import topk_indices
from ..payload import Partition, accumulate_dtype

SCATTER_KEEP = 4.0  # the default: owners keep this many times k of the sum (1 lost accuracy: docs/results.md)


class Owners:
    """One worker's owner-side residuals, per tensor key (its region of each, in the partition's positions)."""

    def __init__(self):
        self.residual: dict[str, torch.Tensor] = {}
        self.deferred = 0  # entries this step's sums held back (telemetry)

    def reduce(self, part: Partition, own_slots: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
               grad_dtype: torch.dtype, wire_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``parts``: every worker's (positions, values) in this worker's region, in worker order. Returns the
        (positions, values) kept, values in ``wire_dtype``."""
        dtype = accumulate_dtype(grad_dtype)
        device = parts[0][1].device
        acc = self.residual.get(part.key)
        if acc is None or acc.numel() != part.region:
            acc = torch.zeros(part.region, dtype=dtype, device=device)
        for pos, vals in parts:
            if vals.numel():
                acc.index_add_(0, pos.long(), vals.to(dtype))
        nonzero = int(torch.count_nonzero(acc))
        keep = topk_indices(acc, min(own_slots, nonzero)) if nonzero else acc.new_zeros(0, dtype=torch.long)
        keep = keep.sort().values
        wire = acc[keep].to(wire_dtype)
        acc.index_put_((keep,), wire.to(dtype).neg(), accumulate=True)  # what left; its rounding stays here
        self.residual[part.key] = acc
        self.deferred += nonzero - keep.numel()
        return keep, wire

    def norm(self) -> float:
        """The L2 norm of everything this worker holds back as an owner."""
        return float(sum(float(r.double().square().sum()) for r in self.residual.values())) ** 0.5

    # ------------------------------------------------------------ state
    def checkpoint(self, keys: Sequence[str]) -> dict[str, Any]:
        if not self.residual:  # (nothing held as an owner: every key absent, no call per key)
            return dict.fromkeys(keys)
        return {k: clone_state(self.residual.get(k)) for k in keys}

    def rollback(self, token: dict[str, Any]) -> None:
        restore(self.residual, token)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.residual.items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor] | None, device: torch.device | None = None) -> None:
        self.residual = {k: v.detach().clone().to(device or v.device) for k, v in (sd or {}).items()}
