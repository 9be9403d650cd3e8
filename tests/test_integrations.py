"""gradsift from the tools people train with: Lightning, the Python API's guards, LAGS and telemetry from register()."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import procs
from ddp_helpers import spawn
from test_launch import env

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- Lightning
def test_lightning_example_really_compresses_on_cpu(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "lit"
    r = procs.run([sys.executable, str(ROOT / "examples" / "lightning_ddp.py"), "--out", str(out), "--steps", "12"],
                  env=env(), timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    # one record per optimizer step, each written from the hook's own telemetry: no hook call, no record
    assert [x["step"] for x in recs] == list(range(1, 13))
    assert all(x["buckets"] >= 1 and x["bytes_per_worker"] > 0 and x["wire_bytes_per_worker"] > 0 for x in recs)
    assert statistics.median(x["density"] for x in recs) < 0.05
    assert recs[-1]["loss"] < recs[0]["loss"] * 1.5 and "gradsift totals" in r.stdout


def test_lightning_gradient_clipping_goes_to_the_workers_under_adamw(tmp_path):
    """Under AdamW (the recipe: memory=adam, p.grad holds the averaged direction) Lightning's gradient_clip_val
    becomes each rank's clip of its own gradient and Lightning clips nothing; the model still learns."""
    pytest.importorskip("lightning")
    r = procs.run([sys.executable, str(ROOT / "tests" / "lit_adam_clip_run.py"), str(tmp_path)], env=env(),
                  timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "clip.json").read_text())
    assert got["memory"] == "adam" and got["clip"] == 1.0 and got["lightning_clip"] is None, got
    assert got["accuracy"] > 0.5, got
    assert "gradient_clip_val=1 now clips each rank's own gradient" in r.stderr


def test_lightning_strategy_stands_aside_when_the_measured_plan_chooses_whole(tmp_path):
    """The strategy registers as any user does, so it gets the route owner's behaviour: measured whole, then DDP's
    own all-reduce takes the steps (the twin), with the telemetry still one record per step."""
    pytest.importorskip("lightning")
    out = tmp_path / "lit"
    r = procs.run([sys.executable, str(ROOT / "examples" / "lightning_ddp.py"), "--out", str(out), "--steps", "10",
                   "--wire-plan", "measure", "--measure", "warmup=1", "--measure", "block=2", "--measure",
                   "rounds=1", "--measure", "margin=1.0"], env=env(), timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, 11))
    # 5 measuring steps (whole chosen), one whole step through the hook, then DDP's own all-reduce
    assert [bool(x.get("ddp_allreduce")) for x in recs] == [False] * 6 + [True] * 4
    assert all(x["density"] == 1.0 for x in recs[5:]) and "DDP's own all-reduce takes the steps" in r.stderr


def test_lightning_strategy_skip_leaves_weights_and_momentum_alone(tmp_path):
    """on_nonfinite="skip" with rank 1's loss NaN at one step: neither the weights nor the momentum buffers move on
    any rank; global_step counts the step as it counts a mixed-precision overflow's skip, totals say skipped."""
    pytest.importorskip("lightning")
    r = procs.run([sys.executable, str(ROOT / "tests" / "lit_skip_run.py"), str(tmp_path)], env=env(), timeout=300,
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "skip.json").read_text())
    assert got["weights_still"] and got["momentum_still"]
    assert got["global_step_after"] == got["global_step_before"] + 1
    assert got["skipped"] == 1 and got["steps"] == 5


