"""The compiled pass's calls (:func:`gradsift.kernels.many.topk_many`, ``scan_many``): spec rows in, results out.

:func:`many_compiled` takes rows asking for anything; :func:`plain_call` the common case of a group asking for the
pass and top-k alone (top-k's groups), its spec built a column at a time instead of a row at a time: the same spec,
the same call, the same results, with less Python per tensor (``benchmarks/plain_rows.py`` times the two against each
other)."""

from __future__ import annotations

import array
import itertools
import math

import torch

from . import _state
from .buffers import candidate_buffers, flat_array, pointers, spec_columns
from .many_eager import _bits_of
from .moments import INF_BITS, SD_HEAD, _bits, _magnitude
from .rows import Draw, Scan
from .spec import F, SPEC, blank_row

ONE_BITS = _bits(1.0)
FLOAT_MAX = 3.4028234663852886e38  # (as _bits clamps)


def source_ptr(src: torch.Tensor, x: torch.Tensor) -> int:
    """The address of a tensor the pass reads instead of ``x`` (error feedback's kept residual, momentum's u),
    refused unless it is contiguous with x's dtype and size."""
    if src.dtype != x.dtype or src.numel() != x.numel() or not src.is_contiguous():
        raise ValueError("a source must be a contiguous tensor of the same dtype and size")
    return src.data_ptr()


def float_bits(values) -> list[int]:
    """:func:`gradsift.kernels.moments._bits` of many magnitudes at once (float32 bit patterns, through ``array``)."""
    return array.array("I", array.array("f", [min(abs(v), FLOAT_MAX) for v in values]).tobytes()).tolist()


def _sources(cols, xs, adds, srcs, at) -> None:
    """The ADD and SRC columns of the rows of ``xs[i]``, ``i`` in ``at``, where any of them has one."""
    if any(adds[i] is not None for i in at):
        cols[F.ADD] = pointers(adds[i] for i in at)
    if srcs is not None and any(srcs[i] is not None for i in at):
        cols[F.SRC] = [source_ptr(srcs[i], xs[i]) if srcs[i] is not None else 0 for i in at]


def plain_scan(xs, adds, floors, caps, srcs=None) -> list[Scan]:
    """The compiled pass over every ``xs[i]`` (``xs[i] += adds[i]`` where given, read from ``srcs[i]`` where given)
    asking for its candidates alone -- the entries whose magnitude reaches ``floors[i]`` (None: the non-finite
    ones), at most ``caps[i]`` -- its spec built a column at a time as :func:`plain_call`'s: what
    :func:`gradsift.kernels.many.scan_many` gives for rows asking nothing more (a threshold method's tails,
    GaussianK's), with less Python per tensor. The candidates are views of buffers of this call's own."""
    m = len(xs)
    at = range(m)
    cand_at = list(itertools.accumulate(caps, initial=0))
    bits = float_bits([0.0 if f is None else f for f in floors])
    cols = {F.X: [x.data_ptr() for x in xs], F.N: [x.numel() for x in xs], F.CAP: list(caps),
            F.FLOOR: [INF_BITS if f is None else b for f, b in zip(floors, bits)], F.CAND_AT: cand_at[:-1],
            F.SCORE_BASE: [ONE_BITS] * m, F.SAMPLE_STRIDE: [1] * m}
    _sources(cols, xs, adds, srcs, at)
    spec = spec_columns(cols, m, SPEC)
    res = array.array("q", bytes(32 * m))
    ci, cv = torch.empty(cand_at[-1], dtype=torch.int64), torch.empty(cand_at[-1], dtype=torch.float32)
    cs, none = torch.empty(cand_at[-1], dtype=torch.float32), torch.empty(0)
    if _state["lib"].gs_topk_many(spec.buffer_info()[0], m, res.buffer_info()[0], ci.data_ptr(), cv.data_ptr(),
                                  cs.data_ptr(), none.data_ptr(), none.data_ptr(), None, none.data_ptr(), 0,
                                  max(1, min(torch.get_num_threads(), m))) < 0:
        raise MemoryError("gradsift selection kernel: out of memory for its scratch keys")
    return [Scan(None if st else (ci[a:a + c], cv[a:a + c]), c, 0.0, tp, None)
            for st, c, tp, a in zip(res[0::4], res[1::4], res[3::4], cand_at)]


