"""What one worker sends for one tensor: the bottom layer every other one builds on. Beside the payload type
here: how its indices are coded (``indexcode``) and its values below 16 bits (``lowbits``), the seeds every rank
derives alike (``seeds``), and the interfaces a selector and a transport offer (``protocols``).

Three payload kinds decide the collective (DESIGN.md):

========  ==============================================  ============  =====================
kind      who picks the indices                           collective    bytes per worker
========  ==============================================  ============  =====================
sparse    each worker on its own                          all-gather    count * (value + index)
shared    every worker derives the same indices           all-reduce    count * value
dense     --                                              all-reduce    numel * value
========  ==============================================  ============  =====================

A payload always carries its indices locally (a shared-index payload needs them
to put the reduced values back), but only sparse payloads put them on the wire.
Indices travel coded (:mod:`gradsift.payload.indexcode`: Elias-Fano, a bitmap,
or raw int32 -- int64 from 2**31 elements -- whichever is smallest for the
tensor's size and the payload's slots). Values travel in the payload's own
dtype: a sparse payload's in bf16 when its memory keeps what the rounding drops
(error feedback, momentum correction, Adam's direction: the default), else the
gradient's; ``value_dtype`` sets one dtype for every payload.

A sparse payload also has a ``capacity``: the number of slots it occupies in
the fixed-size all-gather buffer (:mod:`gradsift.transport.wire`). Methods that
send exactly k entries have capacity k; threshold methods get k times their own
acceptance band, and a selection larger than that keeps its largest entries
(the rest stays in error feedback; ``overflow`` counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .indexcode import layout

SPARSE = "sparse"
SHARED = "shared"
DENSE = "dense"
KINDS = (SPARSE, SHARED, DENSE)

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
VALUE_BITS = {"int4": 4, "int2": 2}  # sparse values as codes with a scale per block (gradsift.payload.lowbits)
LOWBITS_BLOCK = 64  # values per scale


def value_part(count: int, item: int, bits: int = 0) -> int:
    """Bytes ``count`` values occupy: ``count * item``, or below 16 bits their codes and block scales
    (:mod:`gradsift.payload.lowbits`)."""
    if bits:
        return -(-count * bits // 8) + 4 * -(-count // LOWBITS_BLOCK)
    return count * item


def index_dtype_for(numel: int) -> torch.dtype:
    """Wire dtype of the indices of a tensor with ``numel`` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def flat_views(ts) -> list[torch.Tensor]:
    """Each tensor as a flat (1-D) one: a 1-D tensor as it is, another ``reshape(-1)`` (a view where its layout
    allows) -- a group's selection then makes no view of the 1-D ones (two thirds of ResNet-50's tensors)."""
    return [t if t.dim() == 1 else t.reshape(-1) for t in ts]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which received values are summed: at least float32."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Payload:
    """One worker's contribution for one tensor.

    ``values`` are in the wire value dtype; ``indices`` (int64, local) are None
    only for dense payloads. ``numel`` and ``grad_dtype`` describe the tensor the
    payload came from, ``target`` is the count the compressor aimed for (its k;
    threshold methods may miss it), used for the ``k_ratio`` telemetry.
    ``capacity`` (sparse payloads) is the slot count on the wire, ``overflow`` the
    number of selected entries that did not fit and stayed behind.
    """

    kind: str
    values: torch.Tensor
    indices: torch.Tensor | None
    numel: int
    grad_dtype: torch.dtype
    target: int
    capacity: int = 0
    overflow: int = 0
    nonfinite: bool = False  # the memory overflowed the float range: the values were zeroed, the step must not count
    owners: "Partition | None" = None  # (the scatter route) how its indices split among the owners, per-owner slots
    settled: bool = False  # the memory already took it out (DGC's compiled pass: v zeroed, u masked where selected)
    finite: bool = False  # the values (as accumulated) are finite: the selecting pass read the largest magnitude
    value_bits: int = 0  # int4/int2 on the wire (its values are on their levels: gradsift.payload.lowbits), else 0

    @property
    def count(self) -> int:
        """Number of values this worker contributes."""
        return int(self.values.numel())

    @property
    def value_bytes(self) -> int:
        return self.values.dtype.itemsize

    @property
    def index_bytes(self) -> float:
        """Bytes per index on the wire: the coded index part over the payload's slots
        (:mod:`gradsift.payload.indexcode`); 0 for payloads that send no indices."""
        slots = max(self.capacity, self.count)
        if self.kind != SPARSE or slots == 0:
            return 0.0
        return layout(self.numel, slots, index_dtype_for(self.numel).itemsize)[1] / slots

    @property
    def nbytes(self) -> int:
        """``bytes_per_worker``: the size of the payload this worker contributes (values and coded indices, no
        header, no padding)."""
        return self.bytes_for(self.count)

    def bytes_for(self, count: int) -> int:
        """:attr:`nbytes` of a payload of this layout holding ``count`` entries (a whole number: every runtime
        sums the same integers)."""
        return value_part(count, self.value_bytes, self.value_bits) + int(round(count * self.index_bytes))

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The flat dense tensor this payload stands for (zeros where nothing is sent)."""
        dtype = dtype or self.grad_dtype
        if self.kind == DENSE:
            return self.values.to(dtype)
        out = torch.zeros(self.numel, dtype=dtype, device=self.values.device)
        out.index_put_((self.indices,), self.values.to(dtype), accumulate=True)
        return out


DEST_SLACK = 1.25  # slots per destination over the even share of a sender's capacity, plus DEST_EXTRA
DEST_EXTRA = 2


@dataclass(frozen=True)
class Partition:
    """How the scatter route splits a tensor's index space among ``world_size`` owners (Ok-Topk's regions, ZEN's
    hashing): a fixed affine permutation ``q = (mult * i + shift) mod numel`` every rank derives from the seed and
    the tensor's key, then owner ``q // region`` holds position ``q % region``. The permutation spreads what is
    contiguous (an embedding's hot rows) or periodic (a matrix's hot columns) over every owner, so the owners'
    loads balance without a count exchange. Slots: a sender gives each owner at most ``dest_slots`` entries
    (what does not fit stays in its memory), each owner keeps ``own_slots`` of its region's sum: together
    ``keep`` times the method's k (1: the sum's k largest, as gTop-k and Ok-Topk)."""

    key: str
    numel: int
    world_size: int
    mult: int
    shift: int
    inverse: int  # mult's inverse mod numel
    keep: float = 1.0

    @property
    def region(self) -> int:
        return -(-self.numel // self.world_size)

    def dest_slots(self, capacity: int) -> int:
        """Slots per destination for a sender of ``capacity`` slots: its even share with slack, within a region."""
        share = math.ceil(DEST_SLACK * capacity / self.world_size - 1e-9) + DEST_EXTRA
        return max(1, min(self.region, share))

    def own_slots(self, target: int) -> int:
        """Entries each owner keeps of its region's sum: together about ``keep`` times ``target`` (the method's k)."""
        return max(1, min(self.region, math.ceil(self.keep * target / self.world_size - 1e-9)))

    def place(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, position in the owner's region) of flat indices (int64)."""
        q = (indices.long() * self.mult + self.shift) % self.numel
        owner = torch.div(q, self.region, rounding_mode="floor")
        return owner, q - owner * self.region

    def index(self, owner: int, positions: torch.Tensor) -> torch.Tensor:
        """The flat indices of ``owner``'s region ``positions`` (int64)."""
        q = positions.long() + owner * self.region
        return (q - self.shift) % self.numel * self.inverse % self.numel

    def owned(self, owner: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, flat indices) of every entry of ``owner``'s region that lies in the tensor (the last region
        is padded past the end)."""
        pos = torch.arange(max(0, min(self.region, self.numel - owner * self.region)), device=device)
        return pos, self.index(owner, pos)


def sparse(values: torch.Tensor, indices: torch.Tensor, numel: int, grad_dtype: torch.dtype, target: int,
           finite: bool = False) -> Payload:
    """``finite``: the selecting pass found no NaN or Inf in the tensor the values were taken from, as they are (the
    fused memory then does not read them again for that)."""
    return Payload(SPARSE, values, indices, numel, grad_dtype, target, finite=finite)


def shared(values: torch.Tensor, indices: torch.Tensor, numel: int, grad_dtype: torch.dtype, target: int) -> Payload:
    return Payload(SHARED, values, indices, numel, grad_dtype, target)


def fit_capacity(p: Payload) -> Payload | None:
    """Keep a sparse payload within its capacity: its ``capacity`` largest entries by magnitude stay (in
    their order), the rest come back as a second payload (None when nothing was cut). ``overflow`` counts them.
    A payload split among owners (``p.owners``, the scatter route) keeps at most ``dest_slots`` per owner."""
    if p.kind != SPARSE:
        return None
    if p.owners is not None:
        keep = _fit_owners(p)
    elif p.count > p.capacity:
        keep = torch.topk(p.values.abs().to(torch.float32), p.capacity, sorted=False).indices.sort().values
    else:
        keep = None
    if keep is None:
        return None
    mask = torch.ones(p.count, dtype=torch.bool, device=p.values.device)
    mask[keep] = False
    dropped = sparse(p.values[mask], p.indices[mask], p.numel, p.grad_dtype, 0)
    p.values, p.indices = p.values[keep], p.indices[keep]
    p.overflow = dropped.count
    return dropped


def _fit_owners(p: Payload) -> torch.Tensor | None:
    """The entries to keep (in their order) so that no owner gets more than its slots: each owner's largest."""
    part = p.owners
    cap = part.dest_slots(p.capacity)
    if p.count <= cap:
        return None
    owner, _ = part.place(p.indices)
    counts = torch.bincount(owner, minlength=part.world_size)
    if int(counts.max()) <= cap:
        return None
    by_size = torch.argsort(p.values.abs().to(torch.float32), descending=True, stable=True)
    grouped, order = torch.sort(owner[by_size], stable=True)  # by owner, largest first within each
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(p.count, device=owner.device) - starts[grouped]
    return by_size[order[rank < cap]].sort().values


