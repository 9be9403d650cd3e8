"""The wire format both transports follow, and the one rule that counts its bytes.

A group of payloads (a DDP bucket; one tensor in the simulator) travels in at
most one all-gather and one all-reduce per value dtype. Each payload takes a
*segment* in one of them, chosen by its route:

``gather``   a sparse payload: ``[count int32 | flag int32 | checksum int64 |
             indices | values]``
             in this rank's all-gather buffer. Indices and values each fill
             ``capacity`` slots, each part padded to 8 bytes. The indices are
             coded (:mod:`gradsift.payload.indexcode`: Elias-Fano, a bitmap,
             or raw int32/int64, whichever is smallest for the tensor's size and
             the slot count), so a sparse entry costs about 1.1 bytes of index
             at density 1%. Every rank's buffer has the same size, fixed by the
             configuration, so no count exchange precedes the data.
``reduce``   a dense or shared-index payload: its values, then one flag
             element, in the all-reduce buffer of its value dtype.
``densify``  a sparse payload summed by all-reduce instead: the payload
             scattered into a dense tensor (accumulate dtype, at least fp32),
             then one flag element. Same mean as the all-gather, cheaper when
             the all-gather would move more (the road's wire plan decides).
``scatter``  a sparse payload reduced by its owners (Ok-Topk, SparDL): the
             index space is split among the N ranks (:class:`~gradsift.payload.Partition`);
             in one all-to-all each rank sends owner j ``[count | flag |
             positions | values]`` of the entries in j's region (``dest_slots``
             slots, equal blocks: no size exchange); each owner sums what it
             received with its owner-side residual, in rank order, keeps its
             ``own_slots`` largest (:mod:`gradsift.route.owners`: the rest waits in
             that residual) and, in one all-gather, every rank receives every
             owner's ``[count | flag | positions | values]``. About 2.25k
             entries received per rank at any N, against (N-1)k by all-gather.
``shard``    the sharded exchange (FSDP's gradient reduce-scatter): regions are
             the contiguous shards (:func:`partition_sharded`), and each owner
             needs only its own shard's sum, dense, so there is only the
             all-to-all: a sparse payload travels as the scatter route's first
             stage; a dense one as one row of ``[values of j's shard | flag]``
             per destination. Each owner sums the rows in rank order
             (:func:`gradsift.transport.base.sum_shard`): bytes (N-1)/N of what
             a dense reduce-scatter moves, times the density.

The flag is 1 on a rank whose input was not finite; it reaches every rank
inside the data collectives, so every rank takes the same decision without a
collective of its own.

A group holding both sparse payloads on the gather route and segments of
the all-reduce may send the all-reduce's buffers in its all-gather instead,
appended to the sparse segments, unpadded: one collective,
one message latency chain, where two would run. Each rank then sums the
gathered rows in rank order -- what the simulator computes -- at the cost of
moving those bytes ``N-1`` times instead of ``2(N-1)/N``; the road merges
where its link model prices one collective cheaper
(:meth:`gradsift.route.plan.WirePlan.merges`).

Wire bytes per worker are counted per segment -- ring all-gather ``(N-1) * size``,
ring all-reduce ``2(N-1)/N * size`` -- and summed. Headers, flags and padding
are part of the size. Because the count is per payload, it does not depend on
how payloads are grouped: the simulator (one tensor per group) and DDP (one
bucket per group) report the same wire bytes for the same run -- except where a
bucket's all-reduce part rides its all-gather on more than 2 ranks, which moves
those bytes ``N-1`` times and is counted so.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..payload import (SPARSE, Partition, Payload, accumulate_dtype, allgather_wire_bytes, allreduce_wire_bytes,
                       index_dtype_for)
from ..payload.seeds import derive_seed
from ..payload import lowbits
from ..payload.indexcode import BITMAP, ELIAS_FANO, RAW, CorruptPayload, check_raw, decode, encode, layout

GATHER = "gather"
REDUCE = "reduce"
DENSIFY = "densify"
SCATTER = "scatter"
SHARD = "shard"
ROUTES = (GATHER, REDUCE, DENSIFY, SCATTER, SHARD)
POSITION_DTYPE = torch.int32  # positions inside an owner's region (a region holds under 2**31 entries)

HEADER_BYTES = 16  # int32 count, int32 flag, int64 checksum of the rest of the segment
ALIGN = 8
CODES = {RAW: 0, BITMAP: 1, ELIAS_FANO: 2}  # the compiled kernels' numbers for the index codes


def pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def route_of(p: Payload, densify: bool = False) -> str:
    if p.kind == SPARSE:
        return DENSIFY if densify else GATHER
    return REDUCE


def slots(p: Payload) -> int:
    """Slots a sparse payload occupies on the wire (its capacity, never below its count)."""
    return max(p.capacity, p.count)


def index_bytes(universe: int, slots: int, idt: torch.dtype) -> int:
    """Bytes of a segment's coded index part (before padding)."""
    return layout(universe, slots, idt.itemsize)[1]


