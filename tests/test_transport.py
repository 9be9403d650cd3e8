"""The wire format and the in-process transport: one byte rule, the same mean on every route, flags and counts."""

from __future__ import annotations

import pytest
import torch

from gradsift import payload as P
from gradsift.transport.base import TransportError, traffic_of
from gradsift.transport.local import LocalGroup, LocalTransport
from gradsift.transport.gather import pack_gather, unpack_gather
from gradsift.transport.wire import DENSIFY, GATHER, REDUCE, gather_segment_bytes, segment_wire_bytes


def _sparse(vals, idx, numel, cap, dtype=torch.float32):
    p = P.sparse(torch.tensor(vals, dtype=dtype), torch.tensor(idx), numel, dtype, cap)
    p.capacity = cap
    return p


def test_pack_and_unpack_round_trip_every_dtype_and_count():
    payloads = [_sparse([1.5, -2.0], [7, 3], 10, 3), _sparse([], [], 5, 2),
                _sparse([0.25], [123], 1000, 4, torch.float64),
                _sparse([3.0, 4.0], [1, 2], 8, 2, torch.float16)]
    buf = pack_gather(payloads, flag=1, device="cpu")
    assert buf.numel() == sum(gather_segment_bytes(p) for p in payloads)
    for p, (count, flag, vals, idx) in zip(payloads, unpack_gather(buf, payloads)):
        assert count == p.count and flag == 1
        order = torch.argsort(p.indices)  # coded indices travel sorted, their values with them
        assert torch.equal(idx, p.indices[order]) and torch.equal(vals, p.values[order])


def test_segment_sizes_are_stated_once():
    # 5 slots of 100 positions, Elias-Fano: 5 x 4 low bits (3 bytes) and 6 + 5 unary bits (2 bytes), 8 padded;
    # 20 bytes of fp32 values, 24 padded
    p = _sparse([1.0] * 3, [0, 1, 2], 100, 5)
    assert gather_segment_bytes(p) == 16 + 8 + 24  # (the header: count, flag, checksum)
    assert segment_wire_bytes(p, GATHER, 4) == 3 * (16 + 8 + 24)
    assert segment_wire_bytes(p, DENSIFY, 4) == pytest.approx(2 * 3 / 4 * 101 * 4)
    d = P.dense(torch.ones(10), torch.float32)
    assert segment_wire_bytes(d, REDUCE, 2) == pytest.approx(2 * 1 / 2 * 11 * 4)
    big = _sparse([1.0], [0], 2**31, 1)
    assert gather_segment_bytes(big) == 16 + 8 + 8  # one raw int64 index from 2**31 elements (Elias-Fano: 5 bytes)


def test_wire_bytes_do_not_depend_on_grouping():
    """The simulator groups one tensor at a time, DDP a bucket at a time: the same total either way."""
    ps = [_sparse([1.0] * 3, [0, 1, 2], 50, 4), P.dense(torch.ones(7), torch.float32), _sparse([2.0], [9], 20, 2),
          P.shared(torch.ones(4, dtype=torch.float16), torch.arange(4), 40, torch.float32, 4)]
    routes = [GATHER, REDUCE, DENSIFY, REDUCE]
    together = traffic_of(ps, routes, 3).wire_bytes
    apart = sum(traffic_of([p], [r], 3).wire_bytes for p, r in zip(ps, routes))
    assert together == pytest.approx(apart)
    assert together == pytest.approx(sum(segment_wire_bytes(p, r, 3) for p, r in zip(ps, routes)))


def test_densified_route_gives_the_same_mean_as_the_all_gather():
    g = torch.Generator().manual_seed(0)
    per_worker = []
    for _ in range(3):
        idx = torch.randperm(30, generator=g)[:6]
        per_worker.append([_sparse(torch.randn(6, generator=g).tolist(), idx.tolist(), 30, 6)])
    t = LocalTransport(3)
    gathered = t.aggregate(per_worker, [GATHER]).means[0]
    densified = t.aggregate(per_worker, [DENSIFY]).means[0]
    torch.testing.assert_close(gathered, densified, rtol=1e-6, atol=1e-7)


def test_local_group_completes_when_every_worker_started_and_reports_flags_and_counts():
    group = LocalGroup(3)
    ends = [group.endpoint(r) for r in range(3)]
    pend = []
    for r, e in enumerate(ends):
        pend.append(e.start([_sparse([float(r + 1)] * (r + 1), list(range(r + 1)), 5, 3)], flag=int(r == 2)))
        if r < 2:
            with pytest.raises(RuntimeError):
                pend[-1].wait()  # not every worker has started yet
    d = pend[0].wait()
    assert d is pend[2].wait()  # one delivery, shared
    assert d.counts == [[1], [2], [3]] and d.flags == [0, 0, 1] and d.any_flag and d.flagged == [2]
    assert d.means[0].tolist() == pytest.approx([(1 + 2 + 3) / 3, (2 + 3) / 3, 3 / 3, 0.0, 0.0])
    with pytest.raises(RuntimeError):
        ends[0].start([_sparse([1.0], [0], 5, 3)])
        ends[0].start([_sparse([1.0], [0], 5, 3)])  # twice before the others


