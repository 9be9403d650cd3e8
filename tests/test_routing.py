"""The route owner (gradsift.route.routing) and the measured plan (gradsift.route.measure): how each step travels, its
transitions, what it says, and its checkpoints. No process group here; tests/test_aside.py runs it on gloo."""

from __future__ import annotations

import pytest
import torch

from gradsift import make_compressor
from gradsift.errors import ConfigError
from gradsift.route.measure import Measurement, check_settings
from gradsift.route.netmodel import NetworkModel
from gradsift.route.plan import WirePlan
from gradsift.route.routing import ASIDE, Routing
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator

W = ("w", (1000, 1000), torch.float32)
F32 = torch.float32


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def measured(narrow=False, *, warmup=2, block=2, rounds=2, margin=0.10, aside="(not in this test)", **kw):
    clock = Clock()
    m = Measurement(narrow=narrow, warmup=warmup, block=block, rounds=rounds, margin=margin, clock=clock, **kw)
    plan = WirePlan(NetworkModel(1.0, 50.0), 4, enabled=True, sparse_collective="gather")
    return Routing(plan, [W], measurement=m, aside=aside), clock


def drive(compressed_s: float, whole_s: float, margin: float = 0.10, steps: int = 14, spec: str = "topk",
          native_s: float | None = None):
    """Steps of the given lengths through the route owner (warm-up 2, then 2 rounds of blocks of 2 steps); the
    route and value dtype decided for the tensor at every step."""
    comp = make_compressor(spec, 0.01, world_size=4)
    routing, clock = measured(narrow=comp.inner.value_dtype is not None, margin=margin)
    seen = []
    for step in range(steps):
        d = routing.decide(comp, *W)
        seen.append((d.route, d.native))
        clock.t += compressed_s if d.route == "gather" else (native_s if d.native else whole_s)
        routing.after_step(comp, step=step + 1)
    return routing, comp, seen


S, D, N = ("gather", False), ("whole", False), ("whole", True)


def test_whole_steps_win_when_faster_and_the_choice_holds():
    routing, comp, seen = drive(compressed_s=0.2, whole_s=0.1)
    assert seen[:10] == [S] * 2 + [S] * 2 + [D] * 2 + [S] * 2 + [D] * 2  # warm-up, then blocks interleaved
    m = routing.measurement
    assert m.times == {"compressed": pytest.approx([0.2, 0.2]), "whole": pytest.approx([0.1, 0.1])}
    assert m.result["choice"] == "whole" and routing.mode == "whole" and seen[10:] == [D] * 4
    assert m.result["compressed_step_ms"] == pytest.approx(200.0) and m.result["whole_step_ms"] == pytest.approx(100.0)
    assert routing.decide(comp, *W).reason.startswith("measured: 200.0 ms a step compressed, 100.0 ms")
    assert routing.events == [{"step": 10, "mode": "whole", "reason": routing.reason}]
    assert Measurement.steps_for(False, 2, 2, 2) == 10 and Measurement.steps_for(True, 2, 2, 2) == 14


def test_compression_stays_only_when_faster_by_the_margin():
    routing, _, seen = drive(compressed_s=0.05, whole_s=0.1)
    assert routing.measurement.result["choice"] == "compressed" and routing.mode == "compressed"
    assert seen[10:] == [S] * 4
    routing, _, _ = drive(compressed_s=0.092, whole_s=0.1)  # 8% faster: not worth the compression error
    assert routing.measurement.result["choice"] == "whole"


def test_drift_is_spread_over_every_phase():
    """A machine that gets 20% faster over the measurement: timed one phase after the other, the later phase would
    win by the drift alone; interleaved, neither does."""
    comp = make_compressor("topk", 0.01, world_size=4)
    routing, clock = measured(warmup=1, block=2, rounds=6)
    n = Measurement.steps_for(False, 1, 2, 6)
    for i in range(n):
        routing.decide(comp, *W)
        clock.t += 0.1 * (1.0 - 0.2 * i / n)  # the same length compressed and whole, shrinking
        routing.after_step(comp, step=i + 1)
    r = routing.measurement.result
    assert r["choice"] == "whole" and abs(r["compressed_step_ms"] - r["whole_step_ms"]) / r["whole_step_ms"] < 0.02


def test_skipped_steps_are_not_timed_and_the_route_round_trips():
    comp = make_compressor("topk", 0.01, world_size=4)
    routing, clock = measured(warmup=1, block=2, rounds=1)
    steps = [(1.0, False), (0.1, False), (50.0, True), (0.7, False), (0.1, False), (0.3, False), (0.3, False)]
    for i, (dt, skipped) in enumerate(steps):  # warm-up; a block's first step; skipped; after it (untimed) ...
        clock.t += dt
        routing.after_step(comp, step=i, skipped=skipped)
    assert routing.measurement.times["compressed"] == pytest.approx([0.1])
    assert routing.measurement.result["choice"] == "compressed"
    sd = routing.state_dict()
    fresh, _ = measured()
    fresh.load_state_dict({**sd, "mode": "whole", "measurement": {**sd["measurement"], "choice": "whole"}})
    assert fresh.measurement.phase == "done" and fresh.mode == "whole" and fresh.decide(comp, *W).whole
    fresh.load_state_dict({"mode": "measuring", "measurement": None})  # an unfinished measurement starts over
    assert fresh.measurement.phase == "warmup" and fresh.mode == "measuring" and not fresh.decide(comp, *W).whole
    with pytest.raises(ConfigError, match="block must be an integer >= 2"):
        Measurement(narrow=False, block=1)
    with pytest.raises(ConfigError, match="unknown setting 'blocks'"):
        check_settings({"blocks": 3})


