"""gradsift in Hugging Face's tools: the Trainer callback and the Accelerate recipe, as their examples run them
(2 gloo processes under torchrun; a tiny GPT-2 built from a config, nothing downloaded)."""

from __future__ import annotations

import importlib.util
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
                              callback_handler=SimpleNamespace(callbacks=[]), train=lambda **kw: None,
                              args=SimpleNamespace(output_dir=outdir))
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


def _clip_handed_over(rank, world, outdir):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from types import SimpleNamespace

    from gradsift.integrations.transformers import compress

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    args = SimpleNamespace(output_dir=outdir, max_grad_norm=1.0)
    trainer = SimpleNamespace(model_wrapped=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              callback_handler=SimpleNamespace(callbacks=[]), train=lambda **kw: None, args=args)
    cb = compress(trainer, "topk", ratio=0.05)
    cb.on_train_begin(None, None, None)
    c = cb.state.compressor
    if rank == 0:
        Path(outdir, "clip.json").write_text(json.dumps({
            "memory": c.memory_name, "clip": c.memory_options["clip"], "tensors": c.tensor_count,
            "trainer_clip": args.max_grad_norm}))


def test_the_trainers_gradient_clipping_goes_to_the_workers_under_adamw(tmp_path):
    """With AdamW the Trainer's default ``max_grad_norm=1.0`` would clip the averaged Adam direction gradsift
    writes into ``p.grad`` (the recipe, memory=adam): it becomes each rank's clip of its own gradient, and the
    Trainer clips nothing."""
    pytest.importorskip("transformers")
    from ddp_helpers import spawn

    spawn(_clip_handed_over, 2, str(tmp_path))
    got = json.loads((tmp_path / "clip.json").read_text())
    assert got == {"memory": "adam", "clip": 1.0, "tensors": 4, "trainer_clip": 0.0}


def test_trainer_checkpoints_hold_every_ranks_gradsift_state(tmp_path):
    """Killed (SIGKILL) after checkpoint-4 and resumed with ``resume_from_checkpoint``: checkpoint-8 holds the same
    weights and, on every rank, the same error-feedback memory, step and totals as an uninterrupted run."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from helpers import assert_same_rank_state

    common = ["--steps", "8", "--save-steps", "4"]
    whole = torchrun("hf_trainer.py", "--out", str(tmp_path / "a"), *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = torchrun("hf_resume_run.py", "--out", str(tmp_path / "b"), *common, "--kill-at", "4")
    assert killed.returncode != 0
    assert not (tmp_path / "b" / "trainer" / "checkpoint-8").exists()
    resumed = torchrun("hf_trainer.py", "--out", str(tmp_path / "b"), *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = tmp_path / "a" / "trainer" / "checkpoint-8", tmp_path / "b" / "trainer" / "checkpoint-8"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for rank in (0, 1):
        sa = torch.load(a / f"gradsift-rank{rank}.pt", weights_only=False)
        sb = torch.load(b / f"gradsift-rank{rank}.pt", weights_only=False)
        assert_same_rank_state(sa, sb, rank, 8)


def test_trainer_with_local_sgd_resumes_mid_period_as_if_never_stopped(tmp_path):
    """``compress(trainer, "local:period=3,compressor=topk")``: a run resumed from checkpoint-4 (mid-period: the
    ranks' models differ, and the Trainer saved rank 0's) ends at checkpoint-8 with every rank's parameters, global
    model, residual and optimizer state of the run that never stopped."""
    pytest.importorskip("transformers")
    import shutil

    import torch

    from helpers import same_state

    common = ["--steps", "8", "--save-steps", "4", "--compressor", "local:period=3,compressor=topk", "--ratio", "0.1"]
    whole = torchrun("hf_trainer.py", "--out", str(tmp_path / "a"), *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    (tmp_path / "b" / "trainer").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "trainer" / "checkpoint-4", tmp_path / "b" / "trainer" / "checkpoint-4")
    resumed = torchrun("hf_trainer.py", "--out", str(tmp_path / "b"), *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    mid = [torch.load(tmp_path / "a" / "trainer" / "checkpoint-4" / f"gradsift-rank{r}.pt", weights_only=False)
           for r in (0, 1)]
    assert not all(torch.equal(x, y) for x, y in zip(mid[0]["local"]["params"], mid[1]["local"]["params"]))
    for rank in (0, 1):
        la, lb = (torch.load(tmp_path / d / "trainer" / "checkpoint-8" / f"gradsift-rank{rank}.pt",
                             weights_only=False) for d in ("a", "b"))
        assert la["local"]["inner_steps"] == lb["local"]["inner_steps"] == 8
        assert la["local"]["syncs"] == lb["local"]["syncs"] == 2
        for what in ("params", "globals"):
            assert all(torch.equal(x, y) for x, y in zip(la["local"][what], lb["local"][what])), (rank, what)
        assert same_state(la["local"]["optimizer"]["state"], lb["local"]["optimizer"]["state"])
        assert same_state(la["compressor_state"], lb["compressor_state"], nonzero=True), rank


def test_accelerate_save_state_holds_every_ranks_gradsift_state(tmp_path):
    """``register_for_checkpointing(state.all_ranks())``: a run stopped at step 6 and resumed from its saved state
    ends at step 12 with the weights and, on every rank, the memory, step and counted totals of a run that never
    stopped (Accelerate writes custom state from rank 0 only: every rank's is gathered into it)."""
    pytest.importorskip("accelerate")
    import torch

    from helpers import assert_same_rank_state

    def run(out, *extra):
        r = torchrun("accelerate_train.py", "--out", str(tmp_path / out), *extra)
        assert r.returncode == 0, r.stderr[-3000:]

    run("a", "--steps", "12", "--save-at", "12")
    run("b", "--steps", "6", "--save-at", "6")
    run("b", "--steps", "12", "--save-at", "12", "--resume")
    from safetensors.torch import load_file

    wa, wb = (load_file(tmp_path / d / "state" / "model.safetensors") for d in ("a", "b"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ga, gb = (torch.load(tmp_path / d / "state" / "custom_checkpoint_0.pkl", weights_only=False) for d in ("a", "b"))
    assert ga["world_size"] == gb["world_size"] == 2
    for rank in (0, 1):
        assert_same_rank_state(ga["ranks"][rank], gb["ranks"][rank], rank, 12)


@pytest.mark.parametrize("spec,ratio,options", [("nosuch", 0.01, {}), ("topk", 2.0, {}),
                                                ("topk", 0.01, {"granularity": "bucket"}),
                                                ("topk", 0.01, {"nosuch_option": 1})])
def test_the_integrations_check_a_spec_where_it_is_given(spec, ratio, options):
    """compress(trainer, spec) and GradsiftDDPStrategy(spec) refuse a bad spec or setting in one line when called,
    not at the first backward on every rank."""
    from types import SimpleNamespace

    from gradsift.compressors import OptionError
    from gradsift.errors import ConfigError

    surfaces = []
    if importlib.util.find_spec("transformers"):
        from gradsift.integrations.transformers import compress

        trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[]), train=lambda **kw: None)
        surfaces.append(lambda: compress(trainer, spec, ratio, **options))
    if importlib.util.find_spec("lightning"):
        from gradsift.integrations.lightning import GradsiftDDPStrategy

        surfaces.append(lambda: GradsiftDDPStrategy(spec, ratio, **options))
    if not surfaces:
        pytest.skip("neither transformers nor lightning is installed")
    for call in surfaces:
        with pytest.raises((ConfigError, OptionError)) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value)
