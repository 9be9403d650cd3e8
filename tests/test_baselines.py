"""DGC (threshold, momentum correction), RedSync, GaussianKSGD, and variable-size aggregation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsift import payload as P
from gradsift import make_compressor
from gradsift.transport.local import LocalTransport


def test_dgc_threshold_stays_near_k():
    comp = make_compressor("dgc:feedback=false", 0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        p = comp.compress("w", torch.randn(100, 1000, generator=g))
        assert p.kind == "sparse" and 0.8 * 1000 <= p.count <= 1.3 * 1000


def test_dgc_sends_1d_tensors_dense_and_compresses_the_rest():
    comp = make_compressor("dgc", 0.01)
    assert comp.compress("fc.bias", torch.randn(100)).kind == P.DENSE
    assert comp.compress("fc.weight", torch.randn(100, 100)).kind == P.SPARSE
    assert comp.compress("model", torch.randn(10_000)).kind == P.SPARSE


def _train(momentum_model: bool, masking: bool, steps: int = 6):
    """One worker, ratio 1: DGC's memory against torch's SGD (with or without momentum)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 5), torch.randn(32, 2)
    net_a = nn.Linear(5, 2, bias=False)
    net_b = nn.Linear(5, 2, bias=False)
    net_b.load_state_dict(net_a.state_dict())
    comp = make_compressor(f"dgc:masking={'true' if masking else 'false'},momentum=0.9,value_dtype=fp32", 1.0)
    opt_a = torch.optim.SGD(net_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(net_b.parameters(), lr=0.1, momentum=0.9 if momentum_model else 0.0)
    for _ in range(steps):
        for net, opt in ((net_a, opt_a), (net_b, opt_b)):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
        p = comp.compress("w", net_a.weight.grad)
        net_a.weight.grad = p.to_dense().view_as(net_a.weight)
        opt_a.step()
        opt_b.step()
    return net_a.weight.detach(), net_b.weight.detach()


def test_dgc_momentum_correction_without_masking_is_momentum_sgd():
    a, b = _train(momentum_model=True, masking=False)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_dgc_momentum_correction_with_masking_is_plain_sgd():
    a, b = _train(momentum_model=False, masking=True)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    c, d = _train(momentum_model=True, masking=True)
    assert not torch.allclose(c, d)  # and it is not momentum SGD: the check can fail


def test_dgc_memory_loses_nothing():
    """sum sent + v == sum of momentum-corrected updates u (masking off)."""
    comp = make_compressor("dgc:masking=false", 0.05)
    g = torch.Generator().manual_seed(1)
    sent = torch.zeros(2000, dtype=torch.float64)
    usum = torch.zeros(2000, dtype=torch.float64)
    u = torch.zeros(2000, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(40, 50, generator=g, dtype=torch.float64)
        u = 0.9 * u + grad.reshape(-1)
        usum += u
        sent += comp.compress("w", grad).to_dense(torch.float64)
    torch.testing.assert_close(sent + comp.v["w"], usum)


def test_momentum_is_handed_to_dgc_never_applied_twice():
    from gradsift.runtime.runconfig import ConfigError, RunConfig
    from gradsift.runtime.simulate import Simulator

    sim = Simulator(RunConfig(task="digits-mlp", compressor="dgc:memory=momentum", optimizer="nesterov", momentum=0.8,
                              workers=2, steps=1))
    mem = sim.compressors[0].memory_options
    assert mem["momentum"] == 0.8 and mem["nesterov"]
    assert all(g.get("momentum", 0) == 0 for g in sim.optimizer.param_groups)
    sim = Simulator(RunConfig(task="digits-mlp", compressor="dgc", optimizer="sgd", workers=2, steps=1))
    assert sim.compressors[0].memory_options["momentum"] == 0.0
    with pytest.raises(ConfigError):
        Simulator(RunConfig(task="digits-mlp", compressor="dgc:momentum=0.9", optimizer="momentum", workers=2, steps=1))
    with pytest.raises(ConfigError):
        Simulator(RunConfig(task="digits-mlp", compressor="dgc:memory=momentum", optimizer="adam", workers=2, steps=1))
    # named alone with momentum SGD, dgc's recipe sends with error feedback and leaves the momentum where it is;
    # with Adam, every worker's Adam direction (gradsift.memory.adam)
    sim = Simulator(RunConfig(task="digits-mlp", compressor="dgc", optimizer="momentum", workers=2, steps=1))
    assert sim.cfg.compressor == "dgc:memory=ef" and not sim.compressors[0].applies_momentum
    assert "dgc sends with error feedback" in sim.recipe and "dgc:memory=momentum" in sim.recipe
    sim = Simulator(RunConfig(task="digits-mlp", compressor="dgc", optimizer="adam", workers=2, steps=1))
    assert sim.cfg.compressor == "dgc:memory=adam" and sim.compressors[0].applies_adam
    assert "Adam direction" in sim.recipe
    assert Simulator(RunConfig(task="digits-mlp", compressor="dgc", optimizer="momentum", workers=2, steps=1,
                               recipe=False)).compressors[0].applies_momentum


@pytest.mark.parametrize("spec", ["redsync", "gaussiank"])
def test_threshold_baselines_send_original_values_above_a_threshold(spec):
    comp = make_compressor(spec + ":feedback=false", 0.01)
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(2))
    assert comp.compress("warm", x).count >= 0
    p = comp.compress("w", x)
    assert p.count > 0 and torch.equal(p.values, x[p.indices])
    smallest = x.abs()[p.indices].min()
    assert int((x.abs() >= smallest).sum()) == p.count


def test_gaussiank_on_gaussian_input_is_close_to_target():
    comp = make_compressor("gaussiank:feedback=false", 0.01)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(3))
    assert 2 / 3 * 2000 <= comp.compress("w", x).count <= 4 / 3 * 2000


