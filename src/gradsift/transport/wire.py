"""The wire format both transports follow, and the one rule that counts its bytes.

A group of payloads (a DDP bucket; one tensor in the simulator) travels in at
most one all-gather and one all-reduce per value dtype. Each payload takes a
*segment* in one of them, chosen by its route:

``gather``   a sparse payload: ``[count int32 | flag int32 | indices | values]``
             in this rank's all-gather buffer. Indices (int32, int64 from 2**31
             elements) and values each fill ``capacity`` slots, each part padded
             to 8 bytes. Every rank's buffer has the same size, fixed by the
             configuration, so no count exchange precedes the data.
``reduce``   a dense or shared-index payload: its values, then one flag
             element, in the all-reduce buffer of its value dtype.
``densify``  a sparse payload summed by all-reduce instead: the payload
             scattered into a dense tensor (accumulate dtype, at least fp32),
             then one flag element. Same mean as the all-gather, cheaper when
             the all-gather would move more (the road's wire plan decides).

The flag is 1 on a rank whose input was not finite; it reaches every rank
inside the data collectives, so every rank takes the same decision without a
collective of its own.

Wire bytes per worker are counted per segment -- ring all-gather ``(N-1) * size``,
ring all-reduce ``2(N-1)/N * size`` -- and summed. Headers, flags and padding
are part of the size. Because the count is per payload, it does not depend on
how payloads are grouped: the simulator (one tensor per group) and DDP (one
bucket per group) report the same wire bytes for the same run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..payload import SPARSE, Payload, accumulate_dtype, allgather_wire_bytes, allreduce_wire_bytes, index_dtype_for

GATHER = "gather"
REDUCE = "reduce"
DENSIFY = "densify"
ROUTES = (GATHER, REDUCE, DENSIFY)

HEADER_BYTES = 8  # int32 count, int32 flag
ALIGN = 8


def pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def route_of(p: Payload, densify: bool = False) -> str:
    if p.kind == SPARSE:
        return DENSIFY if densify else GATHER
    return REDUCE


def slots(p: Payload) -> int:
    """Slots a sparse payload occupies on the wire (its capacity, never below its count)."""
    return max(p.capacity, p.count)


def gather_segment_bytes(p: Payload) -> int:
    n = slots(p)
    return HEADER_BYTES + pad(n * index_dtype_for(p.numel).itemsize) + pad(n * p.value_bytes)


def reduce_dtype(p: Payload, route: str) -> torch.dtype:
    return accumulate_dtype(p.grad_dtype) if route == DENSIFY else p.values.dtype


def reduce_segment_elems(p: Payload, route: str) -> int:
    """Elements of an all-reduce segment: the values (all of the tensor when densified) and the flag."""
    return (p.numel if route == DENSIFY else p.count) + 1


def segment_wire_bytes(p: Payload, route: str, world_size: int) -> float:
    """``wire_bytes_per_worker`` of one payload's segment."""
    if route == GATHER:
        return allgather_wire_bytes(gather_segment_bytes(p), world_size)
    return allreduce_wire_bytes(reduce_segment_elems(p, route) * reduce_dtype(p, route).itemsize, world_size)


def group_bytes(payloads: Sequence[Payload], routes: Sequence[str]) -> tuple[int, int]:
    """(all-reduce bytes, all-gather bytes per rank) of one group."""
    reduce = sum(reduce_segment_elems(p, r) * reduce_dtype(p, r).itemsize for p, r in zip(payloads, routes)
                 if r != GATHER)
    gather = sum(gather_segment_bytes(p) for p, r in zip(payloads, routes) if r == GATHER)
    return reduce, gather


# ------------------------------------------------------------------ the all-gather buffer
def pack_gather(payloads: Sequence[Payload], flag: int, device) -> torch.Tensor:
    """This rank's all-gather buffer for the given sparse payloads (in group order)."""
    total = sum(gather_segment_bytes(p) for p in payloads)
    buf = torch.zeros(max(total, ALIGN), dtype=torch.uint8, device=device)
    off = 0
    for p in payloads:
        n, c = slots(p), p.count
        buf[off:off + HEADER_BYTES].view(torch.int32).copy_(torch.tensor([c, flag], dtype=torch.int32))
        off += HEADER_BYTES
        idt = index_dtype_for(p.numel)
        if c:
            buf[off:off + c * idt.itemsize].view(idt).copy_(p.indices)
        off += pad(n * idt.itemsize)
        if c:
            buf[off:off + c * p.value_bytes].view(p.values.dtype).copy_(p.values)
        off += pad(n * p.value_bytes)
    return buf


def unpack_gather(buf: torch.Tensor, payloads: Sequence[Payload]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Another rank's buffer, read with this rank's layout: ``[(count, flag, values, indices), ...]``."""
    out = []
    off = 0
    for p in payloads:
        n = slots(p)
        count, flag = buf[off:off + HEADER_BYTES].view(torch.int32).tolist()
        off += HEADER_BYTES
        idt = index_dtype_for(p.numel)
        count = max(0, min(count, n))
        idx = buf[off:off + count * idt.itemsize].view(idt).long()
        off += pad(n * idt.itemsize)
        vals = buf[off:off + count * p.value_bytes].view(p.values.dtype)
        off += pad(n * p.value_bytes)
        out.append((count, flag, vals, idx))
    return out
