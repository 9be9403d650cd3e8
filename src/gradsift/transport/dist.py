"""``torch.distributed`` transport: the same aggregation as the in-process one, with real collectives.

One aggregation of a group of tensors (a DDP bucket) issues, in the caller's
thread:

1. a small blocking all-gather of a header ``[flag, count_0, ..., count_T-1]``
   per rank (every rank learns every rank's counts, and whether any rank saw a
   non-finite gradient), when the group holds a sparse payload or a flag must be
   agreed;
2. one all-reduce per wire value dtype of the concatenated dense and
   shared-index values (pre-scaled by the worker weight if the mean is weighted);
3. one all-gather of a packed byte buffer holding this rank's sparse indices
   (int32, or int64 for tensors of 2**31 elements or more) and values, padded to
   the largest rank's size.

Collectives 2 and 3 are asynchronous; :meth:`PendingAggregate.then` decodes
them with local work only (collectives launched inside future callbacks hang
on gloo once there is more than one DDP bucket). Decoding follows
:mod:`gradsift.transport.base`: all-reduced sums divided by N; sparse parts
added in rank order with an accumulating index add -- exactly what the
in-process transport computes. Every collective inherits the process group's
timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..payload import SPARSE, GroupTraffic, Payload, index_dtype_for
from .base import combine_sparse, finish_reduced, normalize_weights, scaled_contribution

ALIGN = 8


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """All-gather equal-size flat tensors into one (all_gather_single where it exists, as 2.13 prefers)."""
    fn = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if fn is None:  # pragma: no cover - older torch
        chunks = list(out.chunk(dist.get_world_size(group)))
        return dist.all_gather(chunks, inp, group=group, async_op=async_op)
    return fn(out, inp, group=group, async_op=async_op)


@dataclass
class Header:
    """Every rank's flag and counts, as exchanged before the data collectives."""

    flags: list[int]
    counts: list[list[int]]  # counts[rank][tensor]