def test_variable_counts_including_zero_aggregate_exactly():
    """Workers sending different counts (zero included) give exactly the mean of their dense equivalents."""
    d = 50
    g = torch.Generator().manual_seed(4)
    counts = [7, 0, 23, 1, 50]
    payloads = []
    for c in counts:
        idx = torch.randperm(d, generator=g)[:c]
        vals = torch.randn(c, generator=g, dtype=torch.float64)
        payloads.append([P.sparse(vals, idx, d, torch.float64, 10)])
    agg = LocalTransport(len(counts)).aggregate(payloads)
    expect = sum(ps[0].to_dense() for ps in payloads) / len(counts)
    torch.testing.assert_close(agg.means[0], expect, rtol=0, atol=1e-15)
    # duplicate indices across workers add up
    a = [P.sparse(torch.tensor([1.0]), torch.tensor([3]), 5, torch.float32, 1)]
    b = [P.sparse(torch.tensor([2.0]), torch.tensor([3]), 5, torch.float32, 1)]
    assert LocalTransport(2).aggregate([a, b]).means[0][3] == 1.5
    # on the wire every worker fills the same fixed capacity: header (count, flag, checksum), then 8-byte-aligned
    # indices (50 slots of 50 positions: a 7-byte bitmap) and values
    from gradsift.transport.wire import gather_segment_bytes

    for ps in payloads:
        ps[0].capacity = 50
        assert gather_segment_bytes(ps[0]) == 16 + 8 + 50 * 8


def test_random_indices_are_distinct_exact_and_uniform():
    from gradsift.kernels.draw import draw_k as random_indices

    for seed, (numel, k) in enumerate(((10, 3), (1000, 250), (1000, 251), (10**6, 1), (10**6, 1000),
                                       (10**6, 200_000), (7, 7), (5, 9))):
        idx = random_indices(numel, k, seed)
        assert idx.numel() == min(k, numel) and idx.unique().numel() == idx.numel()
        assert torch.equal(idx, idx.sort().values)  # ascending: the index coder sends them so
        assert int(idx.min()) >= 0 and int(idx.max()) < numel
    # every position, and every pair, equally likely (n=40, k=4 takes the sampling path; n=40, k=12 keys all)
    for n, k in ((40, 4), (40, 12)):
        draws = 20000
        hits = torch.zeros(n)
        pair = 0
        for seed in range(draws):
            idx = random_indices(n, k, 1000 * seed + 17)
            hits[idx] += 1
            pair += int((idx == 0).any() and (idx == 1).any())
        expected = draws * k / n
        chi2 = float(((hits - expected) ** 2 / expected).sum())
        assert chi2 < 80, chi2  # 39 degrees of freedom: p < 1e-4 above 80
        p_pair = k * (k - 1) / (n * (n - 1))
        assert abs(pair / draws - p_pair) < 5 * (p_pair / draws) ** 0.5, pair


@pytest.mark.parametrize("n,k", [(10, 3), (40, 11), (1000, 10), (1000, 251), (3000, 1), (80_000, 800),
                                 (2_000_000, 20_000), (64, 64), (65, 17)])
def test_random_k_draws_alike_compiled_and_in_torch(n, k):
    """The counter-based draw: the compiled kernel and its torch twin give the same positions (the arithmetic is
    the same 32-bit hashes and 64-bit products), so the eager backend and a GPU draw what the pass draws."""
    from gradsift import kernels
    from gradsift.kernels.draw import draw_k

    for seed in (0, 12345, (1 << 63) - 1):
        with kernels.using("compiled"):
            a = draw_k(n, k, seed)
        with kernels.using("eager"):
            b = draw_k(n, k, seed)
        assert torch.equal(a, b), (n, k, seed)
        assert a.numel() == k and a.unique().numel() == k
