"""Sparse values below 16 bits (``value_dtype=int4``/``int2``): a scale per block of 64, each value its nearest
level, what the rounding drops kept by the memory, the bytes the coded wire moves, and the refusals."""

from __future__ import annotations

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.payload import lowbits
from gradsift import payload as P
from gradsift.memory.wirecast import cast_below_16_bits
from gradsift.errors import ConfigError
from gradsift.route.routing import check_support
from gradsift.transport import gather, wire

COUNTS = [5, 130, 0, 64, 1, 200]


@pytest.mark.parametrize("bits", [2, 4])
def test_each_value_is_its_blocks_nearest_level_and_decodes_to_the_same_bits(bits):
    """The definition, checked by brute force: per block of 64 (none straddling two payloads) the scale is the
    largest magnitude, every value becomes s * LEVEL[c] for the level nearest v / s; decoding the packed bytes gives
    the same float32 bits, and coding the decoded values again gives the same bytes."""
    lev = lowbits.levels(bits)
    n = 2**bits - 1
    assert torch.equal(lev, torch.tensor([(2 * c - n) / n for c in range(n + 1)], dtype=torch.float64).float())
    g = torch.Generator().manual_seed(bits)
    v = torch.randn(sum(COUNTS), generator=g) * torch.rand(sum(COUNTS), generator=g) ** 3
    v[140:150] = 0.0  # (zeros inside a block that is not all zero)
    w = lowbits.round_values(v, COUNTS, bits)
    at = 0
    for c in COUNTS:
        for b in range(0, c, lowbits.BLOCK):
            vb, wb = v[at + b:at + min(b + lowbits.BLOCK, c)], w[at + b:at + min(b + lowbits.BLOCK, c)]
            s = vb.abs().max()
            assert wb.abs().max() == s  # the block's largest is exact
            dist = (vb[:, None] / s - lev[None, :]).abs()
            chosen = (wb[:, None] == s * lev[None, :])  # each decoded value is s times one level...
            assert bool((chosen.sum(1) == 1).all())
            assert torch.equal(dist[chosen], dist.min(1).values)  # ...a nearest one (a tie either way)
        at += c
    slots = [c + 3 for c in COUNTS]
    parts = lowbits.encode(w, COUNTS, slots, bits)
    assert [p.numel() for p in parts] == [lowbits.part_bytes(n_, bits) for n_ in slots]
    buf = torch.cat([torch.zeros(5, dtype=torch.uint8), *parts])
    starts = [5 + sum(lowbits.part_bytes(x, bits) for x in slots[:i]) for i in range(len(slots))]
    got = torch.cat(lowbits.decode(buf, starts, COUNTS, slots, bits))
    assert torch.equal(got.view(torch.int32), w.view(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(lowbits.encode(got, COUNTS, slots, bits), parts))
    zeros = lowbits.round_values(torch.zeros(70), [70], bits)  # a block of zeros: scale 0, zeros decoded
    assert torch.equal(zeros, torch.zeros(70))


@pytest.mark.parametrize("spec", ["topk:value_dtype=int2", "sidco:value_dtype=int2", "rtopk:value_dtype=int4",
                                  "dgc:memory=ef,value_dtype=int2", "gaussiank:value_dtype=int4"])
def test_nothing_is_lost_to_the_rounding(spec):
    """memory + decoded sends == every gradient given (float32 arithmetic), for a group of tensors cast at once as
    the road casts them; the values sent sit on their levels in index order, at 2 or 4 bits each."""
    keys = ["a", "b", "c"]
    g = torch.Generator().manual_seed(1)
    c = make_compressor(spec, 0.05)
    total = {k: torch.zeros(n) for k, n in zip(keys, (3000, 700, 5000))}
    sent = {k: torch.zeros_like(t) for k, t in total.items()}
    for _ in range(6):
        grads = [torch.randn(t.numel(), generator=g) for t in total.values()]
        ps = c.compress_many(keys, grads)
        cast_below_16_bits(c, keys, ps)
        for k, x, p in zip(keys, grads, ps):
            total[k] += x
            assert p.kind == P.SPARSE and p.value_bits == c.value_bits and p.values.dtype == torch.float32
            assert bool((p.indices[1:] > p.indices[:-1]).all())
            assert torch.equal(lowbits.round_values(p.values, [p.count], p.value_bits), p.values)
            sent[k] += p.to_dense(torch.float32)
    for k in keys:
        torch.testing.assert_close(c.residual[k] + sent[k], total[k], rtol=0, atol=1e-5)


def _coded_payloads(bits: int):
    """Sparse payloads as the road hands them to the transport, values on their levels: every index code, empty
    and spare slots, 1 to 300 values."""
    g = torch.Generator().manual_seed(bits)
    out = []
    for numel, k, cap in [(1000, 10, 12), (5000, 300, 300), (64, 64, 64), (200, 0, 2), (1 << 20, 1, 1),
                          (70000, 129, 140)]:
        idx = torch.randperm(numel, generator=g)[:k].sort().values
        v = lowbits.round_values(torch.randn(k, generator=g), [k], bits)
        out.append(P.Payload(P.SPARSE, v, idx, numel, torch.float32, k, capacity=cap, value_bits=bits))
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_the_compiled_buffer_is_the_segments_bytes_and_decodes_to_what_was_sent(bits):
    """The gather buffer with coded values: the compiled writer and reader agree byte for byte and value for value
    with the segment-by-segment ones, the size is what the byte rule counts, and every rank decodes the sent bits."""
    if kernels.backend() != "compiled":
        pytest.skip("no C compiler here")
    ps = _coded_payloads(bits)
    with kernels.using("eager"):
        want = gather.pack_gather(ps, 1, torch.device("cpu"))
        slow = gather.unpack_gather(want, ps)
    with kernels.using("compiled"):
        got = gather.pack_gather(ps, 1, torch.device("cpu"))
        fast = gather.unpack_gather(got, ps)
    assert torch.equal(got, want) and got.numel() == sum(wire.gather_segment_bytes(p) for p in ps)
    for p, a, b in zip(ps, slow, fast):
        assert a[0] == b[0] == p.count and a[1] == b[1] == 1
        assert torch.equal(a[3], p.indices) and torch.equal(b[3], p.indices)
        assert torch.equal(a[2].view(torch.int32), p.values.view(torch.int32))
        assert torch.equal(b[2].view(torch.int32), p.values.view(torch.int32))
    want[100] ^= 1  # a flipped bit in a value part: the checksum names the sender
    with pytest.raises(Exception, match="rank 3 sent a sparse payload that does not decode"):
        gather.unpack_gather(want, ps, sender=3)


def test_bytes_per_entry_below_16_bits():
    """On a 1M-entry tensor at 1% and 0.1% of it: 2-bit values and coded indices, under 1.6 and 2.6 bytes an entry
    (bf16: 3.07 and 4.0); 4-bit values in between. What telemetry counts is what the coded wire moves, less its
    header and padding."""
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(2))
    for vd, most in (("int2", {0.01: 1.6, 0.001: 2.6}), ("int4", {0.01: 1.9, 0.001: 2.9})):
        for ratio, limit in most.items():
            c = make_compressor(f"topk:value_dtype={vd}", ratio)
            p = c.compress("w", x)
            cast_below_16_bits(c, ["w"], [p])
            p.capacity = p.count
            assert p.nbytes / p.count <= limit, (vd, ratio, p.nbytes / p.count)
            assert wire.gather_segment_bytes(p) - p.nbytes <= 16 + 2 * 7, vd  # header and two paddings


def test_what_cannot_carry_codes_is_refused_in_one_line():
    cases = [("gsb:value_dtype=int2", "codes the values of sparse payloads"),
             ("randomk:shared=true,value_dtype=int4", "codes the values of sparse payloads"),
             ("dense:value_dtype=int2", "codes the values of sparse payloads"),
             ("topk:memory=none,value_dtype=int2", "only a memory keeps what that drops"),
             ("topk:value_dtype=int2,residual_dtype=bf16", "must then be fp32"),
             ("topk:value_dtype=int3", "value_dtype must be one of")]
    for spec, says in cases:
        with pytest.raises(ValueError, match=says) as e:
            make_compressor(spec, 0.01)
        assert "\n" not in str(e.value)
    c = make_compressor("topk:value_dtype=int2", 0.01, world_size=4)
    for runtime, coll in (("fsdp", "auto"), ("hsdp", "auto"), ("ddp", "scatter"), ("sim", "scatter")):
        with pytest.raises(ConfigError, match="owners pass sums on"):
            check_support(c, runtime=runtime, sparse_collective=coll)
    check_support(c, runtime="ddp")
    check_support(c, runtime="local")
