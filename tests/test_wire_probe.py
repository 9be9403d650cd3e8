"""The measured wire plan (gradsift.ddp.probe): timed compressed steps against timed whole steps, one choice."""

from __future__ import annotations

import pytest
import torch

from gradsift import make_compressor
from gradsift.ddp.probe import WireProbe
from gradsift.netmodel import NetworkModel
from gradsift.plan import WirePlan
from gradsift.runconfig import ConfigError, RunConfig
from gradsift.simulate import Simulator

from ddp_helpers import plain_mean_grads, spawn


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(compressed_s: float, whole_s: float, margin: float = 0.10) -> tuple[WireProbe, WirePlan, list[str]]:
    """Steps of the given lengths through a probe (warm-up 2, then 2 rounds of a compressed and a whole block of
    2 steps); the plan's route at every step."""
    plan = WirePlan(NetworkModel(1.0, 50.0), 4, enabled=True)
    comp = make_compressor("topk", 0.01, world_size=4)
    clock = Clock()
    probe = WireProbe(plan, warmup=2, block=2, rounds=2, margin=margin, clock=clock)
    routes = []
    for _ in range(14):
        route = plan.decide(comp, "w", (1000, 1000)).route
        routes.append(route)
        clock.t += whole_s if route == "dense" else compressed_s
        probe.after_step()
    return probe, plan, routes


SPARSE, DENSE = ["sparse"] * 2, ["dense"] * 2


def test_whole_steps_win_when_faster_and_the_choice_holds():
    probe, plan, routes = drive(compressed_s=0.2, whole_s=0.1)
    assert routes[:10] == SPARSE + SPARSE + DENSE + SPARSE + DENSE  # warm-up, then blocks interleaved
    assert probe.times == {"compressed": pytest.approx([0.2, 0.2]), "whole": pytest.approx([0.1, 0.1])}
    assert probe.result["choice"] == "whole" and routes[10:] == ["dense"] * 4
    assert probe.result["compressed_step_ms"] == pytest.approx(200.0) and probe.result["whole_step_ms"] == pytest.approx(100.0)
    assert "measured" in plan.decide(make_compressor("topk", 0.01, world_size=4), "w", (1000, 1000)).reason
    assert "every compressed tensor" in plan.summary()["dense"]
    assert WireProbe.steps_for(False, 2, 2, 2) == 10 and WireProbe.steps_for(True, 2, 2, 2) == 14


def test_compression_stays_only_when_faster_by_the_margin():
    probe, plan, routes = drive(compressed_s=0.05, whole_s=0.1)
    assert probe.result["choice"] == "compressed" and plan.override is None and routes[10:] == ["sparse"] * 4
    probe, plan, _ = drive(compressed_s=0.092, whole_s=0.1)  # 8% faster: not worth the compression error
    assert probe.result["choice"] == "whole"


def test_drift_is_spread_over_every_phase():
    """A machine that gets 20% faster over the probe: timed one phase after the other, the later phase would win
    by the drift alone; interleaved, neither does."""
    plan = WirePlan(NetworkModel(1.0, 50.0), 4, enabled=True)
    comp, clock = make_compressor("topk", 0.01, world_size=4), Clock()
    probe = WireProbe(plan, warmup=1, block=2, rounds=6, clock=clock)
    n = WireProbe.steps_for(False, 1, 2, 6)
    for i in range(n):
        plan.decide(comp, "w", (1000, 1000))
        clock.t += 0.1 * (1.0 - 0.2 * i / n)  # the same length compressed and whole, shrinking
        probe.after_step()
    c, w = probe.result["compressed_step_ms"], probe.result["whole_step_ms"]
    assert probe.result["choice"] == "whole" and abs(c - w) / w < 0.02


def test_skipped_steps_are_not_timed_and_state_round_trips():
    plan = WirePlan(NetworkModel(1.0, 50.0), 2, enabled=True)
    clock = Clock()
    probe = WireProbe(plan, warmup=1, block=2, rounds=1, clock=clock)
    steps = [(1.0, False), (0.1, False), (50.0, True), (0.7, False), (0.1, False), (0.3, False), (0.3, False)]
    for dt, skipped in steps:  # warm-up; a block's first step; skipped; after it (untimed, not counted); timed ...
        clock.t += dt
        probe.after_step(skipped)
    assert probe.times["compressed"] == pytest.approx([0.1]) and probe.result["choice"] == "compressed"
    fresh = WireProbe(WirePlan(NetworkModel(), 2, enabled=True))
    fresh.load_state_dict({**probe.state_dict(), "choice": "whole"})
    assert fresh.phase == "done" and fresh.plan.override.startswith("measured")
    fresh.load_state_dict(None)  # an unfinished measurement starts over
    assert fresh.phase == "warmup" and fresh.plan.override is None
    with pytest.raises(ValueError, match="block must be >= 2"):
        WireProbe(plan, block=1)


