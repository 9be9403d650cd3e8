"""The cluster bench's choices and report, without a cluster (no namespaces needed)."""

from __future__ import annotations

import pytest

from gradsift.cluster.bench import MEASURED, PROBE_STEPS, WARMUP_STEPS, median_window, methods, run_cluster_bench, sweep_rates
from gradsift.cluster.hosts import ClusterError
from gradsift.cluster.report import write
from gradsift.cluster.runs import combine_runs, step_stats
from gradsift.route.measure import Measurement


def test_method_and_rate_filters():
    assert [m[0] for m in methods(False, ["topk", "DDP"])] == ["DDP", "topk"]
    with pytest.raises(ClusterError, match="unknown method 'topk 1%'; the methods are: DDP, "):
        methods(False, ["topk 1%"])
    assert set(MEASURED) <= {m[0] for m in methods(False)}
    assert sweep_rates(False, None) == ["100mbit", "1gbit"] and sweep_rates(False, ["1gbit"]) == ["1gbit"]


def test_measured_rows_leave_the_probe_out_and_say_what_it_chose(tmp_path):
    recs = [{"step_s": 9.0 if i < PROBE_STEPS else 0.2, "compute_s": 0.1, "select_s": 0.0, "est_step_s": 0.2,
             "bytes_per_worker": 10.0, "wire_bytes_per_worker": 10.0, "comm_s": 0.1, "est_comm_s": 0.05}
            for i in range(PROBE_STEPS + 5)]
    st = step_stats(recs, skip=PROBE_STEPS)
    assert st["step_s"] == pytest.approx(0.2) and st["wire_efficiency"] == pytest.approx(0.5)
    ddp = {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "DDP", "ok": True, **st, "comm_s": None,
           "wire_efficiency": None, "step_s": 0.25}
    mine = {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "topk", "ok": True, **st, "wire_probe": "whole"}
    text = write(tmp_path, {"calibration": {}, "sweep": [ddp, mine]}, quick=False).read_text()
    row = next(line for line in text.splitlines() if "| topk |" in line)
    assert "| whole | 1.25x |" in row


def _run(step, probe="whole", ok=True):
    return {"ok": ok, "step_s": step, "compute_s": step / 2, "select_s": 0.0, "est_step_s": step,
            "bytes_per_worker": 8.0, "wire_bytes_per_worker": 8.0, "comm_s": 0.1, "model_comm_s": 0.05,
            "wire_efficiency": 0.5, "wire_probe": probe, "error": None if ok else "gradsift: error: boom"}


def test_repeated_runs_give_the_median_run_its_spread_and_the_plans_count(tmp_path):
    row = combine_runs([_run(0.30), _run(0.10, "compressed"), _run(0.12), _run(9.0, ok=False)])
    assert row["ok"] and row["runs"] == 3 and row["step_s"] == pytest.approx(0.12)
    assert row["step_s_runs"] == [0.30, 0.10, 0.12] and row["compute_s"] == pytest.approx(0.06)
    assert row["wire_probe"] == "whole 2/3"
    assert combine_runs([_run(0.1), _run(0.2)])["wire_probe"] == "whole"
    failed = combine_runs([_run(0.1, ok=False), _run(0.2, ok=False)])
    assert not failed["ok"] and failed["error"] == "gradsift: error: boom" and failed["runs"] == 0
    ddp = {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "DDP",
           **combine_runs([_run(0.24, None), _run(0.26, None)]), "comm_s": None, "wire_efficiency": None}
    mine = {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "topk", **row}
    text = write(tmp_path, {"calibration": {}, "sweep": [ddp, mine], "repeats": 3}, quick=False).read_text()
    assert "ran 3 times in interleaved rounds" in text
    line = next(x for x in text.splitlines() if "| topk |" in x)
    assert "| 120 [100-300] |" in line and "| whole 2/3 | 2.08x |" in line


def test_repeats_out_of_range_is_one_line(tmp_path):
    with pytest.raises(ClusterError, match="--repeats must be between 1 and 20, got 0"):
        run_cluster_bench(tmp_path / "b", repeats=0)


