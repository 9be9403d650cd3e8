"""Public helpers: spec strings, make_compressor, sparsify, payload accounting, network model."""

from __future__ import annotations


import pytest
import torch

import gradsift
from gradsift import payload as P
from gradsift import make_compressor
from gradsift.compressors import OptionError, parse_spec, parse_value
from gradsift.route.netmodel import NetworkModel
from gradsift.transport.local import LocalTransport


def test_parse_values_and_specs():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("0.5") == 0.5 and parse_value("1e-3") == 1e-3
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("gp") == "gp"
    assert parse_spec("topk") == ("topk", {})
    assert parse_spec("randomk:shared=true,scale=false") == ("randomk", {"shared": True, "scale": False})
    for bad in ["", "randomk:shared", "randomk:=1", "randomk:shared=true,shared=false"]:
        with pytest.raises(OptionError):
            parse_spec(bad)


def test_make_compressor_errors_are_one_line():
    cases = [
        (("nope",), {}),
        (("topk",), {"ratio": 0}),
        (("topk",), {"ratio": float("nan")}),
        (("topk",), {"ratio": 2}),
        (("topk:bogus=1",), {}),
        (("randomk:shared=true",), {"shared": False}),  # both in spec and keyword
        (("randomk:shared=3",), {}),
        (("randomk:scale=true",), {}),  # unbiased scaling with feedback
        (("topk:seed=3", 0.01), {}),  # the run places a compressor: a spec cannot (a TypeError traceback before)
        (("topk:rank=1", 0.01), {}),
        (("gsb:world_size=4", 0.01), {}),
    ]
    for args, kw in cases:
        with pytest.raises(OptionError) as e:
            make_compressor(*args, **kw)
        assert "\n" not in str(e.value)


def test_make_compressor_defaults_and_memory():
    from gradsift.memory.feedback import ErrorFeedback

    assert isinstance(make_compressor("topk", 0.1), ErrorFeedback)
    assert not isinstance(make_compressor("topk:feedback=false", 0.1), ErrorFeedback)
    assert not isinstance(make_compressor("dense"), ErrorFeedback)
    assert make_compressor("randomk:scale=true,feedback=false", 0.1).inner.options["scale"] is True
    assert make_compressor("topk", ratio=0.2).ratio == 0.2
    assert make_compressor("topk:ratio=0.3").ratio == 0.3


def test_sparsify_returns_values_and_indices():
    x = torch.tensor([[0.1, -5.0, 0.3], [4.0, 0.0, -0.2]])
    v, i = gradsift.sparsify("topk", x, 2 / 6)
    assert sorted(i.tolist()) == [1, 3]
    assert sorted(v.tolist()) == [-5.0, 4.0]
    v, i = gradsift.sparsify("dense", x)
    assert torch.equal(v, x.reshape(-1)) and torch.equal(i, torch.arange(6))
    v, i = gradsift.sparsify("randomk", x, 0.5, seed=3)  # what travels, decoded: bf16 values in the tensor's dtype
    assert v.numel() == 3 and v.dtype == x.dtype and torch.equal(v, x.reshape(-1)[i].bfloat16().float())
    v, i = gradsift.sparsify("randomk:value_dtype=fp32", x, 0.5, seed=3)
    assert torch.equal(v, x.reshape(-1)[i])


def test_k_rounding():
    from gradsift.compressors.base import target_count

    assert target_count(0.01, 50) == 1  # max(1, round(0.5)) -- never zero
    assert target_count(0.01, 250) == 2
    assert target_count(1.0, 7) == 7
    assert target_count(0.001, 10) == 1


def test_payload_bytes():
    x = torch.zeros(1000)
    # 10 indices of 1000, Elias-Fano: 10 x 6 low bits (8 bytes) and 15 + 10 unary bits (4 bytes)
    p = P.sparse(torch.ones(10), torch.arange(10), 1000, torch.float32, 10)
    assert p.nbytes == 10 * 4 + 12 and p.index_bytes == 1.2
    p16 = P.sparse(torch.ones(10, dtype=torch.float16), torch.arange(10), 1000, torch.float32, 10)
    assert p16.nbytes == 10 * 2 + 12
    s = P.shared(torch.ones(10, dtype=torch.float16), torch.arange(10), 1000, torch.float32, 10)
    assert s.nbytes == 10 * 2 and s.index_bytes == 0
    d = P.dense(x, torch.float32)
    assert d.nbytes == 4000
    big = P.sparse(torch.ones(3), torch.arange(3), 2**31, torch.float32, 3)
    assert big.index_bytes == 4 and P.index_dtype_for(2**31 - 1) == torch.int32  # 12 bytes coded, not 3 int64
    assert P.allreduce_wire_bytes(4000, 4) == 2 * 3 / 4 * 4000
    assert P.allgather_wire_bytes(80, 4) == 3 * 80
    assert P.allreduce_wire_bytes(4000, 1) == 0