class PendingAggregate:
    """Collectives in flight for one group; :meth:`then` decodes them locally."""

    def __init__(self, transport: "DistTransport", payloads: Sequence[Payload], header: Header | None,
                 works: list, reduce_plan, gather_out: torch.Tensor | None, started: float,
                 flag_slot: bool = False):
        self.transport = transport
        self.payloads = payloads
        self.header = header
        self.works = works
        self.reduce_plan = reduce_plan
        self.gather_out = gather_out
        self.started = started
        self.finished: float | None = None
        self.flag_slot = flag_slot
        self.any_flag = False

    def decode(self) -> list[torch.Tensor]:
        """The flat means, in payload order. Local work only."""
        t = self.transport
        n = t.world_size
        weighted = t.weights is not None
        means: list[torch.Tensor | None] = [None] * len(self.payloads)
        if self.flag_slot:
            self.any_flag = bool(self.reduce_plan[0][0][-1] != 0)
        if self.header is not None:
            self.any_flag = self.any_flag or any(self.header.flags)
        for buf, items in self.reduce_plan:
            off = 0
            for i, count in items:
                means[i] = finish_reduced(buf[off:off + count], self.payloads[i], n, weighted)
                off += count
        if self.gather_out is not None:
            sparse_ids = [i for i, p in enumerate(self.payloads) if p.kind == SPARSE]
            per_rank = self.gather_out.view(n, -1)
            parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in sparse_ids}
            for r in range(n):
                counts = [self.header.counts[r][i] for i in sparse_ids]
                for i, (vals, idx) in zip(sparse_ids, t.unpack(per_rank[r], [self.payloads[i] for i in sparse_ids], counts)):
                    parts[i].append((vals, idx))
            for i in sparse_ids:
                p = self.payloads[i]
                means[i] = combine_sparse(parts[i], p.numel, p.grad_dtype, t.weights)
        self.finished = time.perf_counter()
        return means  # type: ignore[return-value]

    def future(self, with_flag: bool = False) -> torch.futures.Future:
        """A future resolving to the flat means (decoded in its callback, locally).

        ``with_flag`` resolves to ``(means, any_flag)`` instead: whether any rank
        raised the group's flag (non-finite input), through the header or the
        all-reduce's extra element.
        """
        def result(_=None):
            means = self.decode()
            return (means, self.any_flag) if with_flag else means

        futs = [w.get_future() for w in self.works]
        if not futs:
            f: torch.futures.Future = torch.futures.Future()
            f.set_result(result())
            return f
        return torch.futures.collect_all(futs).then(result)

    def then(self, fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.futures.Future:
        return self.future().then(lambda f: fn(f.value()))

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.decode()

    def traffic(self) -> GroupTraffic:
        """What this aggregation moved per worker (padded sizes from the header)."""
        n = self.transport.world_size
        reduce_bytes = sum(buf.numel() * buf.element_size() for buf, _ in self.reduce_plan)
        if self.flag_slot:
            reduce_bytes -= self.reduce_plan[0][0].element_size()
        gather = self.gather_out.numel() // n if self.gather_out is not None else 0
        if self.header is not None:
            sizes = [sum(self.header.counts[r][i] * (self.payloads[i].value_bytes + self.payloads[i].index_bytes)
                         if self.payloads[i].kind == SPARSE else self.payloads[i].nbytes
                         for i in range(len(self.payloads))) for r in range(n)]
        else:
            sizes = [sum(p.nbytes for p in self.payloads)] * n
        return GroupTraffic(n, sizes, reduce_bytes, gather)


class DistTransport:
    """Aggregates this rank's payloads with every other rank's over a process group."""

    def __init__(self, group=None, weights: Sequence[float] | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.weights = normalize_weights(weights, self.world_size)

    # --------------------------------------------------------------- header
    def exchange_header(self, payloads: Sequence[Payload], flag: int, device) -> Header:
        hdr = torch.tensor([flag] + [p.count for p in payloads], dtype=torch.int64, device=device)
        out = torch.empty(self.world_size * hdr.numel(), dtype=torch.int64, device=device)
        _all_gather_flat(out, hdr, self.group, async_op=False)
        rows = out.view(self.world_size, -1).tolist()
        return Header([r[0] for r in rows], [r[1:] for r in rows])

    # -------------------------------------------------------------- packing
    @staticmethod
    def packed_size(payloads: Sequence[Payload], counts: Sequence[int]) -> int:
        idx_bytes = sum(c * index_dtype_for(p.numel).itemsize for p, c in zip(payloads, counts))
        val_bytes = sum(c * p.value_bytes for p, c in zip(payloads, counts))
        return _pad(idx_bytes) + _pad(val_bytes)

    @staticmethod
    def pack(payloads: Sequence[Payload], size: int, device) -> torch.Tensor:
        """This rank's sparse payloads as bytes: [all indices | pad | all values | pad]."""
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        off = 0
        for p in payloads:
            idx = p.indices.to(index_dtype_for(p.numel))
            nb = idx.numel() * idx.element_size()
            if nb:
                buf[off:off + nb] = idx.view(torch.uint8)
            off += nb
        off = _pad(off)
        for p in payloads:
            nb = p.count * p.value_bytes
            if nb:
                buf[off:off + nb] = p.values.contiguous().view(torch.uint8)
            off += nb
        return buf

    @staticmethod
    def unpack(buf: torch.Tensor, payloads: Sequence[Payload], counts: Sequence[int]):
        """Inverse of :meth:`pack` for another rank's buffer, given its counts."""
        out_idx = []
        off = 0
        for p, c in zip(payloads, counts):
            dt = index_dtype_for(p.numel)
            nb = c * dt.itemsize
            out_idx.append(buf[off:off + nb].view(dt).long())
            off += nb
        off = _pad(off)
        result = []
        for p, c, idx in zip(payloads, counts, out_idx):
            nb = c * p.value_bytes
            vals = buf[off:off + nb].view(p.values.dtype)
            off += nb
            result.append((vals, idx))
        return result

    # ----------------------------------------------------------- aggregation
    def start(self, payloads: Sequence[Payload], header: Header | None = None,
              flag: int | None = None) -> PendingAggregate:
        """Issue the collectives for one group (header first, blocking, if needed and not given).

        ``flag`` (0/1), for a group without sparse payloads, travels as one extra
        element of the all-reduce, so every rank learns whether any rank raised it.
        """
        started = time.perf_counter()
        device = payloads[0].values.device
        has_sparse = any(p.kind == SPARSE for p in payloads)
        if header is None and has_sparse:
            header = self.exchange_header(payloads, 0, device)
        works = []
        # all-reduce: dense and shared-index values, grouped by wire dtype
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(payloads):
            if p.kind != SPARSE:
                by_dtype.setdefault(p.values.dtype, []).append(i)
        reduce_plan = []
        weight = self.weights[self.rank] if self.weights is not None else None
        flag_slot = flag is not None and header is None and bool(by_dtype)
        for j, (dtype, ids) in enumerate(by_dtype.items()):
            parts = [scaled_contribution(payloads[i], weight).reshape(-1) for i in ids]
            if flag_slot and j == 0:
                parts.append(torch.full((1,), float(flag), dtype=dtype, device=device))
            buf = torch.cat(parts)
            works.append(dist.all_reduce(buf, group=self.group, async_op=True))
            reduce_plan.append((buf, [(i, payloads[i].count) for i in ids]))
        gather_out = None
        if has_sparse:
            sp = [p for p in payloads if p.kind == SPARSE]
            sp_ids = [i for i, p in enumerate(payloads) if p.kind == SPARSE]
            size = max(self.packed_size(sp, [header.counts[r][i] for i in sp_ids]) for r in range(self.world_size))
            size = max(size, ALIGN)
            mine = self.pack(sp, size, device)
            gather_out = torch.empty(size * self.world_size, dtype=torch.uint8, device=device)
            works.append(_all_gather_flat(gather_out, mine, self.group, async_op=True))
        return PendingAggregate(self, payloads, header, works, reduce_plan, gather_out, started, flag_slot)

    def aggregate(self, payloads: Sequence[Payload]) -> list[torch.Tensor]:
        """Blocking aggregation: the flat means of this group."""
        return self.start(payloads).wait()
