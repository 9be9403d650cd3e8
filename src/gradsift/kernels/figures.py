"""Two figures of each of many gradients in one compiled read (``gs_figures_many`` in ``select.c``): what
:mod:`gradsift.runtime.gradwatch` records of the gradients the hook wrote and reads again at the optimizer's step."""

from __future__ import annotations

from typing import Sequence

import torch

from . import _compiled, _state
from .buffers import flat_array


def figures_many(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each tensor's L2 norm, its largest entry) as two float64 CPU vectors -- the norm from a sum of squares in
    float64 in a fixed order, so the same entries give the same bits; the largest entry NaN where one is NaN, 0 for
    an empty tensor -- in one compiled pass over each; None where the compiled kernels do not take these tensors
    (not all contiguous float32 CPU tensors, or the eager backend)."""
    if not grads or not _compiled(grads[0]) or not all(
            g.dtype == torch.float32 and g.is_contiguous() and not g.is_cuda for g in grads):
        return None
    m = len(grads)
    ptrs = flat_array("q", [g.data_ptr() for g in grads])
    ns = flat_array("q", [g.numel() for g in grads])
    sq = torch.empty(m, dtype=torch.float64)
    top = torch.empty(m, dtype=torch.float32)
    _state["lib"].gs_figures_many(ptrs.data_ptr(), ns.data_ptr(), m, sq.data_ptr(), top.data_ptr())
    top = top.double()
    top[ns == 0] = 0.0
    return sq.sqrt_(), top