# ---------------------------------------------------------------- register's guards (one process group)
def _guards(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp
    from gradsift.compressors import OptionError
    from gradsift.runtime.runconfig import ConfigError

    lines = {}
    try:
        gddp.register(nn.Linear(4, 4), "topk", ratio=0.1)
    except ConfigError as e:
        lines["not_ddp"] = str(e)
    for bad in (None, "0.01", True, 0.0, 1.5):
        try:
            gddp.register(DDP(nn.Linear(4, 4)), "topk", ratio=bad)
        except (OptionError, ConfigError) as e:
            lines[f"ratio={bad!r}"] = str(e)
    # dgc and a momentum optimizer: given the optimizer, its momentum is taken over (applied once) ...
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    a, b = DDP(nets[0]), DDP(nets[1])
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    sa = gddp.register(a, "dgc:memory=momentum", ratio=0.05, optimizer=opt_a)
    lines["opt_momentum"] = opt_a.param_groups[0]["momentum"]
    lines["dgc_momentum"] = sa.compressor.memory_options["momentum"]
    lines["dgc_nesterov"] = sa.compressor.memory_options["nesterov"]  # the recipe for momentum SGD
    # ... and the same run written the documented way (optimizer without momentum) gives the same weights
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb = gddp.register(b, "dgc:nesterov=true", ratio=0.05)
    lines["warned"] = [str(w.message) for w in caught]
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(30):
        x = torch.randn(32, 16, generator=gen)
        y = (x[:, :4] * 3).argmax(1)
        for m, o, s in ((a, opt_a, sa), (b, opt_b, sb)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            s.end_step()
            o.step()
            if m is a:
                losses.append(float(loss))
    lines["same"] = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    lines["losses"] = (losses[0], sum(losses[-5:]) / 5)
    # a momentum of its own plus an optimizer's: refused, not applied twice
    try:
        gddp.register(DDP(nn.Linear(4, 4)), "dgc:momentum=0.5", ratio=0.1,
                      optimizer=torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1, momentum=0.9))
    except ConfigError as e:
        lines["double"] = str(e)
    # totals and the JSONL writer, from Python
    lines["totals"] = dict(sa.totals)
    if rank == 0:
        (Path(outdir) / "guards.json").write_text(json.dumps(lines))


def test_register_guards_against_silent_misuse(tmp_path):
    spawn(_guards, 2, str(tmp_path))
    got = json.loads((tmp_path / "guards.json").read_text())
    assert "DistributedDataParallel" in got["not_ddp"] and "\n" not in got["not_ddp"]
    for bad in ("None", "'0.01'", "True", "0.0", "1.5"):
        msg = got[f"ratio={bad}"]
        assert "ratio" in msg and "\n" not in msg, (bad, msg)
    assert got["opt_momentum"] == 0.0 and got["dgc_momentum"] == 0.9 and got["dgc_nesterov"] is True
    assert got["warned"] and "optimizer=" in got["warned"][0]  # cannot know the optimizer: warned once (rank 0)
    assert got["same"], "dgc with the optimizer's momentum taken over must equal dgc with a momentum-free SGD"
    first, last = got["losses"]
    assert last < 0.8 * first, got["losses"]
    assert "momentum" in got["double"] and "\n" not in got["double"]
    t = got["totals"]
    assert t["steps"] == 30 and t["bytes_per_worker"] > 0 and t["wire_bytes_per_worker"] >= t["bytes_per_worker"]
    assert t["select_s"] > 0 and t["comm_s"] > 0 and t["skipped_steps"] == 0


def _lags_and_metrics(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.05)
    state = gddp.register(model, "topk", ratio=0.01, lags=True, bandwidth_gbps=0.01,
                          metrics_path=Path(outdir) / "metrics.jsonl")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(12):
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        state.end_step()
        opt.step()
    if rank == 0:
        (Path(outdir) / "lags.json").write_text(json.dumps({"ratios": state.lags.ratios,
                                                            "report": state.lags.report()}, default=str))


def test_lags_and_telemetry_from_python(tmp_path, capfd):
    spawn(_lags_and_metrics, 2, str(tmp_path))
    got = json.loads((tmp_path / "lags.json").read_text())
    ratios = got["ratios"]
    assert ratios and set(ratios) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(0.01 <= r <= 1.0 for r in ratios.values())
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 13)) and all("density" in r for r in recs)
    err = capfd.readouterr().err
    assert "LAGS" in err  # the plan is printed once, on rank 0