def value_part_bytes(slots: int, value_bytes: int, bits: int = 0) -> int:
    """Bytes of a segment's value part before padding: ``slots`` values, or below 16 bits their codes and block
    scales (:func:`gradsift.payload.lowbits.part_bytes`)."""
    return lowbits.part_bytes(slots, bits) if bits else slots * value_bytes


def segment_bytes(universe: int, slots: int, idt: torch.dtype, value_bytes: int, bits: int = 0) -> int:
    """Bytes of one ``[count | flag | indices | values]`` segment of ``slots`` slots, indices in ``[0, universe)``."""
    return HEADER_BYTES + pad(index_bytes(universe, slots, idt)) + pad(value_part_bytes(slots, value_bytes, bits))


def gather_segment_bytes(p: Payload) -> int:
    return segment_bytes(p.numel, slots(p), index_dtype_for(p.numel), p.value_bytes, p.value_bits)


def reduce_dtype(p: Payload, route: str) -> torch.dtype:
    return accumulate_dtype(p.grad_dtype) if route == DENSIFY else p.values.dtype


def reduce_segment_elems(p: Payload, route: str) -> int:
    """Elements of an all-reduce segment: the values (all of the tensor when densified) and the flag."""
    return (p.numel if route == DENSIFY else p.count) + 1


def segment_wire_bytes(p: Payload, route: str, world_size: int) -> float:
    """``wire_bytes_per_worker`` of one payload's segment."""
    if route == GATHER:
        return allgather_wire_bytes(gather_segment_bytes(p), world_size)
    if route == SCATTER:
        return allgather_wire_bytes(scatter_block_bytes(p) + owner_segment_bytes(p), world_size)
    if route == SHARD:
        return allgather_wire_bytes(shard_block_bytes(p), world_size)
    return allreduce_wire_bytes(reduce_segment_elems(p, route) * reduce_dtype(p, route).itemsize, world_size)


def scatter_block_bytes(p: Payload) -> int:
    """One destination's block of a scattered payload in the all-to-all."""
    return segment_bytes(p.owners.region, p.owners.dest_slots(p.capacity), POSITION_DTYPE, p.value_bytes)


def shard_block_bytes(p: Payload) -> int:
    """One destination's block of a payload in the sharded exchange: the scatter route's block for a sparse
    payload; for a dense one, that destination's shard of the values and one flag element."""
    if p.kind == SPARSE:
        return scatter_block_bytes(p)
    return (p.owners.region + 1) * p.values.element_size()


def owner_segment_bytes(p: Payload) -> int:
    """One owner's selection of a scattered payload in the all-gather."""
    return segment_bytes(p.owners.region, p.owners.own_slots(p.target), POSITION_DTYPE, p.value_bytes)


def partition_for(key: str, numel: int, world_size: int, seed: int, keep: float = 1.0) -> Partition:
    """The scatter route's partition of tensor ``key`` (the same on every rank: it follows from the seed); the
    owners keep ``keep`` times k of the sum."""
    h = derive_seed("partition", seed, key, numel)
    mult = 1 + (h % max(numel - 1, 1))
    while math.gcd(mult, numel) != 1:
        mult += 1
    shift = (h >> 32) % numel
    return Partition(key, numel, world_size, mult, shift, pow(mult, -1, numel) if numel > 1 else 0, keep)


def partition_sharded(key: str, numel: int, world_size: int) -> Partition:
    """Contiguous regions of ``numel / world_size`` entries, region j owned by rank j: FSDP's shards (its
    reduce-scatter input is ``world_size`` rows, row j rank j's padded shard)."""
    if numel % world_size:
        raise ValueError(f"a sharded tensor splits into equal shards: {numel} entries over {world_size} ranks")
    return Partition(key, numel, world_size, 1, 0, 1, 1.0)


