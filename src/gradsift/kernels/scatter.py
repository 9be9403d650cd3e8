"""Updates at scattered places, one compiled sweep over them: the sampling methods' bookkeeping at the coordinates
they drew (:func:`sampled`) and memory settling after a sparse send (:func:`subtract_at`). Each array is read or
written at the same scattered places; one sweep lets their cache misses overlap, where one torch index operation per
array walked the places once each; :func:`add_many` adds a group's sparse contributions in one sweep where torch
took a handful of operations each. The torch forms give the same results, bit for bit."""

from __future__ import annotations

import array
import itertools
from typing import NamedTuple, Sequence

import torch

from . import _compiled, _state, draw
from .buffers import pointers, position_bitmap, spec_columns, spec_rows


def _compiled_f32(*ts: torch.Tensor | None) -> bool:
    """Whether the compiled sweep takes these: the compiled backend and contiguous float32 CPU tensors (None: absent)."""
    given = [t for t in ts if t is not None]
    return _compiled(given[0]) and all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in given)


def _positions(idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether the compiled sweeps take these positions: contiguous int64 on the CPU (as many as ``vals[i]`` holds
    entries, where given)."""
    return all(i.dtype == torch.int64 and i.is_contiguous() and not i.is_cuda for i in idxs) and \
        (vals is None or all(i.numel() == v.numel() for i, v in zip(idxs, vals)))


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


class Sample(NamedTuple):
    """One tensor's draw and bookkeeping for :func:`sample_many`: the positions where ``u_i < min(scale * base[i],
    1)`` (:func:`gradsift.kernels.draw.bernoulli` of ``seed``; about ``expect`` of them), then :func:`sampled`'s
    bookkeeping there (``x``, ``visited``, ``prior``, ``alpha``, ``w``, ``gsq`` as it takes them)."""

    base: torch.Tensor
    seed: int
    scale: float
    expect: float
    x: torch.Tensor
    visited: torch.Tensor
    prior: torch.Tensor | None = None
    alpha: float = 1.0
    w: torch.Tensor | None = None
    gsq: torch.Tensor | None = None


SLACK = 4096  # room for positions beyond twice the expected count (more draws again with room for all)


def sample_many(rows: Sequence[Sample]) -> tuple[list[tuple], torch.Tensor]:
    """(for each row (positions, values, olds, news, least), the rows' values one after the other in one tensor):
    :func:`gradsift.kernels.draw.bernoulli`, then :func:`sampled` at what it drew -- the same results; on the
    compiled backend one call for the group (``gs_sample_many``), where two calls a tensor and their Python took
    about as long as the draws themselves on ResNet-50's 161 shapes."""
    if not (rows and _compiled(rows[0].base) and all(
            _f32_cpu(r.base) and _f32_cpu(r.x) and _f32_cpu(r.prior) and _f32_cpu(r.w) and _f32_cpu(r.gsq) and
            r.base.dim() == 1 and r.visited.dtype == torch.bool and r.visited.is_contiguous() for r in rows)):
        out = []
        for r in rows:
            idx = draw.bernoulli(r.base, r.seed, r.scale, expect=r.expect)
            out.append((idx, *sampled(idx, r.x, r.visited, r.prior, r.alpha, r.w, r.gsq)))
        return out, torch.cat([o[1] for o in out]) if out else torch.empty(0)
    rooms = [min(r.base.numel(), int(2 * r.expect) + SLACK) for r in rows]
    got, values = _sample_call(rows, rooms)
    over = [j for j, (g, room) in enumerate(zip(got, rooms)) if g[0] > room]
    if over:  # (more than twice the expected count, left as they were: drawn again with room for all)
        for j, again in zip(over, _sample_call([rows[j] for j in over], [got[j][0] for j in over])[0]):
            got[j] = again
        values = torch.cat([g[2] for g in got])
    inf = float("inf")
    return [(idx, vals, olds, news, least if r.prior is not None and c else inf)
            for (c, idx, vals, olds, news, least), r in zip(got, rows)], values


def _f32_cpu(t: torch.Tensor | None) -> bool:
    """Whether the compiled sweeps take ``t``: absent, or a contiguous float32 CPU tensor."""
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda)


