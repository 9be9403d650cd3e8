"""The all-gather buffer of the ``gather`` route (:mod:`gradsift.transport.wire` defines its segments): every
sparse payload of a group, coded, in one buffer per rank -- written and read by one call of the compiled kernels
where they apply (on a GPU, on the host: one copy each way, not a few dozen kernel launches per tensor)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .. import kernels
from ..kernels.buffers import spec_rows
from ..payload import lowbits
from ..payload.indexcode import ELIAS_FANO, CorruptPayload, layout, low_bits
from ..payload import Payload, index_dtype_for
from .wire import (ALIGN, CODES, HEADER_BYTES, get_segment, pad, put_segment, segment_bytes,
                   slots, value_part_bytes)


class Seg(NamedTuple):
    """A gather segment's layout, a function of its tensor's size, its slots, its value bytes and bits alone."""

    code: int  # the index code (``CODES``)
    index_bytes: int  # the coded index part, before padding
    index_item: int  # 4 (int32) or 8 (int64): raw indices' bytes
    low: int  # Elias-Fano's low bits (0 for the other codes)
    value_part: int  # the value part's bytes, before padding
    size: int  # the whole segment's bytes
    values_at: int  # where the value part starts, from the segment's start


_SEGS: dict[tuple[int, int, int, int], Seg] = {}


def seg_of(p: Payload) -> Seg:
    """Payload ``p``'s segment layout, computed once per (size, slots, value bytes, bits): a step's group meets the
    same few every time, so coding and decoding a bucket read a table instead of working each segment out."""
    key = (p.numel, max(p.capacity, p.count), p.values.element_size(), p.value_bits)
    got = _SEGS.get(key)
    if got is None:
        if len(_SEGS) > 65536:  # (bounded: a run meets a few hundred)
            _SEGS.clear()
        numel, n, vsz, bits = key
        idt = index_dtype_for(numel)
        code, nb = layout(numel, n, idt.itemsize)
        got = _SEGS[key] = Seg(CODES[code], nb, idt.itemsize, low_bits(numel, n) if code == ELIAS_FANO else 0,
                               value_part_bytes(n, vsz, bits), segment_bytes(numel, n, idt, vsz, bits),
                               HEADER_BYTES + pad(nb))
    return got


def pack_gather(payloads: Sequence[Payload], flag: int, device) -> torch.Tensor:
    """This rank's all-gather buffer for the given sparse payloads (in group order). On a GPU with the compiled
    kernels, the buffer is written on the host (:func:`_to_host`: the indices and the values come over in one copy
    per dtype, the buffer goes back in one), so the bucket's coding costs a constant number of kernel launches
    and host reads, not a few dozen per tensor; the bytes are the same."""
    total = sum(seg_of(p).size for p in payloads)
    size = max(total, ALIGN)
    if torch.device(device).type != "cpu" and _host_codes(payloads):
        host = torch.zeros(size, dtype=torch.uint8)
        _pack_compiled(host, payloads, flag, _to_host([p.indices for p in payloads]),
                       _to_host([p.values for p in payloads]))
        return host.to(device)
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if not _pack_compiled(buf, payloads, flag):
        off = 0
        for p in payloads:
            off = put_segment(buf, off, (p.count, flag), p.indices, p.values, slots(p), index_dtype_for(p.numel), p.numel,
                              p.value_bits)
    return buf


def _host_codes(payloads: Sequence[Payload]) -> bool:
    """Whether a device's payloads can be coded by the compiled kernels on the host."""
    return bool(payloads) and kernels.compiled_lib(torch.empty(0)) is not None and \
        all(p.count == p.values.numel() for p in payloads)