def is_finite(t: torch.Tensor) -> bool:
    """No NaN and no Inf in ``t``: one read pass (min and max), exact at the largest finite values."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.reshape(-1))  # NaN propagates into both
    return math.isfinite(lo.item()) and math.isfinite(hi.item())  # (two scalar reads: no more tensor ops)


def all_finite(xs: Sequence[torch.Tensor], buffer: torch.Tensor | None = None) -> bool:
    """No NaN and no Inf in any of ``xs``: one read of ``buffer`` (the flat buffer they are views of) where given,
    else one foreach pass (each tensor's L2 norm, which a NaN or an Inf makes non-finite) and one check of those: a
    constant number of operations, whatever the number of tensors. Only where a norm is not finite (a non-finite
    entry, or squares beyond the float range) is each tensor read again. (The largest magnitudes' foreach, the
    infinity norm, runs tensor by tensor on a CPU: 9 ms for 150 tensors against 0.7.)"""
    if buffer is not None:
        return is_finite(buffer)
    xs = [x for x in xs if x.numel() and x.is_floating_point()]
    if len(xs) <= 1 or len({(x.dtype, x.device) for x in xs}) > 1:
        return all(is_finite(x) for x in xs)
    return is_finite(torch.stack(torch._foreach_norm(xs, 2))) or all(is_finite(x) for x in xs)


def dense(values: torch.Tensor, grad_dtype: torch.dtype) -> Payload:
    n = values.numel()
    return Payload(DENSE, values.reshape(-1), None, n, grad_dtype, n)


# ----------------------------------------------------------------- ring collectives
def allreduce_wire_bytes(size: int, world_size: int) -> float:
    """Bytes one worker moves in a ring all-reduce of ``size`` bytes: 2(N-1)/N * size."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * size


def allgather_wire_bytes(size_each: int, world_size: int) -> float:
    """Bytes one worker receives in a ring all-gather of ``size_each`` bytes from every worker: (N-1) * size."""
    if world_size <= 1:
        return 0.0
    return float((world_size - 1) * size_each)
