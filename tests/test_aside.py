"""The route on real gloo processes: the in-place route, standing aside for DDP's own all-reduce (any register()
user gets it), the measured plan's choices, momentum correction continued from the mean."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddp_helpers import plain_mean_grads, spawn
from gradsift.runtime.runconfig import RunConfig

BASE = dict(task="digits-cnn", ratio=0.05, steps=12, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000)
QUICK = {"warmup": 1, "block": 2, "rounds": 1}  # the measured plan in 5 steps: warm-up, 2 compressed, 2 whole


def _count_hook_calls():
    """Count the hook's calls in this process (the adapter's class method, wrapped)."""
    from gradsift.ddp.state import GradsiftState

    calls = [0]
    original = GradsiftState.on_bucket

    def counted(self, bucket):
        calls[0] += 1
        return original(self, bucket)

    GradsiftState.on_bucket = counted
    return calls


def batches(rank: int, n: int, shape: tuple, nan_step: int | None = None):
    """(step, input) of rank ``rank``'s ``n`` steps; rank 1's input holds a NaN at ``nan_step``."""
    g = torch.Generator().manual_seed(rank)
    for step in range(n):
        x = torch.randn(*shape, generator=g)
        if rank == 1 and step == nan_step:
            x[0, 0] = float("nan")
        yield step, x


def _measured_whole(rank, world, outdir, mode):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    calls = _count_hook_calls()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    state = gddp.register(model, "topk", 0.05, wire_plan="measure", min_numel=0, on_nonfinite=mode,
                          measure={**QUICK, "margin": 1.0})  # margin 1: compression never pays
    rows = []
    for step, x in batches(rank, 10, (16, 64), nan_step=8):
        expected = plain_mean_grads(model.module, x, world)
        before = calls[0]
        loss = model(x).square().mean()
        try:
            loss.backward()
            skipped = state.end_step(loss=loss)
        except Exception as e:  # noqa: BLE001 - the error mode raises
            rows.append({"error": str(e).splitlines()[0]})
            break
        rows.append({"hooked": calls[0] - before, "mode": state.routing.mode, "skipped": skipped,
                     "aside": bool(state.last.get("ddp_allreduce")),
                     "held": sum(float(r.abs().sum()) for r in state.compressor.residual.values()),
                     "gap": max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected)),
                     "nan": all(bool(p.grad.isnan().all()) for p in model.parameters())})
        model.zero_grad()
    torch.save({"rows": rows, "routing": state.routing.summary(state.compressor), "steps": state.totals["steps"]},
               f"{outdir}/{mode}-rank{rank}.pt")


def test_a_register_run_whose_measured_plan_chooses_whole_stands_aside(tmp_path):
    spawn(_measured_whole, 2, str(tmp_path), "skip")
    a, b = (torch.load(tmp_path / f"skip-rank{r}.pt") for r in (0, 1))
    assert a["routing"]["measured"] == b["routing"]["measured"] and a["routing"]["measured"]["choice"] == "whole"
    for r in (a, b):
        rows = r["rows"]
        # warm-up and 2 compressed steps keep a residual; the first whole step sends it along; decided after step 5
        assert rows[0]["held"] > 0 and rows[2]["held"] > 0 and all(x["held"] == 0 for x in rows[3:])
        assert [x["mode"] for x in rows[:6]] == ["measuring"] * 4 + ["whole", "aside"]
        # step 6 went whole (in place) through the hook; from step 7 on DDP's own all-reduce takes the steps: the
        # hook is not called at all, and the gradients are the plain mean
        assert all(x["hooked"] >= 1 for x in rows[:6]) and all(x["hooked"] == 0 for x in rows[6:])
        assert [x["aside"] for x in rows] == [False] * 6 + [True] * 4
        assert rows[3]["gap"] > 1e-3 and max(x["gap"] for x in rows[4:8]) < 1e-6  # (step 4 carried the residual)
        # a NaN on rank 1 while standing aside: the road's rule, read off DDP's sum, skips the step on every rank
        assert rows[8]["skipped"] and rows[8]["nan"] and not rows[9]["skipped"] and rows[9]["gap"] < 1e-6
        assert r["steps"] == 9  # (the skipped step is not counted)
        events = r["routing"]["events"]
        assert [e["mode"] for e in events] == ["whole", "aside"] and events[1]["step"] == 6
    spawn(_measured_whole, 2, str(tmp_path), "error")  # every rank raises NonFiniteGradient alike
    for r, who in ((0, "a rank"), (1, "rank 1")):
        rows = torch.load(tmp_path / f"error-rank{r}.pt")["rows"]
        assert len(rows) == 9 and "error" not in rows[7]
        msg = rows[-1]["error"]
        assert msg.startswith(f"non-finite gradient on {who} at step 9 (") and "summed by DDP's own all-reduce" in msg


def _framework_in_place(rank, world, outdir, mode):
    """hook_state(): no DDP wrapper to stand aside for, so whole buckets are summed in place by the hook itself."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    state = gddp.hook_state(net, "dense", on_nonfinite=mode)
    model = DDP(net)
    model.register_comm_hook(state, gddp.gradsift_hook)
    rows = []
    for step, x in batches(rank, 4, (8, 32), nan_step=2):
        expected = plain_mean_grads(model.module, x, world)
        model(x).square().mean().backward()
        try:
            skipped = state.end_step()
        except Exception as e:  # noqa: BLE001 - the error mode raises in the hook's future
            rows.append({"error": str(e)})
            break
        got = [p.grad.clone() for p in model.parameters()]
        rows.append({"skipped": skipped, "in_place": state.last["buckets_in_place"], "buckets": state.last["buckets"],
                     "gap": max(float((a - b).abs().max()) for a, b in zip(got, expected)),
                     "nan": all(bool(a.isnan().all()) for a in got), "mode": state.routing.mode})
        model.zero_grad()
    torch.save(rows, f"{outdir}/rank{rank}.pt")


