"""LAGS-SGD's planning maths: eq. (19) over one link, the shared profile-and-plan schedule, eq. (20), eq. (21)."""

from __future__ import annotations

import pytest
import torch

from gradsift.route.layerwise import LagsSchedule, delta_l, pipelined_step_s, s_max
from gradsift.route.netmodel import NetworkModel


def test_lags_plan_follows_eq19_over_one_link():
    """Fixed timings: the first layer in backward order hides under the remaining backward (dense), the later
    ones do not and get c_u, and layers queue on the link (a later layer's budget starts when it is free)."""
    from gradsift.route.layerwise import LayerProfile, plan_ratios, smallest_hidden_ratio_c
    from gradsift.route.netmodel import NetworkModel

    net = NetworkModel(bandwidth_gbps=0.1, latency_us=50.0)
    prof = LayerProfile(keys=["out", "mid", "in"], numels=[1000, 100_000, 100_000], ready_s=[0.0, 0.05, 0.099],
                        select_s=[0.0, 0.0, 0.0], forward_s=0.05, backward_s=0.1)
    plan = plan_ratios(prof, net, world=2, c_u=100.0)
    assert plan["out"] == 1.0  # 8 kB dense hides in 0.1 s at 100 Mbit/s
    assert 1 / 100 < plan["mid"] < 1.0  # partly hidden: eq. (19)'s smallest c that fits
    assert plan["in"] == 1 / 100  # ready at the end of backward: nothing hides, c_u
    # eq. (19) directly: the smallest c whose communication fits the budget, clamped to [1, c_u]
    assert smallest_hidden_ratio_c(net, 1000, 1.0, 2, 100.0) == 1.0
    assert smallest_hidden_ratio_c(net, 10**7, 1e-6, 2, 100.0) == 100.0
    c = smallest_hidden_ratio_c(net, 100_000, 0.02, 2, 100.0)
    assert 1.0 < c < 100.0


def test_schedule_profiles_then_plans_once_with_the_ranks_average():
    net = NetworkModel(bandwidth_gbps=0.1, latency_us=50.0)
    sch = LagsSchedule(["in", "out"], {"in": 100_000, "out": 1000}, net, world=2, c_u=100.0, profile_steps=2,
                       skip_steps=1)
    assert not sch.wants(0) and sch.wants(1)
    assert not sch.add(0.01, 0.1, {"out": 0.0, "in": 0.1})
    assert sch.add(0.01, 0.1, {"out": 0.0, "in": 0.1})
    seen = []

    def average(v):  # what the DDP controller's all-reduce does: here, every rank reports the same
        seen.append(list(v))
        return v

    ratios = sch.plan({"in": 0.0, "out": 0.0}, average=average)
    assert seen and len(seen[0]) == 2 + 2 * 2
    assert ratios == {"out": 1.0, "in": 0.01} and not sch.wants(5)
    rep = sch.report()
    assert [l["key"] for l in rep["layers"]] == ["out", "in"] and 1.0 <= rep["s_max"] <= 2.0
    text = sch.describe()
    assert "out: ratio 1" in text and "hides under backward" in text and "in: ratio 0.01" in text


def test_pipelined_step_and_s_max():
    # two tensors, each 10 ms of communication, ready at 0 and 30 ms of a 50 ms backward: both hide
    step, busy = pipelined_step_s(0.02, 0.05, [0.0, 0.03], [0.0, 0.0], [0.01, 0.01])
    assert step == pytest.approx(0.07) and busy == pytest.approx(0.02)
    # the second one sticks out past backward
    step, _ = pipelined_step_s(0.02, 0.05, [0.0, 0.049], [0.0, 0.0], [0.01, 0.01])
    assert step == pytest.approx(0.02 + 0.059)
    assert s_max(0.0, 1.0, 1.0) == pytest.approx(2.0) and s_max(1.0, 1.0, 0.0) == pytest.approx(1.0)


def test_delta_is_one_for_random_k_in_expectation_and_zero_when_all_is_sent():
    x = torch.randn(1000, dtype=torch.float64)
    assert delta_l(x, torch.zeros_like(x), 10, 1000) == 0.0
    assert delta_l(torch.zeros_like(x), x, 10, 1000) == pytest.approx(1 / (1 - 0.01))


def test_sent_per_tensor_splits_a_whole_model_payload_at_the_parameters_bounds():
    """SLGS's one top-k over the concatenation, counted per parameter, adds up to what it sent; the split is the
    parameters' own (every selected index lands in the parameter that holds it)."""

    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.simulate import Simulator

    for granularity in ("model", "layer"):
        sim = Simulator(RunConfig(task="digits-mlp", compressor="topk", ratio=0.05, workers=2, steps=2,
                                  granularity=granularity, delta_telemetry=True, wire_plan=False))
        rec = sim.run()[-1]
        counts = rec["sent_per_tensor"]
        assert list(counts) == [n for n, _ in sim.named]
        assert sum(counts.values()) == sum(p.count for p in sim.last_payloads[0])
        if granularity == "model":
            idx = sim.last_payloads[0][0].indices
            sizes = torch.tensor([p.numel() for p in sim.params])
            start = 0
            for (name, _), size in zip(sim.named, sizes.tolist()):
                assert counts[name] == int(((idx >= start) & (idx < start + size)).sum())
                start += size
