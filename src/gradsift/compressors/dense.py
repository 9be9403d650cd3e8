"""``dense``: no compression; the full gradient is all-reduced (the baseline of every paper)."""

from __future__ import annotations

import torch

from .. import payload as P
from .registry import register
from .base import Compressor


@register
class Dense(Compressor):
    SELECT_PASSES = 0.0  # read passes per selection (gradsift bench select; the wire plan's model)
    """Send everything. ``ratio`` is ignored (always 1); no memory is needed."""

    name = "dense"
    MEMORY = "none"
    RATIO_REQUIRED = False
    EXACT_K = True
    SUMMARY = "no compression: dense all-reduce of the full gradient"

    def payload_kind(self) -> str:
        return P.DENSE

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        self.begin(key, x)
        return P.dense(self.wire(x, sparse=False), x.dtype)

    def k_for(self, key: str, numel: int, step: int | None = None) -> int:
        return numel
