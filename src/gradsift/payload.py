"""What one worker sends for one tensor.

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
Index dtype on the wire is int32, or int64 when the tensor has 2**31 elements or
more. Values travel in the payload's own dtype (fp32, fp16, or the gradient's
dtype when that is wider, e.g. float64 for the linear-regression task).

A sparse payload also has a ``capacity``: the number of slots it occupies in
the fixed-size all-gather buffer (:mod:`gradsift.transport.wire`). Methods that
send exactly k entries have capacity k; threshold methods get k times their own
acceptance band, and a selection larger than that keeps its largest entries
(the rest stays in error feedback; ``overflow`` counts them).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

SPARSE = "sparse"
SHARED = "shared"
DENSE = "dense"
KINDS = (SPARSE, SHARED, DENSE)

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def index_dtype_for(numel: int) -> torch.dtype:
    """Wire dtype of the indices of a tensor with ``numel`` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


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

    @property
    def count(self) -> int:
        """Number of values this worker contributes."""
        return int(self.values.numel())

    @property
    def value_bytes(self) -> int:
        return self.values.dtype.itemsize

    @property
    def index_bytes(self) -> int:
        """Bytes per index on the wire (0 for payloads that send no indices)."""
        if self.kind != SPARSE:
            return 0
        return index_dtype_for(self.numel).itemsize

    @property
    def nbytes(self) -> int:
        """``bytes_per_worker``: the size of the payload this worker contributes (no padding, no slack)."""
        return self.count * (self.value_bytes + self.index_bytes)

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The flat dense tensor this payload stands for (zeros where nothing is sent)."""
        dtype = dtype or self.grad_dtype
        if self.kind == DENSE:
            return self.values.to(dtype)
        out = torch.zeros(self.numel, dtype=dtype, device=self.values.device)
        out.index_put_((self.indices,), self.values.to(dtype), accumulate=True)
        return out


def sparse(values: torch.Tensor, indices: torch.Tensor, numel: int, grad_dtype: torch.dtype, target: int) -> Payload:
    return Payload(SPARSE, values, indices, numel, grad_dtype, target)


def shared(values: torch.Tensor, indices: torch.Tensor, numel: int, grad_dtype: torch.dtype, target: int) -> Payload:
    return Payload(SHARED, values, indices, numel, grad_dtype, target)


def is_finite(t: torch.Tensor) -> bool:
    """No NaN and no Inf in ``t``: one read pass (min and max), exact at the largest finite values."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.reshape(-1))  # NaN propagates into both
    return math.isfinite(lo.item()) and math.isfinite(hi.item())  # (two scalar reads: no more tensor ops)


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
