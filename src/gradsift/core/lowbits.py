"""Sparse values below 16 bits: ``value_dtype=int4`` and ``int2`` (ZeRO++'s 4-bit gradients, SparseLoCo's 2-bit
values).

A sparse payload's values, in the order they travel (sorted by index), fall into blocks of :data:`BLOCK` values;
each block has one float32 scale ``s``, the largest magnitude in it, and each value becomes a code ``c`` of
``bits`` bits standing for ``s * LEVEL[c]``, where the levels split ``[-1, 1]`` evenly into ``2**bits`` points
(int2: -1, -1/3, 1/3, 1; no zero level: the entries a sparsifier sends are its largest, none is zero). The code is
the nearest level (ties to even); the block's largest entry is exactly ``+-s``, so what the receivers decode,
``s * LEVEL[c]`` in float32, is what the sender computed, bit for bit, and the encoder can take the decoded values
themselves and find the same scales and codes again. What the rounding drops (the value minus its level) goes back
into the sender's memory, as bf16's rounding does: nothing is lost, only delayed.

A segment's value part: the codes packed low bits first (``8 / bits`` to a byte), padded to 4 bytes, then one
float32 scale per block of the segment's slots.

Every function works on a group's payloads at once (their values concatenated, ``counts`` per payload): a fixed
number of tensor operations, whatever the number of payloads.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .payload import LOWBITS_BLOCK as BLOCK, value_part


_LEVELS: dict = {}


def levels(bits: int, device=None) -> torch.Tensor:
    """The ``2**bits`` float32 levels, ``(2c - (L-1)) / (L-1)`` for ``c`` in ``0..L-1``."""
    key = (bits, str(device))
    if key not in _LEVELS:
        n = 2**bits - 1
        _LEVELS[key] = torch.tensor([(2 * c - n) / n for c in range(n + 1)], dtype=torch.float64).float().to(device)
    return _LEVELS[key]


def code_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def blocks(count: int) -> int:
    return -(-count // BLOCK)


def part_bytes(slots: int, bits: int) -> int:
    """Bytes of a segment's value part of ``slots`` slots: the codes padded to 4 bytes, then the scales."""
    return (code_bytes(slots, bits) + 3) // 4 * 4 + 4 * blocks(slots)


def sent_bytes(count: int, bits: int) -> int:
    """Bytes the values of ``count`` entries occupy (codes and scales, no padding): the payload-bytes count."""
    return value_part(count, 0, bits)


def _block_ids(counts: Sequence[int], device) -> tuple[torch.Tensor, int]:
    """Each value's block (blocks numbered across the payloads, none straddling two), and the number of blocks."""
    nb = [blocks(c) for c in counts]
    total = sum(counts)
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), 0
    starts = torch.tensor([sum(nb[:i]) for i in range(len(nb))], dtype=torch.int64, device=device)
    firsts = torch.tensor([sum(counts[:i]) for i in range(len(counts))], dtype=torch.int64, device=device)
    cs = torch.tensor(list(counts), dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(len(counts), device=device), cs)
    pos = torch.arange(total, device=device) - firsts[seg]
    return starts[seg] + pos // BLOCK, sum(nb)


