"""The aggregation rules both transports follow, so that they give the same result.

A transport turns every worker's payloads for a group of tensors into the
(weighted) mean gradient of each tensor. The rules, shared by the in-process
transport and the ``torch.distributed`` one:

* dense and shared-index values are summed in their wire dtype (that is what an
  all-reduce of those bytes computes), in worker order in-process;
* sparse payloads are added into a zero tensor in worker order with an
  accumulating index add (indices that several workers send add up; a worker
  may send any count, zero included), in at least float32; a densified sparse
  payload is scattered into a dense tensor of that dtype and summed;
* the sum is divided by the worker count after summing (every route, the
  in-place one included), or, with explicit weights, each worker's values are
  scaled by its weight before they are summed;
* sums run in worker order (rank 0 + rank 1 + ...): the in-process transport
  always, ``torch.distributed`` with ``sum_order="rank"`` (:data:`SUM_ORDERS`);
  its default, ``"backend"``, lets the all-reduce choose (gloo's ring sums each
  chunk from another rank: from 3 ranks on the bits differ from worker order);
* the mean comes back flat, in the gradient's dtype, with every worker's flag
  (non-finite input) and every worker's count per payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..payload import (DENSE, SHARED, SPARSE, Payload, accumulate_dtype, allgather_wire_bytes, allreduce_wire_bytes,
                            value_part)
from ..kernels.scatter import add_many, div_at
from .wire import GATHER, SCATTER, group_bytes


SUM_ORDERS = ("backend", "rank")


class TransportError(RuntimeError):
    """Payloads that cannot be aggregated together (mismatched kinds or sizes)."""


@dataclass
class GroupTraffic:
    """What one aggregation of a group costs per worker: the all-reduce and the all-gather buffer sizes; (sums in
    rank order, ``sum_order="rank"``) the reduce segments gathered instead of all-reduced; (the scatter route)
    the all-to-all block each destination gets and the owner selections all-gathered."""

    world_size: int
    allreduce_bytes: int
    allgather_bytes: int
    gathered_sums: int = 0
    alltoall_bytes: int = 0
    owner_bytes: int = 0

    @property
    def wire_bytes(self) -> float:
        """``wire_bytes_per_worker`` for this group (:mod:`gradsift.transport.wire`): what a worker sends, which
        for every collective here is also what it receives."""
        n = self.world_size
        return (allreduce_wire_bytes(self.allreduce_bytes, n) + sum(
            allgather_wire_bytes(b, n) for b in (self.allgather_bytes, self.gathered_sums, self.alltoall_bytes,
                                                 self.owner_bytes)))


def traffic_of(payloads: Sequence[Payload], routes: Sequence[str], world_size: int,
               ranked: bool = False, merged: bool = False) -> GroupTraffic:
    """What a group moves: ``ranked``, its all-reduce segments all-gathered (sums in rank order); ``merged``, they
    ride the group's all-gather (one collective: :mod:`gradsift.transport.wire`)."""
    reduce, gather, blocks, owned = group_bytes(payloads, routes)
    if merged and reduce and gather:
        return GroupTraffic(world_size, 0, gather + reduce, 0, blocks, owned)
    if ranked:
        return GroupTraffic(world_size, 0, gather, reduce, blocks, owned)
    return GroupTraffic(world_size, reduce, gather, 0, blocks, owned)


