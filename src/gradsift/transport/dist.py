"""``torch.distributed`` transport: the same aggregation as the in-process one, with real collectives.

One group (a DDP bucket) issues, in the caller's thread and all asynchronous:

* one all-reduce per value dtype of the group's ``reduce`` and ``densify``
  segments (:mod:`gradsift.transport.wire`), pre-scaled by the worker weight if
  the mean is weighted, divided after the sum otherwise;
* one all-gather of this rank's fixed-size buffer of ``gather`` segments --
  followed, where the road merges (``start(merge=True)``), by the all-reduce
  buffers' bytes instead of their all-reduces: one collective for the group,
  its reduce segments summed by each rank in rank order.

A group sent whole with nothing held back (:meth:`DistTransport.start_in_place`)
is instead one all-reduce of DDP's bucket buffer itself, divided after the sum
(or pre-scaled by the rank's weight), exactly as the whole route computes; its
delivery's means are views of that buffer.

``sum_order``: ``"backend"`` (default) lets the all-reduce sum in its own order
(gloo's ring starts each chunk at another rank, NCCL picks rings or trees);
``"rank"`` sums in rank order, as the simulator does, so a run gives the
simulator's bits at any world size on any backend: the values of each
all-reduce segment then travel by an all-gather and every rank sums the rows
itself (``(N-1) x`` the segment received per rank instead of an all-reduce's
``2(N-1)/N x``; sparse payloads are unchanged). With two ranks both orders give
the same bits (a sum of two is commutative), so ``"rank"`` changes nothing
there.

Nothing blocks: buffer sizes follow from the configuration (every sparse
payload has a capacity every rank knows), so there is no count exchange, and
each rank's non-finite flag travels inside the data. :meth:`DistPending.future`
decodes in the future's callback with local work only (collectives launched
inside callbacks hang on gloo once there is more than one DDP bucket), exactly
as the in-process transport computes. Every collective inherits the process
group's timeout.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..payload import Payload, accumulate_dtype, is_finite
from .base import (SUM_ORDERS, Delivery, GroupTraffic, combine_sparse_many, decode_scattered, densified,
                   finish_reduced, finish_reduced_many, mean_in_place, mean_into, normalize_weights,
                   scaled_contribution, split_for_owners, sum_rows, traffic_of)
from ..payload.indexcode import CorruptPayload
from .gather import add_gathered, pack_gather, unpack_gather
from .wire import (ALIGN, DENSIFY, GATHER, SCATTER, check_report, corrupt_report, pack_blocks, pack_owned, reduce_dtype,
                   route_of, unpack_block, unpack_owned)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """All-gather equal-size flat tensors into one (``all_gather_single`` where it exists, as 2.13 prefers)."""
    fn = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if fn is None:  # pragma: no cover - older torch
        chunks = list(out.chunk(dist.get_world_size(group)))
        return dist.all_gather(chunks, inp, group=group, async_op=async_op)
    return fn(out, inp, group=group, async_op=async_op)


class _RowsAs(NamedTuple):
    """A merged group's all-reduce buffer as it arrived: every rank's bytes of it (a column block of the gathered
    rows), to be read as ``dtype``."""

    rows: torch.Tensor
    dtype: torch.dtype

    def read(self) -> torch.Tensor:
        """One row per rank, of ``dtype`` (copied out of the gathered bytes: no alignment asked of them)."""
        return self.rows.contiguous().view(self.dtype)


class DistPending:
    """Collectives in flight for one group; :meth:`future` decodes them locally."""

    def __init__(self, transport: "DistTransport", payloads: Sequence[Payload], routes: Sequence[str], works: list,
                 reduce_plan: list, gather_out: torch.Tensor | None, started: float,
                 in_place: torch.Tensor | None = None, rows: torch.Tensor | None = None, scatter=None,
                 out: torch.Tensor | None = None, merged: bool = False, gather_bytes: int = 0):
        self.transport = transport
        self.merged = merged  # the all-reduce buffers rode the all-gather (start(merge=True))
        self.gather_bytes = gather_bytes  # (merged) each rank's sparse segments' bytes, at the start of its row
        self.payloads = list(payloads)
        self.routes = list(routes)
        self.works = works
        self.reduce_plan = reduce_plan  # [(buffer, [(payload index, value elements)])], flag after each segment
        self.gather_out = gather_out
        self.started = started
        self.in_place = in_place  # the buffer summed in place (start_in_place), else None
        self.out = out  # (start_in_place of a narrower copy) where its mean goes
        self.rows = rows  # (sum_order "rank", in place) every rank's buffer, gathered, to sum in rank order
        # (the scatter route) stage 1 in flight: (its all-to-all work, received blocks, payload ids, owners, flag);
        # stage 2 (the owners' selections, all-gathered) starts in advance() from the caller's thread
        self.scatter = scatter
        self.owned_out: torch.Tensor | None = None
        self.sender_words: list[list[tuple[int, int]]] = []  # per scattered payload: every rank's (count, flag)
        self.corrupt: tuple[int, Exception] | None = None  # (sender, error): a block this owner could not decode
        self.finished: float | None = None
        self.code_s = time.perf_counter() - started  # coding the payloads and issuing the collectives
        self.decode_s = 0.0  # decoding and summing what arrived (set by decode)
        self.delivery: Delivery | None = None
        self.into: tuple[torch.Tensor, list[int | None]] | None = None  # (sum_into) where the sparse means go

    def sum_into(self, buffer: torch.Tensor, starts: Sequence[int | None]) -> None:
        """Sum the gather route's means straight into ``buffer`` (flat: the runtime's own gradients, overwritten
        whole when the group is decoded), payload i's at ``starts[i]`` (None: not in it). They come back as views of
        it, so the runtime has nothing to copy. Used where the gradients' dtype is the sum's (float32); call before
        :meth:`future`."""
        self.into = (buffer, list(starts))

    @property
    def traffic(self) -> GroupTraffic:
        return traffic_of(self.payloads, self.routes, self.transport.world_size, self.transport.ranked, self.merged)

    @property
    def needs_advance(self) -> bool:
        """Whether the scatter route's second stage has yet to start (:meth:`advance`)."""
        return self.scatter is not None

    def advance(self) -> None:
        """The scatter route's second stage, from the caller's thread (never from a future's callback: collectives
        started there hang on gloo): wait for the all-to-all, let this rank's owners reduce their regions of what
        every rank sent (in rank order), start the all-gather of their selections. Blocks for the all-to-all."""
        work, recv, ids, owners, flag = self.scatter
        self.scatter = None
        work.wait()
        t = self.transport
        mine = [self.payloads[i] for i in ids]
        blocks, empty = [], recv.new_zeros(0)
        for r in range(t.world_size):
            try:
                blocks.append(unpack_block(recv[r], mine, r))
            except CorruptPayload as e:  # every rank learns it from this owner's report, in the all-gather
                self.corrupt = self.corrupt or (r, e)
                blocks.append([(0, 0, empty.long(), empty.view(p.values.dtype)) for p in mine])
        kept, seen = [], flag
        for k, p in enumerate(mine):
            parts = [(blocks[r][k][2], blocks[r][k][3]) for r in range(t.world_size)]
            self.sender_words.append([(blocks[r][k][0], blocks[r][k][1]) for r in range(t.world_size)])
            seen = max(seen, *(blocks[r][k][1] for r in range(t.world_size)))
            kept.append(owners.reduce(p.owners, p.owners.own_slots(p.target), parts, p.grad_dtype, p.values.dtype))
        if self.corrupt is not None:
            seen = corrupt_report(self.corrupt[0])
        own = pack_owned(mine, kept, seen, recv.device)
        self.owned_out = torch.empty(own.numel() * t.world_size, dtype=torch.uint8, device=recv.device)
        self.works.append(all_gather_flat(self.owned_out, own, t.group, async_op=True))

    def decode(self) -> Delivery:
        """The delivery (means, flags, counts). Local work only."""
        began = time.perf_counter()
        t = self.transport
        n = t.world_size
        weighted = t.weights is not None
        means: list[torch.Tensor | None] = [None] * len(self.payloads)
        counts = [[p.count for p in self.payloads] for _ in range(n)]
        flags: list[int | None] = [0] * n
        flagged_by_reduce = 0.0
        if self.in_place is not None:  # the sum itself says whether some rank's input was not finite
            if self.rows is not None:
                sum_rows(self.rows, out=self.in_place)
            means = [p.values for p in self.payloads]
            if self.out is not None:
                means = list(mean_into(self.out, self.in_place, n, weighted).split([m.numel() for m in means]))
            else:
                mean_in_place(self.in_place, n, weighted)
            flagged_by_reduce = 0.0 if is_finite(self.in_place) else 1.0
        for buf, items in self.reduce_plan:
            if isinstance(buf, _RowsAs):
                buf = buf.read()
            if buf.dim() == 2:  # (sum_order "rank", or merged) every rank's segment values: summed in rank order
                buf = sum_rows(buf)
            sizes = [elems for _, elems in items]
            flag_at = torch.tensor(sizes).add_(1).cumsum_(0).sub_(1)  # each segment's flag word follows it
            flagged_by_reduce = max(flagged_by_reduce, float(buf[flag_at.to(buf.device)].max()))
            fast = finish_reduced_many(buf, [self.payloads[i] for i, _ in items], sizes, n, weighted)
            off = 0
            for k, (i, elems) in enumerate(items):
                means[i] = fast[k] if fast is not None else finish_reduced(buf[off:off + elems], self.payloads[i], n,
                                                                           weighted)
                off += elems + 1
        if self.gather_out is not None:
            ids = [i for i, r in enumerate(self.routes) if r == GATHER]
            mine = [self.payloads[i] for i in ids]
            per_rank = self.gather_out.view(n, -1)
            if not self._add_gathered(per_rank, ids, mine, means, counts, flags):
                self._decode_each(per_rank, ids, mine, means, counts, flags)
        if self.owned_out is not None:
            ids = [i for i, r in enumerate(self.routes) if r == SCATTER]
            mine = [self.payloads[i] for i in ids]
            rows = [unpack_owned(row, mine, j) for j, row in enumerate(self.owned_out.view(n, -1))]
            if self.corrupt is not None:
                raise self.corrupt[1]
            for j in range(n):
                for flag, _, _ in rows[j]:
                    check_report(flag, j)
            for k, i in enumerate(ids):
                for r, (count, flag) in enumerate(self.sender_words[k]):
                    counts[r][i] = count
                    flags[r] = max(int(flags[r] or 0), int(flag))
                means[i] = decode_scattered(self.payloads[i], [(rows[j][k][1], rows[j][k][2]) for j in range(n)],
                                            weighted)
        if flagged_by_reduce and not any(flags):
            flags = [None] * n  # some rank raised it; the all-reduce does not say which
        self.finished = time.perf_counter()
        self.decode_s = self.finished - began
        self.delivery = Delivery(means, flags, counts)  # type: ignore[arg-type]
        self.works = []  # done: let go of the process group's work objects (none may outlive the group)
        return self.delivery

    def _decode_each(self, per_rank: torch.Tensor, ids: list[int], mine: list[Payload], means: list, counts: list,
                     flags: list) -> None:
        """The gather route's means tensor by tensor (:func:`unpack_gather` of every row, then
        :func:`combine_sparse_many`): where :meth:`_add_gathered` does not apply, and to say what is wrong with a
        segment that is not whole."""
        t = self.transport
        n = t.world_size
        if self.merged and per_rank.shape[1] % ALIGN:  # rows of a merged buffer: its sparse part copied out, so
            per_rank = per_rank[:, :self.gather_bytes].contiguous()  # that its values start aligned
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in ids}
        for r in range(n):
            for i, (count, flag, vals, idx) in zip(ids, unpack_gather(per_rank[r], mine, r)):
                parts[i].append((vals, idx))
                counts[r][i] = count
                flags[r] = max(int(flags[r] or 0), int(flag != 0))
        for dtype in {self.payloads[i].grad_dtype for i in ids}:  # (one gradient dtype per DDP bucket)
            same = [i for i in ids if self.payloads[i].grad_dtype == dtype]
            out, starts = self._destination(same, dtype)
            got = combine_sparse_many([parts[i] for i in same], [self.payloads[i].numel for i in same], dtype,
                                      t.weights, self.payloads[same[0]].values.device, out, starts)
            for i, mean in zip(same, got):
                means[i] = mean

    def _add_gathered(self, per_rank: torch.Tensor, ids: list[int], mine: list[Payload], means: list, counts: list,
                      flags: list) -> bool:
        """The gather route's means in one compiled call (:func:`add_gathered`: each tensor zeroed, summed, divided)
        where the mean is unweighted, of float32 gradients, on the host: what :func:`unpack_gather` of every row and
        :func:`combine_sparse_many` compute, bit for bit, with a constant number of operations for the group. False
        where it does not apply or a segment is not whole (nothing delivered: the caller decodes, and says what is
        wrong)."""
        t = self.transport
        if t.weights is not None or per_rank.device.type != "cpu" or any(p.grad_dtype != torch.float32 for p in mine):
            return False
        out, starts = self._destination(ids, torch.float32)
        if out is None:
            starts, at = [], 0
            for p in mine:
                starts.append(at)
                at += p.numel
            out = torch.empty(at, dtype=torch.float32)
        got = add_gathered(out, per_rank, mine, starts, mean=True)  # (zeroes, sums and divides each tensor in turn)
        if got is None:
            return False
        _, words = got
        for r, row in enumerate(words):
            for i, (count, _) in zip(ids, row):
                counts[r][i] = count
            flags[r] = max(int(flags[r] or 0), int(any(flag for _, flag in row)))
        for i, p, s in zip(ids, mine, starts):
            means[i] = out[s:s + p.numel]
        return True

    def _destination(self, ids: list[int], dtype: torch.dtype) -> tuple[torch.Tensor | None, list[int] | None]:
        """(buffer, starts) of :meth:`sum_into` for payloads ``ids``, where it applies; else (None, None)."""
        if self.into is None or self.into[0].dtype != dtype or accumulate_dtype(dtype) != dtype:
            return None, None
        buffer, starts = self.into
        at = [starts[i] for i in ids]
        return (buffer, at) if all(a is not None for a in at) else (None, None)

    def future(self, then=None) -> torch.futures.Future:
        """A future resolving to the :class:`~gradsift.transport.base.Delivery`, decoded in its callback. With
        ``then``, to ``then(delivered)`` instead, run in the same callback, where ``delivered()`` returns the
        delivery or raises what failed (a collective whose peer went away): one Python callback per group on the
        critical path, not one per stage -- a DDP hook's last bucket waits for it."""
        futs = [w.get_future() for w in self.works]

        def decode_after(done: torch.futures.Future | None):
            def delivered() -> Delivery:
                if done is not None:
                    for f in (done.value() if len(futs) > 1 else [done]):
                        f.value()  # a failed collective raises here, before a buffer is read
                return self.decode()

            return delivered() if then is None else then(delivered)

        if not futs:
            f: torch.futures.Future = torch.futures.Future()
            f.set_result(decode_after(None))
            return f
        return (futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)).then(decode_after)

    def wait(self) -> Delivery:
        if self.needs_advance:
            self.advance()
        for w in self.works:
            w.wait()
        return self.decode()