class Narrow:
    """A compressor's value dtype, as the probe sees it."""

    def __init__(self):
        self.value_dtype = torch.float16


def drive_narrow(compressed_s: float, fp16_s: float, native_s: float) -> tuple[WireProbe, Narrow, list[tuple]]:
    """As :func:`drive`, for a method with fp16 values: warm-up 2, then 2 rounds of blocks of 2 steps compressed,
    whole in fp16, whole in the gradient's dtype; (route, value dtype) at every step."""
    plan = WirePlan(NetworkModel(1.0, 50.0), 4, enabled=True)
    comp, narrow, clock = make_compressor("topk", 0.01, world_size=4), Narrow(), Clock()
    probe = WireProbe(plan, narrow=narrow, warmup=2, block=2, rounds=2, clock=clock)
    seen = []
    for _ in range(17):
        route = plan.decide(comp, "w", (1000, 1000)).route
        seen.append((route, narrow.value_dtype))
        clock.t += compressed_s if route == "sparse" else fp16_s if narrow.value_dtype is not None else native_s
        probe.after_step()
    return probe, narrow, seen


def test_narrow_values_are_timed_whole_in_the_gradients_dtype_too():
    probe, narrow, seen = drive_narrow(compressed_s=0.2, fp16_s=0.1, native_s=0.09)
    c, h, n = [("sparse", torch.float16)] * 2, [("dense", torch.float16)] * 2, [("dense", None)] * 2
    assert seen[:14] == c + c + h + n + c + h + n
    assert probe.result["choice"] == "whole-native" and seen[14:] == [("dense", None)] * 3  # fp16 not 5% faster
    assert probe.result["whole_native_step_ms"] == pytest.approx(90.0)
    assert "gradient's own dtype" in probe.plan.override

    probe, narrow, seen = drive_narrow(compressed_s=0.2, fp16_s=0.1, native_s=0.2)  # fp16 halves a slow wire
    assert probe.result["choice"] == "whole" and seen[14:] == [("dense", torch.float16)] * 3
    probe, narrow, seen = drive_narrow(compressed_s=0.08, fp16_s=0.1, native_s=0.2)
    assert probe.result["choice"] == "compressed" and seen[14:] == [("sparse", torch.float16)] * 3
    probe, narrow, seen = drive_narrow(compressed_s=0.088, fp16_s=0.1, native_s=0.09)  # 2% faster than native
    assert probe.result["choice"] == "whole-native"
    # compression under half of fp16's whole step (a slow link): the gradient's dtype cannot win, not timed
    probe, narrow, seen = drive_narrow(compressed_s=0.04, fp16_s=0.1, native_s=0.01)
    assert seen[:10] == c + c + h + c + h and seen[10:] == [("sparse", torch.float16)] * 7
    assert probe.result["choice"] == "compressed" and "whole_native_step_ms" not in probe.result

    # a checkpoint's choice holds in a resumed run, value dtype included; an unfinished one starts over in fp16
    fresh = WireProbe(WirePlan(NetworkModel(), 2, enabled=True), narrow=Narrow())
    fresh.load_state_dict(drive_narrow(0.2, 0.1, 0.09)[0].state_dict())
    assert fresh.phase == "done" and fresh.narrow.value_dtype is None
    fresh.load_state_dict(None)
    assert fresh.phase == "warmup" and fresh.narrow.value_dtype == torch.float16 and fresh.plan.override is None


def test_the_simulator_and_bad_values_refuse_it():
    with pytest.raises(ConfigError, match="runtime ddp"):
        Simulator(RunConfig(task="linreg", compressor="topk", ratio=0.1, workers=2, steps=2, wire_plan="measure"))
    import torch.nn as nn

    import gradsift.ddp as gddp

    with pytest.raises(ConfigError, match="wire_plan must be"):
        gddp.hook_state(nn.Linear(3, 3), "topk", 0.1, wire_plan="sometimes")


