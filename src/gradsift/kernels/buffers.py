"""Buffers the compiled pass reads and writes (:mod:`gradsift.kernels.many`): the spec arrays a call builds, and
top-k's candidate buffers and the mean's bitmap of positions, kept between calls."""

from __future__ import annotations

import array
import threading

import torch

ROOM = threading.local()


def candidate_buffers(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidate buffers of a call whose results are not views of them (int64 positions, float32 values and
    scores), ``n`` entries each, kept between calls (per thread) and grown as needed: a fresh allocation of a few MB
    a call costs a page fault for each 4 KiB it touches (about 1,600 a step over ResNet-50's layers)."""
    have = getattr(ROOM, "bufs", None)
    if have is None or have[0].numel() < n:
        size = max(n, 2 * have[0].numel() if have is not None else 0)
        have = ROOM.bufs = (torch.empty(size, dtype=torch.int64), torch.empty(size, dtype=torch.float32),
                            torch.empty(size, dtype=torch.float32))
    return have[0][:n], have[1][:n], have[2][:n]


def position_bitmap(universe: int) -> torch.Tensor:
    """A zeroed bitmap of at least ``universe`` bits (int64 words), kept between calls (per thread): the compiled
    sweep that takes it (``gs_div_at``) leaves it zeroed again."""
    have = getattr(ROOM, "bitmap", None)
    words = (universe + 63) // 64
    if have is None or have.numel() < words:
        have = ROOM.bitmap = torch.zeros(max(words, 2 * have.numel() if have is not None else 0), dtype=torch.int64)
    return have


def flat_array(code: str, values) -> torch.Tensor:
    """A flat int64 (``q``) or float64 (``d``) tensor of the values (at least one): through ``array``, a few times
    faster than ``torch.tensor`` of a list."""
    a = array.array(code, values) or array.array(code, [0])
    return torch.frombuffer(a, dtype=torch.int64 if code == "q" else torch.float64)