def group_bytes(payloads: Sequence[Payload], routes: Sequence[str]) -> tuple[int, int, int, int]:
    """(all-reduce bytes, all-gather bytes per rank, all-to-all bytes per destination, owner all-gather bytes per
    rank) of one group."""
    reduce = sum(reduce_segment_elems(p, r) * reduce_dtype(p, r).itemsize for p, r in zip(payloads, routes)
                 if r not in (GATHER, SCATTER, SHARD))
    gather = sum(gather_segment_bytes(p) for p, r in zip(payloads, routes) if r == GATHER)
    blocks = sum(scatter_block_bytes(p) for p, r in zip(payloads, routes) if r == SCATTER) + sum(
        shard_block_bytes(p) for p, r in zip(payloads, routes) if r == SHARD)
    owned = sum(owner_segment_bytes(p) for p, r in zip(payloads, routes) if r == SCATTER)
    return reduce, gather, blocks, owned


# ------------------------------------------------------------------ segments
def checksum(body: torch.Tensor, count: int, flag: int) -> int:
    """A segment's checksum: its bytes after the header (a multiple of 8) as int32 words, each times its position
    (1, 2, ...), summed in int64 (wrapping), with the header's count and flag folded in: catches a changed, swapped
    or shifted word, a changed count or flag. One read of the payload."""
    words = body.view(torch.int32).long()
    total = int((words * torch.arange(1, words.numel() + 1, device=body.device)).sum()) if words.numel() else 0
    return (total + count * 1_000_003 + flag * 7 + 2**63) % 2**64 - 2**63


def put_segment(buf: torch.Tensor, off: int, head: tuple[int, int], idx: torch.Tensor, vals: torch.Tensor, slots: int,
         idt: torch.dtype, universe: int, bits: int = 0) -> int:
    """Write one ``[count | flag | checksum | indices | values]`` segment of ``slots`` slots at ``off`` (indices in
    ``[0, universe)``, coded: sorted, the values reordered with them; ``bits``: values below 16 bits, already on
    their levels and in index order, coded by :func:`gradsift.payload.lowbits.encode`); the next offset."""
    c = vals.numel()
    start = off
    buf[off:off + 8].view(torch.int32).copy_(torch.tensor(head, dtype=torch.int32))
    off += HEADER_BYTES
    code, nb = layout(universe, slots, idt.itemsize)
    if c and code == RAW:
        buf[off:off + c * idt.itemsize].view(idt).copy_(idx)
    elif c:
        idx = idx.long()
        if c > 1 and not bool((idx[1:] > idx[:-1]).all()):  # (DGC's, GaussianK's, REGTOP-k's come sorted)
            idx, order = torch.sort(idx)
            vals = vals.index_select(0, order)
        encode(buf[off:off + nb], code, idx, universe, slots)
    off += pad(nb)
    if bits:
        part = lowbits.encode(vals, [c], [slots], bits)[0]
        buf[off:off + part.numel()].copy_(part)
    elif c:
        buf[off:off + c * vals.element_size()].view(vals.dtype).copy_(vals)
    end = off + pad(value_part_bytes(slots, vals.element_size(), bits))
    buf[start + 8:start + 16].view(torch.int64).fill_(checksum(buf[start + HEADER_BYTES:end], *head))
    return end


