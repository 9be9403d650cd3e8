"""Exact top-k of many tensors at once, most in a single pass each (the tensors of a bucket, a whole model's layers).

The two-pass histogram path (:func:`gradsift.kernels.topk`) pays fixed costs per call -- a 65,536-bin histogram to
clear, merge and scan, a dozen torch calls -- that dominate on a real model, where most tensors are small (108 of
ResNet-50's 161 hold 4,096 entries or fewer). Here every tensor of a group goes through one call:

1. **one pass per tensor**: with error feedback the gradient is added into the residual (in place) and, in the same
   pass, every entry whose magnitude reaches a *floor* is recorded (index, value: the candidates);
2. among the candidates, the exact k-th magnitude (a histogram of their 16-bit keys finds its bucket, a three-way
   quickselect on the magnitude bits finishes within it), then every candidate above it and the ties at it in index
   order until k: the selection, in index order. With error feedback the k chosen are then zeroed in the residual
   (k scattered writes; zeroing every candidate as the pass recorded it and writing back those not chosen took
   about 1.4 k).

The floor is a guess (:class:`Guess`): the previous call's k-th magnitude, times its growth and a slack that adapts
per tensor.
It decides only whether the one pass suffices -- at least k and at most ``cap`` candidates -- never which entries
are chosen: when it does not, the tensor (already accumulated) finishes on the histogram path, which returns the
same set. The result is :func:`gradsift.kernels.topk`'s: the k largest magnitudes, ties at the k-th going to the
lowest indices. First calls (no guess yet) take every entry of a small tensor as a candidate and send a large one
to the histogram path.

Both backends make the same decisions from the same counts (the compiled ``gs_topk_many`` in ``select.c``, POSIX
threads over tensors; the eager path here, torch operations), so their results are identical. One tensor's pass is
single-threaded: on 26M entries at two threads it took 9.3 ms where the threaded histogram path took 18.7
(``gradsift bench select --sizes 26214400 --ratios 0.01 --threads 1|2``).
"""

from __future__ import annotations

import array
import itertools
from typing import Any, Sequence

import torch

from . import _compiled, _state, accumulate, topk
from .guess import (  # noqa: F401 (the floors' API, kept here too)
    CAP_EXTRA, EVERY_ENTRY, SLACK, SLACK_RANGE, TOPK_WANT, Guess,
)
from .moments import (  # noqa: F401 (INF_BITS, Levels: the API)
    INF_BITS, Levels, _bits, _magnitude, moments_eager,
)
from .rows import Ask, Draw, Scan  # noqa: F401 (Scan: the API)
from .draw import draw_k
from .many_eager import many_eager as _many_eager
from .many_compiled import float_bits, many_compiled, plain_call, plain_scan
from .buffers import pointers, spec_columns