def test_unknown_task_and_host_count_are_one_line(tmp_path):
    with pytest.raises(ClusterError, match="unknown task 'ptb'; the tasks are: wordlm, charlm"):
        run_cluster_bench(tmp_path / "b", tasks=["ptb"])
    with pytest.raises(ClusterError, match="--host-counts must be between 2 and 8, got \\[1\\]"):
        run_cluster_bench(tmp_path / "c", host_counts=[1])


def test_every_method_of_a_sweep_is_timed_on_the_same_steps(tmp_path):
    """With a measured method in the sweep, plain DDP's medians also leave its PROBE_STEPS steps out (DDP was
    timed on steps 4-28 against the measured methods' 14-28 once); without one, or in the quick bench, the warm-up."""
    assert median_window(False, methods(False, ["DDP", "regtopk"])) == PROBE_STEPS
    assert PROBE_STEPS == Measurement.steps_for(narrow=True)  # the longest measurement (gsb's three phases)
    assert median_window(False, methods(False, ["DDP", "PowerSGD r2", "LAGS equal c"])) == WARMUP_STEPS
    assert median_window(True, methods(True)) == WARMUP_STEPS
    ddp = {"task": "charlm", "hosts": 2, "rate": "1gbit", "method": "DDP", **_run(0.25, None)}
    text = write(tmp_path, {"calibration": {}, "sweep": [ddp], "median_after": PROBE_STEPS, "sweep_steps": 60},
                 quick=False).read_text()
    assert f"medians over steps {PROBE_STEPS + 1}-60 of every run, the same steps for every method" in text


def test_sweep_steps_too_few_for_the_measured_plan_is_one_line(tmp_path):
    with pytest.raises(ClusterError, match=f"--steps must be between {PROBE_STEPS + 5} .* and 2000, got 10"):
        run_cluster_bench(tmp_path / "b", steps=10)
    assert not (tmp_path / "b").exists()


def test_the_race_report_has_its_table_and_its_plot(tmp_path):
    """``gradsift cluster race``'s report from its results (no hosts needed): one row per method, a method that did
    not reach the target said so, and the plot of every method's perplexity against wall time beside it."""
    import math

    from gradsift.cluster.race import write_race

    curves = {"DDP": [[1.0, 20.0], [2.0, 9.0]], "DiLoCo H=8": [[0.5, 15.0], [1.0, 8.5]],
              "sparse local SGD H=8": [[0.5, 16.0], [1.2, 10.0]]}
    rows = [{"method": "DDP", "reached": True, "steps": 20, "seconds": 2.0, "median_step_s": 0.1,
             "final_valid_loss": math.log(9.0)},
            {"method": "DiLoCo H=8", "reached": True, "steps": 10, "seconds": 1.0, "median_step_s": 0.1,
             "final_valid_loss": math.log(8.5)},
            {"method": "sparse local SGD H=8", "reached": False, "steps": 12, "seconds": 1.2, "median_step_s": 0.1,
             "final_valid_loss": math.log(10.0)},
            {"method": "topk 1%", "failed": "rank 1 exited with 1"}]
    res = {"task": "gptlm", "hosts": 4, "rate": "100mbit", "ddp_steps": 20, "factor": 2.0,
           "target_valid_loss": math.log(9.2), "calibration": {"bandwidth_gbps": 0.09, "latency_us": 1200.0},
           "rows": rows, "curves": curves}
    text = write_race(tmp_path, res, "gradsift cluster race ...").read_text()
    assert "| DiLoCo H=8 | yes | 10 | 1.0 s | 0.50x |" in text
    assert "| sparse local SGD H=8 | no | 12 | 1.2 s (not reached) |" in text and "| topk 1% | failed: rank 1" in text
    assert "![validation perplexity against measured wall time](race.png)" in text
    assert (tmp_path / "race.png").stat().st_size > 10_000 and (tmp_path / "race.json").exists()
