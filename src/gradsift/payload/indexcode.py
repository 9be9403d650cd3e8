"""Sparse indices in fewer bytes: a fixed-size code per wire segment.

A sparse segment has a fixed number of ``slots`` (the collectives need equal
buffers on every rank, with no size exchange), holding up to ``slots``
distinct indices in ``[0, universe)`` -- a tensor's flat positions, or the
positions inside an owner's region on the scatter route. Three codes, each of
a size fixed by ``(universe, slots)`` alone, so every rank computes the same
layout; the smallest is used:

``raw``         int32 per slot (int64 from 2**31): ``4 * slots`` bytes.
``bitmap``      one bit per position: ``ceil(universe / 8)`` bytes; wins above
                about a quarter of the positions.
``elias-fano``  the sorted indices split into ``L = floor(log2(universe /
                slots))`` low bits, stored as they are (whole bytes as
                byte planes, the rest packed eight entries to an int64's
                bytes: little-endian, as every platform PyTorch ships for),
                and the high part
                ``i >> L`` stored in unary: bit ``(i_j >> L) + j`` set for the
                j-th index. At most ``slots * (log2(universe / slots) + 2)``
                bits, whatever the indices: about 1.1 bytes an entry at
                density 1%, 1.5 at 0.1%
                (Elias 1974, Fano 1971; the code search engines use for posting
                lists).

Varint deltas, the usual alternative, have a size that depends on the
indices, so a fixed buffer must hold their worst case (1.95 bytes an entry at
1%) or drop what overflows. Elias-Fano's bound is its size: 1.1 bytes an entry
at 1%, never more.

Coded indices travel sorted (the values are reordered with them). Decoding
checks what a corrupt stream could break -- the count, the number of set bits,
strictly increasing indices inside the universe -- and raises
:class:`CorruptPayload` instead of putting anything into the sum.
"""

from __future__ import annotations

import functools
import math

import torch


RAW, BITMAP, ELIAS_FANO = "raw", "bitmap", "elias-fano"


class CorruptPayload(RuntimeError):
    """A received sparse payload that does not decode (a bad code stream, an index out of range)."""


def low_bits(universe: int, slots: int) -> int:
    """Elias-Fano's ``L``: the low bits stored as they are."""
    return max(0, int(math.floor(math.log2(universe / slots)))) if universe > slots else 0


def upper_bits(universe: int, slots: int, low: int) -> int:
    """Length of the unary high part: the largest set bit is ``((universe - 1) >> L) + slots - 1``."""
    return ((max(universe, 1) - 1) >> low) + slots


