"""The rows of the compiled pass's call and of its answer, by name: what the pass does for one tensor
(:class:`Ask`) and what it gave (:class:`Scan`) -- :func:`gradsift.kernels.many.topk_many`, ``scan_many`` and
``pick_many`` fill and read them, on either backend."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .moments import Levels


class Draw(NamedTuple):
    """Random-k's draw made inside the pass: ``k`` distinct positions from ``seed``
    (:func:`gradsift.kernels.draw.draw_k`)."""

    k: int
    seed: int


class Ask(NamedTuple):
    """What the pass does for tensor ``i`` (:func:`_run`)."""

    i: int
    floor: float | None  # candidates: magnitudes at or above it (None: the non-finite ones)
    cap: int  # at most this many candidates kept
    drawn: torch.Tensor | Draw | None = None  # random-k: the positions drawn (or to draw) are the candidates
    score: Any = None  # REGTOP-k: (positions, factors, base)
    mom: Any = None  # momentum correction: (u, momentum, nesterov, u's source or None)
    sample: tuple[int, int, int] | None = None  # (start, stride, count) of a strided sample to copy out
    levels: Levels | None = None  # SIDCo: moments at magnitude levels (scans only)
    sidco: Any = None  # SIDCo from its state (compiled only): sd_in_scan's (ints, doubles, path room)
    dgc: tuple[int, int] | None = None  # DGC's selection right after the scan (compiled, with a sample): (k, settle)
    keep: tuple[int, int] | None = None  # rTop-k: (keep, seed): a random keep of the k chosen stay (compiled)


class Scan(NamedTuple):
    """What the pass gave for one tensor (:func:`scan_many`, and inside :func:`topk_many`)."""

    result: Any  # (indices, values): the candidates in index order (a scan), the selection (top-k; SIDCo's or DGC's
    # when taken there), or None: more than the cap reached the floor (top-k: or fewer than k)
    count: int  # how many reached the floor
    kth: float  # top-k: the k-th magnitude
    top: int  # the float32 bits of the largest magnitude of the updated tensor (>= INF_BITS: NaN or Inf in it; 0 for
    # random-k's draws)
    sample: torch.Tensor | None  # the strided sample asked for, as updated
    moments: list | None = None  # per level asked for: (count, sum of q1, sum of q2) (:class:`Levels`)
    sidco: list | None = None  # sd_in_scan's out row (``scan_many``'s ``sidco``; compiled, finite)
    dgc: list | None = None  # DGC's (threshold, count at it, kept) when the compiled pass selected (``dgc``)

    @property
    def idx(self) -> torch.Tensor | None:
        return self.result[0] if self.result is not None else None

    @property
    def vals(self) -> torch.Tensor | None:
        return self.result[1] if self.result is not None else None