def _measured(rank, world, outdir):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    state = gddp.register(model, "topk", 0.05, wire_plan="measure", min_numel=0)
    state.probe.warmup, state.probe.block, state.probe.rounds, state.probe.margin = 1, 2, 1, 1.0  # whole wins
    g = torch.Generator().manual_seed(rank)
    held, in_place, gaps = [], [], []
    for step in range(8):
        x = torch.randn(16, 64, generator=g)
        expected = plain_mean_grads(model.module, x, world)
        model(x).square().mean().backward()
        state.end_step()
        gaps.append(max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected)))
        in_place.append((state.last["buckets_in_place"], state.last["buckets"]))
        model.zero_grad()
        held.append(sum(float(r.abs().sum()) for r in state.compressor.residual.values()))
    torch.save({"held": held, "result": state.probe.result, "routes": state.road.plan.summary(),
                "in_place": in_place, "gaps": gaps}, f"{outdir}/rank{rank}.pt")


def test_ddp_ranks_agree_and_nothing_held_back_is_lost(tmp_path):
    spawn(_measured, 2, str(tmp_path))
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert a["result"] == b["result"] and a["result"]["choice"] == "whole"  # one choice, from one all-reduce
    for r in (a, b):
        assert r["held"][0] > 0 and r["held"][2] > 0  # compressed steps keep a residual
        assert all(h == 0 for h in r["held"][3:])  # the first whole step sent it along, none since
        assert "every compressed tensor" in r["routes"]["dense"]
        # compressed steps and the flushing step take the road; from then on DDP's bucket is summed in place,
        # and the result is the plain mean
        assert all(n == 0 for n, _ in r["in_place"][:4]) and all(n == b >= 1 for n, b in r["in_place"][4:])
        assert max(r["gaps"][4:]) < 1e-6


def _measured_fp16(rank, world, outdir, margin):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    state = gddp.register(model, "gsb", 0.05, wire_plan="measure", min_numel=0)
    state.probe.warmup, state.probe.block, state.probe.rounds = 1, 2, 1
    state.probe.margin = state.probe.narrow_margin = margin
    state.probe._native_cannot_win = lambda: False  # time every phase, whatever this machine's clock says
    g = torch.Generator().manual_seed(rank)
    out = {"in_place": [], "gaps": [], "dtype": [], "aside": []}
    for step in range(10):
        x = torch.randn(16, 64, generator=g)
        expected = plain_mean_grads(model.module, x, world)
        out["dtype"].append(str(state.compressor.inner.value_dtype))
        model(x).square().mean().backward()
        state.end_step()
        out["gaps"].append(max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected)))
        out["in_place"].append((state.last["buckets_in_place"], state.last["buckets"]))
        out["aside"].append(state.stand_aside())
        model.zero_grad()
    torch.save({**out, "result": state.probe.result, "sd": state.state_dict()["wire_probe"]}, f"{outdir}/{margin}rank{rank}.pt")


def test_ddp_gsb_measures_fp16_against_the_gradients_dtype_and_stands_aside(tmp_path):
    """GSB sends fp16 values: the probe also times whole steps in fp32; sent so, DDP's bucket is summed in place
    and the hook can stand aside (GSB keeps no error feedback: fp16's rounding is simply gone from then on)."""
    spawn(_measured_fp16, 2, str(tmp_path), 1.0)  # margin 1: neither compression nor fp16 ever pays
    a, b = (torch.load(tmp_path / f"1.0rank{r}.pt") for r in (0, 1))
    assert a["result"] == b["result"] and a["result"]["choice"] == "whole-native"
    assert set(a["result"]) >= {"compressed_step_ms", "whole_step_ms", "whole_native_step_ms"}
    for r in (a, b):
        # warm-up + 2 compressed, 2 whole in fp16, then the gradient's dtype: for the probe's 2 steps and after
        assert r["dtype"] == ["torch.float16"] * 5 + ["None"] * 5
        assert all(n == 0 for n, _ in r["in_place"][:5]) and all(n == m >= 1 for n, m in r["in_place"][5:])
        assert max(r["gaps"][5:]) < 1e-6 and r["gaps"][4] > 1e-6  # exact mean in fp32, rounded in fp16
        # the probe decided after step 6, which it had timed: the first step sent as decided is step 7
        assert r["aside"] == [False] * 7 + [True] * 3

    spawn(_measured_fp16, 2, str(tmp_path), -10.0)  # compression always wins
    a, b = (torch.load(tmp_path / f"-10.0rank{r}.pt") for r in (0, 1))
    assert a["result"] == b["result"] and a["result"]["choice"] == "compressed"
    for r in (a, b):
        # compressed again after the probe's whole steps (in place, but only while it timed them): not aside
        assert r["dtype"][-3:] == ["torch.float16"] * 3 and r["aside"] == [False] * 10
        assert any(n for n, _ in r["in_place"]) and all(n == 0 for n, _ in r["in_place"][-3:])