def test_misaligned_payloads_are_refused():
    t = LocalTransport(2)
    a = [[P.dense(torch.ones(3), torch.float32)], [P.dense(torch.ones(4), torch.float32)]]
    with pytest.raises(TransportError):
        t.aggregate(a)
    b = [[_sparse([1.0], [0], 5, 2)], [_sparse([1.0], [0], 5, 3)]]
    with pytest.raises(TransportError, match="capacities"):
        t.aggregate(b)


def _combine_one_by_one(parts, numel, dtype, weights):
    """The sparse sum written out tensor by tensor (the rule of transport/base.py): zeros, each worker's values made
    float32 and added in worker order, divided by the worker count (or pre-scaled by the weight)."""
    out = torch.zeros(numel, dtype=torch.float32)
    for rank, (values, indices) in enumerate(parts):
        v = values.to(torch.float32)
        out.index_add_(0, indices, v if weights is None else v * weights[rank])
    return (out if weights is not None else out / len(parts)).to(dtype)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_a_groups_sparse_sum_is_each_tensors_bit_for_bit_in_a_fixed_number_of_operations(backend):
    from gradsift import kernels
    from gradsift.transport.base import combine_sparse_many

    if backend == "compiled" and kernels.compiled_lib(torch.empty(0)) is None:
        pytest.skip("no compiled kernels here")
    gen = torch.Generator().manual_seed(3)
    numels = [1000, 37, 5000, 1, 64]
    value_dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    parts = []  # three workers: a third is not a power of two, and indices overlap between workers
    for n, vd in zip(numels, value_dtypes):
        k = max(1, n // 7)
        parts.append([(torch.randn(k if r != 1 else 0, generator=gen).mul_(1e3).to(vd),
                       torch.randperm(n, generator=gen)[:k if r != 1 else 0]) for r in range(3)])
    want = [_combine_one_by_one(p, n, torch.float32, None) for p, n in zip(parts, numels)]
    weights = [0.5, 0.2, 0.3]
    weighted = [_combine_one_by_one(p, n, torch.float32, weights) for p, n in zip(parts, numels)]
    starts = [9000, 0, 2000, 8999, 1100]  # placed apart, not in order, with gaps that must end up zero
    with kernels.using(backend):
        fresh = combine_sparse_many(parts, numels, torch.float32, None, "cpu")
        out = torch.full((10100,), 7.0)
        placed = combine_sparse_many(parts, numels, torch.float32, None, "cpu", out, starts)
        scaled = combine_sparse_many(parts, numels, torch.float32, weights, "cpu")
    if backend == "compiled":  # (the compiled sweep took it)
        from gradsift.kernels.scatter import add_many
        assert add_many(torch.zeros(4), [(torch.ones(1), torch.tensor([2]))], [0], [4]) is not None
    for w, a, b, c, d in zip(want, fresh, placed, weighted, scaled):
        assert torch.equal(a, w) and torch.equal(b, w) and torch.equal(d, c)
    assert all(m.data_ptr() == out[s:].data_ptr() for m, s in zip(placed, starts))  # the means are views of out
    mask = torch.ones(10100, dtype=torch.bool)
    for s, n in zip(starts, numels):
        mask[s:s + n] = False
    assert torch.equal(out[mask], torch.zeros(int(mask.sum())))  # zeroed whole, not only where sent


def test_a_sparse_index_outside_its_tensor_is_refused():
    from gradsift.transport.base import combine_sparse_many

    parts = [[(torch.ones(2), torch.tensor([0, 3]))], [(torch.ones(1), torch.tensor([4]))]]
    with pytest.raises(IndexError):
        combine_sparse_many(parts, [4, 4], torch.float32, None, "cpu")


@pytest.mark.parametrize("workers", [2, 3, 5, 7, 24])
def test_the_compiled_division_of_a_mean_is_torchs_once_per_position(workers):
    from gradsift import kernels
    from gradsift.kernels.scatter import div_at

    if kernels.compiled_lib(torch.empty(0)) is None:
        pytest.skip("no compiled kernels here")
    gen = torch.Generator().manual_seed(workers)
    out = torch.randn(20000, generator=gen) * torch.exp(torch.randn(20000, generator=gen) * 20)
    at = torch.randint(0, 20000, (9000,), generator=gen)  # (positions repeat: several workers sent them)
    mine, want = out.clone(), out.clone()
    with kernels.using("compiled"):
        assert div_at(mine, at, workers)
    want.index_put_((at,), want.index_select(0, at).div_(workers))
    assert torch.equal(mine.view(torch.int32), want.view(torch.int32))
    from gradsift.kernels.buffers import position_bitmap

    assert not position_bitmap(20000).any()  # (kept between calls: left zeroed for the next)
