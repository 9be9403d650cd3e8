"""A group's all-reduce part riding its all-gather: one collective where two would run, the simulator's sums (worker
order) at any world size, the bytes it moves counted, and the road's decision priced on its link."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ddp_helpers import spawn
from gradsift import payload as P
from gradsift.route.netmodel import NetworkModel
from gradsift.route.plan import WirePlan
from gradsift.transport.base import traffic_of
from gradsift.transport.wire import DENSIFY, GATHER, REDUCE, group_bytes


def _payloads(rank: int) -> tuple[list[P.Payload], list[str]]:
    """Two sparse payloads (fp32 and bf16 values), a dense one in fp32, one in bf16 and a densified sparse one:
    two all-reduce dtypes beside the all-gather. Values differ by rank and span magnitudes, so that the order of
    the sums shows in the bits."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for numel, cap, vd in ((500, 20, torch.float32), (70, 9, torch.bfloat16)):
        count = cap - rank  # every rank its own count
        idx = torch.randperm(numel, generator=g)[:count]
        p = P.sparse((torch.randn(count, generator=g) * 10.0 ** rank).to(vd), idx, numel, torch.float32, cap)
        p.capacity = cap
        out.append(p)
    out.append(P.dense(torch.randn(33, generator=g).mul_(1e4 ** rank), torch.float32))
    out.append(P.dense(torch.randn(18, generator=g).mul_(3.0 ** rank).bfloat16(), torch.float32))  # (19 bf16 words: rows
    # of the merged buffer then start 2 bytes off a 4-byte boundary, where the fp32 values of rank 1 are read)
    idx = torch.randperm(40, generator=g)[:5]
    d = P.sparse(torch.randn(5, generator=g).mul_(1e3 ** rank), idx, 40, torch.float32, 5)
    d.capacity = 5
    out.append(d)
    return out, [GATHER, GATHER, REDUCE, REDUCE, DENSIFY]


def _merged_run(rank: int, world: int, outdir: str) -> None:
    from gradsift.transport.dist import DistTransport

    t = DistTransport()
    payloads, routes = _payloads(rank)
    pending = t.start(payloads, routes, flag=1 if rank == world - 1 else 0, merge=True)
    assert pending.merged and len(pending.works) == 1  # one collective for the group
    delivery = pending.wait()
    if rank == 0:
        torch.save((delivery.means, delivery.flags, delivery.counts, pending.traffic.wire_bytes),
                   Path(outdir) / "merged.pt")
    dist.barrier()


def test_merged_sums_are_the_simulators_on_three_ranks_in_one_collective(tmp_path):
    from gradsift.transport.local import LocalTransport

    world = 3
    spawn(_merged_run, world, str(tmp_path))
    means, flags, counts, wire = torch.load(tmp_path / "merged.pt")
    per_worker = [_payloads(r)[0] for r in range(world)]
    routes = _payloads(0)[1]
    local = LocalTransport(world).aggregate(per_worker, routes, flags=[0, 0, 1])
    for a, b in zip(means, local.means):
        assert a.dtype == b.dtype and torch.equal(a, b)  # worker order, bit for bit (gloo's ring would not be)
    assert counts == local.counts and flags[2] == 1 and not flags[0]
    reduce, gather, _, _ = group_bytes(per_worker[0], routes)
    assert wire == traffic_of(per_worker[0], routes, world, merged=True).wire_bytes == (world - 1) * (gather + reduce)


def test_merged_bytes_equal_the_two_collectives_on_two_workers():
    payloads, routes = _payloads(0)
    assert traffic_of(payloads, routes, 2, merged=True).wire_bytes == traffic_of(payloads, routes, 2).wire_bytes
    alone = [p for p, r in zip(payloads, routes) if r == GATHER]
    assert traffic_of(alone, [GATHER] * 2, 4, merged=True) == traffic_of(alone, [GATHER] * 2, 4)  # nothing to merge


