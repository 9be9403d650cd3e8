"""``gradsift bench hook``: every method on the same loopback ranks, each step against plain DDP's, with the hook's
own breakdown from its telemetry (``select_s``, ``code_s``, ``decode_s``)."""

import json

import pytest

import procs
from gradsift.cli import main


def test_bench_hook_times_every_method_against_ddp_with_the_hooks_breakdown(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([["conv", [64, 32, 3, 3]], ["bias", [64]], ["fc", [300, 200]], [50]]))
    out = tmp_path / "b"
    r = procs.cli(["bench", "hook", "--shapes", str(shapes), "--methods", "ddp", "fp16", "topk", "dgc:memory=momentum",
                   "--steps", "3", "--warm", "1", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "hook.json").read_text())
    rows = {row["method"]: row for row in res["rows"]}
    assert list(rows) == ["ddp", "fp16", "topk", "dgc:memory=momentum"]
    assert rows["ddp"]["x_ddp"] == 1.0 and res["compute_ms"] > 0
    for name, row in rows.items():
        assert row["step_ms"] > 0 and row["wait_ms"] >= 0
        assert len(row["steps_ms"]) == 3 and row["step_ms"] == pytest.approx(sorted(row["steps_ms"])[1])
        # interleaved: paired by turn (here one turn of 3 steps): the turn's median over DDP's in the same turn
        assert row["x_ddp"] == pytest.approx(row["step_ms"] / rows["ddp"]["step_ms"])
        own = name not in ("ddp", "fp16")  # the hook's own telemetry: gradsift's methods only
        assert all((row[k] > 0) == own for k in ("select_ms", "code_ms", "decode_ms")), row
        assert row["select_ms"] + row["code_ms"] < row["step_ms"]  # the hook's part of one step, not of several
    assert res["interleaved"] and res["config"]["interleave"]  # (small: every model fits at once, turns of steps)
    md = (out / "hook.md").read_text()
    assert "methods in turns of 4 steps" in md
    assert "| topk |" in md and "select + memory ms" in md and md.count("\n| ") == 5
    assert (out / "hook.png").stat().st_size > 5000
    assert "| dgc:memory=momentum |" in r.stdout  # the table on the terminal too


@pytest.mark.parametrize("args, needle", [
    (["--methods", "topk"], "must include ddp"),
    (["--methods", "ddp", "nosuch"], "nosuch"),
    (["--model", "alexnet"], "--model must be one of"),
    (["--ratio", "0"], "--ratio must be in (0, 1]"),
    (["--steps", "2"], "--steps must be >= 3"),
    (["--ranks", "1"], "--ranks must be at least 2"),
    (["--model", "mlp", "--shapes", "x.json"], "not both"),
    (["--shapes", "missing.json"], "missing.json"),
    (["--shapes", "huge.json"], "GiB available"),
])
def test_bench_hook_bad_input_is_one_line_before_any_process(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "huge.json").write_text("[[100000, 100000, 100]]")
    out = tmp_path / "b"
    assert main(["bench", "hook", *args, "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_the_ratio_to_ddp_is_paired_by_turn_so_load_that_comes_and_goes_hits_both_sides():
    from gradsift.experiments.hook_bench import TURN, paired_ratio

    ddp = [100.0] * TURN + [200.0] * TURN + [100.0] * TURN  # the machine got slow for the second turn
    topk = [110.0] * TURN + [220.0] * TURN + [110.0] * TURN
    assert paired_ratio(topk, ddp) == pytest.approx(1.1)
    odd = [110.0] * TURN + [400.0] * TURN + [110.0] * TURN  # one bad turn does not move the median
    assert paired_ratio(odd, ddp) == pytest.approx(1.1)
    assert paired_ratio(topk[:-1], ddp) == pytest.approx(1.1)  # a last, shorter turn
