"""Fewer bytes an entry: coded indices (Elias-Fano, bitmap, raw) and bf16 values whose rounding error feedback keeps;
a corrupt coded payload stops every rank in one line naming the sender."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ddp_helpers import spawn
from gradsift import make_compressor
from gradsift import payload as P
from gradsift.runtime.runconfig import RunConfig
from gradsift.payload import indexcode as ic
from gradsift.transport.gather import pack_gather, unpack_gather
from gradsift.transport.wire import gather_segment_bytes


@pytest.mark.parametrize("universe,slots", [(1, 1), (5, 5), (7, 1), (64, 60), (1000, 1), (1000, 10), (100_000, 1000),
                                            (100_000, 100), (1_000_003, 997), (2**20, 2**20 // 3), (300, 299)])
def test_every_code_round_trips_any_count(universe, slots):
    g = torch.Generator().manual_seed(universe + slots)
    for count in sorted({0, 1, slots // 2, slots}):
        count = min(count, universe)
        idx = torch.sort(torch.randperm(universe, generator=g)[:count]).values
        for chosen in (idx, torch.arange(universe - count, universe)):  # the largest indices: the code's worst case
            for code in (ic.BITMAP, ic.ELIAS_FANO):
                buf = torch.zeros(ic.code_bytes(code, universe, slots, 4), dtype=torch.uint8)
                ic.encode(buf, code, chosen, universe, slots)
                assert torch.equal(ic.decode(buf, code, count, universe, slots), chosen), (code, count)


def test_the_smallest_code_and_its_bound():
    """Elias-Fano needs at most slots * (log2(universe / slots) + 2) bits whatever the indices; a bitmap wins above
    about a quarter."""
    for universe, slots in [(10**6, 10**4), (10**6, 10**3), (10**7, 10**4), (123_457, 1234), (10**6, 65_536)]:
        code, nbytes = ic.layout(universe, slots, 4)
        assert code == ic.ELIAS_FANO and nbytes <= slots * (math.log2(universe / slots) + 2) / 8 + 2
    assert ic.layout(10**6, 10**4, 4)[1] / 10**4 < 1.15  # density 1%: about 1.1 bytes an index, not 4
    assert ic.layout(10**6, 10**3, 4)[1] / 10**3 < 1.5  # 0.1%
    assert ic.layout(10**6, 4 * 10**5, 4)[0] == ic.BITMAP
    assert ic.layout(2**20, 1, 4) == (ic.RAW, 4)  # one index: Elias-Fano ties, and the tie goes to raw


def test_default_values_are_bf16_where_the_memory_keeps_the_rounding():
    x = torch.randn(100, 100, generator=torch.Generator().manual_seed(0))  # (DGC sends vectors whole)
    for spec in ("topk", "sidco", "dgc", "gaussiank", "regtopk", "topk:memory=adam"):
        c = make_compressor(spec, 0.01)
        p = c.compress("w", x)
        assert p.values.dtype == torch.bfloat16, spec
    assert make_compressor("topk:value_dtype=fp32", 0.01).compress("w", x).values.dtype == torch.float32
    assert make_compressor("topk:feedback=false", 0.01).compress("w", x).values.dtype == torch.float32
    assert make_compressor("randomk:shared=true", 0.01).compress("w", x).values.dtype == torch.float32  # all-reduced
    assert make_compressor("dense").compress("w", x).values.dtype == torch.float32


@pytest.mark.parametrize("spec", ["topk", "sidco", "gaussiank", "dgc:memory=ef", "rtopk", "regtopk"])
def test_nothing_is_lost_to_the_rounding(spec):
    """memory + decoded sends == every gradient given, exactly (fp32 arithmetic: a bf16 rounding's remainder is exact)."""
    g = torch.Generator().manual_seed(1)
    c = make_compressor(spec, 0.02)
    total, sent = torch.zeros(5000), torch.zeros(5000)
    for _ in range(6):
        x = torch.randn(50, 100, generator=g)
        total += x.reshape(-1)
        p = c.compress("w", x)
        assert p.kind == P.SPARSE and p.values.dtype == torch.bfloat16
        sent += p.to_dense(torch.float32)
    held = c.residual["w"]
    torch.testing.assert_close(held + sent, total, rtol=0, atol=2e-6)


def test_entry_bytes_at_one_percent_and_one_in_a_thousand():
    """A sparse entry of a 1M-entry tensor: 8 bytes before (int32 + fp32); now under 3.5 at 1% and 4.5 at 0.1%."""
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(2))
    for ratio, most in ((0.01, 3.5), (0.001, 4.5)):
        p = make_compressor("topk", ratio).compress("w", x)
        p.capacity = p.count
        assert (gather_segment_bytes(p) - 8) / p.count <= most
        assert p.nbytes / p.count <= most