def plain_call(xs, kk, adds, at, floors, caps, zero: bool, srcs=None, wire_bf16: bool = False,
               sizes=None, scores=None) -> tuple[list, list, list, list, list]:
    """The compiled pass over the tensors ``xs[i]``, ``i`` in ``at``, asking for top-k alone (``kk``, floors and caps
    given per listed tensor: ``k > 0``, floats, ints; ``sizes``: their sizes, where known) -- or, with ``scores``
    (per listed tensor (positions, factors, base): :func:`gradsift.kernels.many.topk_many`'s), for the top-k of the
    scores -- its spec built a column at a time: the Python per tensor of top-k's and REGTOP-k's groups kept to list
    slices. Columns, one entry per listed tensor, as :class:`Scan` reads them: status (0: selected), count, k-th
    magnitude (or score), top bits, and (indices, values) or None."""
    m = len(at)
    cand_at = list(itertools.accumulate(caps, initial=0))
    out_at = list(itertools.accumulate(kk, initial=0))
    cols = {F.X: [xs[i].data_ptr() for i in at], F.N: sizes or [xs[i].numel() for i in at], F.K: kk, F.CAP: caps,
            F.FLOOR: float_bits(floors), F.CAND_AT: cand_at[:-1], F.OUT_AT: out_at[:-1],
            F.SCORE_BASE: [ONE_BITS] * m, F.SAMPLE_STRIDE: [1] * m}
    _sources(cols, xs, adds, srcs, at)
    keep = []  # (the scores' tensors the kernel reads: alive until it returns)
    if scores is not None:
        pos = [p if p.is_contiguous() else p.contiguous() for p, _, _ in scores]
        fac = [f if f.dtype == torch.float32 and f.is_contiguous() else f.to(torch.float32).contiguous()
               for _, f, _ in scores]
        keep = [pos, fac]
        cols[F.SCORE_POS], cols[F.SCORE_FAC] = [t.data_ptr() for t in pos], [t.data_ptr() for t in fac]
        cols[F.SCORE_N], cols[F.SCORE_BASE] = [t.numel() for t in pos], float_bits([b for _, _, b in scores])
    wire = int(wire_bf16 and zero)
    if wire:
        cols[F.WIRE_BF16] = [wire] * m
    spec = spec_columns(cols, m, SPEC)  # (spec and results in arrays, their addresses passed: no torch call)
    res = array.array("q", bytes(32 * m))
    ci, cv, cs = candidate_buffers(cand_at[-1])
    oi, ov = torch.empty(out_at[-1], dtype=torch.int64), torch.empty(out_at[-1], dtype=torch.float32)
    ob = torch.empty(out_at[-1], dtype=torch.bfloat16) if wire else None
    ois, vals = oi.split_with_sizes(kk), (ob if wire else ov).split_with_sizes(kk)  # (the views made before the
    # pass, while the caches hold what torch's calls read: made after it, they took some 150 us a call)
    p = lambda t: t.data_ptr()  # noqa: E731
    if _state["lib"].gs_topk_many(spec.buffer_info()[0], m, res.buffer_info()[0], p(ci), p(cv), p(cs), p(oi), p(ov),
                                  p(ob) if ob is not None else None, None, int(zero),  # (no sample asked)
                                  max(1, min(torch.get_num_threads(), m))) < 0:
        raise MemoryError("gradsift selection kernel: out of memory for its scratch keys")
    del keep
    status, count, top = res[0::4].tolist(), res[1::4].tolist(), res[3::4].tolist()
    kths = array.array("f", array.array("I", res[2::4]).tobytes()).tolist()  # (the k-th's bits: a float32 magnitude)
    got = list(zip(ois, vals))
    if any(status) or (wire and max(top) >= INF_BITS):  # (a floor missed; a non-finite tensor's values: float32)
        got = [None if st else (i, v if tp < INF_BITS else ov[a:a + len(i)])
               for st, tp, i, v, a in zip(status, top, ois, vals, out_at)]
    return status, count, kths, top, got