def test_network_model():
    m = NetworkModel(bandwidth_gbps=8.0, latency_us=10.0)  # 1e9 bytes/s
    assert m.allreduce_s(1e9, 4) == pytest.approx(6 * 10e-6 + 1.5)
    assert m.allgather_s(1e6, 4) == pytest.approx(3 * 10e-6 + 3e-3)
    assert m.allreduce_s(1e9, 1) == 0.0
    with pytest.raises(ValueError):
        NetworkModel(bandwidth_gbps=0)


def test_local_transport_shared_dense_sparse_means():
    t = LocalTransport(2)
    idx = torch.tensor([1, 3])
    sh = [[P.shared(torch.tensor([1.0, 2.0]), idx, 4, torch.float32, 2)],
          [P.shared(torch.tensor([3.0, 6.0]), idx, 4, torch.float32, 2)]]
    assert t.aggregate(sh).means[0].tolist() == [0.0, 2.0, 0.0, 4.0]
    sp = [[P.sparse(torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), 3, torch.float32, 2)],
          [P.sparse(torch.tensor([4.0]), torch.tensor([1]), 3, torch.float32, 2)]]
    assert t.aggregate(sp).means[0].tolist() == [0.5, 3.0, 0.0]
    de = [[P.dense(torch.tensor([1.0, 2.0]), torch.float32)], [P.dense(torch.tensor([3.0, 4.0]), torch.float32)]]
    assert t.aggregate(de).means[0].tolist() == [2.0, 3.0]
    w = LocalTransport(2, weights=[0.25, 0.75])
    assert w.aggregate(de).means[0].tolist() == [2.5, 3.5]
    assert w.aggregate(sp).means[0].tolist() == [0.25, 3.5, 0.0]
    with pytest.raises(ValueError):
        LocalTransport(2, weights=[1.0])


def test_transport_refuses_misaligned_payloads():
    from gradsift.transport.base import TransportError

    t = LocalTransport(2)
    a = [[P.dense(torch.ones(3), torch.float32)], [P.sparse(torch.ones(1), torch.tensor([0]), 3, torch.float32, 1)]]
    with pytest.raises(TransportError):
        t.aggregate(a)


def test_compressors_never_touch_global_rng():
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    c = make_compressor("randomk", 0.1)
    for _ in range(3):
        c.compress("x", torch.randn(100, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.rand(3), expect)


def test_randomk_shared_draws_same_indices_on_every_worker():
    comps = [make_compressor("randomk:shared=true", 0.1, rank=r, world_size=3, seed=9) for r in range(3)]
    for step in range(3):
        ps = [c.compress("w", torch.randn(200)) for c in comps]
        assert all(p.kind == P.SHARED for p in ps)
        assert all(torch.equal(ps[0].indices, p.indices) for p in ps)
    own = [make_compressor("randomk", 0.1, rank=r, world_size=3, seed=9) for r in range(3)]
    ps = [c.compress("w", torch.randn(200)) for c in own]
    assert not torch.equal(ps[0].indices, ps[1].indices)


def test_readme_example_runs():
    """The README's first-screen example (its first complete program, marked ``runs``) is true."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- snippet: runs -->\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})


def test_messages_go_through_the_gradsift_logger(capsys):
    """Notices and problems are logging records of the "gradsift" logger: by default each line as it is on the
    standard error of the moment; a level or a handler of the user's own takes them over."""
    import logging

    from gradsift.messages import say, warn

    say("gradsift: a notice")
    warn("gradsift: a problem")
    assert capsys.readouterr().err == "gradsift: a notice\ngradsift: a problem\n"
    log = logging.getLogger("gradsift")
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append
    level = log.level
    log.addHandler(handler)
    try:
        log.setLevel(logging.WARNING)
        say("gradsift: quiet")
        warn("gradsift: loud")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert [(r.levelname, r.getMessage()) for r in got] == [("WARNING", "gradsift: loud")]
    assert capsys.readouterr().err == "gradsift: loud\n"
