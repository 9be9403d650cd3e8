"""In-process transport: the simulator's workers are a list, the network is a loop.

Each worker holds an endpoint of one :class:`LocalGroup` and starts its part of
a group's aggregation exactly as a ``torch.distributed`` rank does
(:meth:`LocalEndpoint.start`, or :meth:`LocalEndpoint.start_in_place` for a
group summed in the buffer it lives in); once every worker has started, the
group aggregates, following the rules of :mod:`gradsift.transport.base` in
worker order. The ``torch.distributed`` transport gives the same bits: always
for sparse payloads and for two workers (a sum of two is commutative), and for
every payload at any world size with ``sum_order="rank"``.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..payload import SPARSE, Payload
from .base import (Delivery, GroupTraffic, TransportError, check_aligned, combine_sparse_many, decode_scattered, densified,
                   finish_reduced, mean_in_place, mean_into, normalize_weights, scaled_contribution, shard_rows,
                   split_for_owners, sum_shard, traffic_of)
from .wire import DENSIFY, GATHER, SCATTER, SHARD, route_of


class LocalPending:
    """One worker's view of a group in flight; :meth:`wait` returns the delivery once every worker started."""

    def __init__(self, group: "LocalGroup", payloads: Sequence[Payload], routes: Sequence[str],
                 merged: bool = False):
        self.group = group
        self.payloads = list(payloads)
        self.routes = list(routes)
        self.merged = merged  # the all-reduce part counted as riding the all-gather (the same sums: worker order)
        self.delivery: Delivery | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.code_s = 0.0  # (in process: nothing is coded; the sum is the group's, counted by no worker)
        self.decode_s = 0.0

    def wait(self) -> Delivery:
        if self.delivery is None:
            raise RuntimeError("the group is not complete: every worker must start it before any waits")
        self.finished = self.finished or time.perf_counter()
        return self.delivery

    @property
    def traffic(self) -> GroupTraffic:
        return traffic_of(self.payloads, self.routes, self.group.world_size, self.group.ranked, self.merged)