@dataclass
class Delivery:
    """The result of one group's aggregation, identical on every worker.

    ``means`` flat, in payload order; ``flags[r]`` is 1 if worker r's input was
    not finite (None where only "some worker" is known, from an all-reduce);
    ``counts[r][i]`` is what worker r contributed for payload i.
    """

    means: list[torch.Tensor]
    flags: list[int | None]
    counts: list[list[int]]
    _sums: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def sums(self, layouts: tuple[tuple[int, float, int], ...]) -> tuple[list[int], list[int]]:
        """(entries, payload bytes) each worker contributed, for payloads of these (value bytes, index bytes per
        entry, value bits below 16 or 0) layouts (:meth:`Payload.bytes_for`'s arithmetic); worked out once per delivery and layout, as every
        worker of the simulator reports the same delivery."""
        got = self._sums.get(layouts)
        if got is None:
            got = self._sums[layouts] = (
                [sum(row) for row in self.counts],
                [sum(value_part(c, vb, bits) + int(round(c * ib)) for c, (vb, ib, bits) in zip(row, layouts))
                 for row in self.counts])
        return got

    @property
    def any_flag(self) -> bool:
        return any(f is None or f != 0 for f in self.flags)

    @property
    def flagged(self) -> list[int]:
        """Workers known to have raised the flag."""
        return [r for r, f in enumerate(self.flags) if f]


def normalize_weights(weights: Sequence[float] | None, world_size: int) -> list[float] | None:
    """Validate worker weights; None (or all equal to 1/N) means a plain mean."""
    if weights is None:
        return None
    w = [float(x) for x in weights]
    if len(w) != world_size:
        raise ValueError(f"weights: expected {world_size} values (one per worker), got {len(w)}")
    if any((not math.isfinite(x)) or x < 0 for x in w):
        raise ValueError("weights: every weight must be a finite number >= 0")
    if all(abs(x - 1.0 / world_size) < 1e-15 for x in w):
        return None
    return w


def scaled_contribution(p: Payload, weight: float | None) -> torch.Tensor:
    """What a worker puts into an all-reduce: its values, pre-scaled by its weight if any."""
    if weight is None:
        return p.values
    return (p.values.to(accumulate_dtype(p.grad_dtype)) * weight).to(p.values.dtype)


def densified(p: Payload, weight: float | None) -> torch.Tensor:
    """A sparse payload scattered into a dense tensor (accumulate dtype), pre-scaled by the weight if any."""
    acc = accumulate_dtype(p.grad_dtype)
    out = torch.zeros(p.numel, dtype=acc, device=p.values.device)
    if p.count:
        v = p.values.to(acc)
        out.index_put_((p.indices,), v if weight is None else v * weight, accumulate=True)
    return out


def finish_reduced(summed: torch.Tensor, p: Payload, world_size: int, weighted: bool) -> torch.Tensor:
    """Turn an all-reduced sum for ``p`` (its values, or the whole tensor if densified) into the flat mean."""
    acc = accumulate_dtype(p.grad_dtype)
    mean = summed.to(acc)
    if not weighted:
        mean = mean / world_size
    if p.kind == SHARED:
        out = torch.zeros(p.numel, dtype=acc, device=mean.device)
        out[p.indices] = mean
        return out.to(p.grad_dtype)
    return mean.to(p.grad_dtype)  # dense, or a densified sparse payload


def mean_in_place(flat: torch.Tensor, world_size: int, weighted: bool) -> torch.Tensor:
    """A summed buffer becomes the mean, in place, with :func:`finish_reduced`'s arithmetic (divided in at least
    float32, then rounded to the buffer's dtype once)."""
    if weighted:
        return flat
    acc = accumulate_dtype(flat.dtype)
    if acc == flat.dtype:
        return flat.div_(world_size)
    return flat.copy_(flat.to(acc).div_(world_size))


def mean_into(out: torch.Tensor, summed: torch.Tensor, world_size: int, weighted: bool) -> torch.Tensor:
    """``out`` (wider than ``summed``: the gradient's buffer, ``summed`` its copy in the wire dtype, all-reduced)
    becomes the mean, with :func:`finish_reduced`'s arithmetic: converted, then divided in at least float32."""
    acc = accumulate_dtype(out.dtype)
    if acc != out.dtype:
        return out.copy_(summed.to(acc).div_(world_size) if not weighted else summed)
    out.copy_(summed)
    return out if weighted else out.div_(world_size)


