"""Buffers the compiled pass reads and writes (:mod:`gradsift.kernels.many`): the spec arrays a call builds, and
top-k's candidate buffers and the mean's bitmap of positions, kept between calls; and the spare tensors the memories
write a step's result into instead of allocating (:func:`reuse_spare`)."""

from __future__ import annotations

import array
import itertools
import sys
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


def pointers(ts) -> list[int]:
    """The tensors' addresses (0 for None): a compiled call's pointer column."""
    return [t.data_ptr() if t is not None else 0 for t in ts]


def spec_columns(cols, m: int, width: int) -> array.array:
    """``m`` rows of ``width`` int64 fields from their columns -- ``cols`` maps a field to one int a row, or lists the
    columns in field order; fields not given are 0 -- flat in an array whose address a compiled call takes: an
    array's extended slice a column, one C loop each (a list's made into an array took 3.5 times as long, a tuple a
    row longer still)."""
    out = array.array("q", bytes(8 * m * width))
    for f, col in cols.items() if isinstance(cols, dict) else enumerate(cols):
        out[f::width] = array.array("q", col)
    return out


def spec_rows(rows) -> torch.Tensor:
    """A compiled call's spec: ``rows`` (tuples of ints, all as long) flat in one int64 tensor, row after row
    (:func:`flat_array`: a few times faster than ``torch.tensor`` of the rows)."""
    return flat_array("q", itertools.chain.from_iterable(rows))


def reuse_spare(spare: dict, at, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor ``spare`` keeps at ``at`` (taken out of it) when it has ``like``'s shape and device, ``dtype``
    (default ``like``'s), and nothing else holds it; else a new, empty one. A memory that must not write into the
    tensors an open checkpoint holds writes a step's result into the one the key's previous such step replaced,
    once that checkpoint is gone: a fresh allocation of every entry each step costs a page fault every 4 KiB."""
    out = spare.pop(at, None)
    dtype = like.dtype if dtype is None else dtype
    if out is None or (out.shape, out.dtype, out.device) != (like.shape, dtype, like.device) or \
            sys.getrefcount(out) > 2:  # (2: this name and the call's argument: nothing else holds it)
        out = torch.empty(like.shape, dtype=dtype, device=like.device)
    return out
