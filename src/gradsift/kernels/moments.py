"""Moments at magnitude levels, gathered in the scan that accumulates a tensor (SIDCo's fits,
:mod:`gradsift.compressors.sidco`; the compiled form is ``moments64`` in ``select.c``)."""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

INF_BITS = 0x7F800000  # the magnitude bits of Inf: entries at or above them are not finite


def _bits(v: float) -> int:
    """The float32 bit pattern of the magnitude ``v`` (a floor to compare magnitude bits against)."""
    return struct.unpack("<I", struct.pack("<f", min(abs(v), 3.4028234663852886e38)))[0]


def _magnitude(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0x7FFFFFFF))[0]


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


SD_PATH = 32  # select.c's gs_sidco_many: the path's room


class SIDCoAsk(NamedTuple):
    """One tensor's threshold question for :func:`sidco_thresholds` (what a ``ScanStats`` holds, and the options)."""

    x: torch.Tensor  # the accumulated tensor (counts under the floor away from a level read it)
    cand: torch.Tensor | None  # the candidates' values (None: more than the cap reached the floor)
    cand_idx: torch.Tensor | None  # their positions
    cand_count: int
    floor: float
    top: float  # the largest magnitude
    levels: list  # (value, count, sum, sum of squares), ascending from 0
    k: int
    stages: int  # the stage count to start from
    max_stages: int
    options: dict


def sidco_thresholds(asks: list[SIDCoAsk], zero: bool) -> list[tuple[float, int, list[float], int]]:
    """``SIDCo.threshold`` of every tensor in one compiled call: (threshold, stage count taken, the stages'
    thresholds before the last, how many were selected) -- the same float64 operations as the Python reference, so
    the same numbers. Where the threshold lies at or above the floor, the selection -- the candidates above it, in
    index order -- is moved to the front of the candidates' arrays (``cand_idx[:count]``, ``cand[:count]``) and, with
    ``zero``, zeroed in ``x``; elsewhere the count is -1 and the caller selects."""
    from . import _state

    spec, dspec = [], []
    for a in asks:
        o = a.options
        spec.append([a.x.data_ptr(), a.x.numel(), a.cand.data_ptr() if a.cand is not None else 0,
                     a.cand.numel() if a.cand is not None else 0, int(a.cand is not None), a.cand_count,
                     len(a.levels), a.k, int(o["dist"] == "gp"), int(bool(o["adapt"])), int(bool(o["correct"])),
                     a.stages, a.max_stages, len(dspec),
                     a.cand_idx.data_ptr() if a.cand_idx is not None else 0, int(zero)])
        dspec += [a.floor, a.top, o["first_ratio"], o["eps_l"], o["eps_h"]]
        for row in a.levels:
            dspec += list(row)
    spec_t = torch.tensor(spec, dtype=torch.int64)
    dspec_t = torch.tensor(dspec, dtype=torch.float64)
    out = torch.empty(len(asks), 4 + SD_PATH, dtype=torch.float64)
    if _state["lib"].gs_sidco_many(spec_t.data_ptr(), len(asks), dspec_t.data_ptr(), out.data_ptr()) < 0:
        raise MemoryError("gradsift SIDCo kernel: out of memory for a tensor's statistics")
    res = []
    for row in out.tolist():
        n = int(row[2])
        res.append((row[0], int(row[1]), row[4:4 + n], int(row[3])))
    return res
