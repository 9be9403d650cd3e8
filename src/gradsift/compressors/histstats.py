"""The statistics SIDCo's fits read (:mod:`gradsift.compressors.sidco`): count, sum, sum of squares and sum of logs
of the magnitudes above any threshold, from the histogram of their 16-bit keys (:mod:`gradsift.kernels`: 65,536
buckets of relative width 2^-7, each magnitude represented by its bucket's middle)."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..kernels import many

_CONSTANTS: dict = {}  # per-bucket constants, computed once


def _finite_values() -> np.ndarray:
    """The buckets' values below Inf's, as numpy (searched once per fit step)."""
    top = _CONSTANTS.get("top")
    if top is None:
        top = _CONSTANTS["top"] = kernels.bucket_values()[: (0x7F800000 >> kernels.SHIFT)].numpy()
    return top


def _bucket_table() -> tuple[np.ndarray, np.ndarray]:
    """Each bucket's value and its log (0 where the value is 0), as numpy, computed once."""
    table = _CONSTANTS.get("table")
    if table is None:
        v = kernels.bucket_values().numpy()
        table = _CONSTANTS["table"] = (v, np.log(np.where(v > 0, v, 1.0)))
    return table


def _suffix(t: np.ndarray) -> np.ndarray:
    """Sums of ``t[j:]`` for every j, and a final 0."""
    out = np.zeros(t.size + 1)
    out[:-1] = np.cumsum(t[::-1])[::-1]
    return out


class TailStats:
    """Count, sum, sum of squares and sum of logs of the magnitudes above any threshold, from one histogram of the
    bucket keys, given as the counts of its occupied span ``[lo, lo + len(counts))`` (a tensor's magnitudes cover a
    few thousand of the 65,536 buckets): the suffix sums are those over the whole histogram, the empty buckets adding
    zeros. :meth:`of_histogram` takes a full histogram, :meth:`of_tensor` counts a small tensor's keys directly."""

    def __init__(self, counts: np.ndarray, lo: int):
        full, logs = _bucket_table()
        v = full[lo:lo + counts.size]
        c = counts.astype(np.float64) * (v > 0)  # exact zeros (bucket 0) are not fitted
        self.values, self.lo, self.span = full, lo, counts.size
        self._top = _finite_values()
        self.n, self.s1 = _suffix(c), _suffix(c * v)
        self._c, self._v, self._s2, self._sl = c, v, None, None
        self.memo: dict = {}  # SIDCo's chains keep their stages here

    @property
    def s2(self) -> np.ndarray:
        """Suffix sums of the squares (generalized Pareto's variance), made when first asked."""
        if self._s2 is None:
            self._s2 = _suffix(self._c * self._v * self._v)
        return self._s2

    @property
    def sl(self) -> np.ndarray:
        """Suffix sums of the logs (the gamma fit's first stage), made when first asked."""
        if self._sl is None:
            self._sl = _suffix(self._c * _bucket_table()[1][self.lo:self.lo + self.span])
        return self._sl

    @classmethod
    def of_histogram(cls, counts: torch.Tensor) -> "TailStats":
        c = counts.numpy()
        occupied = np.flatnonzero(c)
        lo, hi = (int(occupied[0]), int(occupied[-1])) if occupied.size else (0, 0)
        return cls(c[lo:hi + 1], lo)

    @classmethod
    def of_tensor(cls, x: torch.Tensor) -> "TailStats":
        """The same statistics for a flat float32 CPU tensor, its keys counted with no 65,536-bucket histogram
        (a small tensor's whole cost would otherwise be setting that histogram up)."""
        keys = (x.numpy().view(np.uint32) & 0x7FFFFFFF) >> kernels.SHIFT
        if not keys.size:
            return cls(np.zeros(1, dtype=np.int64), 0)
        lo = int(keys.min())
        return cls(np.bincount(keys - lo), lo)

    def largest(self) -> float:
        """The value of the highest non-empty bucket: nothing lies above it (0.0 if every entry is zero)."""
        full = np.nonzero(self.n[:-1] > 0)[0]
        return float(self.values[self.lo + int(full[-1])]) if full.size else 0.0

    def _at(self, t: float) -> int:
        b = int(np.searchsorted(self._top, t, side="right")) if t > 0 else 1
        return min(max(b - self.lo, 0), self.span)

    def count(self, t: float, enough: float = float("inf")) -> float:
        """How many entries lie in buckets above ``t`` (``enough``: as :meth:`ScanStats.count`; every count is a
        lookup here)."""
        return float(self.n[self._at(t)])

    def above(self, t: float) -> tuple[float, float, float, float]:
        """(count, sum, sum of squares, sum of logs) of the entries whose bucket lies above ``t``."""
        j = self._at(t)
        return float(self.n[j]), float(self.s1[j]), float(self.s2[j]), float(self.sl[j])

    def stage(self, t: float, squares: bool = False) -> tuple[float, float, float, float]:
        """(location, count, sum, sum of squares) of the entries whose bucket lies above ``t``: a stage's fit from
        ``t`` itself (the squares, for the generalized Pareto fit, only with ``squares``; else 0)."""
        j = self._at(t)
        return t, float(self.n[j]), float(self.s1[j]), (float(self.s2[j]) if squares else 0.0)

    def points(self) -> list[tuple[float, float]]:
        """(threshold, count) pairs known without a count (none here: any count is cheap)."""
        return []

    exact_counts = True  # every count is a lookup