def batchable(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the compiled one-pass path: a non-empty contiguous float32 CPU tensor."""
    return x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda and x.numel() > 0


def topk_many(xs: Sequence[torch.Tensor], ks: Sequence[int], states: Sequence[dict[str, Any]],
              adds: Sequence[torch.Tensor | None] | None = None, zero: bool = False,
              scores: Sequence[Any] | None = None, rank=None,
              finite: list[bool] | None = None,
              srcs: Sequence[torch.Tensor | None] | None = None,
              wire_bf16: bool = False,
              keeps: Sequence[tuple[int, int] | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For every flat float32 ``xs[i]``: ``xs[i] += adds[i]`` (when given), then its exact top-``ks[i]`` as
    (int64 indices, values), zeroed in ``xs[i]`` with ``zero``. ``states[i]`` holds the tensor's guess
    (:class:`Guess`), updated here. Every ``xs[i]`` must satisfy :func:`batchable`, with ``0 < k``. ``finite``, when
    given, gets per tensor whether its pass read it all finite (False where unknown: the histogram path).

    ``scores[i]`` = (positions, factors, base) ranks the entries of ``xs[i]`` by ``|x| * factor`` instead (the
    factor at those sorted positions, ``base`` <= 1 elsewhere: REGTOP-k's score); where one pass cannot settle that
    ranking, ``rank(i)`` ranks the accumulated ``xs[i]`` whole: (indices, k-th score).

    ``srcs[i]``, when given, is read instead: ``xs[i] = srcs[i] + adds[i]`` is written whole and ``srcs[i]`` is left
    as it was (error feedback's memory kept for a rollback without a copy).

    ``wire_bf16`` (with ``zero``) lets the compiled pass take the wire's bf16 cast
    (:meth:`gradsift.compressors.base.Compressor.wire`): a tensor it selects, finite, gets its values in bf16 and
    keeps ``v - bf16(v)`` where it is zeroed -- what the cast and its put-back into memory leave
    (:func:`gradsift.memory.wirecast.cast_many_for_wire`), bit for bit, without a second scattered write into the
    memory. Elsewhere (the eager backend, the histogram path, a non-finite tensor) the values stay float32 for the
    caller's cast, which ends in the same bits.

    ``keeps[i]`` = (keep, seed) keeps a uniformly random ``keep`` of the k chosen (rTop-k: k of the top r), drawn by
    :func:`gradsift.kernels.draw.draw_k` over their index order, and puts the others back into ``xs[i]`` (with
    ``zero``); in the compiled pass, else after it: the same selection on every path."""
    m = len(xs)
    adds = list(adds) if adds is not None else [None] * m
    srcs = list(srcs) if srcs is not None else [None] * m
    ns = [x.numel() for x in xs]
    floors, caps = _floors(states, ns, ks)
    at = [i for i in range(m) if floors[i] is not None]
    direct = [i for i in range(m) if floors[i] is None]
    out: list[Any] = [None] * m
    fin = [False] * m
    failed: dict[int, tuple[float, int]] = {}
    if at:
        wire = wire_bf16 and zero
        kk, fl = ([ks[i] for i in at], [floors[i] for i in at]) if direct else (list(ks), floors)
        if keeps is None and columns(xs[at[0]]):  # top-k alone (or of scores): the spec a column at a time
            status, counts, kths, tops, got = plain_call(
                xs, kk, adds, at, fl, [caps[i] for i in at] if direct else caps, zero, srcs, wire,
                [ns[i] for i in at] if direct else ns, None if scores is None else [scores[i] for i in at])
        else:
            rows = [Ask(i, floors[i], caps[i], score=scores[i] if scores is not None else None,
                        keep=keeps[i] if keeps is not None else None) for i in at]
            scans = _run(xs, ks, adds, rows, zero, srcs, wire_bf16=wire)
            status, got = [0 if g.result is not None else 1 for g in scans], [g.result for g in scans]
            counts, kths, tops = [g.count for g in scans], [g.kth for g in scans], [g.top for g in scans]
        learned = range(len(at))  # (the listed tensors the pass selected: their guesses learn in one loop)
        if any(status):  # a floor missed: accumulated by the pass, finished on the histogram path
            for j in [j for j in learned if status[j]]:
                i = at[j]
                direct.append(i)
                failed[i] = (floors[i], counts[j])
                adds[i] = srcs[i] = None
            learned = [j for j in learned if not status[j]]
            at, got, counts, kths, tops = ([col[j] for j in learned] for col in (at, got, counts, kths, tops))
            kk, fl = [ks[i] for i in at], [floors[i] for i in at]
        for i, res, top in zip(at, got, tops):
            out[i], fin[i] = res, top < INF_BITS
        Guess.update_many([states[i] for i in at], kths, kk, [TOPK_WANT * k for k in kk], fl, counts)
    for i in direct:
        x, a = xs[i], adds[i]
        if srcs[i] is not None:  # (read in place from here on)
            x.copy_(srcs[i])
        if scores is not None and scores[i] is not None:  # ranked whole by the caller
            if a is not None:
                x.add_(a)
            idx, kth = rank(i)
            vals = x[idx]
            if zero:
                x.index_fill_(0, idx, 0.0)
        else:
            idx, vals = topk(x, ks[i], hist=accumulate(x, a) if a is not None else None, zero=zero)
            kth = float(vals.abs().min()) if vals.numel() else 0.0
        out[i] = (idx, vals)
        Guess.update(states[i], kth, ks[i], TOPK_WANT * ks[i], *failed.get(i, (None, None)))
    for i, kp in enumerate(keeps or ()):
        if kp is not None and out[i][0].numel() > kp[0]:  # (not kept in the pass: the eager or histogram path)
            out[i] = _keep_some(xs[i], *out[i], kp[0], kp[1], zero)
    if finite is not None:
        finite[:] = fin
    return out


def columns(x: torch.Tensor) -> bool:
    """Whether a group asking for top-k alone, or for candidates alone, has its compiled spec built a column at a
    time (:func:`gradsift.kernels.many_compiled.plain_call`, ``plain_scan``; the compiled backend), not a row at a
    time."""
    return _compiled(x)


def _floors(states, ns, ks) -> tuple[list[float | None], list[int]]:
    """Per tensor, the floor and the candidate cap of its pass (:meth:`Guess.floors`; every entry of a tensor of at
    most ``EVERY_ENTRY``); a floor of None: no guess for a large tensor (the histogram path)."""
    got = Guess.floors(states, ns, ks, every=EVERY_ENTRY)
    return [None if g is None else g[0] for g in got], [0 if g is None else g[1] for g in got]


def _keep_some(x, idx, vals, keep: int, seed: int, zero: bool):
    """``keeps``' draw after a selection (:func:`topk_many`): the selection in index order, a random ``keep`` of it
    kept, the rest put back into ``x`` where it was zeroed."""
    order = torch.argsort(idx)
    idx, vals = idx[order], vals[order]
    chosen = torch.zeros(idx.numel(), dtype=torch.bool, device=idx.device)
    chosen[draw_k(idx.numel(), keep, seed, idx.device)] = True
    if zero:
        x[idx[~chosen]] = vals[~chosen].to(x.dtype)
    return idx[chosen], vals[chosen]


def scan_many(xs: Sequence[torch.Tensor], adds: Sequence[torch.Tensor | None],
              floors: Sequence[float | None] = (), caps: Sequence[int] = (),
              momentum: tuple | None = None,
              samples: Sequence[tuple[int, int, int] | None] = (),
              levels: Sequence[Levels | None] = (), sidco: Sequence[Any] = (),
              dgc: Sequence[tuple[int, int] | None] = (),
              srcs: Sequence[torch.Tensor | None] = ()) -> list[Scan]:
    """One pass per tensor: ``xs[i] += adds[i]`` (when given) and the entries whose magnitude reaches ``floors[i]``
    (default: the non-finite ones), at most ``caps[i]`` (default 64), with the largest magnitude read on the way
    (:class:`Scan`). With ``momentum`` = (us, m, nesterov) the pass is momentum correction's instead, ``xs`` the
    velocities v and ``adds`` the gradients: ``u = m u + g; v += u`` (Nesterov: ``u = (u + g) m; v += u + g``),
    rounded as the torch operations round; (us, m, nesterov, u_srcs) reads ``u_srcs[i]`` and ``srcs[i]`` instead
    and writes ``us[i]`` and ``xs[i]`` whole (both sources given or neither, per tensor). ``samples[i]`` = (start, stride, count) copies ``xs[i][start::stride]
    [:count]`` out as the pass updates it (DGC's sampled threshold, without a second, scattered read).
    ``levels[i]`` gathers moments at magnitude levels (:class:`Levels`; ``Scan.moments``). ``sidco[i]`` = (ints,
    doubles, path room), SIDCo's options and the tensor's state (``SIDCo._rows``), has the compiled pass work out
    the floor and the levels from that state (``floors[i]`` and ``levels[i]`` are not read), then find SIDCo's
    threshold, select, and learn the next state right after (``Scan.sidco``: ``sd_in_scan``'s out row in ``select.c``; None for
    non-finite tensors; compiled backend only).
    ``dgc[i]`` = (k, settle), with a sample, has it select as DGC does right after (``dgc_in_scan``: ``Scan.dgc``,
    the selection in ``idx`` / ``vals``; None where it did not: the eager backend, non-finite tensors, counts that
    would read the tensor), and with settle 1 zero it in ``xs[i]``, with 2 in the momentum ``u`` too. ``srcs[i]``:
    read from there, ``xs[i]`` written whole (as :func:`topk_many`)."""
    m = len(xs)
    floors = list(floors) or [None] * m
    caps = list(caps) or [64] * m
    if m and not momentum and all(v is None for v in itertools.chain(samples, levels, sidco, dgc)) and columns(xs[0]):
        srcs = list(srcs) if any(t is not None for t in srcs) else None  # (the candidates alone: a column at a time)
        return plain_scan(xs, adds, floors, [min(c, x.numel()) for c, x in zip(caps, xs)], srcs)
    samples = list(samples) or [None] * m
    levels = list(levels) or [None] * m
    sidco = list(sidco) or [None] * m
    dgc = list(dgc) or [None] * m
    usrcs = momentum[3] if momentum and len(momentum) > 3 else [None] * m
    moms = [(momentum[0][i], momentum[1], momentum[2], usrcs[i]) for i in range(m)] if momentum else [None] * m
    rows = [Ask(i, floors[i], min(caps[i], xs[i].numel()), None, None, moms[i], samples[i], levels[i], sidco[i],
                dgc[i]) for i in range(m)]
    return _run(xs, [0] * m, list(adds), rows, False, list(srcs) or None)


def pick_many(xs: Sequence[torch.Tensor], adds: Sequence[torch.Tensor | None],
              draws: Sequence[torch.Tensor | Draw], zero: bool = False,
              srcs: Sequence[torch.Tensor | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pass per tensor: ``xs[i] += adds[i]`` (when given) and the entries at the positions ``draws[i]`` (int64,
    duplicates allowed; or a :class:`Draw`: the k positions of :func:`gradsift.kernels.draw.draw_k`, drawn inside the
    pass), each once, in index order, as (indices, values) -- zeroed in ``xs[i]`` with ``zero``: random-k's
    selection read while the accumulating pass holds the line, not gathered afterwards. ``srcs[i]``: read from
    there, ``xs[i]`` written whole (as :func:`topk_many`)."""
    m = len(xs)
    draws = [d if isinstance(d, Draw) else d.contiguous() for d in draws]
    rows = [Ask(i, None, min(d.k if isinstance(d, Draw) else d.numel(), xs[i].numel()), drawn=d)
            for i, d in enumerate(draws)]
    return [g.result for g in _run(xs, [0] * m, list(adds), rows, zero, srcs)]


TAKE_ROOM = 1 << 20  # take_above writes up to this many entries without counting them first


def count_above(v: torch.Tensor, t: float, inclusive: bool = False, magnitudes: bool = False) -> int:
    """How many entries of the flat ``v`` have ``|v| > t`` (``>=`` with ``inclusive``), compared as a tensor
    compares with a number (float32 ``v``: with ``t`` rounded to float32): one read of ``v``, compiled for float32.
    ``magnitudes``: ``v`` is already ``|x|`` (the torch form then takes no ``abs``)."""
    if t >= 0 and batchable(v) and _compiled(v):
        return int(_state["lib"].gs_count_above(v.data_ptr(), v.numel(), _bits(t), int(inclusive)))
    mag = v if magnitudes else v.abs()
    return int(torch.count_nonzero(mag >= t if inclusive else mag > t))


def take_above(v: torch.Tensor, idx: torch.Tensor | None, t: float, inclusive: bool = False,
               magnitudes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of :func:`count_above`, in order: (their positions -- ``idx`` at them when given, else their own
    --, their values)."""
    if t >= 0 and batchable(v) and _compiled(v) and (idx is None or idx.is_contiguous()):
        # candidates: room for all, one branch-free read; a whole tensor: counted first, room for those only
        cap = v.numel() if v.numel() <= TAKE_ROOM else count_above(v, t, inclusive)
        oi, ov = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.float32)
        n = _state["lib"].gs_take_above(v.data_ptr(), idx.data_ptr() if idx is not None else None, v.numel(),
                                        _bits(t), int(inclusive), oi.data_ptr(), ov.data_ptr(), cap)
        return (oi, ov) if n == cap else (oi[:n].clone(), ov[:n].clone())
    mag = v if magnitudes else v.abs()
    keep = torch.nonzero(mag >= t if inclusive else mag > t).squeeze(1)  # (then index_select: masks are slower)
    return (keep if idx is None else idx.index_select(0, keep)), v.index_select(0, keep)


def take_above_many(vs, idxs, ts, zeros, caps=None) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """:func:`take_above` of many float32 CPU ``vs[i]`` (candidates: their positions ``idxs[i]``; a whole tensor:
    None) above ``ts[i]`` (>= 0), and where ``zeros[i]`` is a tensor, those positions zeroed in it: one compiled call
    for them all (a threshold method's selections of a group): (indices, values, overflow) each. ``caps``: with them,
    each tensor's wire capacity is taken there too: a selection of more than ``caps[i]`` entries keeps the ``caps[i]``
    of largest magnitude, in their order, the others left in ``zeros[i]`` unzeroed and counted as ``overflow`` --
    :func:`gradsift.payload.fit_capacity`'s choice, bit for bit, which follows where magnitudes tie across the cut;
    and what is kept, at most ``caps[i]``, takes the wire's bf16 cast (:meth:`Compressor.wire`'s bits): its values
    come in bf16, ``zeros[i]`` keeping what the cast rounds off (``v - bf16(v)``, where the cast after it put that
    back at the same places); the values must be finite. The compiled backend only (:func:`_compiled`)."""
    sizes = [v.numel() for v in vs]
    at = list(itertools.accumulate(sizes, initial=0))
    caps = caps if caps is not None else [-1] * len(vs)
    oi, ov = torch.empty(at[-1], dtype=torch.int64), torch.empty(at[-1], dtype=torch.float32)
    rows = spec_columns((pointers(vs), pointers(idxs), sizes, float_bits(ts), [0] * len(vs), pointers(zeros),
                         at[:-1], caps), len(vs), 8)
    counts, kept = array.array("q", bytes(8 * len(vs))), array.array("q", bytes(8 * len(vs)))
    ob = torch.empty(at[-1], dtype=torch.bfloat16) if any(c >= 0 for c in caps) else None
    _state["lib"].gs_take_above_many(rows.buffer_info()[0], len(vs), oi.data_ptr(), ov.data_ptr(),
                                     counts.buffer_info()[0], ob.data_ptr() if ob is not None else None,
                                     kept.buffer_info()[0])
    return [(oi[a:a + c], (ob if z is not None and 0 <= c <= cap else ov)[a:a + c], n - c)
            for a, z, cap, n, c in zip(at, zeros, caps, counts, kept)]


def _double_bits(vs) -> list[int]:
    """Float64s' bits as signed int64s (spec fields), through ``array``."""
    return array.array("q", array.array("d", vs).tobytes()).tolist()


def _threshold_rows(fn, rows, last) -> list[float]:
    """One compiled call of ``fn`` over rows (first, k, candidates' values, floor bits, count at the floor, tensor,
    two more fields made int columns by ``last``), its spec filled a column at a time: a threshold each."""
    m = len(rows)
    t, k, v, fb, count, x, a, b = zip(*rows)
    spec = spec_columns((_double_bits(t), k, pointers(v), [u.numel() for u in v], fb, count, pointers(x),
                         [u.numel() for u in x], *last(a, b)), m, 10)
    out = array.array("d", bytes(8 * m))
    fn(spec.buffer_info()[0], m, out.buffer_info()[0])
    return list(out)


def gaussk_corrections(rows) -> list[float]:
    """GaussianK's corrections for many tensors in one compiled call (``gs_gaussk_many``: the float64 operations of
    :meth:`gradsift.compressors.gaussiank.GaussianK.correct`, each count :meth:`Tail.count_above`'s), each row (first
    threshold, k, the candidates' float32 values, the floor's magnitude bits, how many reached the floor, the float32
    tensor, rounds, printed steps or not); the compiled backend only, contiguous CPU tensors."""
    return _threshold_rows(_state["lib"].gs_gaussk_many, rows,
                           lambda rounds, paper: (rounds, [int(p) for p in paper]))


def redsync_searches(rows) -> list[float]:
    """RedSync's searches for many tensors in one compiled call (``gs_redsync_many``: the float64 operations of
    :meth:`gradsift.compressors.redsync.RedSync.threshold`, each count :meth:`Tail.count_above`'s), each row (mean
    magnitude, k, the candidates' float32 values, the floor's magnitude bits, how many reached the floor, the float32
    tensor, the largest magnitude, the search's width); the compiled backend only, contiguous CPU tensors."""
    return _threshold_rows(_state["lib"].gs_redsync_many, rows, lambda top, tol: (_double_bits(top), _double_bits(tol)))


def _run(xs, ks, adds, rows: list[Ask], zero: bool, srcs=None, wire_bf16: bool = False) -> list[Scan]:
    """The rows on the backend the kernels resolved to (``srcs``: per tensor, where to read it from; None: itself;
    ``wire_bf16``: the compiled pass casts top-k's selections for the wire, :func:`topk_many`)."""
    if not rows:
        return []
    srcs = srcs if srcs is not None and any(t is not None for t in srcs) else None
    if any(r.mom is not None and (r.mom[3] is not None) != (srcs is not None and srcs[r.i] is not None)
           for r in rows):
        raise ValueError("momentum correction's pass reads u and v both in place or both from sources")
    if _compiled(xs[rows[0].i]):
        return many_compiled(xs, ks, adds, rows, zero, srcs, wire_bf16, _sample_count)
    return _many_eager(xs, ks, adds, rows, zero, srcs)


def _sample_count(n: int, start: int, stride: int, count: int) -> int:
    """How many of ``x[start::stride][:count]`` exist in ``n`` entries."""
    return max(0, min(count, (n - start + stride - 1) // stride)) if start < n else 0