class LocalEndpoint:
    """Worker ``rank``'s handle on the group: the same ``start`` a distributed rank calls."""

    def __init__(self, group: "LocalGroup", rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def start(self, payloads: Sequence[Payload], routes: Sequence[str] | None = None, flag: int = 0,
              owners=None, merge: bool = False) -> LocalPending:
        """``owners``: this worker's :class:`~gradsift.route.owners.Owners` (scatter routes only). ``merge``: the
        all-reduce segments ride the all-gather, as on ``torch.distributed`` (in process the sums are the same,
        worker order; only the bytes counted change)."""
        routes = list(routes) if routes is not None else [route_of(p) for p in payloads]
        return self.group.post(self.rank, payloads, routes, flag, owners=owners, merge=merge)

    def start_in_place(self, flat: torch.Tensor, payloads: Sequence[Payload], routes: Sequence[str],
                       flag: int = 0, out: torch.Tensor | None = None) -> LocalPending:
        """``flat`` (``payloads``: dense views of it, on the all-reduce ``routes``) summed with every worker's in
        worker order and divided, in place: each worker's buffer ends holding the mean, as each DDP rank's bucket
        does (``out``: each worker's, where ``flat`` is its copy in a narrower wire dtype)."""
        return self.group.post(self.rank, payloads, list(routes), flag, in_place=(flat, out))


class LocalGroup:
    """N workers in one process; aggregates a group once all of them have posted their payloads."""

    def __init__(self, world_size: int, weights: Sequence[float] | None = None, sum_order: str = "backend"):
        """``sum_order`` changes no arithmetic here (sums always run in worker order); it makes the traffic
        counted what ``torch.distributed`` moves for that order (:mod:`gradsift.transport.dist`)."""
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.weights = normalize_weights(weights, world_size)
        self.ranked = sum_order == "rank" and world_size > 2
        self._posted: dict[int, tuple[LocalPending, int, torch.Tensor | None, object]] = {}

    def endpoint(self, rank: int) -> LocalEndpoint:
        return LocalEndpoint(self, rank)

    def post(self, rank: int, payloads: Sequence[Payload], routes: Sequence[str], flag: int,
             in_place: tuple[torch.Tensor, torch.Tensor | None] | None = None, owners=None,
             merge: bool = False) -> LocalPending:
        if rank in self._posted:
            raise RuntimeError(f"worker {rank} started a group twice before every worker had started it")
        pending = LocalPending(self, payloads, routes, merge)
        self._posted[rank] = (pending, int(flag), in_place, owners)
        if len(self._posted) == self.world_size:
            posted, self._posted = self._posted, {}
            ordered = [posted[r] for r in range(self.world_size)]
            flags = [f for _, f, _, _ in ordered]
            if in_place is not None:
                delivery = self.sum_in_place([o[2] for o in ordered], [o[0].payloads for o in ordered], flags)
            else:
                delivery = self.aggregate([o[0].payloads for o in ordered], routes, flags, [o[3] for o in ordered])
            for p, _, _, _ in ordered:
                p.delivery = delivery
        return pending

    def sum_in_place(self, placed: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                     per_worker: Sequence[Sequence[Payload]], flags: Sequence[int]) -> Delivery:
        """Every worker's buffer summed in worker order into worker 0's, divided (or pre-scaled by the weights)
        as the whole route divides, then copied into every other worker's: what each DDP rank's bucket holds
        after the in-place all-reduce. The means are views of worker 0's buffer -- or, where each buffer is its
        ``out``'s copy in a narrower wire dtype, the sum is divided into every ``out`` (:func:`mean_into`)."""
        buffers = [b for b, _ in placed]
        if any(b.shape != buffers[0].shape or b.dtype != buffers[0].dtype for b in buffers):
            raise TransportError("workers summed buffers of different shapes or dtypes in place")
        if self.weights is not None:
            for b, w in zip(buffers, self.weights):
                b.mul_(w)
        total = buffers[0]
        for b in buffers[1:]:
            total += b
        counts = [[p.count for p in ps] for ps in per_worker]
        outs = [o for _, o in placed]
        if outs[0] is not None:
            mean = mean_into(outs[0], total, self.world_size, self.weights is not None)
            for o in outs[1:]:
                o.copy_(mean)
            means = list(mean.split([p.values.numel() for p in per_worker[0]]))
            return Delivery(means, [int(f) for f in flags], counts)
        mean_in_place(total, self.world_size, self.weights is not None)
        for b in buffers[1:]:
            b.copy_(total)
        return Delivery([p.values for p in per_worker[0]], [int(f) for f in flags], counts)

    def aggregate(self, per_worker: Sequence[Sequence[Payload]], routes: Sequence[str] | None = None,
                  flags: Sequence[int] | None = None, owners: Sequence | None = None) -> Delivery:
        """Every worker's payloads at once (``per_worker[worker][tensor]``): the delivery. ``owners``: every
        worker's :class:`~gradsift.route.owners.Owners`, for scatter routes."""
        if len(per_worker) != self.world_size:
            raise ValueError(f"expected payloads from {self.world_size} workers, got {len(per_worker)}")
        routes = list(routes) if routes is not None else [route_of(p) for p in per_worker[0]]
        check_aligned(per_worker, routes)
        weighted = self.weights is not None
        w = self.weights if weighted else [None] * self.world_size
        means: list[torch.Tensor | None] = [None] * len(routes)
        gathered = [i for i, route in enumerate(routes) if route == GATHER]
        for dtype in {per_worker[0][i].grad_dtype for i in gathered}:  # all at once, as the distributed transport
            same = [i for i in gathered if per_worker[0][i].grad_dtype == dtype]
            got = combine_sparse_many([[(ps[i].values, ps[i].indices) for ps in per_worker] for i in same],
                                      [per_worker[0][i].numel for i in same], dtype, self.weights,
                                      per_worker[0][same[0]].values.device)
            for i, mean in zip(same, got):
                means[i] = mean
        for i, (first, route) in enumerate(zip(per_worker[0], routes)):
            if route == GATHER:
                continue
            if route == SCATTER:  # every owner reduces its region of what every worker sent, in worker order
                blocks = [split_for_owners(ps[i], w[r]) for r, ps in enumerate(per_worker)]
                part, own = first.owners, first.owners.own_slots(first.target)
                kept = [owners[j].reduce(part, own, [blocks[r][j] for r in range(self.world_size)], first.grad_dtype,
                                         first.values.dtype) for j in range(self.world_size)]
                means[i] = decode_scattered(first, kept, weighted)
                continue
            if route == SHARD:  # every owner sums its shard of what every worker sent, in worker order
                parts = [self._shard_parts(ps[i], w[r]) for r, ps in enumerate(per_worker)]
                means[i] = torch.cat([sum_shard(first, [parts[r][j] for r in range(self.world_size)], weighted)
                                      for j in range(self.world_size)])
                continue
            contrib = densified if route == DENSIFY else scaled_contribution
            total = contrib(first, w[0]).clone()
            for r in range(1, self.world_size):
                total += contrib(per_worker[r][i], w[r])
            means[i] = finish_reduced(total, first, self.world_size, weighted)
        flags = list(flags) if flags is not None else [0] * self.world_size
        counts = [[p.count for p in ps] for ps in per_worker]
        return Delivery(means, [int(f) for f in flags], counts)


    @staticmethod
    def _shard_parts(p: Payload, weight: float | None) -> list:
        """One worker's payload split by destination shard, as the sharded exchange delivers it: (positions,
        values) of a sparse payload, (None, the shard's values) of a dense one."""
        if p.kind == SPARSE:
            return split_for_owners(p, weight)
        return [(None, row[:-1]) for row in shard_rows(p, 0, weight)]


class LocalTransport(LocalGroup):
    """All workers' payloads aggregated in one call (tests and tools): ``aggregate(per_worker)``."""