def sum_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of ``rows`` (one per worker) summed in worker order: ``((r0 + r1) + r2) + ...`` (into ``out``)."""
    out = rows[0].clone() if out is None else out.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        out += rows[r]
    return out


def split_for_owners(p: Payload, weight: float | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A scattered payload's (positions, values) per owner, in owner order (values pre-scaled by the weight, in
    the wire dtype, as :func:`scaled_contribution`)."""
    part = p.owners
    values = scaled_contribution(p, weight)
    if not p.count:
        empty = (p.indices[:0].to(torch.int32), values[:0])
        return [empty] * part.world_size
    owner, pos = part.place(p.indices)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=part.world_size).tolist()
    pos, values = pos[order].to(torch.int32), values[order]
    out, off = [], 0
    for c in counts:
        out.append((pos[off:off + c], values[off:off + c]))
        off += c
    return out


def shard_rows(p: Payload, flag: int, weight: float | None) -> torch.Tensor:
    """A dense payload's all-to-all rows for the sharded exchange: row j is owner j's shard of the values
    (pre-scaled by the weight) and this worker's flag."""
    part = p.owners
    values = scaled_contribution(p, weight).reshape(part.world_size, part.region)
    flags = torch.full((part.world_size, 1), float(flag), dtype=values.dtype, device=values.device)
    return torch.cat([values, flags], dim=1)


def sum_shard(p: Payload, parts: Sequence[tuple[torch.Tensor | None, torch.Tensor]], weighted: bool) -> torch.Tensor:
    """This owner's shard of the mean, from every worker's part in worker order: ``(positions, values)`` of a
    sparse payload, ``(None, the shard's values)`` of a dense one; summed in worker order in the accumulate
    dtype, then divided (the same arithmetic in both transports)."""
    acc = accumulate_dtype(p.grad_dtype)
    out = torch.zeros(p.owners.region, dtype=acc, device=p.values.device)
    for pos, vals in parts:
        if pos is None:
            out += vals.to(acc)
        elif vals.numel():
            out.index_add_(0, pos.long(), vals.to(acc))
    if not weighted:
        out /= p.owners.world_size
    return out.to(p.grad_dtype)


def decode_scattered(p: Payload, selections: Sequence[tuple[torch.Tensor, torch.Tensor]], weighted: bool
                     ) -> torch.Tensor:
    """The flat mean from every owner's (positions, values) kept, in owner order: summed, then divided."""
    part = p.owners
    acc = accumulate_dtype(p.grad_dtype)
    out = torch.zeros(p.numel, dtype=acc, device=p.values.device)
    for owner, (pos, vals) in enumerate(selections):
        if vals.numel():
            out[part.index(owner, pos)] = vals.to(acc)  # (regions are disjoint: one value per index)
    if not weighted:
        out /= part.world_size
    return out.to(p.grad_dtype)