def _totals_across_resume(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    def run(state_dict, steps):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
        state = gddp.register(model, "topk", ratio=0.05, wire_plan=False)
        if state_dict is not None:
            state.load_state_dict(state_dict)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            model.zero_grad()
            model(torch.randn(8, 32, generator=gen)).square().mean().backward()
            state.end_step()
        return state

    first = run(None, 3)
    second = run(first.state_dict(), 2)  # a user's resume: a fresh model and hook, the saved state loaded
    if rank == 0:
        dense = sum(p.numel() * 4 for _, p in second.named)
        (Path(outdir) / "totals.json").write_text(json.dumps({"first": dict(first.totals), "second": dict(second.totals),
                                                              "dense": dense}))


def test_totals_carry_dense_bytes_and_compression_across_a_resume(tmp_path):
    """`state.totals` after `load_state_dict` continues the saved run's: steps, what dense all-reduce would have
    sent and moved, and both compressions (payload and wire), as a user's script reads them."""
    spawn(_totals_across_resume, 2, str(tmp_path))
    got = json.loads((tmp_path / "totals.json").read_text())
    first, second, dense = got["first"], got["second"], got["dense"]
    assert first["steps"] == 3 and second["steps"] == 5
    assert second["dense_bytes_per_worker"] == 5 * dense
    assert second["dense_wire_bytes_per_worker"] == pytest.approx(5 * dense)  # ring of 2: 2(N-1)/N = 1
    assert second["bytes_per_worker"] > first["bytes_per_worker"] > 0
    assert second["compression"] == pytest.approx(second["dense_bytes_per_worker"] / second["bytes_per_worker"])
    assert second["wire_compression"] == pytest.approx(
        second["dense_wire_bytes_per_worker"] / second["wire_bytes_per_worker"])
    assert 5 < second["wire_compression"] < second["compression"]  # indices and padding cost on the wire


def _reshaped(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    def step(width):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)))
        state = gddp.register(model, "topk", ratio=0.1, wire_plan=False)
        model(torch.randn(8, 16)).square().mean().backward()
        state.end_step()
        return state

    saved = step(64).state_dict()
    other = step(32)  # the same parameter names, another shape
    try:
        other.load_state_dict(saved)
        got = "loaded"
    except ValueError as e:
        got = str(e)
    from gradsift.runtime.runconfig import ConfigError

    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    try:
        gddp.register(DDP(mixed, bucket_cap_mb=100), "topk", ratio=0.1, granularity="model")
        dtypes = "registered"
    except ConfigError as e:
        dtypes = str(e)
    if rank == 0:
        Path(outdir, "reshaped.txt").write_text(got)
        Path(outdir, "dtypes.txt").write_text(dtypes)


def test_state_of_a_reshaped_model_is_refused_at_load(tmp_path):
    """It loaded and failed only at the next backward; now one line at load. And whole-model compression over
    mixed dtypes gets the right advice."""
    spawn(_reshaped, 2, str(tmp_path))
    got = (tmp_path / "reshaped.txt").read_text()
    assert "another model" in got and "\n" not in got, got
    # whole-model compression over two dtypes: DDP buckets each apart, so no bucket_cap_mb helps (it advised one)
    dtypes = (tmp_path / "dtypes.txt").read_text()
    assert "2 dtypes (float32, float64)" in dtypes and "bucket_cap_mb" not in dtypes, dtypes