def many_compiled(xs, ks, adds, rows, zero: bool, srcs=None, wire_bf16: bool = False, sample_count=None):
    """The rows in one ``gs_topk_many`` call, whatever each asks for (draws, scores, momentum, samples, levels,
    SIDCo's and DGC's selections); ``sample_count(n, start, stride, count)``: a sample's length."""
    spec, cand_at, out_at = [], 0, 0
    keep = []  # tensors whose addresses the kernel reads: alive until it returns
    sample_at, lev_at = 0, 0
    lev_vals: list[float] = []
    sd_i: list[int] = []
    sd_d: list[float] = []
    leveled = []  # per row with levels: (spec row, offset of its values, of its moments)
    sds = []  # per SIDCo row: (spec row, offset of its ints, of its doubles, its path's room)
    dgcs = []  # the spec rows asking for DGC's selection
    for i, floor, cap, drawn, score, mom, sample, levels, sidco, dgc, kept in rows:
        x, a = xs[i], adds[i]
        row = blank_row(_bits(1.0))
        row[F.X], row[F.ADD], row[F.N], row[F.K] = x.data_ptr(), a.data_ptr() if a is not None else 0, x.numel(), ks[i]
        row[F.FLOOR], row[F.CAP], row[F.CAND_AT], row[F.OUT_AT] = _bits_of(floor), cap, cand_at, out_at
        if srcs is not None and srcs[i] is not None:
            row[F.SRC] = source_ptr(srcs[i], x)
        if isinstance(drawn, Draw):
            row[F.DRAW_SEEDED], row[F.DRAWN_N], row[F.DRAW_SEED] = 1, drawn.k, drawn.seed
        elif drawn is not None:
            row[F.DRAWN], row[F.DRAWN_N] = drawn.data_ptr(), drawn.numel()
        row[F.SAMPLE_AT] = sample_at
        if sample is not None:
            row[F.SAMPLE_START], row[F.SAMPLE_STRIDE] = sample[0], sample[1]
            row[F.SAMPLE_N] = sample_count(x.numel(), *sample)
            sample_at += row[F.SAMPLE_N]
            if dgc is not None:  # (k, settle: 0 no, 1 zero v, 2 and mask u; + 8: v keeps what bf16 rounds off)
                row[F.DGC_K], settle = dgc[0], dgc[1] & 3
                row[F.DGC_FLAGS] = int(floor is not None) | (2 if settle else 0) | (4 if settle == 2 else 0) | \
                    (dgc[1] & 8 if settle else 0)
                dgcs.append(row)
        if levels is not None:
            row[F.LEV_N], row[F.LEV_EXP] = len(levels.levels), math.frexp(levels.scale)[1] - 1
            row[F.LEV_SQUARES] = int(levels.squares)
            leveled.append((row, len(lev_vals), lev_at))
            lev_vals += levels.levels
            lev_at += 3 * len(levels.levels)
        if sidco is not None:
            sds.append((row, len(sd_i), len(sd_d), sidco[2]))
            sd_i += sidco[0]
            sd_d += sidco[1]
        if mom is not None:
            row[F.MOM_U], row[F.MOM_M], row[F.MOM_NESTEROV] = mom[0].data_ptr(), _bits(mom[1]), int(bool(mom[2]))
            if mom[3] is not None:
                row[F.MOM_USRC] = source_ptr(mom[3], x)
        row[F.WIRE_BF16] = int(wire_bf16 and zero and ks[i] > 0 and drawn is None and mom is None)
        if kept is not None and 0 < kept[0] < ks[i]:
            row[F.KEEP_K], row[F.DRAW_SEED] = kept
        if score is not None:
            pos, fac, base = score
            pos, fac = pos.contiguous(), fac.to(torch.float32).contiguous()
            keep += [pos, fac]
            row[F.SCORE_POS], row[F.SCORE_FAC], row[F.SCORE_N], row[F.SCORE_BASE] = \
                pos.data_ptr(), fac.data_ptr(), pos.numel(), _bits(base)
        spec.append(row)
        cand_at += cap
        out_at += ks[i]
    lev_t = flat_array("d", lev_vals)
    mom_t = torch.zeros(max(lev_at, 1), dtype=torch.int64)
    sd_it, sd_dt = flat_array("q", sd_i), flat_array("d", sd_d)
    width = SD_HEAD + max((room for *_, room in sds), default=0)  # (out rows: room for the longest path)
    sd_out = torch.zeros(max(len(sds), 1), width, dtype=torch.float64)
    at = [t.data_ptr() for t in (lev_t, mom_t, sd_it, sd_dt, sd_out)]
    for row, lev_off, mom_off in leveled:  # the arrays exist now: their addresses into the rows
        row[F.LEV_AT], row[F.LEV_OUT] = at[0] + 8 * lev_off, at[1] + 8 * mom_off
    for j, (row, i_off, d_off, _) in enumerate(sds):
        row[F.SD_INTS], row[F.SD_DOUBLES], row[F.SD_OUT] = at[2] + 8 * i_off, at[3] + 8 * d_off, at[4] + 8 * width * j
    dg_out = torch.zeros(max(len(dgcs), 1), 4, dtype=torch.float64)
    for j, row in enumerate(dgcs):
        row[F.DGC_OUT] = dg_out.data_ptr() + 32 * j
    spec_t = flat_array("q", itertools.chain.from_iterable(spec))
    res = torch.zeros(len(rows), 4, dtype=torch.int64)
    if all(ks[a.i] > 0 and a.sidco is None and a.dgc is None for a in rows):  # (the candidates: scratch only)
        ci, cv, cs = candidate_buffers(cand_at)
    else:  # (a scan's candidates, SIDCo's and DGC's selections are views of them: the caller's)
        ci, cv = torch.empty(cand_at, dtype=torch.int64), torch.empty(cand_at, dtype=torch.float32)
        cs = torch.empty(cand_at, dtype=torch.float32)
    oi, ov = torch.empty(out_at, dtype=torch.int64), torch.empty(out_at, dtype=torch.float32)
    ob = torch.empty(out_at, dtype=torch.bfloat16) if wire_bf16 else None  # (the selections cast for the wire)
    sv = torch.empty(sample_at, dtype=torch.float32)
    p = lambda t: t.data_ptr()  # noqa: E731
    if _state["lib"].gs_topk_many(p(spec_t), len(rows), p(res), p(ci), p(cv), p(cs), p(oi), p(ov), p(ob) if ob is not None else None,
                                  p(sv), int(zero),
                                  max(1, min(torch.get_num_threads(), len(rows)))) < 0:
        raise MemoryError("gradsift selection kernel: out of memory for its scratch keys")
    results = []
    moments = None  # (read when a row needs them)
    sd_rows = iter(sd_out.tolist() if sds else ())
    lev_offs = iter(m for _, _, m in leveled)
    dg_rows = iter(dg_out.tolist() if dgcs else ())
    for ask, s, (status, count, kth, top) in zip(rows, spec, res.tolist()):
        sample = sv[s[F.SAMPLE_AT]:s[F.SAMPLE_AT] + s[F.SAMPLE_N]] if ask.sample is not None else None
        got_m = got_sd = None
        got_dg = next(dg_rows) if s[F.DGC_K] else None
        if got_dg is not None and got_dg[3] == 1.0:  # DGC's selection, taken there
            at, n = s[F.CAND_AT], int(got_dg[2])
            results.append(Scan((ci[at:at + n], cv[at:at + n]), count, 0.0, top, sample, dgc=got_dg[:3]))
            continue
        if ask.levels is not None:
            at = next(lev_offs)
            moments = mom_t.tolist() if moments is None else moments
            got_m = [tuple(moments[at + 3 * j:at + 3 * j + 3]) for j in range(len(ask.levels.levels))]
        if ask.sidco is not None:
            got_sd = next(sd_rows)
            got_sd = got_sd if top < INF_BITS else None  # (not run on a non-finite tensor)
        if got_sd is not None and got_sd[3] >= 0:  # SIDCo's selection, taken there
            at, n = s[F.CAND_AT], int(got_sd[3])
            results.append(Scan((ci[at:at + n], cv[at:at + n]), count, 0.0, top, sample, got_m, got_sd))
        elif status:
            results.append(Scan(None, count, 0.0, top, sample, got_m, got_sd))
        elif ks[ask.i] == 0:  # a scan: the candidates themselves
            at = s[F.CAND_AT]
            results.append(Scan((ci[at:at + count], cv[at:at + count]), count, 0.0, top, sample, got_m, got_sd))
        else:
            at, k = s[F.OUT_AT], s[F.KEEP_K] or ks[ask.i]
            vals = ob[at:at + k] if s[F.WIRE_BF16] and top < INF_BITS else ov[at:at + k]
            results.append(Scan((oi[at:at + k], vals), count, _magnitude(kth), top, sample))
    return results