def _to_host(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``xs``: one concatenation and one copy per dtype, split back into views (their order kept)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(x.dtype, []).append(i)
    for ids in by_dtype.values():
        flat = torch.cat([xs[i].reshape(-1) for i in ids]).cpu()
        for i, part in zip(ids, flat.split([xs[i].numel() for i in ids])):
            out[i] = part
    return out  # type: ignore[return-value]


def _pack_compiled(buf: torch.Tensor, payloads: Sequence[Payload], flag: int,
                   idxs: Sequence[torch.Tensor] | None = None, vals: Sequence[torch.Tensor] | None = None) -> bool:
    """Every segment of ``pack_gather``'s buffer in one call of the compiled kernel (``gs_pack_segments``: the same
    bytes as :func:`put_segment`, segment by segment): on the CPU with the compiled kernels; False where it does not apply
    (the caller then writes them one by one). ``idxs``/``vals``: host copies of the payloads' tensors, where those
    live on a device."""
    lib = kernels.compiled_lib(buf)
    if lib is None or not payloads or any(p.count != p.values.numel() for p in payloads):
        return False
    idxs = idxs if idxs is not None else [p.indices for p in payloads]
    vals = list(vals if vals is not None else [p.values for p in payloads])
    coded = [j for j, p in enumerate(payloads) if p.value_bits]
    if coded:  # values below 16 bits: every such value part coded in one go, handed over whole
        bits = payloads[coded[0]].value_bits
        parts = lowbits.encode(torch.cat([vals[j] for j in coded]), [payloads[j].count for j in coded],
                               [slots(payloads[j]) for j in coded], bits)
        for j, part in zip(coded, parts):
            vals[j] = part
    rows, keep, off = [], [], 0
    for p, i, v in zip(payloads, idxs, vals):
        g = seg_of(p)
        if i.dtype != torch.int64 or not i.is_contiguous():
            i = i.to(torch.int64).contiguous()
        if not v.is_contiguous():
            v = v.contiguous()
        keep += (i, v)
        rows.append((off, p.count, flag, p.numel, slots(p), g.code, g.index_bytes, g.index_item,
                     p.values.element_size(), g.low, i.data_ptr(), v.data_ptr(), v.numel() * v.element_size(),
                     g.value_part))
        off += g.size
    spec = spec_rows(rows)
    failed = lib.gs_pack_segments(buf.data_ptr(), spec.data_ptr(), len(rows))
    if failed:
        raise MemoryError(f"no memory to sort the indices of segment {failed - 1} of a gather buffer")
    return True


_VALUE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _unpack_row(p: Payload, g: Seg, n: int, off: int, at: int) -> tuple[int, ...]:
    """Payload ``p``'s row of the compiled unpacking's spec (``gs_unpack_segments``): its segment at ``off`` (layout
    ``g``, ``n`` slots), its indices to ``at``."""
    return off, p.numel, n, g.code, g.index_bytes, g.index_item, g.value_part, g.low, at


def unpack_gather(buf: torch.Tensor, payloads: Sequence[Payload],
                  sender: int = 0) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Rank ``sender``'s buffer, read with this rank's layout: ``[(count, flag, values, indices), ...]``. On a GPU
    with the compiled kernels, the buffer is read on the host (one copy there, the indices one copy back; the values
    stay views of ``buf``)."""
    host = buf
    if buf.device.type != "cpu" and _host_codes(payloads):
        host = buf.cpu()
    fast = _unpack_compiled(host, payloads, sender, buf)
    if fast is not None:
        return fast
    out, off = [], 0
    for p in payloads:
        count, flag, idx, vals, off = get_segment(buf, off, slots(p), index_dtype_for(p.numel), p.values.dtype, p.numel,
                                           sender, bits=p.value_bits)
        out.append((count, flag, vals, idx))
    return out


def _unpack_compiled(buf: torch.Tensor, payloads: Sequence[Payload], sender: int, values_from: torch.Tensor):
    """:func:`unpack_gather` with every segment's header, checksum and indices read by one call of the compiled
    kernel (``gs_unpack_segments``; the same indices as :func:`get_segment`, int64); a segment it finds corrupt is read again
    by :func:`get_segment`, which raises what is wrong. None where the compiled kernels do not apply. ``buf`` is on the
    host; the values are views of ``values_from`` (``buf`` or its device original), the indices on its device."""
    lib = kernels.compiled_lib(buf)
    if lib is None or not payloads or not buf.is_contiguous():
        return None
    rows, spots, off, room = [], [], 0, 0
    for p in payloads:
        g, n = seg_of(p), slots(p)
        rows.append(_unpack_row(p, g, n, off, room))
        spots.append((off, n, room, off + g.values_at))
        off += g.size
        room += n
    spec = spec_rows(rows)
    idx = torch.empty(max(room, 1), dtype=torch.int64)
    status = torch.empty(3 * len(rows), dtype=torch.int64)
    lib.gs_unpack_segments(buf.data_ptr(), spec.data_ptr(), len(rows), idx.data_ptr(), status.data_ptr())
    out = []
    found = status.view(-1, 3).tolist()
    for p, (start, n, _, _), (count, flag, bad) in zip(payloads, spots, found):
        if bad:
            get_segment(buf, start, n, index_dtype_for(p.numel), p.values.dtype, p.numel, sender, bits=p.value_bits)  # raises what is wrong
            raise CorruptPayload(f"rank {sender} sent a sparse payload that does not decode")  # (never reached)
    idx = idx.to(values_from.device)
    coded = [j for j, p in enumerate(payloads) if p.value_bits]
    decoded = {}
    if coded:  # values below 16 bits: every such value part decoded in one go
        got = lowbits.decode(values_from, [spots[j][3] for j in coded], [found[j][0] for j in coded],
                             [spots[j][1] for j in coded], payloads[coded[0]].value_bits)
        decoded = dict(zip(coded, got))
    for j, (p, (start, n, at, voff), (count, flag, bad)) in enumerate(zip(payloads, spots, found)):
        vsz = p.values.element_size()
        vals = decoded[j] if j in decoded else values_from[voff:voff + count * vsz].view(p.values.dtype)
        out.append((count, flag, vals, idx[at:at + count]))
    return out


def add_gathered(out: torch.Tensor, rows: torch.Tensor, payloads: Sequence[Payload], starts: Sequence[int],
                 mean: bool = False) -> tuple[torch.Tensor | None, list] | None:
    """Every rank's sparse segments added into ``out`` in one call of the compiled kernels (``gs_add_gathered``):
    ``rows`` holds rank r's gathered buffer in row r (uint8, contiguous, on the host), read with this rank's layout
    (``payloads``); ``out`` is zeroed and payload i's entries go to ``out[starts[i] + index]``, rank after rank, each
    made float32 and added once -- :func:`unpack_gather` of every row then
    :func:`~gradsift.transport.base.combine_sparse_many`'s adds, bit for bit, without a tensor per segment, tensor
    after tensor while it is in cache; with ``mean``, each tensor then divided by the rank count where it is (what
    :func:`~gradsift.kernels.scatter.div_at` at the positions written gives). Returns (the positions written, None
    with ``mean``; ``[rank][payload]`` of (count, flag)); None where it does not apply (values below 16 bits or not float32/bfloat16, ``out`` not float32 on the
    host) or where a segment is not whole (then :func:`unpack_gather` of that row says what is wrong)."""
    lib = kernels.compiled_lib(out)
    if (lib is None or out.dtype != torch.float32 or not out.is_contiguous() or rows.device.type != "cpu"
            or not rows.is_contiguous() or rows.dim() != 2 or not payloads
            or any(p.value_bits or p.values.dtype not in _VALUE_CODES for p in payloads)):
        return None
    spec, adds, off, room, every = [], [], 0, 1, 0
    for p, start in zip(payloads, starts):
        g, n = seg_of(p), slots(p)
        if start < 0 or start + p.numel > out.numel():
            return None
        spec.append(_unpack_row(p, g, n, off, 0))
        adds.append((start, _VALUE_CODES[p.values.dtype], g.values_at))
        off += g.size
        room, every = max(room, n), every + n
    if off > rows.shape[1]:
        return None
    world, m = rows.shape[0], len(payloads)
    spec_t, adds_t = spec_rows(spec), spec_rows(adds)
    scratch = torch.empty(room, dtype=torch.int64)
    at = None if mean else torch.empty(world * every, dtype=torch.int64)
    status = torch.empty(3 * world * m, dtype=torch.int64)
    w = lib.gs_add_gathered(rows.data_ptr(), world, rows.shape[1], spec_t.data_ptr(), adds_t.data_ptr(), m,
                            scratch.data_ptr(), out.data_ptr(), out.numel(), at.data_ptr() if at is not None else None,
                            status.data_ptr(), float(world) if mean else 0.0)
    if w < 0:
        return None
    words = status.view(world, m, 3)[:, :, :2].tolist()
    return (at[:w] if at is not None else None), words
