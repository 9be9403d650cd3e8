"""gradsift in Hugging Face's tools: the Trainer callback and the Accelerate recipe, as their examples run them
(2 gloo processes under torchrun; a tiny GPT-2 built from a config, nothing downloaded)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

import procs
from test_launch import TORCHRUN, env, free_port

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, timeout: float = 300):
    path = ROOT / "examples" / script if (ROOT / "examples" / script).exists() else ROOT / "tests" / script
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--max-restarts", "0", str(path), *args]
    return procs.run(cmd, env=env(), timeout=timeout)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_callback_compresses_every_optimizer_step(tmp_path, accumulate):
    """One metrics line per optimizer step (the hook runs once per step under gradient accumulation), compressed
    (median density < 0.05), and the totals the script prints from the callback's state."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    r = torchrun("hf_trainer.py", "--out", str(out), "--steps", "12", "--accumulate", str(accumulate))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 13))
    assert all(x["buckets"] >= 1 and x["bytes_per_worker"] > 0 for x in recs)
    assert statistics.median(x["density"] for x in recs) < 0.05
    assert "gradsift: 12 steps" in r.stdout and "fewer wire bytes" in r.stdout


def test_trainer_callback_skip_leaves_weights_and_schedule_alone(tmp_path):
    """A non-finite gradient under on_nonfinite="skip": the callback stops the optimizer and the schedule for that
    step on every rank; the other steps train and log."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    r = torchrun("hf_skip_run.py", "--out", str(out), "--steps", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((out / "skip.json").read_text())
    assert got["skipped"] == 1
    assert got["unchanged_at_skip"] and got["lr_unchanged_at_skip"]
    assert [x["step"] for x in records(out / "metrics.jsonl")] == [1, 2, 4, 5, 6]


def test_accelerate_recipe_compresses_with_accumulate(tmp_path):
    pytest.importorskip("accelerate")
    out = tmp_path / "acc"
    r = torchrun("accelerate_train.py", "--out", str(out), "--steps", "10", "--accumulate", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 11))  # one record per optimizer step, not per micro-batch
    assert statistics.median(x["density"] for x in recs) < 0.05
    assert "gradsift: 10 optimizer steps" in r.stdout


def test_accelerate_recipe_on_one_process_says_so_in_one_line(tmp_path):
    pytest.importorskip("accelerate")
    r = procs.run([sys.executable, str(ROOT / "examples" / "accelerate_train.py"), "--out", str(tmp_path / "a")],
                  env=env(), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "world size of 1" in lines[-1] and "Traceback" not in r.stderr


def _rewrap(rank, world, outdir):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from types import SimpleNamespace

    from gradsift.integrations.transformers import compress

    def wrapped():
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))

    first = wrapped()
    trainer = SimpleNamespace(model_wrapped=first, optimizer=torch.optim.SGD(first.parameters(), lr=0.1),
                              callback_handler=SimpleNamespace(callbacks=[]))
    cb = compress(trainer, "topk", ratio=0.05, wire_plan=False)
    cb.on_train_begin(None, None, None)
    state_a = cb.state
    cb.on_train_begin(None, None, None)  # the same wrapper: registered once
    same = cb.state is state_a
    trainer.model_wrapped = second = wrapped()  # the Trainer wrapped anew (auto_find_batch_size's retry)
    cb.on_train_begin(None, None, None)
    second(torch.randn(8, 16)).square().mean().backward()
    cb.on_pre_optimizer_step(None, None, None)
    if rank == 0:
        Path(outdir, "rewrap.json").write_text(json.dumps({
            "same": same, "new_state": cb.state is not state_a, "first": trainer.callback_handler.callbacks[0] is cb,
            "density": cb.state.last.get("density"), "steps": cb.state.totals["steps"]}))


def test_trainer_callback_registers_again_on_a_new_wrapper(tmp_path):
    """Once per DDP wrapper: a second train begin on the same wrapper keeps the state; a new wrapper gets a hook
    of its own, which compresses the next step."""
    pytest.importorskip("transformers")
    from ddp_helpers import spawn

    spawn(_rewrap, 2, str(tmp_path))
    got = json.loads((tmp_path / "rewrap.json").read_text())
    assert got["same"] and got["new_state"] and got["first"]
    assert got["steps"] == 1 and got["density"] < 0.1