class DistTransport:
    """Aggregates this rank's payloads with every other rank's over a process group."""

    def __init__(self, group=None, weights: Sequence[float] | None = None, sum_order: str = "backend"):
        if sum_order not in SUM_ORDERS:
            raise ValueError(f"sum_order must be one of {', '.join(SUM_ORDERS)}, got {sum_order!r}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.weights = normalize_weights(weights, self.world_size)
        self.sum_order = sum_order
        self.ranked = sum_order == "rank" and self.world_size > 2  # (two ranks: both orders give the same bits)

    def _reduce(self, buf: torch.Tensor):
        """Start summing ``buf`` over the ranks: (work, what decode sums) -- the buffer itself, all-reduced in
        place, or (rank order) an all-gather of it into one row per rank."""
        if not self.ranked:
            return dist.all_reduce(buf, group=self.group, async_op=True), buf
        rows = torch.empty((self.world_size, buf.numel()), dtype=buf.dtype, device=buf.device)
        return all_gather_flat(rows.view(-1), buf, self.group, async_op=True), rows

    def start(self, payloads: Sequence[Payload], routes: Sequence[str] | None = None, flag: int = 0,
              owners=None, merge: bool = False) -> DistPending:
        """Issue the group's collectives (asynchronous); ``flag`` is this rank's non-finite flag (0/1). Scattered
        payloads need ``owners`` (this rank's :class:`~gradsift.route.owners.Owners`) and a second stage:
        :meth:`DistPending.advance`. ``merge``: where the group has both, its all-reduce buffers ride its
        all-gather (:mod:`gradsift.transport.wire`), each rank summing the gathered rows in rank order."""
        started = time.perf_counter()
        routes = list(routes) if routes is not None else [route_of(p) for p in payloads]
        device = payloads[0].values.device
        weight = self.weights[self.rank] if self.weights is not None else None
        works = []
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (p, r) in enumerate(zip(payloads, routes)):
            if r not in (GATHER, SCATTER):
                by_dtype.setdefault(reduce_dtype(p, r), []).append(i)
        reduce_plan, sums = [], []
        for dtype, ids in by_dtype.items():
            parts, items, mark = [], [], torch.full((1,), float(flag), dtype=dtype, device=device)  # (every flag)
            for i in ids:
                p = payloads[i]
                seg = densified(p, weight) if routes[i] == DENSIFY else scaled_contribution(p, weight).reshape(-1)
                parts += [seg.to(dtype), mark]
                items.append((i, seg.numel()))
            sums.append((torch.cat(parts), items))
        gather_out, gather_bytes = None, 0
        sparse = [p for p, r in zip(payloads, routes) if r == GATHER]
        merged = merge and bool(sparse) and bool(sums)
        if not merged:
            for flat, items in sums:
                work, summed = self._reduce(flat)
                works.append(work)
                reduce_plan.append((summed, items))
        if sparse:
            mine = pack_gather(sparse, flag, device)
            spans, at = [], mine.numel()
            gather_bytes = at
            if merged:  # every reduce buffer's bytes after the sparse segments: one all-gather
                for flat, _ in sums:
                    spans.append((at, flat.numel() * flat.element_size()))
                    at += spans[-1][1]
                mine = torch.cat([mine, *(flat.view(torch.uint8) for flat, _ in sums)])
            gather_out = torch.empty(mine.numel() * self.world_size, dtype=torch.uint8, device=device)
            works.append(all_gather_flat(gather_out, mine, self.group, async_op=True))
            rows = gather_out.view(self.world_size, -1)
            for (flat, items), (a, nbytes) in zip(sums if merged else [], spans):
                # (each rank's row, read after the gather as the buffer's dtype: decode sums the rows in rank order)
                reduce_plan.append((_RowsAs(rows[:, a:a + nbytes], flat.dtype), items))
        scatter = None
        ids = [i for i, r in enumerate(routes) if r == SCATTER]
        if ids:
            if owners is None:
                raise ValueError("the scatter route needs this rank's owners (gradsift.route.owners.Owners)")
            mine = [payloads[i] for i in ids]
            send = pack_blocks(mine, [split_for_owners(p, weight) for p in mine], flag, device)
            recv = torch.empty_like(send)
            scatter = (dist.all_to_all_single(recv, send, group=self.group, async_op=True), recv, ids, owners, flag)
        return DistPending(self, payloads, routes, works, reduce_plan, gather_out, started, scatter=scatter,
                           merged=merged, gather_bytes=gather_bytes)

    def start_in_place(self, flat: torch.Tensor, payloads: Sequence[Payload], routes: Sequence[str],
                       flag: int = 0, out: torch.Tensor | None = None) -> DistPending:
        """Sum ``flat`` in place into the group's mean (``payloads``: dense views of it, for the delivery and the
        byte count): one asynchronous collective, divided after the sum in the decoding callback -- in ``out``
        where given (``flat`` its copy in a narrower wire dtype; :func:`~gradsift.transport.base.mean_into`).
        ``flag`` is for the message only: a non-finite input on any rank shows in the sum."""
        started = time.perf_counter()
        if self.weights is not None:
            flat.mul_(self.weights[self.rank])
        work, summed = self._reduce(flat)
        return DistPending(self, payloads, list(routes), [work], [], None, started, in_place=flat,
                           rows=summed if summed is not flat else None, out=out)