def test_the_road_merges_where_one_collective_is_priced_cheaper():
    payloads, routes = _payloads(0)
    slow = NetworkModel(bandwidth_gbps=0.1, latency_us=1000.0)
    assert WirePlan(slow, world_size=4).merges(payloads, routes)  # a few hundred bytes: the latencies win
    assert WirePlan(slow, world_size=2).merges(payloads, routes)  # two workers: the same bytes either way
    assert not WirePlan(slow, world_size=4).merges(payloads[:2], routes[:2])  # no all-reduce part
    assert not WirePlan(slow, world_size=4).merges(payloads[2:4], routes[2:4])  # no all-gather
    big = P.dense(torch.zeros(200_000), torch.float32)  # 800 KB more, moved 3 times instead of 1.5
    assert not WirePlan(slow, world_size=4).merges([*payloads, big], [*routes, REDUCE])
    assert WirePlan(slow, world_size=2).merges([*payloads, big], [*routes, REDUCE])


class _Group:
    """What :class:`DistPending` reads of its transport, for decoding in process."""

    def __init__(self, world_size: int):
        self.world_size, self.weights, self.ranked = world_size, None, False


def _gathered(world: int) -> tuple[list[P.Payload], torch.Tensor]:
    """Every rank's sparse payloads (top-k 1% of tensors of several sizes, fp32 and bf16 values, one rank sending
    fewer), packed and concatenated in rank order as the all-gather delivers them."""
    from gradsift.transport.gather import pack_gather

    per_rank = []
    for r in range(world):
        g = torch.Generator().manual_seed(50 + r)
        ps = []
        for n, vd in ((65536, torch.bfloat16), (4096, torch.float32), (1000, torch.bfloat16), (7, torch.float32)):
            cap = max(1, n // 100)
            count = cap if r != 1 else cap // 2
            x = torch.randn(n, generator=g) * 10.0 ** r
            idx = x.abs().topk(count).indices
            p = P.sparse(x[idx].to(vd), idx, n, torch.float32, cap)
            p.capacity = cap
            ps.append(p)
        per_rank.append(ps)
    return per_rank[0], torch.cat([pack_gather(ps, 0, "cpu") for ps in per_rank])


def _decode(mine, gathered, world, monkeypatch=None, compiled=True):
    from gradsift.transport import dist as D

    if not compiled:
        monkeypatch.setattr(D, "add_gathered", lambda *a, **k: None)
    pending = D.DistPending(_Group(world), mine, [GATHER] * len(mine), [], [], gathered.clone(), 0.0)
    return pending.decode()


def test_a_gathered_group_decodes_in_one_call_with_the_same_bits(monkeypatch):
    from gradsift import kernels

    world = 3
    mine, gathered = _gathered(world)
    one = _decode(mine, gathered, world)
    with monkeypatch.context() as m:
        each = _decode(mine, gathered, world, m, compiled=False)  # a tensor per segment, then the sums
    for a, b in zip(one.means, each.means):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert one.counts == each.counts and one.counts[1][0] == 327 and one.flags == each.flags == [0, 0, 0]
    if kernels.compiled_lib(torch.empty(0)) is not None:  # (the one call took it)
        from gradsift.transport.gather import add_gathered

        from gradsift.kernels.scatter import div_at

        # the tensors anywhere in a buffer holding other numbers (a DDP bucket), out of order, with gaps: it ends
        # zero but for the means, each tensor's from the same adds in the same order
        out = torch.full((71700,), float("nan"))
        starts = [5000, 100, 70600, 4200]
        at, _ = add_gathered(out, gathered.view(world, -1), mine, starts)
        assert div_at(out, at, world)
        want = torch.zeros(71700)
        for s, mean in zip(starts, each.means):
            want[s:s + mean.numel()] = mean
        assert torch.equal(out, want)
        out.fill_(float("nan"))  # the mean taken in the same call: each tensor divided where it is, the same bits
        assert add_gathered(out, gathered.view(world, -1), mine, starts, mean=True)[0] is None
        assert torch.equal(out, want)


def test_a_damaged_segment_in_a_gathered_group_names_its_sender():
    from gradsift.payload.indexcode import CorruptPayload

    world = 3
    mine, gathered = _gathered(world)
    row = gathered.numel() // world
    gathered[row + 40] ^= 0x10  # a bit of rank 1's first segment
    try:
        _decode(mine, gathered, world)
    except CorruptPayload as e:
        assert "rank 1" in str(e)
    else:
        raise AssertionError("a damaged segment decoded")