def test_in_place_gives_the_plain_mean_and_a_non_finite_sum_is_skipped_or_names_the_rank(tmp_path):
    spawn(_framework_in_place, 2, str(tmp_path), "skip")
    for r in (0, 1):
        rows = torch.load(tmp_path / f"rank{r}.pt")
        assert len(rows) == 4 and all(row["buckets"] >= 1 and row["in_place"] == row["buckets"] for row in rows)
        assert all(row["mode"] == "compressed" for row in rows)  # (nothing to stand aside for)
        for step, row in enumerate(rows):
            assert row["skipped"] == (step == 2)
            assert row["nan"] if step == 2 else row["gap"] < 1e-6  # skipped: NaN, as DDP's own all-reduce leaves it
    errs = spawn(_framework_in_place, 2, str(tmp_path), "error", expect_failure=True)
    assert set(errs) == {0, 1}
    assert "non-finite gradient on rank 1 at step 3" in errs[1]
    assert "non-finite gradient on another rank at step 3" in errs[0]


def _measured_fp16(rank, world, outdir, margin):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    state = gddp.register(model, "gsb", 0.05, wire_plan="measure", min_numel=0,
                          measure={**QUICK, "margin": margin, "narrow_margin": margin})
    state.routing.measurement._native_cannot_win = lambda: False  # time every phase, whatever this machine's clock
    out = {"gaps": [], "native": [], "aside": [], "config": state.compressor.config()["value_dtype"]}
    for step, x in batches(rank, 10, (16, 64)):
        expected = plain_mean_grads(model.module, x, world)
        out["native"].append(state.routing.decide(state.compressor, "2.weight", (10, 256), torch.float32).native)
        model(x).square().mean().backward()
        state.end_step()
        out["gaps"].append(max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected)))
        out["aside"].append(bool(state.last.get("ddp_allreduce")))
        model.zero_grad()
    torch.save({**out, "routing": state.routing.summary(state.compressor),
                "after": state.compressor.config()["value_dtype"]}, f"{outdir}/{margin}rank{rank}.pt")


def test_gsb_measures_fp16_against_the_gradients_dtype_and_stands_aside_or_keeps_compressing(tmp_path):
    """GSB sends fp16 values: whole steps are also timed in fp32; chosen, they are summed in place and the hook
    stands aside. fp32 is a wire decision: the compressor's configuration still says fp16."""
    spawn(_measured_fp16, 2, str(tmp_path), 1.0)  # margin 1: neither compression nor fp16 ever pays
    a, b = (torch.load(tmp_path / f"1.0rank{r}.pt") for r in (0, 1))
    assert a["routing"]["measured"] == b["routing"]["measured"]
    assert a["routing"]["measured"]["choice"] == "whole-native"
    for r in (a, b):
        # warm-up + 2 compressed, 2 whole in fp16, 2 whole in fp32 (the decision after step 7), then fp32
        assert r["native"] == [False] * 5 + [True] * 5
        assert max(r["gaps"][5:]) < 1e-6 and r["gaps"][4] > 1e-6  # exact mean in fp32, rounded in fp16
        assert r["aside"] == [False] * 8 + [True] * 2  # (step 8 in place through the hook, then DDP's own)
        assert r["config"] == r["after"] == "fp16"
    spawn(_measured_fp16, 2, str(tmp_path), -10.0)  # compression always wins
    a, b = (torch.load(tmp_path / f"-10.0rank{r}.pt") for r in (0, 1))
    assert a["routing"]["measured"]["choice"] == b["routing"]["measured"]["choice"] == "compressed"
    assert not any(a["aside"]) and a["routing"]["mode"] == "compressed"


