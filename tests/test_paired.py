"""Standing aside for DDP's own all-reduce, and ``train --paired-ddp``: gradsift against DDP in the same processes."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_helpers import spawn
from gradsift.cluster import report
from gradsift.cluster.bench import check_options
from gradsift.cluster.hosts import ClusterError
from gradsift.cluster.runs import combine_runs, step_stats
from gradsift.launch.plain import Pairing
from gradsift.runconfig import ConfigError, RunConfig

BASE = dict(task="digits-cnn", ratio=0.05, steps=12, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000)


class FakeState:
    settled = False


def test_sides_alternate_in_blocks_once_the_hook_has_settled():
    state = FakeState()
    pairing = Pairing(3, state, None)
    sides = []
    for it in range(16):
        if it == 5:
            state.settled = True  # e.g. the measured wire plan decided after step 5
        sides.append(pairing.side(it))
    # nothing alternates while the hook still measures, nor in the LEAD steps after (it may still stand aside)
    assert sides[:7] == [None] * 7
    assert sides[7:] == ["gradsift"] * 3 + ["ddp"] * 3 + ["gradsift"] * 3
    early = Pairing(2, type("S", (), {"settled": True})(), None)
    assert [early.side(it) for it in range(9)] == [None] * 5 + ["gradsift"] * 2 + ["ddp"] * 2  # WARMUP + LEAD
    recs = [{"paired": "gradsift", "step_s": 0.2}, {"paired": "ddp", "step_s": 0.1}, {"paired": "gradsift",
            "step_s": 0.2}, {"step_s": 9.0}]
    s = pairing.summary(recs)
    assert s["gradsift_steps"] == 2 and s["ddp_steps"] == 1 and s["speedup"] == pytest.approx(0.5)
    assert pairing.summary([{"paired": "gradsift", "step_s": 0.2}])["speedup"] is None


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="between 1 and 1000"):
        RunConfig(paired_ddp=0).validate()
    with pytest.raises(ConfigError, match="no gradsift hook to pair"):
        RunConfig(paired_ddp=4, torch_hook="ddp").validate()
    with pytest.raises(ClusterError, match="--paired is a block length"):
        check_options(paired=0)


def test_the_simulator_refuses_it_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "gradsift", "train", "--task", "linreg", "--steps", "2",
                        "--paired-ddp", "4", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2 and "--paired-ddp needs --runtime ddp" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def _paired(rank, world, outdir):
    from gradsift.launch import train_ddp

    # the wire plan off keeps the hook on its steps (with it on, a run that sends everything whole stands aside)
    runs = {"paired": dict(BASE, compressor="dense", workers=world, paired_ddp=2, wire_plan=False),
            "ddp": dict(BASE, compressor="dense", workers=world, torch_hook="ddp")}
    for name, cfg in runs.items():
        out = str(Path(outdir) / name) if rank == 0 else None
        res = train_ddp(RunConfig(**cfg), out=out, bucket_cap_mb=0.005)
        torch.save(res["params"], Path(outdir) / f"{name}-rank{rank}.pt")


def test_both_wrappers_train_one_model_and_the_summary_pairs_them(tmp_path):
    spawn(_paired, 2, str(tmp_path))
    paired = [torch.load(tmp_path / f"paired-rank{r}.pt") for r in (0, 1)]
    plain = torch.load(tmp_path / "ddp-rank0.pt")
    for a, b in zip(*paired):
        assert torch.equal(a, b)  # the ranks stay in step through both wrappers
    # dense through gradsift's hook and DDP's own all-reduce are the same mean: the alternating run trains as
    # plain DDP does
    diff = sum(float((a - b).norm() ** 2) for a, b in zip(paired[0], plain)) ** 0.5
    ref = sum(float(b.norm() ** 2) for b in plain) ** 0.5
    assert diff <= 1e-5 * ref
    recs = [json.loads(line) for line in (tmp_path / "paired" / "metrics.jsonl").read_text().splitlines()]
    sides = [r.get("paired") for r in recs]
    assert sides == [None] * 5 + ["gradsift"] * 2 + ["ddp"] * 2 + ["gradsift"] * 2 + ["ddp"]
    assert all("buckets" in r for r in recs if r.get("paired") != "ddp")  # the hook's telemetry, its steps only
    assert not any("buckets" in r for r in recs if r.get("paired") == "ddp")
    summary = json.loads((tmp_path / "paired" / "summary.json").read_text())
    p = summary["paired_ddp"]
    assert p["block"] == 2 and p["gradsift_steps"] == 4 and p["ddp_steps"] == 3
    assert p["speedup"] == pytest.approx(p["ddp_step_ms"] / p["gradsift_step_ms"]) and p["speedup"] > 0
    assert summary["config"]["paired_ddp"] == 2
    # the bench's view of the run: the method's medians leave DDP's steps out; the pair's ratio is over one window
    st = step_stats(recs, skip=5)
    own = [r["step_s"] for r in recs[5:] if r.get("paired") == "gradsift"]
    ref_steps = [r["step_s"] for r in recs[5:] if r.get("paired") == "ddp"]
    assert st["step_s"] == pytest.approx(statistics.median(own))
    assert st["paired_speedup"] == pytest.approx(statistics.median(ref_steps) / statistics.median(own))


def test_bench_rows_and_report_carry_the_paired_column(tmp_path):
    def run(g, d):
        recs = [{"step_s": 1.0, "compute_s": 0.5, "select_s": 0.0, "est_step_s": 0.1, "bytes_per_worker": 10.0,
                 "wire_bytes_per_worker": 10.0, "est_comm_s": 0.01, "comm_s": 0.01}] * 3
        recs += [{**recs[0], "step_s": g, "paired": "gradsift"}, {**recs[0], "step_s": d, "paired": "ddp"}] * 3
        return {"ok": True, **step_stats(recs, skip=3)}

    runs = [run(0.10, 0.11), run(0.12, 0.12), run(0.20, 0.19)]
    assert [r["step_s"] for r in runs] == [0.10, 0.12, 0.20]  # DDP's steps are not the method's
    row = combine_runs(runs)
    assert row["paired_speedup"] == pytest.approx(1.0) and row["paired_speedup_runs"] == pytest.approx([1.1, 1.0, 0.95])
    ddp = {"ok": True, "step_s": 0.12, "compute_s": 0.12, "select_s": 0.0, "bytes_per_worker": 10.0,
           "model_comm_s": 0.01, "wire_efficiency": None}
    results = {"calibration": {}, "sweep": [{"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "DDP", **ddp},
                                            {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "topk", **row}],
               "repeats": 3, "paired": 4}
    text = report.write(tmp_path, results, quick=False).read_text()
    assert "same processes |" in text and "1.00x [0.95-1.10] |" in text and "blocks of 4 steps" in text
    header = next(line for line in text.splitlines() if line.startswith("| hosts"))
    assert all(line.count("|") == header.count("|") for line in text.splitlines() if line.startswith("| 2 |"))


def _aside(rank, world, outdir):
    from gradsift.launch import train_ddp

    runs = {"aside": dict(BASE, compressor="dense", workers=world),
            "hook": dict(BASE, compressor="dense", workers=world, wire_plan=False),
            "compressing": dict(BASE, compressor="topk", workers=world),
            "skip": dict(BASE, compressor="dense", workers=world, fault_nan_step=5, on_nonfinite="skip")}
    for name, cfg in runs.items():
        out = str(Path(outdir) / name) if rank == 0 else None
        res = train_ddp(RunConfig(**cfg), out=out, bucket_cap_mb=0.005)
        torch.save({"params": res["params"], "skipped": res["state"].totals["skipped_steps"]},
                   Path(outdir) / f"{name}-rank{rank}.pt")


DGC_WHOLE = [  # a message latency that carries the whole model: the wire plan sends every tensor whole
    ("dgc", dict(BASE, compressor="dgc", latency_us=1e5), 0.005),
    ("dgc-nesterov", dict(BASE, compressor="dgc", latency_us=1e5, optimizer="nesterov"), 0.005),
    ("dgc-model", dict(BASE, compressor="dgc", latency_us=1e5, granularity="model"), None),
    ("dgc-sgd", dict(BASE, compressor="dgc", latency_us=1e5, optimizer="sgd"), 0.005),  # momentum 0: nothing to add
]


def _aside_momentum(rank, world, outdir):
    from gradsift.launch import train_ddp

    for name, cfg, cap in DGC_WHOLE:
        out = str(Path(outdir) / name) if rank == 0 else None
        res = train_ddp(RunConfig(**dict(cfg, workers=world)), out=out, bucket_cap_mb=cap)
        torch.save(res["params"], Path(outdir) / f"{name}-rank{rank}.pt")


def test_momentum_correction_stands_aside_with_the_velocity_of_the_mean_gradient(tmp_path):
    """DGC sent whole is momentum SGD: after standing aside the velocity follows DDP's mean gradient, and the run
    matches the simulator, where every step goes the hook's way."""
    from gradsift.simulate import Simulator

    spawn(_aside_momentum, 2, str(tmp_path))
    for name, cfg, _ in DGC_WHOLE:
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert "ddp_allreduce" not in recs[0] and all(r.get("ddp_allreduce") for r in recs[1:]), name
        got = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in (0, 1)]
        sim = Simulator(RunConfig(**dict(cfg, workers=2)))
        sim.run()
        diff = sum(float((a.detach() - b).norm() ** 2) for a, b in zip(sim.params, got[0])) ** 0.5
        ref = sum(float(a.detach().norm() ** 2) for a in sim.params) ** 0.5
        assert diff <= 1e-5 * ref, (name, diff / ref)
        assert all(torch.equal(a, b) for a, b in zip(*got)), name