def _filled(buf: torch.Tensor, counts: Sequence[int], rooms: Sequence[int], copies: int = 1) -> list[torch.Tensor]:
    """The first ``counts[j]`` entries of each room ``j`` of ``buf`` (rooms of ``rooms[j]`` entries one after the
    other, ``copies`` times over): one split, where a slice a room took three times as long a view."""
    sizes = list(itertools.chain.from_iterable((c, room - c) for c, room in zip(counts, rooms))) * copies
    return buf.split_with_sizes(sizes)[::2]


SAMPLE_FIELDS = 14  # (select.c's gs_sample_many: a row's int64s)


def _sample_call(rows: Sequence[Sample], rooms: Sequence[int]) -> tuple[list[tuple], torch.Tensor]:
    """One ``gs_sample_many`` call: (per row (count, positions, values, olds, news, least) -- the positions, olds
    and news of a row whose count outran its room are its room's, undone, no values --, the rows' values one after
    the other). Its spec is filled a column at a time (the rows' rooms at offsets into three buffers)."""
    m, total = len(rows), sum(rooms)
    at = list(itertools.accumulate(rooms, initial=0))[:-1]
    idx = torch.empty(total, dtype=torch.int64)
    priors = [r.prior is not None for r in rows]
    pairs = torch.empty(2 * total, dtype=torch.float32) if any(priors) else None
    ip, pp = idx.data_ptr(), pairs.data_ptr() if pairs is not None else 0
    spec = spec_columns((pointers(r.base for r in rows), [r.base.numel() for r in rows],
                         _f32_bits([r.scale for r in rows]), [r.seed for r in rows], rooms, [ip + 8 * a for a in at],
                         pointers(r.x for r in rows), pointers(r.visited for r in rows),
                         pointers(r.prior for r in rows), _f32_bits([r.alpha for r in rows]),
                         pointers(r.w for r in rows), pointers(r.gsq for r in rows),
                         [pp + 4 * a if pr else 0 for a, pr in zip(at, priors)],
                         [pp + 4 * (total + a) if pr else 0 for a, pr in zip(at, priors)]), m, SAMPLE_FIELDS)
    vals = torch.empty(total, dtype=torch.float32)
    kept, least = array.array("q", bytes(8 * m)), array.array("f", bytes(4 * m))
    _state["lib"].gs_sample_many(spec.buffer_info()[0], m, vals.data_ptr(), kept.buffer_info()[0],
                                 least.buffer_info()[0])
    filled = [c if c <= room else room for c, room in zip(kept, rooms)]
    sizes = [c if c <= room else 0 for c, room in zip(kept, rooms)]
    values = vals[:sum(sizes)]
    idxs = _filled(idx, filled, rooms)
    pair = _filled(pairs, filled, rooms, 2) if pairs is not None else [None] * (2 * m)
    return [(c, i, v, o if pr else None, n if pr else None, lo)
            for c, i, v, o, n, lo, pr in zip(kept, idxs, values.split_with_sizes(sizes), pair[:m], pair[m:], least,
                                             priors)], values


def _f32_bits(vs: Sequence[float]) -> list[int]:
    """The float32 bit patterns of numbers rounded to float32 (as ctypes and torch round a number; beyond the range,
    Inf), through ``array``."""
    return array.array("I", array.array("f", vs).tobytes()).tolist()


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


ADD_CODES = {torch.float32: 0, torch.bfloat16: 1}


def add_many(out: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], starts: Sequence[int],
             universes: Sequence[int]) -> torch.Tensor | None:
    """For each ``(values, indices)`` of ``parts``, in order: ``out[starts[i] + indices] += values`` (float32 or
    bfloat16 values, made float32 exactly; int64 indices in ``[0, universes[i])``), in one compiled sweep
    (``gs_add_segments``); returns the positions written, in order. torch's ``index_add_`` of each part, values made
    float32, gives the same bits (one rounding an entry). None where the sweep does not apply: the caller adds with
    torch."""
    if not (_compiled_f32(out) and all(v.dtype in ADD_CODES and v.is_contiguous() and not v.is_cuda for v, _ in parts)
            and _positions([i for _, i in parts], [v for v, _ in parts])):
        return None
    if any(s < 0 or s + n > out.numel() for s, n in zip(starts, universes)):
        raise ValueError(f"a part's place ends past the output ({out.numel()} entries)")
    rows = [(v.numel(), s, n, i.data_ptr(), v.data_ptr(), ADD_CODES[v.dtype])
            for (v, i), s, n in zip(parts, starts, universes)]
    at = torch.empty(sum(r[0] for r in rows), dtype=torch.int64)
    spec = spec_rows(rows)
    bad = _state["lib"].gs_add_segments(out.data_ptr(), spec.data_ptr(), len(rows), at.data_ptr())
    if bad:
        raise IndexError(f"index out of range: a sparse part holds an index outside [0, {universes[bad - 1]})")
    return at