def _segment(universe=10_000, count=100):
    idx = torch.randperm(universe, generator=torch.Generator().manual_seed(3))[:count]
    p = P.sparse(torch.randn(count).to(torch.bfloat16), idx, universe, torch.float32, count)
    p.capacity = count
    return p


def test_a_corrupt_stream_is_refused_naming_the_sender():
    p = _segment()
    good = pack_gather([p], 0, "cpu")
    (count, _, vals, idx), = unpack_gather(good, [p], sender=3)
    assert count == 100 and torch.equal(idx, torch.sort(p.indices).values)
    for how in ("bits", "count", "fewer", "flag", "flipped"):
        bad = good.clone()
        if how == "bits":
            bad[16:24] = 255  # index bits: the checksum no longer matches
        elif how == "count":
            bad[0:4].view(torch.int32).fill_(101)  # more than its slots
        elif how == "fewer":
            bad[0:4].view(torch.int32).fill_(99)  # a count that fits: the checksum holds the header too
        elif how == "flag":
            bad[4:8].view(torch.int32).fill_(7)
        else:
            bad[4:8].view(torch.int32).fill_(1)  # a flag that could be true: the checksum again
        with pytest.raises(ic.CorruptPayload, match=r"^rank 3 sent a sparse payload that does not decode"):
            unpack_gather(bad, [p], sender=3)
    with pytest.raises(ic.CorruptPayload, match="out of range"):
        ic.check_raw(torch.tensor([0, 5, 10]), 10)


def _corrupting(rank, world, route, outdir):
    """Rank 1 corrupts the index part of what it sends at its third step; every rank must stop in one line."""
    import gradsift.transport.dist as td
    from gradsift.launch import train_ddp

    calls = {"n": 0}
    name = "pack_gather" if route == "gather" else "pack_blocks"
    original = getattr(td, name)

    def corrupt(*a, **kw):
        buf = original(*a, **kw)
        calls["n"] += 1
        if rank == 1 and calls["n"] >= 3:
            rows = buf.view(-1, buf.shape[-1]) if buf.dim() > 1 else buf.view(1, -1)
            rows[:, 16:24] ^= 255
        return buf

    setattr(td, name, corrupt)
    cfg = RunConfig(task="digits-cnn", ratio=0.05, steps=6, batch_size=16, lr=0.05, optimizer="momentum",
                    eval_every=1000, compressor="topk", workers=world, granularity="model", wire_plan="off",
                    sparse_collective=route)
    train_ddp(cfg, out=None, bucket_cap_mb=25)


@pytest.mark.parametrize("route,world", [("gather", 2), ("scatter", 3)])
def test_a_corrupt_payload_stops_every_rank_in_one_line(tmp_path, route, world):
    errs = spawn(_corrupting, world, route, str(tmp_path), expect_failure=True)
    assert set(errs) == set(range(world))
    for r, text in errs.items():
        first = text.splitlines()[0]
        assert first.startswith("CorruptPayload: rank 1 sent"), (r, first)
        assert "does not decode" in first and "nothing of it was summed" in first


@pytest.mark.parametrize("spec", ["topk", "sidco", "dgc", "gaussiank", "redsync"])
def test_the_same_entries_as_fp32_values_within_the_rounding(spec):
    """The coding changes what travels, not what is selected: the same indices as value_dtype=fp32, and values
    that are its values rounded to bf16."""
    x = torch.randn(64, 250, generator=torch.Generator().manual_seed(4))
    wide = make_compressor(f"{spec}:value_dtype=fp32", 0.01).compress("w", x)
    narrow = make_compressor(spec, 0.01).compress("w", x)
    assert torch.equal(narrow.indices, wide.indices)
    assert torch.equal(narrow.values, wide.values.to(torch.bfloat16))


def _mixed_payloads(seed: int):
    """Sparse payloads of every code (raw int32 and int64, bitmap, Elias-Fano with 0-7 leftover low bits), sorted
    and unsorted indices, empty and spare slots, 2- and 4-byte values."""
    from gradsift.payload import SPARSE, Payload

    g = torch.Generator().manual_seed(seed)
    out = []
    for numel, k, cap, vdt, shuffle in [(1000, 10, 12, torch.bfloat16, False), (5000, 50, 50, torch.float32, True),
                                        (64, 64, 64, torch.bfloat16, False), (100, 30, 30, torch.bfloat16, True),
                                        (3_000_000, 3000, 3100, torch.bfloat16, True), (200, 0, 2, torch.float32, False),
                                        (70000, 700, 700, torch.float16, False), (1 << 20, 1, 1, torch.bfloat16, False),
                                        (40, 5, 5, torch.float32, True), (2**31 + 5, 3, 3, torch.bfloat16, True),
                                        (1 << 16, 655, 655, torch.bfloat16, True)]:
        if numel > 1e8:
            idx = torch.randint(0, numel, (3 * k,), generator=g).unique()[:k]
        else:
            idx = torch.randperm(numel, generator=g)[:k]
        idx = idx[torch.randperm(idx.numel(), generator=g)] if shuffle else idx.sort().values
        out.append(Payload(SPARSE, torch.randn(idx.numel(), generator=g).to(vdt), idx, numel, torch.float32, k,
                           capacity=cap))
    return out