def _aside_error(rank, world):
    from gradsift.launch import train_ddp

    train_ddp(RunConfig(**dict(BASE, compressor="dense", workers=world, fault_nan_step=5)), out=None,
              bucket_cap_mb=0.005)


def test_the_hook_stands_aside_once_everything_goes_whole_in_place(tmp_path):
    from gradsift.simulate import Simulator

    spawn(_aside, 2, str(tmp_path))

    def recs(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    aside = recs("aside")
    # the first step goes through the hook (summed in place); from then on DDP's own all-reduce takes the steps
    assert "ddp_allreduce" not in aside[0] and aside[0]["buckets_in_place"] == aside[0]["buckets"] >= 1
    assert all(r.get("ddp_allreduce") for r in aside[1:])
    assert all(r["bytes_per_worker"] == aside[0]["bytes_per_worker"] > 0 for r in aside)  # what each step moved
    assert not any(r.get("ddp_allreduce") for name in ("hook", "compressing") for r in recs(name))
    a = [torch.load(tmp_path / f"aside-rank{r}.pt")["params"] for r in (0, 1)]
    hook = torch.load(tmp_path / "hook-rank0.pt")["params"]
    for x, y, z in zip(a[0], a[1], hook):
        assert torch.equal(x, y)  # the ranks stay in step
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-6)  # the same mean as the hook's own route
    # a NaN on one rank while standing aside: skipped on every rank, as the simulator skips it
    skip = [torch.load(tmp_path / f"skip-rank{r}.pt") for r in (0, 1)]
    assert skip[0]["skipped"] == skip[1]["skipped"] == 1
    sim = Simulator(RunConfig(**dict(BASE, compressor="dense", workers=2, fault_nan_step=5, on_nonfinite="skip")))
    sim.run()
    assert sim.skipped == 1
    for x, y in zip(sim.params, skip[0]["params"]):
        torch.testing.assert_close(x.detach(), y, rtol=1e-5, atol=1e-6)
    errs = spawn(_aside_error, 2, expect_failure=True)
    assert set(errs) == {0, 1}
    assert errs[1].splitlines()[0].startswith("NonFiniteGradient: non-finite gradient on rank 1 at step 5 (summed by "
                                              "DDP's own all-reduce)")
    assert errs[0].splitlines()[0].startswith("NonFiniteGradient: non-finite gradient on a rank at step 5")