def test_narrow_values_are_timed_whole_in_the_gradients_dtype_too_and_never_flipped_on_the_compressor():
    c, h, n = [S] * 2, [D] * 2, [N] * 2
    routing, comp, seen = drive(compressed_s=0.2, whole_s=0.1, native_s=0.09, spec="topk:value_dtype=fp16", steps=17)
    assert seen[:14] == c + c + h + n + c + h + n
    assert routing.measurement.result["choice"] == "whole-native" and seen[14:] == [N] * 3  # fp16 not 5% faster
    assert routing.native and "gradient's own dtype" in routing.reason
    # the wire dtype is the route's decision: the compressor's configuration still says what the user named
    assert comp.config()["value_dtype"] == "fp16" and comp.inner.value_dtype == torch.float16
    p = comp.compress("w", torch.randn(1000, 1000), dense=True, native=True)
    assert p.values.dtype == torch.float32 and comp.compress("w", torch.randn(10), dense=True).values.dtype == \
        torch.float16

    routing, _, seen = drive(compressed_s=0.2, whole_s=0.1, native_s=0.2, spec="topk:value_dtype=fp16", steps=17)  # fp16 pays
    assert routing.measurement.result["choice"] == "whole" and seen[14:] == [D] * 3
    routing, _, seen = drive(compressed_s=0.08, whole_s=0.1, native_s=0.2, spec="topk:value_dtype=fp16", steps=17)
    assert routing.measurement.result["choice"] == "compressed" and seen[14:] == [S] * 3
    # compression under half of fp16's whole step (a slow link): the gradient's dtype cannot win, not timed
    routing, _, seen = drive(compressed_s=0.04, whole_s=0.1, native_s=0.01, spec="topk:value_dtype=fp16", steps=17)
    assert seen[:10] == c + c + h + c + h and seen[10:] == [S] * 7
    assert routing.measurement.result["choice"] == "compressed"
    assert "whole_native_step_ms" not in routing.measurement.result


def test_where_the_plan_scatters_the_measurement_also_times_all_gathers_and_keeps_the_faster():
    comp = make_compressor("topk", 0.01, world_size=4)
    clock = Clock()
    m = Measurement(narrow=False, scattered=True, warmup=1, block=2, rounds=2, clock=clock)
    routing = Routing(WirePlan(NetworkModel(1.0, 50.0), 4, enabled=True, sparse_collective="scatter",
                               scatter_keep=1.0), [W], measurement=m, aside="(no)")
    assert routing.planned(comp, *W).route == "scatter"  # asked for, and priced (owners keeping k)
    seen = []
    for step in range(Measurement.steps_for(False, 1, 2, 2, scattered=True) + 2):
        route = routing.decide(comp, *W).route
        seen.append(route)
        clock.t += {"scatter": 0.12, "gather": 0.10, "whole": 0.2}[route]  # the link disagrees with the model
        routing.after_step(comp, step=step + 1)
    assert seen[:7] == ["scatter"] * 3 + ["gather"] * 2 + ["whole"] * 2  # warm-up, compressed, gathered, whole
    assert m.result["choice"] == "gathered" and m.result["gathered_step_ms"] == pytest.approx(100.0)
    assert routing.mode == "compressed" and routing.gathered and seen[-2:] == ["gather"] * 2
    assert "all-gathers were faster" in routing.decide(comp, *W).reason
    again, _ = measured()
    again.load_state_dict(routing.state_dict())
    assert again.gathered and again.decide(comp, *W).route == "gather"


# ---------------------------------------------------------------- in place, and standing aside
SHAPES = [torch.Size([256, 64]), torch.Size([256])]
KEYS = ["w", "b"]


def routing_for(spec, ratio=0.05, *, mode=None, aside=None, enabled=True, **options):
    comp = make_compressor(spec, ratio, world_size=2, **options)
    r = Routing(WirePlan(NetworkModel(1.0, 50.0), 2, enabled=enabled, min_numel=0),
                [(k, s, F32) for k, s in zip(KEYS, SHAPES)], aside=aside)
    if mode is not None:
        r.mode, r.reason = mode, "measured: whole is faster"
    return r, comp