class ScanStats:
    """What SIDCo's fits read after the one pass that accumulates a tensor (:func:`gradsift.kernels.many.scan_many`):
    moments at a few magnitude levels gathered in the pass (:class:`gradsift.kernels.moments.Levels`: the non-zero
    entries, and a ladder under the floor), and above the floor the candidates the pass recorded (their keys counted
    as :meth:`TailStats.of_tensor` does). A stage's fit starts from ``t`` itself above the floor and from the highest
    level at or below ``t`` under it (:meth:`stage`); counts under the floor away from a level read the tensor."""

    exact_counts = False

    def __init__(self, x: torch.Tensor, levels: list, cand: TailStats | None, floor: float, cand_count: int,
                 top: float):
        self.levels = levels  # (value, count, sum, sum of squares), ascending from 0: level_rows
        self.x, self.cand, self.floor, self.cand_count, self.top = x, cand, floor, cand_count, top
        self.memo: dict = {}  # SIDCo's chains keep their stages here

    @staticmethod
    def level_rows(levels, moments: list) -> list[tuple[float, float, float, float]]:
        """(value, count, sum, sum of squares) per level, from the pass's integer sums."""
        sc = levels.scale
        return [(v, float(c), q1 / sc, q2 * 2.0 ** 20 / (sc * sc)) for v, (c, q1, q2) in zip(levels.levels, moments)]

    def _above_floor(self, t: float) -> bool:
        return self.cand is not None and t >= self.floor

    def stage(self, t: float, squares: bool = False) -> tuple[float, float, float, float]:
        """(location, count, sum, sum of squares) of the entries above the location: ``t`` at or above the floor,
        else the highest level at or below ``t`` (the level 0 always is)."""
        if self._above_floor(t):
            return self.cand.stage(t, True)
        for lv in reversed(self.levels):  # (ascending, the first at 0)
            if lv[0] <= t:
                return lv
        return self.levels[0]

    def count(self, t: float, enough: float = float("inf")) -> float:
        """How many entries lie above ``t`` -- or, under the floor when more than ``enough`` reached it, that many
        (the caller only needs to know the count exceeds ``enough``; no read of the tensor)."""
        if self._above_floor(t):
            return self.cand.count(t)
        for v, c, _, _ in self.levels:
            if v == t:
                return c
        if self.cand is not None and self.cand_count > enough:
            return float(self.cand_count)
        return float(many.count_above(self.x, t))

    def points(self) -> list[tuple[float, float]]:
        """The levels and the floor: (threshold, count) pairs known exactly without a read."""
        pts = [(v, c) for v, c, _, _ in self.levels]
        return pts + ([(self.floor, self.cand.count(self.floor))] if self.cand is not None else [])

    def largest(self) -> float:
        return self.top
