"""What one worker sends for one tensor, and what that costs on the wire.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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
    """

    kind: str
    values: torch.Tensor
    indices: torch.Tensor | None
    numel: int
    grad_dtype: torch.dtype
    target: int

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
        """``bytes_per_worker``: the size of the payload this worker contributes."""
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


def dense(values: torch.Tensor, grad_dtype: torch.dtype) -> Payload:
    n = values.numel()
    return Payload(DENSE, values.reshape(-1), None, n, grad_dtype, n)


# ----------------------------------------------------------------- wire sizes
def allreduce_wire_bytes(size: int, world_size: int) -> float:
    """Bytes one worker moves in a ring all-reduce of ``size`` bytes: 2(N-1)/N * size."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * size


def allgather_wire_bytes(padded_size: int, world_size: int) -> float:
    """Bytes one worker receives in a ring all-gather of ``padded_size`` bytes each: (N-1) * size."""
    if world_size <= 1:
        return 0.0
    return float((world_size - 1) * padded_size)


@dataclass
class GroupTraffic:
    """What one aggregation of a group of tensors costs, per worker.

    ``allreduce_bytes`` is the size of the one all-reduce buffer (dense and
    shared-index values), ``allgather_bytes`` the padded per-worker size of the
    one packed all-gather (sparse values and indices), ``payload_bytes`` what each
    worker contributed (its ``bytes_per_worker``).
    """

    world_size: int
    payload_bytes: list[int]
    allreduce_bytes: int
    allgather_bytes: int

    @property
    def wire_bytes(self) -> float:
        """``wire_bytes_per_worker`` for this group."""
        return allreduce_wire_bytes(self.allreduce_bytes, self.world_size) + allgather_wire_bytes(
            self.allgather_bytes, self.world_size
        )


def group_traffic(per_worker: Sequence[Sequence[Payload]]) -> GroupTraffic:
    """Traffic of aggregating one group, from every worker's payloads.

    Sparse payloads of a group travel in one packed all-gather, padded to the
    largest worker's total; dense and shared-index payloads in one all-reduce.
    """
    n = len(per_worker)
    payload_bytes = [sum(p.nbytes for p in ps) for ps in per_worker]
    sparse_sizes = [sum(p.nbytes for p in ps if p.kind == SPARSE) for ps in per_worker]
    reduce_size = sum(p.nbytes for p in per_worker[0] if p.kind != SPARSE) if n else 0
    return GroupTraffic(n, payload_bytes, reduce_size, max(sparse_sizes, default=0))