def test_only_groups_that_go_whole_exactly_as_they_are_are_summed_in_place():
    r, dense = routing_for("dense", None)
    assert r.in_place(dense, KEYS, SHAPES, F32)
    r, topk = routing_for("topk")
    assert not r.in_place(topk, KEYS, SHAPES, F32)  # the plan compresses w
    r.mode = "whole"
    assert r.in_place(topk, KEYS, SHAPES, F32)
    topk.residual["w"] = torch.ones(256 * 64)  # something held back must travel with it: the road
    assert not r.in_place(topk, KEYS, SHAPES, F32)
    r, half = routing_for("topk", mode="whole", value_dtype="fp16")
    assert not r.in_place(half, KEYS, SHAPES, F32)  # whole in fp16, the rounding kept by the memory: the road ...
    r.native = True
    assert r.in_place(half, KEYS, SHAPES, F32) == "as-is"  # ... whole in the gradient's dtype is the bucket as it is
    r, gsb = routing_for("gsb", mode="whole")  # fp16 values, no memory: the bucket cast once
    assert r.in_place(gsb, KEYS, SHAPES, F32) == "cast"
    r.native = True
    assert r.in_place(gsb, KEYS, SHAPES, F32) == "as-is"
    r, gsb = routing_for("gsb", enabled=False)  # the method as it says: sampled
    assert r.in_place(gsb, KEYS, SHAPES, F32) is None
    r, dgc = routing_for("dgc", mode="whole")
    assert not r.in_place(dgc, KEYS, SHAPES, F32)  # momentum correction applies momentum itself
    r, psgd = routing_for("powersgd", None, mode="whole")
    assert not r.in_place(psgd, KEYS, SHAPES, F32)  # two rounds, its own rule


def test_standing_aside_follows_the_route_not_telemetry():
    r, dense = routing_for("dense", None)
    assert r.after_step(dense, step=1) == ASIDE and r.mode == ASIDE and r.events[-1]["step"] == 1
    for why, kw in (("off", {"enabled": False}), ("weighted", {"aside": "the mean is weighted"})):
        r, dense = routing_for("dense", None, **kw)
        assert r.after_step(dense, step=1) is None and r.mode == "compressed", why
    r, topk = routing_for("topk")
    assert r.after_step(topk, step=1) is None  # compressing: DDP's own all-reduce would not do the same
    r, topk = routing_for("topk", mode="whole")
    topk.residual["w"] = torch.ones(256 * 64)
    assert r.after_step(topk, step=1) is None  # the first whole step still has to carry the residual
    topk.residual.clear()
    assert r.after_step(topk, step=2, skipped=True) is None and r.after_step(topk, step=2, others_settled=False) is None
    assert r.after_step(topk, step=2) == ASIDE  # (LAGS still planning: not yet)
    r, half = routing_for("gsb", mode="whole")  # fp16 whole is not DDP's all-reduce
    assert r.after_step(half, step=1) is None
    r.native = True
    assert r.after_step(half, step=2) == ASIDE
    r, dgc = routing_for("dgc", mode="whole")
    assert r.after_step(dgc, step=1) is None  # no velocity yet
    for k, s in zip(KEYS, SHAPES):
        dgc.u[k], dgc.v[k] = torch.ones(s.numel()), torch.zeros(s.numel())
    assert r.after_step(dgc, step=2) == ASIDE
    r, clipped = routing_for("dgc", mode="whole", clip=1.0)
    for k, s in zip(KEYS, SHAPES):
        clipped.u[k], clipped.v[k] = torch.ones(s.numel()), torch.zeros(s.numel())
    assert r.after_step(clipped, step=2) is None  # each rank clips its own gradient: there is no mean of that


def test_a_checkpoint_keeps_the_route_and_a_runtime_that_cannot_stand_aside_sends_the_same_whole_steps():
    r, dense = routing_for("dense", None)
    r.after_step(dense, step=3)
    sd = r.state_dict()
    again, _ = routing_for("dense", None)
    again.load_state_dict(sd)
    assert again.mode == ASIDE and again.events == r.events and again.native
    cannot, _ = routing_for("dense", None, aside="hook_state() has no DDP wrapper")
    cannot.load_state_dict(sd)
    assert cannot.mode == "whole" and cannot.native and cannot.decide(dense, "w", SHAPES[0], F32).whole


def test_the_plan_speaks_in_the_simulator_and_the_measured_plan_is_refused_there():
    sim = Simulator(RunConfig(task="logistic-toy", compressor="topk", ratio=0.5, workers=2, steps=2, wire_plan="auto"))
    (line,) = sim.notices()
    assert line.startswith("gradsift: wire plan: 1 of 1 tensors sent whole") and "--wire-plan off" in line
    assert Simulator(RunConfig(task="logistic-toy", compressor="topk", ratio=0.5, workers=2, steps=2)).notices() == []
    with pytest.raises(ConfigError, match="runtime ddp"):
        Simulator(RunConfig(task="linreg", compressor="topk", ratio=0.1, workers=2, steps=2, wire_plan="measure"))
    import torch.nn as nn

    import gradsift.ddp as gddp

    with pytest.raises(ConfigError, match="wire_plan must be"):
        gddp.hook_state(nn.Linear(3, 3), "topk", 0.1, wire_plan="sometimes")
    with pytest.raises(ConfigError, match="needs wire_plan='measure'"):
        gddp.hook_state(nn.Linear(3, 3), "topk", 0.1, measure={"rounds": 1})