def low_bytes(slots: int, low: int) -> int:
    """Bytes of the low part: ``low // 8`` whole byte planes of ``slots`` bytes, then the remaining ``low % 8`` bits
    of each entry as one bit stream (eight entries to ``low % 8`` bytes)."""
    return (low // 8) * slots + -(-slots * (low % 8) // 8)


def code_bytes(code: str, universe: int, slots: int, itemsize: int) -> int:
    """Bytes of ``slots`` indices in ``[0, universe)`` under ``code`` (raw indices are ``itemsize`` bytes)."""
    if code == RAW:
        return slots * itemsize
    if code == BITMAP:
        return -(-universe // 8)
    low = low_bits(universe, slots)
    return low_bytes(slots, low) + -(-upper_bits(universe, slots, low) // 8)


@functools.lru_cache(maxsize=4096)  # (a pure function of three integers, asked for per segment per step)
def layout(universe: int, slots: int, itemsize: int) -> tuple[str, int]:
    """(code, bytes): the smallest code for a segment of ``slots`` indices in ``[0, universe)`` (ties: raw, then
    the bitmap)."""
    if slots <= 0:
        return RAW, 0
    size, _, code = min((code_bytes(c, universe, slots, itemsize), i, c) for i, c in enumerate((RAW, BITMAP, ELIAS_FANO)))
    return code, size


_SHIFTS: dict[tuple[str, int], torch.Tensor] = {}


def _shifts(n: int, device) -> torch.Tensor:
    key = (str(device), n)
    t = _SHIFTS.get(key)
    if t is None:
        t = _SHIFTS[key] = torch.arange(n, dtype=torch.int64, device=device)
    return t


def _set_bits(out: torch.Tensor, positions: torch.Tensor) -> None:
    """Set bit ``p`` (little-endian within each byte) of the uint8 ``out`` for each distinct ``p``."""
    if positions.numel() == 0:
        return
    acc = torch.zeros(out.numel(), dtype=torch.int32, device=out.device)
    acc.index_add_(0, positions >> 3, (torch.ones_like(positions) << (positions & 7)).to(torch.int32))
    out.copy_(acc.to(torch.uint8))


def _bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """The first ``nbits`` bits of the uint8 ``data``, as int64 0/1."""
    return ((data.long().unsqueeze(1) >> _shifts(8, data.device)) & 1).reshape(-1)[:nbits]


def _pack_low(out: torch.Tensor, low: torch.Tensor, bits: int, slots: int) -> None:
    """Write ``low`` (int64, each under ``2**bits``) into ``out`` (:func:`low_bytes` long): whole byte planes, then
    the remaining bits of eight entries at a time in one int64 (little-endian bytes), so a few passes over the
    entries whatever ``bits`` is."""
    c, off = low.numel(), 0
    for plane in range(bits // 8):
        out[off:off + c].copy_(((low >> (8 * plane)) & 255).to(torch.uint8))
        off += slots
    rest = bits % 8
    if rest and c:
        top = low >> (bits - rest)
        m = -(-c // 8)
        groups = torch.zeros(m * 8, dtype=torch.int64, device=low.device)
        groups[:c] = top
        words = (groups.view(m, 8) << (_shifts(8, low.device) * rest)).sum(1)
        used = -(-c * rest // 8)  # (the last group's bytes past its entries are zeros: dropped)
        out[off:off + used].copy_(words.view(torch.uint8).view(m, 8)[:, :rest].reshape(-1)[:used])


def _unpack_low(data: torch.Tensor, count: int, bits: int, slots: int) -> torch.Tensor:
    """The first ``count`` values :func:`_pack_low` wrote."""
    low = torch.zeros(count, dtype=torch.int64, device=data.device)
    off = 0
    for plane in range(bits // 8):
        low |= data[off:off + count].long() << (8 * plane)
        off += slots
    rest = bits % 8
    if rest and count:
        m = -(-count // 8)
        stream = torch.zeros(m * rest, dtype=torch.uint8, device=data.device)
        used = -(-count * rest // 8)
        stream[:used] = data[off:off + used]
        words = torch.zeros(m, 8, dtype=torch.uint8, device=data.device)
        words[:, :rest] = stream.view(m, rest)
        top = (words.view(torch.int64) >> (_shifts(8, data.device) * rest)) & ((1 << rest) - 1)
        low |= top.reshape(-1)[:count] << (bits - rest)
    return low


def encode(out: torch.Tensor, code: str, indices: torch.Tensor, universe: int, slots: int) -> None:
    """Write the sorted, distinct ``indices`` (int64) into the zeroed uint8 ``out`` (the segment's index part)."""
    c = indices.numel()
    if c == 0 or code == RAW:
        return  # raw indices are written by the caller, in the wire's index dtype
    if code == BITMAP:
        _set_bits(out, indices)
        return
    low = low_bits(universe, slots)
    lo = low_bytes(slots, low)
    _pack_low(out[:lo], indices & ((1 << low) - 1), low, slots)
    _set_bits(out[lo:], (indices >> low) + torch.arange(c, device=indices.device))


def decode(data: torch.Tensor, code: str, count: int, universe: int, slots: int) -> torch.Tensor:
    """The ``count`` indices (int64, increasing) coded in the uint8 ``data``; :class:`CorruptPayload` (without the
    sender, which the caller adds) when the stream does not hold exactly that."""
    if code == BITMAP:
        bits = _bits(data, data.numel() * 8)
        idx = bits.nonzero().squeeze(1)
        if idx.numel() != count or (count and int(idx[-1]) >= universe):
            raise CorruptPayload(f"a bitmap of {idx.numel()} set positions where the header says {count} in "
                                 f"[0, {universe})")
        return idx
    low = low_bits(universe, slots)
    lo = low_bytes(slots, low)
    pos = _bits(data[lo:], upper_bits(universe, slots, low)).nonzero().squeeze(1)
    if pos.numel() != count:
        raise CorruptPayload(f"an Elias-Fano stream of {pos.numel()} entries where the header says {count}")
    if count == 0:
        return pos
    idx = ((pos - torch.arange(count, device=pos.device)) << low) | _unpack_low(data[:lo], count, low, slots)
    if int(idx[-1]) >= universe or (count > 1 and not bool((idx[1:] > idx[:-1]).all())):
        raise CorruptPayload(f"an Elias-Fano stream decoding to indices that do not increase within [0, {universe})")
    return idx


def check_raw(idx: torch.Tensor, universe: int) -> None:
    """Raw indices on receipt: inside ``[0, universe)``."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= universe):
        raise CorruptPayload(f"an index out of range: [{int(idx.min())}, {int(idx.max())}] outside [0, {universe})")
