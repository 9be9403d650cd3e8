"""Moments at magnitude levels, gathered in the scan that accumulates a tensor (SIDCo's fits,
:mod:`gradsift.compressors.sidco`; the compiled form is ``moments64`` in ``select.c``)."""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

INF_BITS = 0x7F800000  # the magnitude bits of Inf: entries at or above them are not finite


_PACK_F, _UNPACK_I = struct.Struct("<f").pack, struct.Struct("<I").unpack
_PACK_I, _UNPACK_F = struct.Struct("<I").pack, struct.Struct("<f").unpack


def _bits(v: float) -> int:
    """The float32 bit pattern of the magnitude ``v`` (a floor to compare magnitude bits against)."""
    return _UNPACK_I(_PACK_F(min(abs(v), 3.4028234663852886e38)))[0]


def _magnitude(bits: int) -> float:
    return _UNPACK_F(_PACK_I(bits & 0x7FFFFFFF))[0]


class Levels(NamedTuple):
    """Moments the scan gathers at magnitude levels (SIDCo's fits): for every level, over the entries with
    ``|x| > level``, the count and the integer sums of ``q1 = rint(|x| scale)`` and, with ``squares``, of
    ``q2 = rint((|x| scale)^2 2^-20)`` (float32 products, ties to even). Integer sums are the same in any order, on
    both backends. ``scale`` is a power of two that keeps ``q1 <= 2^20`` (:meth:`fits` tells afterwards); at most
    ``MAX_LEVELS`` levels."""

    levels: tuple[float, ...]
    scale: float
    squares: bool

    def fits(self, top: int) -> bool:
        """Whether the largest magnitude's bits ``top`` kept every ``q1`` within 2^20 (else the sums are void)."""
        return top < INF_BITS and _magnitude(top) * self.scale <= 2.0 ** 20

    @staticmethod
    def scale_for(top: float) -> float:
        """The power of two that puts ``top`` at 2^18 (room for it to grow fourfold)."""
        e = math.floor(math.log2(2.0 ** 18 / top)) if top > 0 else 127
        return 2.0 ** min(max(e, -126), 127)


MAX_LEVELS = 8


def moments_eager(x: torch.Tensor, bits: torch.Tensor, levels: Levels) -> list:
    """The compiled scan's moments at levels (:class:`Levels`) in torch operations: the same integers."""
    b = x.abs() * levels.scale
    q1 = torch.round(b).to(torch.int64)
    q2 = torch.round((b * b) * 2.0 ** -20).to(torch.int64) if levels.squares else None
    out = []
    for v in levels.levels:
        on = bits >= max(_bits(v) + 1, 1)
        out.append((int(on.sum()), int(q1[on].sum()), int(q2[on].sum()) if q2 is not None else 0))
    return out


SD_PATH = 32  # select.c's sd_in_scan: the path's room
SD_HEAD = 9  # its out row: threshold, stages, path length, selected, learned, grow, slack, floor, largest; the path