def div_at(out: torch.Tensor, at: torch.Tensor, d: int) -> bool:
    """``out[p] /= d`` once for every distinct position ``p`` of ``at`` (int64, in range; repeats allowed), in one
    compiled sweep (``gs_div_at``, with a bitmap of the positions done kept between calls): the bits of
    ``out.index_put_((at,), out.index_select(0, at).div_(d))``. False where the sweep does not apply (nothing divided:
    the caller divides with torch)."""
    if not (_compiled_f32(out) and at.dtype == torch.int64 and at.is_contiguous() and not at.is_cuda):
        return False
    _state["lib"].gs_div_at(out.data_ptr(), at.data_ptr(), at.numel(), float(d), position_bitmap(out.numel()).data_ptr())
    return True


def add_at_many(mems: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor]) -> bool:
    """``mems[i].index_add_(0, idxs[i], vals[i])`` for every i, in one compiled sweep (``gs_add_at_many``) where
    every memory and value tensor is contiguous float32 on the CPU and every index tensor contiguous int64: the same
    bits (one rounding an entry). False where the sweep does not apply (nothing was added: the caller adds with
    torch)."""
    if not mems or not (_compiled_f32(*mems, *vals) and _positions(idxs, vals)):
        return False
    _add_at_rows(mems, [(i.numel(), m.numel(), m.data_ptr(), i.data_ptr(), v.data_ptr())
                        for m, i, v in zip(mems, idxs, vals)])
    return True


def zero_at_many(mems: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor]) -> None:
    """``mems[i].index_fill_(0, idxs[i], 0.0)`` for every i: one compiled sweep (``gs_add_at_many`` without values)
    where every memory is contiguous float32 on the CPU and every index tensor contiguous int64, else torch's, one a
    tensor."""
    if mems and _compiled_f32(*mems) and _positions(idxs):
        _add_at_rows(mems, [(i.numel(), m.numel(), m.data_ptr(), i.data_ptr(), 0) for m, i in zip(mems, idxs)])
        return
    for m, i in zip(mems, idxs):
        m.index_fill_(0, i, 0.0)


def _add_at_rows(mems: Sequence[torch.Tensor], rows) -> None:
    """One ``gs_add_at_many`` call over its rows; an index out of its memory's range raises."""
    spec = spec_rows(rows)  # (held while the sweep reads it)
    bad = _state["lib"].gs_add_at_many(spec.data_ptr(), len(rows))
    if bad:
        raise IndexError(f"index out of range: an index outside [0, {mems[bad - 1].numel()}) for a memory")


def gather_many(srcs: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[bool]] | None:
    """(``srcs[i].index_select(0, idxs[i])`` for every i, one after the other in one tensor; whether each
    ``idxs[i]`` ascends strictly), in one compiled sweep (``gs_gather_many``) where every source is contiguous
    float32 on the CPU and every index tensor contiguous int64; None where the sweep does not apply."""
    if not srcs or not (_compiled_f32(*srcs) and _positions(idxs)):
        return None
    sizes = [i.numel() for i in idxs]
    at = list(itertools.accumulate(sizes, initial=0))
    out = torch.empty(at[-1], dtype=torch.float32)
    spec = spec_rows([(i.numel(), s.numel(), s.data_ptr(), i.data_ptr(), a) for s, i, a in zip(srcs, idxs, at)])
    ascending = array.array("q", bytes(8 * len(srcs)))
    bad = _state["lib"].gs_gather_many(spec.data_ptr(), len(srcs), out.data_ptr(), ascending.buffer_info()[0])
    if bad:
        raise IndexError(f"index out of range: an index outside [0, {srcs[bad - 1].numel()}) for a source")
    return out, [bool(a) for a in ascending]