def get_segment(buf: torch.Tensor, off: int, slots: int, idt: torch.dtype, vdt: torch.dtype, universe: int,
         sender: int, word: bool = False, bits: int = 0):
    """Read the segment at ``off`` written by rank ``sender``: (count, flag word, indices, values, next offset).
    ``word``: the flag word is more than a 0/1 flag (a block's ``2 * count + flag``, an owner's report). A segment
    that does not decode, or whose checksum differs, is :class:`CorruptPayload`, naming the sender, before anything
    reaches a sum."""
    count, flag = buf[off:off + 8].view(torch.int32).tolist()
    sent_sum = int(buf[off + 8:off + 16].view(torch.int64))
    start = off
    off += HEADER_BYTES
    code, nb = layout(universe, slots, idt.itemsize)
    end = off + pad(nb) + pad(value_part_bytes(slots, vdt.itemsize, bits))
    try:
        if not 0 <= count <= slots or flag < 0 or (not word and flag > 1):
            raise CorruptPayload(f"a header of count {count} and flag {flag} in a segment of {slots} slots")
        if checksum(buf[start + HEADER_BYTES:end], count, flag) != sent_sum:
            raise CorruptPayload("its checksum does not match")
        if code == RAW:
            idx = buf[off:off + count * idt.itemsize].view(idt).long()
            check_raw(idx, universe)
        else:
            idx = decode(buf[off:off + nb], code, count, universe, slots)
    except CorruptPayload as e:
        raise CorruptPayload(f"rank {sender} sent a sparse payload that does not decode ({code} indices of "
                             f"{universe} positions): {e}; nothing of it was summed") from None
    off += pad(nb)
    if bits:
        vals = lowbits.decode(buf, [off], [count], [slots], bits)[0]
    else:
        vals = buf[off:off + count * vdt.itemsize].view(vdt)
    return count, flag, idx, vals, end


# ------------------------------------------------------------------ the scatter route's two stages
def pack_blocks(payloads: Sequence[Payload], splits: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                flag: int, device) -> torch.Tensor:
    """This rank's all-to-all buffer, one equal block per destination (row j goes to owner j): for every scattered
    payload, the (positions, values) in j's region. The header's second word carries the flag and this rank's
    count for the whole tensor (``2 * count + flag``), so every owner learns every rank's count and flag."""
    n = payloads[0].owners.world_size
    block = sum(scatter_block_bytes(p) for p in payloads)
    buf = torch.zeros((n, max(block, ALIGN)), dtype=torch.uint8, device=device)
    for j in range(n):
        off = 0
        for p, split in zip(payloads, splits):
            pos, vals = split[j]
            off = put_segment(buf[j], off, (vals.numel(), 2 * p.count + flag), pos, vals, p.owners.dest_slots(p.capacity),
                       POSITION_DTYPE, p.owners.region)
    return buf


def unpack_block(row: torch.Tensor, payloads: Sequence[Payload],
                 sender: int = 0) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Rank ``sender``'s block to this owner: ``[(its count for the tensor, its flag, positions, values), ...]``."""
    out, off = [], 0
    for p in payloads:
        _, word, pos, vals, off = get_segment(row, off, p.owners.dest_slots(p.capacity), POSITION_DTYPE, p.values.dtype,
                                       p.owners.region, sender, word=True)
        out.append((word >> 1, word & 1, pos, vals))
    return out


def pack_owned(payloads: Sequence[Payload], kept: Sequence[tuple[torch.Tensor, torch.Tensor]], flag: int,
               device) -> torch.Tensor:
    """This owner's all-gather buffer: what it kept of each scattered payload's region."""
    buf = torch.zeros(max(sum(owner_segment_bytes(p) for p in payloads), ALIGN), dtype=torch.uint8, device=device)
    off = 0
    for p, (pos, vals) in zip(payloads, kept):
        off = put_segment(buf, off, (vals.numel(), flag), pos.to(POSITION_DTYPE), vals, p.owners.own_slots(p.target),
                   POSITION_DTYPE, p.owners.region)
    return buf


def unpack_owned(row: torch.Tensor, payloads: Sequence[Payload],
                 owner: int = 0) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Owner ``owner``'s selections: ``[(flag, positions, values), ...]``; a flag from 2 up is the owner's report
    of a block it could not decode (:func:`corrupt_report`)."""
    out, off = [], 0
    for p in payloads:
        _, flag, pos, vals, off = get_segment(row, off, p.owners.own_slots(p.target), POSITION_DTYPE, p.values.dtype,
                                       p.owners.region, owner, word=True)
        out.append((flag, pos, vals))
    return out


def corrupt_report(sender: int) -> int:
    """The flag an owner sends every rank when rank ``sender``'s block to it did not decode."""
    return 2 + 4 * sender


def check_report(flag: int, owner: int) -> None:
    """Raise on every rank what owner ``owner`` found (:func:`corrupt_report`); nothing for a 0/1 flag."""
    if flag >= 2:
        raise CorruptPayload(f"rank {flag >> 2} sent owner rank {owner} a sparse payload that does not decode; "
                             "nothing of it was summed")