def _train_runs(rank, world, outdir, runs):
    from gradsift.launch import train_ddp

    for name, cfg, cap in runs:
        out = str(Path(outdir) / name) if rank == 0 else None
        res = train_ddp(RunConfig(**dict(cfg, workers=world)), out=out, bucket_cap_mb=cap)
        torch.save({"params": res["params"], "skipped": res["state"].totals["skipped_steps"]},
                   Path(outdir) / f"{name}-rank{rank}.pt")


def _recs(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_gradsift_train_stands_aside_once_everything_goes_whole_and_matches_the_hooks_route(tmp_path):
    from gradsift.runtime.simulate import Simulator

    runs = [("aside", dict(BASE, compressor="dense"), 0.005),
            ("hook", dict(BASE, compressor="dense", wire_plan=False), 0.005),
            ("compressing", dict(BASE, compressor="topk"), 0.005),
            ("skip", dict(BASE, compressor="dense", fault_nan_step=5, on_nonfinite="skip"), 0.005)]
    spawn(_train_runs, 2, str(tmp_path), runs)
    aside = _recs(tmp_path / "aside")
    # the first step goes through the hook (summed in place); from then on DDP's own all-reduce takes the steps
    assert "ddp_allreduce" not in aside[0] and aside[0]["buckets_in_place"] == aside[0]["buckets"] >= 1
    assert all(r.get("ddp_allreduce") for r in aside[1:])
    assert all(r["bytes_per_worker"] == aside[0]["bytes_per_worker"] > 0 for r in aside)  # what each step moved
    assert not any(r.get("ddp_allreduce") for name in ("hook", "compressing") for r in _recs(tmp_path / name))
    summary = json.loads((tmp_path / "aside" / "summary.json").read_text())
    assert summary["routing"]["mode"] == "aside" and summary["routing"]["events"][0]["step"] == 1
    a = [torch.load(tmp_path / f"aside-rank{r}.pt")["params"] for r in (0, 1)]
    hook = torch.load(tmp_path / "hook-rank0.pt")["params"]
    for x, y, z in zip(a[0], a[1], hook):
        assert torch.equal(x, y)  # the ranks stay in step
        assert torch.equal(x, z)  # 2 ranks: DDP's pre-divided sum is the hook's sum then divide, bit for bit
    skip = [torch.load(tmp_path / f"skip-rank{r}.pt") for r in (0, 1)]
    assert skip[0]["skipped"] == skip[1]["skipped"] == 1
    sim = Simulator(RunConfig(**dict(BASE, compressor="dense", workers=2, fault_nan_step=5, on_nonfinite="skip")))
    sim.run()
    assert sim.skipped == 1
    for x, y in zip(sim.params, skip[0]["params"]):
        torch.testing.assert_close(x.detach(), y, rtol=1e-5, atol=1e-6)


DGC_WHOLE = [  # a message latency that carries the whole model: the wire plan sends every tensor whole
    ("dgc", dict(BASE, compressor="dgc", latency_us=1e5), 0.005),
    ("dgc-nesterov", dict(BASE, compressor="dgc", latency_us=1e5, optimizer="nesterov"), 0.005),
    ("dgc-model", dict(BASE, compressor="dgc", latency_us=1e5, granularity="model"), None),
    ("dgc-sgd", dict(BASE, compressor="dgc", latency_us=1e5, optimizer="sgd"), 0.005),  # momentum 0: nothing to add
]


def test_momentum_correction_stands_aside_with_the_velocity_of_the_mean_gradient(tmp_path):
    """DGC sent whole is momentum SGD: after standing aside the velocity follows DDP's mean gradient
    (MomentumCorrection.step_from_mean), and the run matches the simulator, where every step goes the hook's way.
    Not bit for bit: the hook advances each rank's velocity from its own gradient and averages, standing aside
    advances it from the average -- the same by linearity, to float32 rounding. No selection turns that rounding
    into another route, so it stays a few ulps a step: 12 steps of ~4 roundings each, 12 * 4 * 2**-24 ~ 3e-6
    relative, under the 1e-5 asserted."""
    from gradsift.runtime.simulate import Simulator

    spawn(_train_runs, 2, str(tmp_path), [(n, dict(c, wire_plan="auto"), cap) for n, c, cap in DGC_WHOLE])
    for name, cfg, _ in DGC_WHOLE:
        recs = _recs(tmp_path / name)
        assert "ddp_allreduce" not in recs[0] and all(r.get("ddp_allreduce") for r in recs[1:]), name
        got = [torch.load(tmp_path / f"{name}-rank{r}.pt")["params"] for r in (0, 1)]
        sim = Simulator(RunConfig(**dict(cfg, workers=2, wire_plan="auto")))
        sim.run()
        diff = sum(float((a.detach() - b).norm() ** 2) for a, b in zip(sim.params, got[0])) ** 0.5
        ref = sum(float(a.detach().norm() ** 2) for a in sim.params) ** 0.5
        assert diff <= 1e-5 * ref, (name, diff / ref)
        assert all(torch.equal(a, b) for a, b in zip(*got)), name
