"""The compiled selection pass's steps in torch operations (:func:`gradsift.kernels.many._run` on the eager
backend): the same counts, decisions and selections, row by row (:class:`gradsift.kernels.rows.Ask`)."""

from __future__ import annotations

import torch

from .draw import draw_k
from .moments import INF_BITS, _bits, _magnitude, moments_eager  # noqa: F401
from .rows import Draw, Scan


def _bits_of(floor: float | None) -> int:
    return INF_BITS if floor is None else _bits(floor)


def many_eager(xs, ks, adds, rows, zero: bool, srcs=None):
    """The compiled kernel's steps in torch operations: the same counts, decisions and selections."""
    results = []
    for i, floor, cap, drawn, score, mom, sample, levels, *_ in rows:
        x, a, k, t = xs[i], adds[i], ks[i], _bits_of(floor)
        if srcs is not None and srcs[i] is not None:
            x.copy_(srcs[i])
        if mom is not None:  # momentum correction's update, as MomentumCorrection writes it
            u, mm, nesterov, usrc = mom
            if usrc is not None:
                u.copy_(usrc)
            if nesterov:
                u.add_(a).mul_(mm)
                x.add_(u).add_(a)
            else:
                u.mul_(mm).add_(a)
                x.add_(u)
        elif a is not None:
            x.add_(a)
        taken = x[sample[0]::sample[1]][:sample[2]].clone() if sample is not None else None  # (before zeroing)
        if drawn is not None:
            cand = draw_k(x.numel(), drawn.k, drawn.seed, x.device) if isinstance(drawn, Draw) else torch.unique(drawn)
            vals = x[cand]
            if zero:
                x.index_fill_(0, cand, 0.0)
            results.append(Scan((cand, vals), cand.numel(), 0.0, 0, taken))
            continue
        bits = x.view(torch.int32) & 0x7FFFFFFF
        top = int(bits.max()) if x.numel() else 0  # (as compiled: every pass but random-k's reads it)
        cand = torch.nonzero(bits >= t).squeeze(1)
        count = cand.numel()
        if k == 0:
            got_m = moments_eager(x, bits, levels) if levels is not None else None
            results.append(Scan((cand, x[cand]) if count <= cap else None, count, 0.0, top, taken, got_m))
            continue
        if count < k or count > cap:
            results.append(Scan(None, count, 0.0, top, taken))
            continue
        cb = bits[cand]
        if score is not None:  # |x| times the factor at the given positions, base elsewhere (float32 products)
            pos, fac, base = score
            mult = torch.full((count,), base, dtype=torch.float32)
            if pos.numel():
                at = torch.searchsorted(cand, pos).clamp_(max=max(count - 1, 0))
                hit = cand[at] == pos if count else torch.zeros_like(pos, dtype=torch.bool)
                mult[at[hit]] = fac.to(torch.float32)[hit]
            cb = (x[cand].abs() * mult).view(torch.int32) & 0x7FFFFFFF
        kth = int(torch.kthvalue(cb, count - k + 1).values)  # the k-th largest
        if score is not None and kth < t:  # an entry below the floor may score higher
            results.append(Scan(None, count, 0.0, top, taken))
            continue
        above = cb > kth
        eq = cb == kth
        keep = above | (eq & (torch.cumsum(eq, 0) <= k - int(above.sum())))
        idx = cand[keep]
        vals = x[idx]
        if zero:
            x.index_fill_(0, idx, 0.0)
        results.append(Scan((idx, vals), count, _magnitude(kth), top, taken))
    return results