def _elastic_fold(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    state = gddp.register(model, "topk", ratio=0.1, wire_plan=False)
    model(torch.randn(8, 16)).square().mean().backward()
    state.end_step()
    base = state.state_dict()
    saved = []
    for r in range(3):  # a 3-rank run's states: residual r + 1 everywhere (one rank never saw "2.bias")
        sd = {**base, "rank": r, "world_size": 3, "compressor_state": dict(base["compressor_state"])}
        sd["compressor_state"]["residual"] = {k: torch.full_like(v, r + 1.0) for k, v in
                                              base["compressor_state"]["residual"].items() if r or k != "2.bias"}
        saved.append(sd)
    state.load_elastic(saved)
    got = {k: v.unique().tolist() for k, v in state.road.compressor.residual.items()}
    if rank == 0:
        Path(outdir, "fold.json").write_text(json.dumps(got))


def test_elastic_resume_folds_the_memory_to_the_ranks_mean(tmp_path):
    """Resuming a 3-rank checkpoint on 2 ranks: every rank's residual is the saved ranks' mean (a rank without the
    key counts as zero), so the mass left to send is what it was."""
    spawn(_elastic_fold, 2, str(tmp_path))
    got = json.loads((tmp_path / "fold.json").read_text())
    assert got["0.weight"] == [2.0] and got["2.bias"] == [pytest.approx((2.0 + 3.0) / 3)]


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    """An elastic job that gains a rank, or loses one, continues from its checkpoint (it was refused in one line),
    says so once, and trains on."""
    from test_robustness import torchrun

    out = tmp_path / "run"
    common = ["--task", "digits-mlp", "--compressor", "topk", "--ratio", "0.05", "--checkpoint-every", "3",
              "--quiet", "--out", str(out)]
    r = torchrun(2, ["--steps", "3", *common])
    assert r.returncode == 0, r.stderr[-2000:]
    one = tmp_path / "one"
    shutil.copytree(out, one)
    r = torchrun(3, ["--steps", "6", "--resume", str(out / "checkpoints"), *common], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("resuming 2 ranks' checkpoint on 3") == 1
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    # and on one rank (a job that lost a node): DDP of one process, the memory folded the same way
    common[-1] = str(one)
    r = torchrun(1, ["--steps", "6", "--resume", str(one / "checkpoints"), *common], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("resuming 2 ranks' checkpoint on 1") == 1
    recs = [json.loads(l) for l in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7)) and recs[-1]["density"] < 0.2


def test_lightning_checkpoints_hold_every_ranks_gradsift_state(tmp_path):
    """A fresh launch resumed from the step=4.ckpt a run wrote on its way to step 8 ends at step 8 with the weights
    and, on every rank, the error-feedback memory, step and counted totals of that run, which never stopped. (An
    epoch is 4 steps: Lightning restarts a plain DataLoader's epoch on resume, which would change the data.)"""
    pytest.importorskip("lightning")
    from helpers import assert_same_rank_state

    script = str(ROOT / "examples" / "lightning_ddp.py")

    def run(out, steps, *extra):
        r = procs.run([sys.executable, script, "--out", str(tmp_path / out), "--steps", str(steps),
                       "--checkpoint-every", "4", "--wire-plan", "off", "--samples", "256", *extra], env=env(), timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]

    run("a", 8)
    run("b", 8, "--resume", str(tmp_path / "a" / "ckpt" / "step=4.ckpt"))
    ca = torch.load(tmp_path / "a" / "ckpt" / "step=8.ckpt", weights_only=False)
    cb = torch.load(tmp_path / "b" / "ckpt" / "step=8.ckpt", weights_only=False)
    assert all(torch.equal(ca["state_dict"][k], cb["state_dict"][k]) for k in ca["state_dict"])
    ga, gb = ca["gradsift"], cb["gradsift"]
    assert ga["world_size"] == gb["world_size"] == 2
    for rank in (0, 1):
        assert_same_rank_state(ga["ranks"][rank], gb["ranks"][rank], rank, 8)


def test_lightning_with_local_sgd_resumes_mid_period_as_if_never_stopped(tmp_path):
    """``GradsiftDDPStrategy("local:period=3,compressor=topk")``: resumed from step=4.ckpt (mid-period: the ranks'
    models differ; Lightning restores rank 0's model and optimizer on both), a fresh launch ends at step 8 with every
    rank's parameters, global model, optimizer state and residual of the run that never stopped."""
    pytest.importorskip("lightning")
    from helpers import same_state

    script = str(ROOT / "examples" / "lightning_ddp.py")

    def run(out, *extra):
        r = procs.run([sys.executable, script, "--out", str(tmp_path / out), "--steps", "8", "--checkpoint-every", "4",
                       "--wire-plan", "off", "--samples", "256", "--compressor", "local:period=3,compressor=topk",
                       "--ratio", "0.1", *extra], env=env(), timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]

    run("a")
    run("b", "--resume", str(tmp_path / "a" / "ckpt" / "step=4.ckpt"))
    mid = torch.load(tmp_path / "a" / "ckpt" / "step=4.ckpt", weights_only=False)["gradsift"]["ranks"]
    assert not all(torch.equal(x, y) for x, y in zip(mid[0]["local"]["params"], mid[1]["local"]["params"]))
    ga, gb = (torch.load(tmp_path / d / "ckpt" / "step=8.ckpt", weights_only=False)["gradsift"] for d in ("a", "b"))
    for rank in (0, 1):
        la, lb = ga["ranks"][rank]["local"], gb["ranks"][rank]["local"]
        assert la["inner_steps"] == lb["inner_steps"] == 8 and la["syncs"] == lb["syncs"] == 2
        for what in ("params", "globals"):
            assert all(torch.equal(x, y) for x, y in zip(la[what], lb[what])), (rank, what)
        assert same_state(la["optimizer"]["state"], lb["optimizer"]["state"], nonzero=True), rank
        assert same_state(ga["ranks"][rank]["compressor_state"], gb["ranks"][rank]["compressor_state"], nonzero=True)


def _forgotten_end_step(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    models = [DDP(n) for n in nets]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    states = [gddp.register(m, "topk", ratio=0.05, wire_plan=False) for m in models]
    gen = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            x = torch.randn(32, 16, generator=gen)
            y = (x[:, :4] * 3).argmax(1)
            for i, (m, o, s) in enumerate(zip(models, opts, states)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                if i == 0:
                    s.end_step()  # the documented script; model 1's script forgets it
                o.step()
    said = [str(w.message) for w in caught if "end_step" in str(w.message)]
    if rank == 0:
        (Path(outdir) / "forgotten.json").write_text(json.dumps({
            "said": said, "steps": [s.totals["steps"] for s in states],
            "same": all(torch.equal(p, q) for p, q in zip(*(m.parameters() for m in models))),
            "density": states[1].last.get("density")}))


def test_a_forgotten_end_step_is_closed_at_the_next_backward_and_said_once(tmp_path):
    """Without optimizer= and without end_step(): each step closes when the next backward begins (the telemetry
    counts it, the memory snapshot is not kept past it), the weights are those of the documented script, and a
    warning says so once on rank 0."""
    spawn(_forgotten_end_step, 2, str(tmp_path))
    got = json.loads((tmp_path / "forgotten.json").read_text())
    assert len(got["said"]) == 1 and "optimizer=" in got["said"][0] and "\n" not in got["said"][0]
    assert got["steps"] == [5, 4]  # the fifth step is still open: the next backward or end_step closes it
    assert got["same"] and 0 < got["density"] < 0.2


def _nan_from_python(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp
    from gradsift.compressors import NonFiniteGradient

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gddp.register(model, "topk", ratio=0.05, optimizer=opt, wire_plan=False, on_nonfinite="error")  # (default: skip)
    gen = torch.Generator().manual_seed(rank)
    got = {}
    for step in range(1, 5):
        x = torch.randn(32, 16, generator=gen)
        loss = nn.functional.cross_entropy(model(x), (x[:, :4] * 3).argmax(1))
        if step == 3 and rank == 1:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()  # no error here: the optimizer's step raises it, before anything moves
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except NonFiniteGradient as e:
            got = {"step": step, "line": str(e),
                   "still": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
            break
    (Path(outdir) / f"nan{rank}.json").write_text(json.dumps(got))


def test_a_non_finite_gradient_under_the_python_api_is_gradsifts_error_with_the_python_fix(tmp_path):
    spawn(_nan_from_python, 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"nan{rank}.json").read_text())
        assert got["step"] == 3 and got["still"], got
        assert "at step 3" in got["line"] and "on_nonfinite='skip'" in got["line"] and "\n" not in got["line"]
