"""The sharded exchange over ``torch.distributed``: FSDP's gradient reduce-scatter, sparse.

A group here is one FSDP module's reduce-scatter input: ``N`` rows of one shard each, row j destined for rank j
(:func:`gradsift.transport.wire.partition_sharded`). Every payload takes the ``shard`` route
(:mod:`gradsift.transport.wire`): sparse payloads as the scatter route's first stage (``[count | flag | positions
| values]`` per destination, fixed slots, no size exchange), dense ones as rows of ``[values | flag]``. One
all-to-all per kind; no second stage, because each rank needs only its own shard. Each rank sums what it
received in rank order (:func:`gradsift.transport.base.sum_shard`, the arithmetic the in-process group uses), so
the run gives the same bits at any world size on any backend.

A delivery's means are this rank's shards, not whole tensors: a method that reads the round's whole mean
(REGTOP-k) or runs several rounds (PowerSGD) cannot take this route (:mod:`gradsift.fsdp` refuses them).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from ..payload import DENSE, SPARSE, Payload
from .base import Delivery, normalize_weights, shard_rows, split_for_owners, sum_shard, traffic_of
from .wire import SHARD, pack_blocks, unpack_block


class ShardPending:
    """The all-to-alls of one group in flight; :meth:`wait` decodes this rank's shards."""

    def __init__(self, transport: "ShardTransport", payloads: Sequence[Payload], routes: Sequence[str],
                 works: list, sparse: tuple | None, dense: list, started: float):
        self.transport = transport
        self.payloads = list(payloads)
        self.routes = list(routes)
        self.works = works
        self.sparse = sparse  # (received blocks, payload ids)
        self.dense = dense  # [(received rows, payload id)]
        self.started = started
        self.finished: float | None = None
        self.code_s = time.perf_counter() - started  # coding the payloads and issuing the collectives
        self.decode_s = 0.0  # set by decode
        self.delivery: Delivery | None = None
        self.needs_advance = False

    @property
    def traffic(self):
        return traffic_of(self.payloads, self.routes, self.transport.world_size)

    def decode(self) -> Delivery:
        began = time.perf_counter()
        t = self.transport
        n, weighted = t.world_size, t.weights is not None
        means: list[torch.Tensor | None] = [None] * len(self.payloads)
        counts = [[p.count for p in self.payloads] for _ in range(n)]
        flags = [0] * n
        if self.sparse is not None:
            recv, ids = self.sparse
            mine = [self.payloads[i] for i in ids]
            blocks = [unpack_block(recv[r], mine, r) for r in range(n)]
            for k, i in enumerate(ids):
                for r in range(n):
                    counts[r][i] = blocks[r][k][0]
                    flags[r] = max(flags[r], blocks[r][k][1])
                means[i] = sum_shard(self.payloads[i], [(blocks[r][k][2], blocks[r][k][3]) for r in range(n)],
                                     weighted)
        for rows, i in self.dense:
            for r in range(n):
                flags[r] = max(flags[r], int(rows[r, -1].item() != 0))
            means[i] = sum_shard(self.payloads[i], [(None, rows[r, :-1]) for r in range(n)], weighted)
        self.finished = time.perf_counter()
        self.decode_s = self.finished - began
        self.delivery = Delivery(means, flags, counts)  # type: ignore[arg-type]
        self.works = []
        return self.delivery

    def wait(self) -> Delivery:
        for w in self.works:
            w.wait()
        return self.decode()


class ShardTransport:
    """Reduce-scatters this rank's payloads with every other rank's over a process group (module docstring)."""

    def __init__(self, group=None, weights: Sequence[float] | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.weights = normalize_weights(weights, self.world_size)

    def start(self, payloads: Sequence[Payload], routes: Sequence[str], flag: int = 0, owners=None,
              merge: bool = False) -> ShardPending:
        """Issue the group's all-to-alls (asynchronous); every payload carries its partition (``p.owners``) and
        takes the ``shard`` route (``merge``: nothing to merge here, no all-gather)."""
        started = time.perf_counter()
        routes = list(routes)
        if any(r != SHARD for r in routes) or any(p.owners is None or p.kind not in (SPARSE, DENSE) for p in payloads):
            raise ValueError("the sharded exchange takes sparse or dense payloads with their shards, route 'shard'")
        weight = self.weights[self.rank] if self.weights is not None else None
        device = payloads[0].values.device
        works, sparse, dense = [], None, []
        ids = [i for i, p in enumerate(payloads) if p.kind == SPARSE]
        if ids:
            mine = [payloads[i] for i in ids]
            send = pack_blocks(mine, [split_for_owners(p, weight) for p in mine], flag, device)
            recv = torch.empty_like(send)
            works.append(dist.all_to_all_single(recv, send, group=self.group, async_op=True))
            sparse = (recv, ids)
        for i, p in enumerate(payloads):
            if p.kind == DENSE:
                send = shard_rows(p, flag, weight)
                recv = torch.empty_like(send)
                works.append(dist.all_to_all_single(recv, send, group=self.group, async_op=True))
                dense.append((recv, i))
        return ShardPending(self, payloads, routes, works, sparse, dense, started)