def quantize(values: torch.Tensor, counts: Sequence[int], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64, scales float32) of float32 ``values`` (the payloads' values concatenated, ``counts`` each):
    the nearest level in each block's scale. A block of zeros has scale 0 and the code of level ``+1/(L-1)``."""
    ids, nb = _block_ids(counts, values.device)
    mags = values.abs()
    scales = torch.zeros(nb, dtype=torch.float32, device=values.device).scatter_reduce_(0, ids, mags, "amax")
    s = scales[ids]
    n = 2**bits - 1
    t = torch.where(s > 0, values / torch.where(s > 0, s, 1.0), 0.0)
    codes = torch.round((t + 1) * (n / 2)).clamp_(0, n).to(torch.int64)
    codes = torch.where(s > 0, codes, (n + 1) // 2)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, counts: Sequence[int], bits: int) -> torch.Tensor:
    """``s * LEVEL[c]`` for every value: what the receivers sum (float32)."""
    ids, _ = _block_ids(counts, codes.device)
    return scales[ids] * levels(bits, codes.device)[codes]


def round_values(values: torch.Tensor, counts: Sequence[int], bits: int) -> torch.Tensor:
    """``values`` as they arrive: each rounded to its block's nearest level (float32)."""
    codes, scales = quantize(values.float(), counts, bits)
    return dequantize(codes, scales, counts, bits)


def encode(values: torch.Tensor, counts: Sequence[int], slots: Sequence[int], bits: int) -> list[torch.Tensor]:
    """Each payload's value part (uint8, :func:`part_bytes` of its slots) for values already on their levels
    (:func:`round_values`'s output): the codes and scales found again, packed."""
    codes, scales = quantize(values.float(), counts, bits)
    dev = values.device
    per = 8 // bits
    sizes = [part_bytes(n, bits) for n in slots]
    out = torch.zeros(max(sum(sizes), 1), dtype=torch.uint8, device=dev)
    if codes.numel():
        base = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.int64, device=dev)
        firsts = torch.tensor([sum(counts[:i]) for i in range(len(counts))], dtype=torch.int64, device=dev)
        seg = torch.repeat_interleave(torch.arange(len(counts), device=dev),
                                      torch.tensor(list(counts), dtype=torch.int64, device=dev))
        pos = torch.arange(codes.numel(), device=dev) - firsts[seg]
        packed = torch.zeros(out.numel(), dtype=torch.int64, device=dev)
        packed.index_add_(0, base[seg] + pos // per, codes << (bits * (pos % per)))  # disjoint bits: an or
        out.copy_(packed.to(torch.uint8))
        sbase = torch.tensor([sum(sizes[:i]) + (code_bytes(n, bits) + 3) // 4 * 4 for i, n in enumerate(slots)],
                             dtype=torch.int64, device=dev)
        nb = [blocks(c) for c in counts]
        bseg = torch.repeat_interleave(torch.arange(len(counts), device=dev),
                                       torch.tensor(nb, dtype=torch.int64, device=dev))
        bfirst = torch.tensor([sum(nb[:i]) for i in range(len(nb))], dtype=torch.int64, device=dev)
        at = sbase[bseg] + 4 * (torch.arange(scales.numel(), device=dev) - bfirst[bseg])
        out[(at[:, None] + torch.arange(4, device=dev)).reshape(-1)] = scales.view(torch.uint8)
    return list(out[:sum(sizes)].split(sizes))


def decode(buf: torch.Tensor, starts: Sequence[int], counts: Sequence[int], slots: Sequence[int],
           bits: int) -> list[torch.Tensor]:
    """The float32 values of the value parts at byte offsets ``starts`` of ``buf`` (uint8), ``counts`` values in
    parts of ``slots`` slots each: one gather of the codes' bytes and one of the scales' for all of them."""
    dev = buf.device
    total = sum(counts)
    if total == 0:
        return [torch.zeros(0, dtype=torch.float32, device=dev) for _ in counts]
    per = 8 // bits
    st = torch.tensor(list(starts), dtype=torch.int64, device=dev)
    firsts = torch.tensor([sum(counts[:i]) for i in range(len(counts))], dtype=torch.int64, device=dev)
    seg = torch.repeat_interleave(torch.arange(len(counts), device=dev),
                                  torch.tensor(list(counts), dtype=torch.int64, device=dev))
    pos = torch.arange(total, device=dev) - firsts[seg]
    byte = buf[st[seg] + pos // per].to(torch.int64)
    codes = (byte >> (bits * (pos % per))) & (2**bits - 1)
    nb = [blocks(c) for c in counts]
    sst = torch.tensor([s + (code_bytes(n, bits) + 3) // 4 * 4 for s, n in zip(starts, slots)], dtype=torch.int64,
                       device=dev)
    bseg = torch.repeat_interleave(torch.arange(len(counts), device=dev),
                                   torch.tensor(nb, dtype=torch.int64, device=dev))
    bfirst = torch.tensor([sum(nb[:i]) for i in range(len(nb))], dtype=torch.int64, device=dev)
    at = sst[bseg] + 4 * (torch.arange(sum(nb), device=dev) - bfirst[bseg])
    scales = buf[(at[:, None] + torch.arange(4, device=dev)).reshape(-1)].contiguous().view(torch.float32)
    return list(dequantize(codes, scales, counts, bits).split(list(counts)))


def sort_by_index(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
    """Each payload's (indices, values) in increasing index order, the order they travel in: one sort for the group
    (payload number and index as one key), only where some payload is out of order."""
    counts = [i.numel() for i in indices]
    idx = torch.cat([i.long() for i in indices])
    seg = torch.repeat_interleave(torch.arange(len(counts), device=idx.device),
                                  torch.tensor(counts, dtype=torch.int64, device=idx.device))
    if bool(((idx[1:] > idx[:-1]) | (seg[1:] != seg[:-1])).all()):
        return list(indices), list(values)
    span = int(idx.max()) + 1 if idx.numel() else 1
    order = torch.argsort(seg * span + idx)
    return list(idx[order].split(counts)), list(torch.cat(list(values))[order].split(counts))
