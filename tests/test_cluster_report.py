"""The cluster bench's choices and report, without a cluster (no namespaces needed)."""

from __future__ import annotations

import pytest

from gradsift.cluster.bench import MEASURED, PROBE_STEPS, methods, sweep_rates
from gradsift.cluster.hosts import ClusterError
from gradsift.cluster.report import write
from gradsift.cluster.runs import step_stats


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
