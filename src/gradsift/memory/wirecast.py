"""The wire's cast of what a memory sent: the values narrowed to the wire dtype (``Compressor.wire``), what the
cast rounds off put back into the memory, so that what the receivers decode is exactly what left it."""

from __future__ import annotations

import torch

from ..payload import lowbits
from .. import payload as P
from ..compressors.base import Compressor
from ..kernels.scatter import add_at_many, cast_bf16_many, keep_largest_many


def cast_for_wire(compressor: Compressor, memory: torch.Tensor, sent: P.Payload) -> None:
    """``sent``'s values, selected from ``memory`` and already taken out of it, cast to the wire dtype
    (:meth:`Compressor.wire`), what the cast rounds off put back into ``memory``: what the receivers decode is
    exactly what left."""
    wire = compressor.wire(sent.values, sparse=sent.kind == P.SPARSE)
    if wire.dtype != sent.values.dtype and sent.count:
        memory.index_add_(0, sent.indices, sent.values - wire.to(sent.values.dtype))
    sent.values = wire


def cast_many_for_wire(compressor: Compressor, memories: list[torch.Tensor], sents: list[P.Payload]) -> None:
    """:func:`cast_for_wire` for a group's sparse payloads of float32 values: one cast over all their values (the
    same elementwise operations, so the same bits), what it rounds off put back into the memories (one compiled
    sweep over all of them, else one ``index_add_`` each: the same bits) -- a constant number of operations for the
    cast, not seven per tensor. Payloads whose values are already in the wire dtype (a kernel took the cast:
    ``select_many_into``'s ``wire``) are left as they are."""
    wire_dt = compressor.sparse_wire_dtype()
    if wire_dt is not None and any(s.values.dtype == wire_dt for s in sents):
        todo = [(m, s) for m, s in zip(memories, sents) if s.values.dtype != wire_dt]
        memories, sents = [m for m, _ in todo], [s for _, s in todo]
    if not sents:
        return
    if len(sents) < 2 or any(s.kind != P.SPARSE or s.values.dtype != torch.float32 for s in sents):
        for m, s in zip(memories, sents):
            cast_for_wire(compressor, m, s)
        return
    if wire_dt == torch.bfloat16:  # (one compiled call for the group, where it applies: the same bits)
        got = cast_bf16_many(memories, [s.indices for s in sents], [s.values for s in sents])
        if got is not None:
            for s, w in zip(sents, got):
                s.values = w
            return
    values = torch.cat([s.values for s in sents])
    wire = compressor.wire(values, sparse=True)
    if wire.dtype == values.dtype:
        return
    lost = values - wire.to(values.dtype)
    sizes = [s.values.numel() for s in sents]
    parts = lost.split(sizes)
    if not add_at_many(memories, [s.indices for s in sents], parts):  # (one compiled sweep for the group)
        for m, s, part in zip(memories, sents, parts):
            if s.count:
                m.index_add_(0, s.indices, part)
    for s, w in zip(sents, wire.split(sizes)):
        s.values = w


def cut_to_capacity(compressor: Compressor, memories: list[torch.Tensor], sents: list[P.Payload]) -> None:
    """A group's sparse payloads that selected more than their wire capacity (``Compressor.capacity_for``; a
    threshold method's count) cut to it in one compiled call where it applies, what they drop added back into
    their memories: :func:`gradsift.payload.fit_capacity`'s result, ``overflow`` counted. Payloads it leaves (within
    capacity, split among owners, on a GPU) are fitted where they are settled."""
    over = []
    for m, s in zip(memories, sents):
        if s.kind == P.SPARSE and s.owners is None:
            s.capacity = compressor.capacity_for(s.target, s.numel)
            if s.count > s.capacity:
                over.append((m, s))
    if not over:
        return
    cut = keep_largest_many([s.values for _, s in over], [s.indices for _, s in over], [s.capacity for _, s in over],
                            [m for m, _ in over])
    for (_, s), done in zip(over, cut):
        if done:  # (else fit_capacity cuts it where it is settled)
            s.overflow = s.count - s.capacity
            s.values, s.indices = s.values[:s.capacity], s.indices[:s.capacity]


def cast_below_16_bits(memory, keys: list[str], sents: list[P.Payload]) -> None:
    """``value_dtype=int4``/``int2``: a group's sparse payloads, as the memory handed them over (float values,
    already taken out of it), put in index order and rounded to their blocks' levels (:mod:`gradsift.payload.lowbits`),
    what the rounding drops put back into the memory's store of what is unsent (one compiled sweep for the group):
    what the receivers decode is exactly what left. A constant number of operations for the group."""
    bits = memory.inner.value_bits
    chosen = [(k, p) for k, p in zip(keys, sents) if p.kind == P.SPARSE]
    if not chosen:
        return
    ks, ps = zip(*chosen)
    idxs, vals = lowbits.sort_by_index([p.indices for p in ps], [p.values.float() for p in ps])
    counts = [p.count for p in ps]
    flat = torch.cat(vals)
    wire = lowbits.round_values(flat, counts, bits)
    store = getattr(memory, memory.UNSENT)
    back = [j for j, (k, p) in enumerate(zip(ks, ps)) if not p.nonfinite and p.count and k in store]
    lost = (flat - wire).split(counts)
    mems, at, parts = [store[ks[j]] for j in back], [idxs[j] for j in back], [lost[j] for j in back]
    if back and not add_at_many(mems, at, parts):
        for m, i, part in zip(mems, at, parts):
            m.index_add_(0, i, part.to(m.dtype))
    for p, i, w in zip(ps, idxs, wire.split(counts)):
        p.indices, p.values, p.value_bits = i, w, bits