def keep_largest_many(values: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], caps: Sequence[int],
                      mems: Sequence[torch.Tensor | None]) -> list[bool]:
    """Sparse payloads cut to their wire capacity in one compiled call (``gs_keep_largest_many``), in place: of
    ``values[i]`` (float32) at ``indices[i]`` (int64), both contiguous on the CPU, the ``caps[i]`` of largest
    magnitude stay at the front, in their order, the others are added back into ``mems[i]`` where given --
    :func:`gradsift.payload.fit_capacity`'s choice, bit for bit. Per payload, whether it was cut: not where
    magnitudes tie across the cut (which of them stay is ``torch.topk``'s choice there) or a NaN is among them, nor
    anywhere when the call does not apply (then nothing changed)."""
    if not values or not (_compiled_f32(*values, *[m for m in mems if m is not None]) and _positions(indices)):
        return [False] * len(values)
    spec = spec_rows([(v.data_ptr(), i.data_ptr(), v.numel(), c, m.data_ptr() if m is not None else 0)
                      for v, i, c, m in zip(values, indices, caps, mems)])
    done = array.array("q", bytes(8 * len(values)))
    if _state["lib"].gs_keep_largest_many(spec.data_ptr(), len(values), done.buffer_info()[0]) < 0:
        raise MemoryError("gradsift: out of memory cutting payloads to their capacity")
    return [bool(d) for d in done]


def cast_bf16_many(mems: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor],
                   vals: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Finite float32 ``vals[i]`` cast to bf16 for the wire as :meth:`gradsift.compressors.base.Compressor.wire`
    casts them, ``mems[i].index_add_(0, idxs[i], vals[i] - cast)`` -- what the cast rounds off back into memory --
    in one compiled call (``gs_cast_bf16_many``): the bf16 values, per tensor (views of one buffer); the same bits.
    None where the call does not apply or a value is not finite (nothing written)."""
    if not mems or not (_compiled_f32(*mems, *vals) and _positions(idxs, vals)):
        return None
    sizes = [v.numel() for v in vals]
    at = list(itertools.accumulate(sizes, initial=0))
    out = torch.empty(at[-1], dtype=torch.bfloat16)
    spec = spec_rows([(i.numel(), m.numel(), m.data_ptr(), i.data_ptr(), v.data_ptr(), a)
                      for m, i, v, a in zip(mems, idxs, vals, at)])
    parts = out.split(sizes)
    bad = _state["lib"].gs_cast_bf16_many(spec.data_ptr(), len(sizes), out.data_ptr())
    if bad < 0:  # (a NaN or an Inf: torch's careful cast)
        return None
    if bad:
        raise IndexError(f"index out of range: an index outside [0, {mems[bad - 1].numel()}) for a memory")
    return list(parts)


def momentum_whole(us: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                   momentum: float, nesterov: bool) -> tuple[torch.Tensor, list[bool]] | None:
    """Momentum correction's update of a group's tensors sent whole, in one compiled call (``gs_momentum_whole``):
    ``u = m u + g; v += u`` (Nesterov: ``u = (u + g) m; v += u + g``, torch's roundings), every ``v`` copied out one
    after the other, and each finite ``v`` settled to ``v - v`` -- (the copies in one tensor, per tensor whether it
    was finite; a non-finite ``v`` is left as updated). None where the compiled call does not take them (then
    nothing changed): contiguous float32 CPU tensors on the compiled backend."""
    if not us or not _compiled_f32(*us, *vs, *gs):
        return None
    sizes = [g.numel() for g in gs]
    out = torch.empty(sum(sizes), dtype=torch.float32)
    spec = array.array("q", itertools.chain.from_iterable(
        (u.data_ptr(), v.data_ptr(), g.data_ptr(), n) for u, v, g, n in zip(us, vs, gs, sizes)))
    finite = array.array("q", bytes(8 * len(us)))
    _state["lib"].gs_momentum_whole(spec.buffer_info()[0], len(us), momentum, int(bool(nesterov)), out.data_ptr(),
                                    finite.buffer_info()[0])
    return out, [bool(f) for f in finite]
