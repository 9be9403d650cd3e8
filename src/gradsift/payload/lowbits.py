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

import itertools
from typing import Sequence

import torch

from . import LOWBITS_BLOCK as BLOCK


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


def _spread(counts: Sequence[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``sum(counts)`` items laid out payload after payload: each item's payload and its place within it."""
    firsts = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                  torch.tensor(list(counts), dtype=torch.int64, device=device))
    return seg, torch.arange(sum(counts), device=device) - firsts[seg]


def _block_ids(counts: Sequence[int], device) -> tuple[torch.Tensor, int]:
    """Each value's block (blocks numbered across the payloads, none straddling two), and the number of blocks."""
    nb = [blocks(c) for c in counts]
    starts = torch.tensor([0, *itertools.accumulate(nb)][:-1], dtype=torch.int64, device=device)
    seg, pos = _spread(counts, device)
    return starts[seg] + pos // BLOCK, sum(nb)


def quantize(values: torch.Tensor, counts: Sequence[int], bits: int,
             ids: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64, scales float32) of float32 ``values`` (the payloads' values concatenated, ``counts`` each):
    the nearest level in each block's scale. A block of zeros has scale 0 and the code of level ``+1/(L-1)``.
    ``ids``: :func:`_block_ids` of ``counts``, where the caller has them."""
    ids, nb = ids or _block_ids(counts, values.device)
    scales = torch.zeros(nb, dtype=torch.float32, device=values.device).scatter_reduce_(0, ids, values.abs(), "amax")
    s = scales[ids]
    n = 2**bits - 1
    t = torch.where(s > 0, values / torch.where(s > 0, s, 1.0), 0.0)
    codes = torch.round((t + 1) * (n / 2)).clamp_(0, n).to(torch.int64)
    codes = torch.where(s > 0, codes, (n + 1) // 2)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, counts: Sequence[int], bits: int,
               ids: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``s * LEVEL[c]`` for every value: what the receivers sum (float32)."""
    ids, _ = ids or _block_ids(counts, codes.device)
    return scales[ids] * levels(bits, codes.device)[codes]


def round_values(values: torch.Tensor, counts: Sequence[int], bits: int) -> torch.Tensor:
    """``values`` as they arrive: each rounded to its block's nearest level (float32)."""
    ids = _block_ids(counts, values.device)
    codes, scales = quantize(values.float(), counts, bits, ids)
    return dequantize(codes, scales, counts, bits, ids)


def _scale_bytes(starts: Sequence[int], counts: Sequence[int], slots: Sequence[int], bits: int, device):
    """The byte positions of every block's float32 scale, for value parts at byte offsets ``starts``."""
    nb = [blocks(c) for c in counts]
    first = torch.tensor([s + (code_bytes(n, bits) + 3) // 4 * 4 for s, n in zip(starts, slots)], dtype=torch.int64,
                         device=device)
    bseg, bpos = _spread(nb, device)
    return ((first[bseg] + 4 * bpos)[:, None] + torch.arange(4, device=device)).reshape(-1)


def encode(values: torch.Tensor, counts: Sequence[int], slots: Sequence[int], bits: int) -> list[torch.Tensor]:
    """Each payload's value part (uint8, :func:`part_bytes` of its slots) for values already on their levels
    (:func:`round_values`'s output): the codes and scales found again, packed."""
    codes, scales = quantize(values.float(), counts, bits)
    dev = values.device
    per = 8 // bits
    sizes = [part_bytes(n, bits) for n in slots]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    out = torch.zeros(max(sum(sizes), 1), dtype=torch.uint8, device=dev)
    if codes.numel():
        seg, pos = _spread(counts, dev)
        base = torch.tensor(starts, dtype=torch.int64, device=dev)
        packed = torch.zeros(out.numel(), dtype=torch.int64, device=dev)
        packed.index_add_(0, base[seg] + pos // per, codes << (bits * (pos % per)))  # disjoint bits: an or
        out.copy_(packed.to(torch.uint8))
        out[_scale_bytes(starts, counts, slots, bits, dev)] = scales.view(torch.uint8)
    return list(out[:sum(sizes)].split(sizes))


def decode(buf: torch.Tensor, starts: Sequence[int], counts: Sequence[int], slots: Sequence[int],
           bits: int) -> list[torch.Tensor]:
    """The float32 values of the value parts at byte offsets ``starts`` of ``buf`` (uint8), ``counts`` values in
    parts of ``slots`` slots each: one gather of the codes' bytes and one of the scales' for all of them."""
    dev = buf.device
    if sum(counts) == 0:
        return [torch.zeros(0, dtype=torch.float32, device=dev) for _ in counts]
    per = 8 // bits
    seg, pos = _spread(counts, dev)
    byte = buf[torch.tensor(list(starts), dtype=torch.int64, device=dev)[seg] + pos // per].to(torch.int64)
    codes = (byte >> (bits * (pos % per))) & (2**bits - 1)
    scales = buf[_scale_bytes(starts, counts, slots, bits, dev)].contiguous().view(torch.float32)
    return list(dequantize(codes, scales, counts, bits).split(list(counts)))


def sort_by_index(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
    """Each payload's (indices, values) in increasing index order, the order they travel in: one sort for the group
    (payload number and index as one key), only where some payload is out of order."""
    counts = [i.numel() for i in indices]
    idx = torch.cat([i.long() for i in indices])
    seg, _ = _spread(counts, idx.device)
    if bool(((idx[1:] > idx[:-1]) | (seg[1:] != seg[:-1])).all()):
        return list(indices), list(values)
    span = int(idx.max()) + 1 if idx.numel() else 1
    order = torch.argsort(seg * span + idx)
    return list(idx[order].split(counts)), list(torch.cat(list(values))[order].split(counts))
