"""In-process transport: the simulator's workers are a list, the network is a loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..payload import SPARSE, GroupTraffic, Payload, group_traffic
from .base import check_aligned, combine_sparse, finish_reduced, normalize_weights, scaled_contribution


@dataclass
class Aggregate:
    """The flat mean of every tensor of a group, and what moving it cost."""

    means: list[torch.Tensor]
    traffic: GroupTraffic


class LocalTransport:
    """Aggregates ``payloads[worker][tensor]`` in one process.

    Follows the rules of :mod:`gradsift.transport.base`, in worker order, so the
    ``torch.distributed`` transport reproduces its result (exactly for sparse
    payloads and for two workers; to rounding in the all-reduce otherwise).
    """

    def __init__(self, world_size: int, weights: Sequence[float] | None = None):
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.weights = normalize_weights(weights, world_size)

    def aggregate(self, per_worker: Sequence[Sequence[Payload]]) -> Aggregate:
        if len(per_worker) != self.world_size:
            raise ValueError(f"expected payloads from {self.world_size} workers, got {len(per_worker)}")
        check_aligned(per_worker)
        weighted = self.weights is not None
        means = []
        for i, first in enumerate(per_worker[0]):
            if first.kind == SPARSE:
                parts = [(ps[i].values, ps[i].indices) for ps in per_worker]
                means.append(combine_sparse(parts, first.numel, first.grad_dtype, self.weights))
            else:
                total = scaled_contribution(first, self.weights[0] if weighted else None).clone()
                for w in range(1, self.world_size):
                    total += scaled_contribution(per_worker[w][i], self.weights[w] if weighted else None)
                means.append(finish_reduced(total, first, self.world_size, weighted))
        return Aggregate(means, group_traffic(per_worker))
