"""The statistics SIDCo's fits read (:mod:`gradsift.compressors.sidco`): count, sum, sum of squares and sum of logs
of the magnitudes above any threshold, from the histogram of their 16-bit keys (:mod:`gradsift.kernels`: 65,536
buckets of relative width 2^-7, each magnitude represented by its bucket's middle)."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels

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

    def count(self, t: float) -> float:
        """How many entries lie in buckets above ``t``."""
        return float(self.n[self._at(t)])

    def above(self, t: float) -> tuple[float, float, float, float]:
        """(count, sum, sum of squares, sum of logs) of the entries whose bucket lies above ``t``."""
        j = self._at(t)
        return float(self.n[j]), float(self.s1[j]), float(self.s2[j]), float(self.sl[j])

    def moments(self, t: float, squares: bool = False) -> tuple[float, ...]:
        """(count, sum), with ``squares`` also the sum of squares, of the entries whose bucket lies above ``t``
        (what the exponential and generalized Pareto fits read)."""
        j = self._at(t)
        return (float(self.n[j]), float(self.s1[j])) + ((float(self.s2[j]),) if squares else ())
