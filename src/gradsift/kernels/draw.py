"""Independent Bernoulli draws with a counter-based generator: ``i`` is kept when ``u_i < p[i]``, ``u_i`` a 24-bit
uniform on [0, 1) that is a function of (seed, i) alone (two rounds of the 32-bit "lowbias32" finalizer, keyed by
the seed's two halves; 32-bit arithmetic, so the compiled draw vectorizes).

The sampling methods (GS, RSB, GSB) draw one uniform per coordinate every step, identical on every worker. Torch's
``torch.rand`` over every entry, then a comparison and a ``nonzero``, took a third of GSB's step on ResNet-50's
shapes; the compiled draw is one read of ``p``. The torch twin computes the same mixing in int64 arithmetic on
32-bit values (products masked to 32 bits: no overflow), so both backends draw the same coordinates."""

from __future__ import annotations

import torch

from . import _compiled, _state

M1, M2 = 0x7FEB352D, 0x846CA68B
LOW32 = 0xFFFFFFFF


def _mix32(z: torch.Tensor) -> torch.Tensor:
    """The lowbias32 finalizer on the low 32 bits of int64 ``z`` (products taken mod 2^32)."""
    z = z ^ (z >> 16)
    z = (z * M1) & LOW32
    z = z ^ (z >> 15)
    z = (z * M2) & LOW32
    return z ^ (z >> 16)


def uniforms(n: int, seed: int, device=None) -> torch.Tensor:
    """The ``n`` uniforms of ``seed`` as float32 (the torch form of the compiled draw's ``u_i``)."""
    s0, s1 = seed & LOW32, (seed >> 32) & LOW32
    z = (torch.arange(n, dtype=torch.int64, device=device) + s0) & LOW32
    z = _mix32(_mix32(z) ^ s1)
    return (z >> 8).to(torch.float32) * 2.0 ** -24


def bernoulli(base: torch.Tensor, seed: int, scale: float = 1.0, expect: float | None = None) -> torch.Tensor:
    """The positions of the flat float32 ``base`` where ``u_i < min(scale * base[i], 1)`` (int64, ascending; the
    product in float32, the scale rounded to float32 as torch multiplies by a number), ``seed`` in [0, 2^63).
    ``expect``: about how many will be kept (the probabilities' sum), to size the output (a count beyond twice it
    draws again with room for all: the same positions)."""
    if base.dtype == torch.float32 and base.is_contiguous() and not base.is_cuda and base.dim() == 1 \
            and _compiled(base):
        n = base.numel()
        room = n if expect is None else min(n, int(2 * expect) + 4096)
        out = torch.empty(room, dtype=torch.int64)
        kept = int(_state["lib"].gs_bernoulli(base.data_ptr(), n, scale, seed, out.data_ptr(), room))
        if kept > room:
            out = torch.empty(kept, dtype=torch.int64)
            _state["lib"].gs_bernoulli(base.data_ptr(), n, scale, seed, out.data_ptr(), kept)
            return out
        return out[:kept].clone() if kept < room // 2 else out[:kept]
    p = base.reshape(-1).to(torch.float32).mul(scale).clamp_(max=1.0)
    return torch.nonzero(uniforms(p.numel(), seed, p.device) < p).squeeze(1)


def sampled(idx: torch.Tensor, x: torch.Tensor, visited: torch.Tensor, prior: torch.Tensor | None = None,
            alpha: float = 1.0, w: torch.Tensor | None = None, gsq: torch.Tensor | None = None):
    """The sampling methods' bookkeeping at the sampled coordinates ``idx``: (the values ``x[idx]``, the olds and the
    news, the smallest new prior). ``visited[idx] = True``; with ``prior``: ``prior[idx] *= alpha`` (float32) -- olds
    and news its values before and after -- and with ``w`` as well: ``w[idx] = gsq[idx] * prior[idx]``, olds and news
    then ``w``'s. One compiled sweep over ``idx`` (``gs_sampled``), else torch operations with the same results."""
    inf = float("inf")
    arrays = [t for t in (x, prior, w, gsq) if t is not None]
    if _compiled(x) and all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in arrays) \
            and visited.dtype == torch.bool and visited.is_contiguous() and idx.is_contiguous():
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
    arrays = [acc, vals] + ([zero] if zero is not None else [])
    if _compiled(acc) and all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in arrays) \
            and idx.is_contiguous() and idx.dtype == torch.int64:
        _state["lib"].gs_subtract_at(acc.data_ptr(), idx.data_ptr(), vals.data_ptr(), idx.numel(),
                                     zero.data_ptr() if zero is not None else None)
        return
    acc.index_add_(0, idx, vals, alpha=-1)
    if zero is not None:
        zero.index_fill_(0, idx, 0.0)