def test_the_compiled_gather_buffer_is_the_same_bytes_as_segment_by_segment():
    """pack_gather writes every segment in one call of the compiled kernel on the CPU: byte for byte what put_segment
    writes one segment at a time (header, coded indices sorted with their values, padding, checksum), and it
    decodes to what was sent."""
    from gradsift import kernels
    from gradsift.transport import gather, wire

    codes = set()
    for seed in range(3):
        ps = _mixed_payloads(seed)
        codes |= {wire.layout(p.numel, wire.slots(p), wire.index_dtype_for(p.numel).itemsize)[0] for p in ps}
        for flag in (0, 1):
            with kernels.using("eager"):
                want = gather.pack_gather(ps, flag, torch.device("cpu"))
            with kernels.using("compiled"):
                got = gather.pack_gather(ps, flag, torch.device("cpu"))
            assert torch.equal(got, want), (seed, flag)
            for p, (count, f, vals, idx) in zip(ps, gather.unpack_gather(got, ps)):
                order = torch.argsort(p.indices)
                assert count == p.count and f == flag
                assert torch.equal(idx.long().sort().values, p.indices[order])
                assert torch.equal(vals[torch.argsort(idx.long())], p.values[order])
    assert codes == {"raw", "bitmap", "elias-fano"}


def test_the_compiled_reader_gives_what_segment_by_segment_gives_and_the_same_errors():
    """unpack_gather's compiled reader (headers, checksums and indices of every segment in one call) returns the
    same counts, flags, values and int64 indices as get_segment one segment at a time; a corrupted byte anywhere is the
    same CorruptPayload line on both paths (a segment the kernel rejects is read again by get_segment, which says why)."""
    from gradsift import kernels
    from gradsift.payload.indexcode import CorruptPayload
    from gradsift.transport import gather, wire

    ps = _mixed_payloads(7)
    buf = gather.pack_gather(ps, 1, torch.device("cpu"))
    with kernels.using("eager"):
        want = gather.unpack_gather(buf, ps, 3)
    with kernels.using("compiled"):
        got = gather.unpack_gather(buf, ps, 3)
    for a, b in zip(want, got):
        assert a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]) and b[3].dtype == torch.int64
    gen = torch.Generator().manual_seed(0)
    for at in torch.randint(0, buf.numel(), (40,), generator=gen).tolist():
        bad = buf.clone()
        bad[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        said = []
        for backend in ("eager", "compiled"):
            with kernels.using(backend):
                try:
                    gather.unpack_gather(bad, ps, 3)
                    said.append(None)
                except CorruptPayload as e:
                    said.append(str(e))
        assert said[0] is not None and said[0] == said[1], (at, said)


def test_a_devices_buffer_coded_on_the_host_is_the_same_bytes():
    """On a GPU the gather buffer is coded on the host from one copy per dtype of the payloads' indices and values
    (``_to_host``: concatenated, copied, split back into views in their order) and read there, the values left as
    views of the device's buffer: here the same route with host tensors gives the direct path's bytes and reads
    (tests/test_cuda.py checks it on a GPU)."""
    from gradsift import kernels
    from gradsift.transport import gather

    ps = _mixed_payloads(11)
    ps[1] = dataclasses.replace(ps[1], indices=ps[1].indices.to(torch.int32))  # indices of two dtypes
    idxs, vals = gather._to_host([p.indices for p in ps]), gather._to_host([p.values for p in ps])
    assert [i.dtype for i in idxs] == [p.indices.dtype for p in ps]
    assert all(torch.equal(a, p.indices) and torch.equal(b, p.values) for a, b, p in zip(idxs, vals, ps))
    with kernels.using("compiled"):
        want = gather.pack_gather(ps, 1, torch.device("cpu"))
        host = torch.zeros_like(want)
        assert gather._pack_compiled(host, ps, 1, idxs, vals)
        assert torch.equal(host, want)
        device_copy = want.clone()
        got = gather._unpack_compiled(want, ps, 3, device_copy)
    for (count, flag, v, i), (c2, f2, v2, i2) in zip(gather.unpack_gather(want, ps, 3), got):
        assert (count, flag) == (c2, f2) and torch.equal(v, v2) and torch.equal(i, i2)
        assert v2.untyped_storage().data_ptr() == device_copy.untyped_storage().data_ptr()
