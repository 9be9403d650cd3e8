"""What each way of sending a tensor costs on the link: the numbers the route owner decides from.

A sparsifier pays off only where the bytes it saves cost more than what it spends. :class:`WirePlan` holds the
plan's configuration (the link's alpha-beta model, the world size, whether the plan is on, the small-tensor limit,
the selection speed, the sparse collective asked for, the owners' keep factor, whether the exchange is sharded)
and prices, from the configuration alone (so that every worker prices alike), the ways a tensor can travel:

* whole, merged into the group's all-reduce (bandwidth terms only: it adds bytes, not messages);
* its payload by all-gather (``capacity`` slots of index and value, every worker's);
* its payload scattered to the owners of its entries' regions (one all-to-all of equal per-owner blocks, then
  one all-gather of the owners' selections; :mod:`gradsift.route.owners`);
* its payload densified and summed by all-reduce (at least fp32);
* a group's all-reduce part appended to its all-gather (:meth:`WirePlan.merges`);
* the selection itself: the method's ``SELECT_PASSES`` read passes at a nominal ``select_gbps`` (2.5 GB/s, one
  CPU thread), a fixed model so that every worker decides alike.

Which way a tensor goes is decided in one place, the route owner (:mod:`gradsift.route.routing`), from these prices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .owners import SCATTER_KEEP
from .. import payload as P
from .netmodel import NetworkModel
from ..transport.wire import POSITION_DTYPE, group_bytes, index_bytes, segment_bytes

SELECT_GBPS = 2.5  # nominal bytes per second (x1e9) one thread reads in a selection pass on a CPU


class Prices(NamedTuple):
    """Seconds one tensor's ways of travelling cost (:meth:`WirePlan.prices`); ``scatter`` None where the tensor
    cannot be scattered."""

    gather: float  # its payload by all-gather, messages included
    scatter: float | None  # the owners' all-to-all and all-gather, messages included
    densified: float  # its payload densified, summed by all-reduce, messages included
    whole: float  # sent whole inside the group's all-reduce (bandwidth term)
    select: float  # selecting it
    sent_gather: float  # its payload's bandwidth term by all-gather
    sent_scatter: float | None  # its payload's bandwidth terms by the owners' scatter
    reduce_bytes: int  # what the densified all-reduce carries


@dataclass
class WirePlan:
    """The wire plan's configuration and prices (see the module docstring)."""

    net: NetworkModel = field(default_factory=NetworkModel)
    world_size: int = 1
    enabled: bool = True
    min_numel: int | None = None
    select_gbps: float = SELECT_GBPS
    sparse_collective: str = "auto"
    scatter_keep: float = SCATTER_KEEP  # the owners keep this times k of the sum (owners.py)
    sharded: bool = False  # (FSDP) every tensor travels to its shards' owners (transport/shard.py)

    def small_limit(self, value_bytes: int) -> int:
        """Tensors up to this many elements cost no more than one message latency whole."""
        if self.min_numel is not None:
            return int(self.min_numel)
        return int(self.net.alpha * self.net.beta / max(value_bytes, 1))

    def prices(self, c, key: str, numel: int, k: int, item: int, scatter_ok: bool) -> Prices:
        """The ways tensor ``key`` (``numel`` entries of ``item`` bytes, ``k`` sent) can travel under compressor
        ``c`` (the inner compressor), priced on this plan's link."""
        net, n = self.net, self.world_size
        sparse = c.payload_kind() == P.SPARSE
        vb = c.sparse_value_bytes(item) if sparse else (c.value_dtype.itemsize if c.value_dtype is not None else item)
        cap = c.capacity_for(k, numel) if sparse else k
        bits = c.value_bits if sparse else 0
        gather = net.allgather_s(segment_bytes(numel, cap, P.index_dtype_for(numel), vb, bits), n)
        scatter = sent_scatter = None
        if scatter_ok:
            sizes = P.Partition(key, numel, n, 1, 0, 1, self.scatter_keep)
            ds, os_ = sizes.dest_slots(cap), sizes.own_slots(k)
            block = segment_bytes(sizes.region, ds, POSITION_DTYPE, vb)
            owned = segment_bytes(sizes.region, os_, POSITION_DTYPE, vb)
            scatter = net.alltoall_s(block, n) + net.allgather_s(owned, n)
            sent_scatter = scatter - net.alltoall_s(0.0, n) - net.allgather_s(0.0, n)
        acc = max(item, 4)  # densified sums travel in at least fp32
        reduce_bytes = acc * numel
        densified = net.allreduce_s((numel + 1) * acc, n)
        whole = net.allreduce_s(numel * item, n) - net.allreduce_s(0.0, n)
        select = c.SELECT_PASSES * numel * 4 / (self.select_gbps * 1e9)
        if sparse:
            sent = P.value_part(k, vb, bits) + index_bytes(numel, k, P.index_dtype_for(numel))
            sent_gather = net.allgather_s(sent, n) - \
                net.allgather_s(0.0, n)
        else:
            sent_gather = net.allreduce_s(k * vb, n) - net.allreduce_s(0.0, n)
        return Prices(gather, scatter, densified, whole, select, sent_gather, sent_scatter, reduce_bytes)

    def merges(self, payloads, routes) -> bool:
        """Whether a group's all-reduce segments should ride its all-gather (:mod:`gradsift.transport.wire`): where
        it has both and one all-gather of both is priced no dearer than the all-gather and the all-reduce -- it
        saves the all-reduce's ``2(N-1)`` message latencies and moves its bytes ``N-1`` times instead of
        ``2(N-1)/N`` (always, on 2 workers: the same bytes). From the configuration alone: every worker decides
        alike."""
        reduce, gather, blocks, _ = group_bytes(payloads, routes)
        if not reduce or not gather or blocks:
            return False
        net, n = self.net, self.world_size
        return net.allgather_s(gather + reduce, n) <= net.allgather_s(gather, n) + net.allreduce_s(reduce, n)
