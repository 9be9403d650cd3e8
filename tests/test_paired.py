"""``train --paired-ddp``: gradsift against DDP's own all-reduce in the same processes (a benchmark tool)."""

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
from gradsift.experiments.pairing import Pairing
from gradsift.runtime.runconfig import ConfigError, RunConfig

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
    with pytest.raises(ConfigError, match=r"paired-ddp must be an integer in \[1, 1000\]"):
        RunConfig(paired_ddp=0).validate()
    with pytest.raises(ConfigError, match="no gradsift hook to pair"):
        RunConfig(paired_ddp=4, torch_hook="ddp").validate()
    with pytest.raises(ClusterError, match="--paired is a block length"):
        check_options(paired=0)


def test_the_simulator_refuses_it_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "gradsift", "train", "--task", "linreg", "--compressor", "topk", "--steps", "2",
                        "--paired-ddp", "4", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2 and "--paired-ddp needs --runtime ddp" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def _paired(rank, world, outdir):
    from gradsift.experiments.ddp_runs import train

    # the wire plan off keeps the hook on its steps (with it on, a run that sends everything whole stands aside)
    runs = {"paired": dict(BASE, compressor="dense", workers=world, paired_ddp=2, wire_plan=False),
            "ddp": dict(BASE, compressor="dense", workers=world, torch_hook="ddp")}
    for name, cfg in runs.items():
        out = str(Path(outdir) / name) if rank == 0 else None
        res = train(RunConfig(**cfg), out=out, bucket_cap_mb=0.005)
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
