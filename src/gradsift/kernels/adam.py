"""Adam's direction for a group of tensors in one compiled pass each (``gs_adam_many`` in ``select.c``), the
arithmetic of :class:`gradsift.memory.adam.AdamDirection`'s foreach form, operation by operation.

Where the compiled kernels are not in use (``GRADSIFT_KERNELS=eager``, no C compiler, a GPU, another dtype) the
caller runs the foreach form; both give the same bits: the kernel rounds every scalar to float32 and every
operation once, as torch does, and fuses ``add_(y, alpha=a)`` and ``addcmul_`` into one rounding exactly where
torch's own CPU kernels do (:func:`torch_fuses`, probed once).
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
from typing import Sequence

import torch

from . import _compiled, _state

ADAM_FIELDS = 10  # select.c's rows: entries, g, m in, m out, v in, v out, w in, w out, n, s


def takes(xs: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel takes these tensors: the compiled backend, contiguous float32 CPU tensors."""
    return bool(xs) and _compiled(xs[0]) and all(x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda
                                                 for x in xs)


@functools.lru_cache(maxsize=1)
def torch_fuses() -> bool:
    """Whether torch's CPU ``add_(y, alpha=a)`` rounds ``x + a y`` once (a fused multiply-add, as its vectorized
    kernels do on CPUs with FMA), read off numbers where one rounding and two differ."""
    x = torch.full((19,), -1.0)  # (a vectorized body and a tail)
    y = torch.full((19,), 1.0 + 2.0 ** -23)
    got = x.add_(y, alpha=1.0 - 2.0 ** -23)  # a y = 1 - 2^-46: rounded alone to 1 (then x + 1 = 0), exact in an FMA
    return bool((got != 0).all())


def directions(gs, ms_in, ms_out, vs_in, vs_out, ws_in, ws_out, scales, c1s, c2s, *, beta1: float, beta2: float,
               eps: float, keep: float, coef: float, nesterov: bool,
               scratch: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The group's directions ``d = n / (sqrt(s) + eps)`` (views of one new float32 buffer): one kernel call writes
    ``ms_out``, ``vs_out``, ``ws_out`` (may be the inputs themselves), ``n`` and ``s``, and three torch operations
    over the whole buffer finish ``d`` (torch's CPU square root is not always the correctly rounded one, and it is
    the same at any position: so the foreach form's bits). ``ws_in`` None with ``scale="worker"``. ``scales``: each
    gradient's clip factor; ``c1s``, ``c2s``: the bias corrections; ``keep = 1 - r`` and ``coef = 1/N - r``
    (:class:`AdamDirection`). ``scratch``: a float32 tensor of at least twice the group's entries to hold ``n`` and
    ``s`` (kept by the caller between steps: a fresh allocation of them cost a page fault every 4 KiB); the
    directions are then views of it, valid until the next call."""
    m = len(gs)
    sizes = [g.numel() for g in gs]
    total = sum(sizes)
    n, s = (torch.empty(2, total) if scratch is None else scratch[:2 * total].view(2, total))
    ds, ss = n.split(sizes), s.split(sizes)
    ptr = torch.Tensor.data_ptr
    no_w = [0] * m
    cols = [sizes, map(ptr, gs), map(ptr, ms_in), map(ptr, ms_out), map(ptr, vs_in), map(ptr, vs_out),
            map(ptr, ws_in) if ws_in is not None else no_w, map(ptr, ws_out) if ws_in is not None else no_w,
            map(ptr, ds), map(ptr, ss)]
    rows = array.array("q", itertools.chain.from_iterable(zip(*cols)))  # (one row a tensor, built in C loops)
    per = array.array("f", itertools.chain.from_iterable(zip(scales, c1s, c2s)))
    k = (ctypes.c_float * 9)(beta1, 1 - beta1, beta2, 1 - beta2, eps, keep, coef, float(nesterov),
                             float(torch_fuses()))
    _state["lib"].gs_adam_many(rows.buffer_info()[0], per.buffer_info()[0], m, k)
    n.div_(s.sqrt_().add_(eps))
    return list(ds)