def combine_sparse_many(parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], numels: Sequence[int],
                        grad_dtype: torch.dtype, weights: Sequence[float] | None, device,
                        out: torch.Tensor | None = None, starts: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The means of several tensors of one gradient dtype from sparse contributions (``parts[i]``: tensor i's
    ``(values, indices)`` in worker order), as views of one flat tensor -- ``out`` where given (of the accumulate
    dtype, zeroed here whole; tensor i at ``starts[i]``), else a new one holding them one after the other. The rule
    (module docstring): every entry is its workers' values, made the accumulate dtype (pre-scaled by the weights if
    any), added to zero in worker order with an accumulating index add, then divided by the worker count (an entry
    nobody sent stays 0). One zeroing, one index add per worker over the tensors' index space and one division of
    the entries sent: a number of operations that does not grow with the tensors."""
    acc = accumulate_dtype(grad_dtype)
    if out is None:
        at = [0]
        for n in numels:
            at.append(at[-1] + int(n))
        out, starts = torch.zeros(at[-1], dtype=acc, device=device), at[:-1]
    else:
        out.zero_()
    sent = []
    for rank in range(len(parts[0]) if parts else 0):
        if weights is None:  # one compiled sweep where it applies
            at = add_many(out, [tensor_parts[rank] for tensor_parts in parts], starts, numels)
            if at is not None:
                sent.append(at)
                continue
        vals = [tensor_parts[rank][0] for tensor_parts in parts]
        counts = [v.numel() for v in vals]
        if not any(counts):
            continue
        if len({v.dtype for v in vals}) > 1:
            vals = [v.to(acc) for v in vals]
        v = torch.cat(vals).to(acc)
        if weights is not None:
            v = v * weights[rank]
        shift = torch.tensor(list(starts), device=device).repeat_interleave(torch.tensor(counts, device=device),
                                                                           output_size=sum(counts))
        where = torch.cat([tensor_parts[rank][1] for tensor_parts in parts]) + shift
        out.index_add_(0, where, v)
        sent.append(where)
    if weights is None and sent:
        touched = torch.cat(sent)  # (an index several workers sent is written once for each, with the same quotient)
        if not div_at(out, touched, len(parts[0])):  # (one compiled sweep where it applies: the same bits)
            out.index_put_((touched,), out.index_select(0, touched).div_(len(parts[0])))
    mean = out.to(grad_dtype)
    return [mean[s:s + int(n)] for s, n in zip(starts, numels)]


def finish_reduced_many(summed: torch.Tensor, payloads: Sequence[Payload], elems: Sequence[int], world_size: int,
                        weighted: bool) -> list[torch.Tensor] | None:
    """:func:`finish_reduced` of consecutive segments of one all-reduced buffer (``elems[i]`` entries for
    ``payloads[i]``), each followed by one flag word (the layout :class:`~gradsift.transport.dist.DistTransport`
    sends), in a number of operations that does not grow with the segments: the means as views of one converted
    buffer, with :func:`finish_reduced`'s arithmetic on every entry. None where a payload needs more (shared
    indices, or gradient dtypes that differ)."""
    if any(p.kind == SHARED for p in payloads) or len({p.grad_dtype for p in payloads}) != 1:
        return None
    grad_dtype = payloads[0].grad_dtype
    mean = summed.to(accumulate_dtype(grad_dtype))
    if not weighted:  # (in place where the conversion made a new tensor: the same bits, one allocation fewer)
        mean = mean / world_size if mean is summed else mean.div_(world_size)
    sizes = []
    for n in elems:
        sizes += [int(n), 1]
    return list(mean.to(grad_dtype).split(sizes)[::2])


def check_aligned(per_worker: Sequence[Sequence[Payload]], routes: Sequence[str]) -> None:
    """Every worker must send the same tensors with the same kinds, capacities and (shared) counts."""
    first = per_worker[0]
    for w, ps in enumerate(per_worker):
        if len(ps) != len(first):
            raise TransportError(f"worker {w} sent {len(ps)} payloads, worker 0 sent {len(first)}")
        for i, (a, b) in enumerate(zip(first, ps)):
            if a.kind != b.kind or a.numel != b.numel:
                raise TransportError(
                    f"tensor {i}: worker {w} sent a {b.kind} payload of numel {b.numel}, "
                    f"worker 0 a {a.kind} payload of numel {a.numel}")
            if a.kind == SHARED and a.count != b.count:
                raise TransportError(f"tensor {i}: shared-index payloads differ in count between workers 0 and {w}")
            if a.kind == DENSE and a.count != b.count:
                raise TransportError(f"tensor {i}: dense payloads differ in size between workers 0 and {w}")
            if routes[i] in (GATHER, SCATTER) and a.capacity and b.capacity and a.capacity != b.capacity:
                raise TransportError(f"tensor {i}: sparse payloads of workers 0 and {w} have different capacities")
            if routes[i] == SCATTER and (a.owners != b.owners or a.target != b.target or a.owners is None):
                raise TransportError(f"tensor {i}: workers 0 and {w} scatter with different partitions or targets")
            if a.kind != SPARSE and a.values.dtype != b.values.dtype:
                raise TransportError(f"tensor {i}: workers 0 and {w} send values of different dtypes")
