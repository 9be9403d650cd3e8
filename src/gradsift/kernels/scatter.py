"""Updates at scattered places, one compiled sweep over them: the sampling methods' bookkeeping at the coordinates
they drew (:func:`sampled`) and memory settling after a sparse send (:func:`subtract_at`). Each array is read or
written at the same scattered places; one sweep lets their cache misses overlap, where one torch index operation per
array walked the places once each. The torch forms give the same results, bit for bit."""

from __future__ import annotations

import torch

from . import _compiled, _state


def _compiled_f32(*ts: torch.Tensor | None) -> bool:
    """Whether the compiled sweep takes these: the compiled backend and contiguous float32 CPU tensors (None: absent)."""
    given = [t for t in ts if t is not None]
    return _compiled(given[0]) and all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in given)


def sampled(idx: torch.Tensor, x: torch.Tensor, visited: torch.Tensor, prior: torch.Tensor | None = None,
            alpha: float = 1.0, w: torch.Tensor | None = None, gsq: torch.Tensor | None = None):
    """The sampling methods' bookkeeping at the sampled coordinates ``idx``: (the values ``x[idx]``, the olds and the
    news, the smallest new prior). ``visited[idx] = True``; with ``prior``: ``prior[idx] *= alpha`` (float32) -- olds
    and news its values before and after -- and with ``w`` as well: ``w[idx] = gsq[idx] * prior[idx]``, olds and news
    then ``w``'s. One compiled sweep over ``idx`` (``gs_sampled``), else torch operations with the same results."""
    inf = float("inf")
    if _compiled_f32(x, prior, w, gsq) and visited.dtype == torch.bool and visited.is_contiguous() \
            and idx.is_contiguous():
        k = idx.numel()
        vals = torch.empty(k, dtype=torch.float32)
        olds = torch.empty(k, dtype=torch.float32) if prior is not None else None
        news = torch.empty(k, dtype=torch.float32) if prior is not None else None
        p = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        least = _state["lib"].gs_sampled(p(idx), k, p(x), p(vals), p(visited), p(prior), alpha, p(w), p(gsq), p(olds),
                                         p(news))
        return vals, olds, news, (float(least) if prior is not None and k else inf)
    vals = x.index_select(0, idx)
    visited.index_fill_(0, idx, True)
    if prior is None:
        return vals, None, None, inf
    before = prior.index_select(0, idx)
    now = before * alpha
    prior.index_copy_(0, idx, now)
    least = float(now.min()) if idx.numel() else inf
    if w is None:
        return vals, before, now, least
    old, new = w.index_select(0, idx), gsq.index_select(0, idx).mul_(now)
    w.index_copy_(0, idx, new)
    return vals, old, new, least


def subtract_at(acc: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, zero: torch.Tensor | None = None) -> None:
    """``acc[idx] -= vals`` (torch's ``index_add_`` with alpha -1: the same roundings) and ``zero[idx] = 0``, in one
    compiled sweep over ``idx`` for contiguous float32 CPU tensors (memory settling after a send: two torch index
    operations walked the scattered places twice)."""
    if _compiled_f32(acc, vals, zero) and idx.is_contiguous() and idx.dtype == torch.int64:
        _state["lib"].gs_subtract_at(acc.data_ptr(), idx.data_ptr(), vals.data_ptr(), idx.numel(),
                                     zero.data_ptr() if zero is not None else None)
        return
    acc.index_add_(0, idx, vals, alpha=-1)
    if zero is not None:
        zero.index_fill_(0, idx, 0.0)
