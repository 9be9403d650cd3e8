"""Time to a model: the race (dense's final quality as the target, the baselines beside), local SGD, the gptlm
task's recipe, and a user's own DDP script that reaches its dense accuracy with one ``register`` call."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ddp_helpers import spawn
from gradsift.errors import ConfigError
from gradsift.runtime.runconfig import RunConfig, lr_factor

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"


def test_the_schedule_warms_up_then_decays_to_a_tenth_at_the_horizon():
    cfg = RunConfig(task="gptlm", steps=100, schedule="cosine", warmup_steps=10, lr=1.0)
    f = [lr_factor(cfg, s) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # then non-increasing
    assert f[55] == pytest.approx(0.55, abs=0.02) and f[100] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)
    assert lr_factor(RunConfig(steps=100), 50) == 1.0
    horizon = RunConfig(steps=300, schedule="cosine", schedule_steps=100)  # a race: dense's horizon for everyone
    assert lr_factor(horizon, 100) == pytest.approx(0.1) and lr_factor(horizon, 299) == pytest.approx(0.1)


def test_gptlm_is_a_pre_norm_transformer_trained_with_adamw_warmup_cosine_decay_and_clipping():
    from gradsift.runtime.simulate import Simulator

    sim = Simulator(RunConfig(task="gptlm", compressor="topk", ratio=0.05, workers=2, steps=30, eval_every=30,
                              data=str(SHAKESPEARE), task_options={"embed": 32, "layers": 2, "heads": 2,
                                                                   "seq_len": 32, "eval_chars": 2048}))
    opt = sim.optimizer
    assert isinstance(opt, torch.optim.AdamW) and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in sim.named if id(p) in decayed}
    assert "tokens.weight" in names and not any("ln" in n or n.endswith("bias") or "positions" in n for n in names)
    assert sim.cfg.schedule == "cosine" and sim.cfg.clip_norm == 1.0 and sim.cfg.warmup_steps > 0
    recs = sim.run()
    assert recs[-1]["valid_loss"] < math.log(len(sim.task.vocab))  # better than guessing a character
    assert recs[-1]["perplexity"] == pytest.approx(math.exp(recs[-1]["valid_loss"]))


def test_local_sgd_averages_the_models_every_period_and_can_sparsify_the_sync():
    from gradsift.runtime.localsgd import LocalSGD

    base = dict(task="digits-mlp", workers=4, steps=8, eval_every=4, ratio=0.05)
    sim = LocalSGD(RunConfig(**base, compressor="local:period=4"), "local:period=4")
    recs = sim.run()
    assert [r["est_comm_s"] > 0 for r in recs] == [False, False, False, True] * 2  # a sync every 4 steps
    for w in sim.workers:  # after a sync every worker holds the averaged model
        assert all(torch.equal(p, g) for p, (_, g) in zip(w.parameters(), sim.named))
    sparse = LocalSGD(RunConfig(**base, compressor="local:period=4,compressor=topk"), "local:period=4,compressor=topk")
    recs = sparse.run()
    assert 0.0 < recs[3]["density"] < 0.2 and recs[3]["bytes_per_worker"] < 0.2 * recs[3]["wire_bytes_per_worker"] + 1e9
    assert any(t.abs().sum() > 0 for t in sparse.ranks[0].compressor.residual.values())  # error feedback holds
    with pytest.raises(ConfigError, match="period must be an integer"):
        LocalSGD(RunConfig(**base, compressor="local:period=0"), "local:period=0")
    with pytest.raises(ConfigError, match="unknown option 'h'"):
        LocalSGD(RunConfig(**base, compressor="local:h=3"), "local:h=3")


def test_a_race_sets_the_target_from_dense_and_prices_every_method_on_every_link(tmp_path):
    from gradsift.experiments.race import run_race

    base = RunConfig(task="digits-mlp", workers=4, steps=40, eval_every=10, ratio=0.05)
    res = run_race(base, ["dense", "bf16", "powersgd:rank=1", "local:period=4", "topk"], tmp_path, seeds=2,
                   links=[0.1, 10.0])
    rows = {r["method"]: r for r in res["rows"]}
    assert res["target"] == pytest.approx(sum(res["dense_final"]) / 2 - 0.01)
    assert set(rows) == {"dense", "dense:value_dtype=bf16", "powersgd:approx_rank=1,start=4", "local:period=4", "topk"}
    for r in rows.values():
        for s in r["per_seed"]:
            if s["steps"] is not None:  # a run that reached it is faster on the faster link, never slower
                assert s["time_s"][10.0] <= s["time_s"][0.1] and s["steps"] <= 120
    d, b = rows["dense"], rows["dense:value_dtype=bf16"]
    assert b["bytes_per_step"] == pytest.approx(d["bytes_per_step"] / 2)
    assert (tmp_path / "race.md").read_text().count("| `") == 5 and (tmp_path / "race.png").stat().st_size > 1000
    assert json.loads((tmp_path / "race.json").read_text())["rows"][0]["method"] == "dense"


def test_a_race_reuses_finished_runs_whose_recipe_rewrote_the_spec(tmp_path):
    """--reuse reads a finished run back, also one whose recorded spec is its recipe's (AdamW: topk:memory=adam;
    momentum SGD: dgc:memory=ef), and trains nothing again."""
    from gradsift.experiments.race import run_race

    for opt, spec in (("adamw", "topk"), ("momentum", "dgc")):
        base = RunConfig(task="digits-mlp", workers=2, steps=20, eval_every=10, ratio=0.05, optimizer=opt, lr=3e-3)
        out = tmp_path / opt
        run_race(base, ["dense", spec], out, seeds=1, factor=1.0, links=[0.1])
        recorded = json.loads((out / spec / "seed0" / "summary.json").read_text())["config"]["compressor"]
        assert recorded == {"topk": "topk:memory=adam", "dgc": "dgc:memory=ef"}[spec]
        stamps = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
        run_race(base, ["dense", spec], out, seeds=1, factor=1.0, links=[0.1], reuse=True)
        assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == stamps


def test_race_refuses_bad_input_in_one_line(tmp_path, capsys):
    from gradsift.cli import main

    cases = [(["--steps", "0"], "steps must be an integer >= 1"), (["--methods", "nosuch"], "nosuch"), (["--factor", "0.5"], "factor"),
             (["--methods", "local:period=0"], "period")]
    for args, said in cases:
        capsys.readouterr()
        try:
            code = main(["race", "--task", "digits-mlp", *args, "--out", str(tmp_path / said)])
        except SystemExit as e:
            code = e.code
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and said in lines[0], (args, lines)


# ---------------------------------------------------------------- a user's own DDP script
def _user_script(rank, world, outdir, optimizer):
    """A user's model and data (not a gradsift task): a 3-layer MLP learning a random teacher, 300 steps, plain
    DDP, then the same script with one register call."""
    import gradsift.ddp

    gen = torch.Generator().manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    for p in teacher.parameters():  # (balanced classes: weights of fan-in scale)
        p.data = torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 10)
    x_test = torch.randn(2000, 32, generator=gen)
    y_test = teacher(x_test).argmax(1)
    out = {}
    for name, spec in (("plain", None), ("topk", "topk")):
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = (torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
               else torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01))
        if spec is not None:
            gradsift.ddp.register(ddp, spec, ratio=0.01, optimizer=opt)
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(400):
            x = torch.randn(64, 32, generator=data)
            loss = torch.nn.functional.cross_entropy(ddp(x), teacher(x).argmax(1).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out[name] = float((net(x_test).argmax(1) == y_test).float().mean())
    torch.save(out, Path(outdir) / f"rank{rank}.pt")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_users_ddp_script_reaches_its_dense_accuracy_with_one_register_call(optimizer, tmp_path):
    """register(ddp, "topk", ratio=0.01, optimizer=opt) and nothing else: within 2 points of the same script
    without gradsift, with momentum SGD and with AdamW."""
    spawn(_user_script, 2, str(tmp_path), optimizer)
    r = torch.load(tmp_path / "rank0.pt")
    assert r["plain"] > 0.6, r  # the task is learnable
    assert r["topk"] >= r["plain"] - 0.02, r


def _post_local_sgd(rank, world, outdir):
    from gradsift.experiments.ddp_runs import train

    cfg = RunConfig(task="digits-mlp", compressor="dense", torch_hook="localsgd:period=4", workers=world, steps=9,
                    eval_every=8, lr=0.05)
    res = train(cfg, out=None)
    flat = torch.cat([p.reshape(-1) for p in res["params"]])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    if rank == 0:
        torch.save({"bytes": [r["bytes_per_worker"] for r in res["records"]], "params": gathered},
                   Path(outdir) / "out.pt")


def test_post_local_sgd_in_ddp_averages_every_period_and_sends_nothing_between():
    """``--torch-hook localsgd:period=4`` (PyTorch's post_localSGD_hook and PeriodicModelAverager): the models are
    averaged after the optimizer's step every 4 steps (the ranks hold the same weights after step 9), and the steps
    between send nothing."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spawn(_post_local_sgd, 2, d)
        r = torch.load(Path(d) / "out.pt")
    b = r["bytes"]
    assert b[1] == b[2] == b[3] == 0 and b[4] > 0 and b[5] == 0, b  # averaged at steps 1 (start), 5, ...
    assert torch.equal(r["params"][0], r["params"][1])
