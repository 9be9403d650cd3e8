"""gradsift under FSDP2 (fully_shard on gloo): the sparse reduce-scatter of gradsift.fsdp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddp_helpers import spawn

fsdp_api = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _sharded(model: torch.nn.Module, mesh=None, **kw) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _train(rank, spec, steps=20, ratio=1.0, nan_at=None, mesh=None, **kw):
    """20 SGD steps of the 64-64-10 MLP, each rank its own batches; gradsift registered unless ``spec`` is None,
    every module compressed as the method says unless ``wire_plan`` is given (the 650-entry head is small enough
    for the wire plan to send whole)."""
    import gradsift.fsdp as gf

    model = _sharded(_mlp(), mesh)
    kw.setdefault("wire_plan", False)
    state = gf.register(model, spec, ratio=ratio, **kw) if spec is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    skipped = []
    for step in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        if nan_at == step and rank == 1:
            x[0, 0] = float("nan")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if state is not None and state.end_step():
            skipped.append(step)
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return params, state, skipped


def _dense_parity(rank, world, outdir):
    own, _, _ = _train(rank, None)
    ours, state, _ = _train(rank, "dense")
    topk, tstate, _ = _train(rank, "topk", ratio=0.05)
    _, narrow, _ = _train(rank, "topk", ratio=0.05, steps=3, residual_dtype="bf16")
    _, fp8, _ = _train(rank, "topk", ratio=0.05, steps=3, residual_dtype="fp8")
    torch.save({"own": own, "ours": ours, "last": state.last, "topk_last": tstate.last,
                "memory": tstate.memory, "narrow": narrow.memory, "fp8": fp8.memory,
                "per_param": (tstate.memory_per_parameter, fp8.memory_per_parameter),
                "rounding": (tstate.residual_rounding, fp8.residual_rounding)}, Path(outdir) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_dense_through_gradsift_equals_fsdps_own_reduce_scatter(world, tmp_path):
    spawn(_dense_parity, world, str(tmp_path))
    r = torch.load(tmp_path / "rank0.pt")
    rel = float((r["own"] - r["ours"]).abs().max() / r["own"].abs().max())
    assert rel < 1e-6, rel
    assert r["last"]["density"] == 1.0 and r["last"]["modules"] == 2  # both Linear modules went through gradsift
    # topk 5%: about 5% of each module's entries sent, received bytes a fraction of a dense reduce-scatter's
    assert 0.04 < r["topk_last"]["density"] < 0.06
    assert r["topk_last"]["wire_bytes_per_worker"] < 0.2 * r["last"]["wire_bytes_per_worker"]
    n_params = sum(p.numel() for p in _mlp().parameters())
    assert n_params * 4 <= r["memory"] <= (n_params + 2 * 64 * world) * 4  # the unsharded residual, padded
    assert r["narrow"] == r["memory"] // 2 + 8 * 2  # residual_dtype="bf16": half, and a draw count a module
    assert r["fp8"] == r["memory"] // 4 + 12 * 2  # fp8: a byte an entry, a scale and a draw count a module
    assert r["per_param"][0] == 4.0 and 1.0 < r["per_param"][1] <= 1.006, r["per_param"]
    assert r["rounding"][0] is None and 0 < r["rounding"][1] < 2**-4  # what fp8 rounded off, counted


def _sum_parity(rank, world, outdir):
    """FSDP asks for a sum, not an average, for an fp64 model, an fp16 reduce dtype and under
    set_force_sum_reduction_for_comms (it divides afterwards, the fp16 case half before); a divide factor other
    than the group's size is a pre-multiplied sum, refused."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import gradsift.fsdp as gf
    from gradsift.errors import ConfigError

    got = {}
    fp16 = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float16)}
    for name, dtype, force, kw in (("fp64", torch.float64, False, {}), ("forced", torch.float32, True, {}),
                                   ("fp16", torch.float32, False, fp16)):
        torch.set_default_dtype(dtype)
        try:
            runs = []
            for spec in (None, "dense", "topk"):
                model = _sharded(_mlp(), **kw)
                for m in model.modules():
                    if isinstance(m, gf.FSDPModule) and force:
                        m.set_force_sum_reduction_for_comms(True)
                state = gf.register(model, spec, ratio=0.1, wire_plan=False) if spec else None
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                gen = torch.Generator().manual_seed(100 + rank)
                for _ in range(5):
                    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    if state is not None:
                        state.end_step()
                    opt.step()
                    opt.zero_grad()
                runs.append(torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]))
            start = torch.cat([p.detach().reshape(-1) for p in _mlp().parameters()])
            got[name] = (runs, state.last["density"], start)
        finally:
            torch.set_default_dtype(torch.float32)
    model = _sharded(_mlp())
    for m in model.modules():
        if isinstance(m, gf.FSDPModule):
            m.set_gradient_divide_factor(3.0)
    gf.register(model, "topk", ratio=0.1, wire_plan=False)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        got["factor"] = "accepted"
    except ConfigError as e:
        got["factor"] = str(e)
    dist.barrier()
    torch.save(got, Path(outdir) / f"rank{rank}.pt")


def test_fsdp_asking_for_a_sum_gets_the_sum_and_a_divide_factor_is_refused(tmp_path):
    """An fp64 model, an fp16 reduce dtype (FSDP averages only fp32 and bf16 itself) and
    set_force_sum_reduction_for_comms train through gradsift as through FSDP's own reduce-scatter (dense: the same
    parameters; top-k 10%: trains, sparsely)."""
    spawn(_sum_parity, 2, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt")
    for name, tol in (("fp64", 1e-12), ("forced", 1e-6), ("fp16", 1e-4)):
        (own, dense, topk), density, start = got[name]
        assert own.dtype == (torch.float64 if name == "fp64" else torch.float32)
        assert float((own - dense).abs().max() / own.abs().max()) < tol, name
        assert 0.05 < density < 0.15 and not torch.equal(topk, own) and bool(torch.isfinite(topk).all())
        assert float((topk - start).norm()) > 0.1 * float((own - start).norm())  # top-k trained too
    assert "divide factor" in got["factor"] and "\n" not in got["factor"]


def _invariant(rank, world, outdir):
    """Record every module's reduce-scatter input and this rank's output shard; at the end the residuals."""
    import torch.distributed as dist

    import gradsift.fsdp as gf

    sums: dict[str, list[torch.Tensor]] = {}
    real = gf.SparseReduceScatter.__call__

    def spy(self, output_tensor, input_tensor, group, op, async_op=False):
        acc = sums.setdefault(self.key, [torch.zeros_like(input_tensor), torch.zeros_like(output_tensor)])
        acc[0] += input_tensor
        real(self, output_tensor, input_tensor, group, op, async_op)
        acc[1] += output_tensor

    gf.SparseReduceScatter.__call__ = spy
    _, state, _ = _train(rank, "topk", ratio=0.02)
    out = {}
    for key, (inp, shard) in sums.items():
        total_in = inp.clone()
        dist.all_reduce(total_in)  # every rank's gradients, summed
        shards = [torch.zeros_like(shard) for _ in range(world)]
        dist.all_gather(shards, shard)  # the mean applied, every shard
        residual = state.road.compressor.residual[key].clone()
        dist.all_reduce(residual)
        out[key] = (total_in, torch.cat(shards) * world, residual)
    torch.save(out, Path(outdir) / f"rank{rank}.pt")


def test_nothing_is_lost_by_error_feedback_under_fsdp(tmp_path):
    """Over 20 steps at 3 ranks: everything applied (the mean times N) plus every rank's residual equals the sum
    of every rank's gradients, for every module."""
    spawn(_invariant, 3, str(tmp_path))
    out = torch.load(tmp_path / "rank0.pt")
    assert set(out) == {"0", "2"}
    for key, (total_in, applied, residual) in out.items():
        assert residual.abs().sum() > 0  # topk 2% held something back
        torch.testing.assert_close(applied + residual, total_in, rtol=1e-5, atol=1e-5)


def _skip(rank, world, outdir):
    _, state, skipped = _train(rank, "topk", ratio=0.05, steps=6, nan_at=3, on_nonfinite="skip")
    try:
        _train(rank, "topk", ratio=0.05, steps=6, nan_at=3)
        error = "no error"
    except Exception as e:  # noqa: BLE001 - every rank raises
        error = f"{type(e).__name__}: {e}"
    torch.save({"skipped": skipped, "totals": dict(state.totals), "error": error}, Path(outdir) / f"rank{rank}.pt")


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank_or_raises(tmp_path):
    spawn(_skip, 2, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["skipped"] == [3], r
        assert r["totals"]["skipped_steps"] == 1 and r["totals"]["steps"] == 5
        assert r["error"].startswith("NonFiniteGradient: non-finite gradient on rank 1 at step 4"), r["error"]


def _refusals(rank, world, outdir):
    import gradsift.fsdp as gf
    from gradsift.errors import ConfigError

    said = {}
    for name, make in (("plain", lambda: gf.register(_mlp(), "topk", ratio=0.01)),
                       ("regtopk", lambda: gf.register(_sharded(_mlp()), "regtopk", ratio=0.01)),
                       ("gsb", lambda: gf.register(_sharded(_mlp()), "gsb", ratio=0.01)),
                       ("shared", lambda: gf.register(_sharded(_mlp()), "randomk:shared=true", ratio=0.01)),
                       ("spec", lambda: gf.register(_sharded(_mlp()), "nosuch", ratio=0.01))):
        try:
            make()
            said[name] = "accepted"
        except (ConfigError, ValueError) as e:
            said[name] = str(e)
    torch.save(said, Path(outdir) / f"rank{rank}.pt")


def test_what_it_cannot_do_is_refused_in_one_line(tmp_path):
    spawn(_refusals, 1, str(tmp_path))
    said = torch.load(tmp_path / "rank0.pt")
    assert "no FSDP module" in said["plain"]
    assert "regtopk" in said["regtopk"] and "shard" in said["regtopk"]
    assert "gsb" in said["gsb"] and "shard" in said["gsb"]  # its refresh reads the whole mean
    assert "shared indices" in said["shared"]
    assert said["spec"] != "accepted"
    assert all("\n" not in s for s in said.values())


def _resume(rank, world, outdir):
    """20 steps straight, against 10 steps, a checkpoint (model and optimizer by torch.distributed.checkpoint,
    gradsift's state per rank), a fresh model and optimizer loaded from it, and 10 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gradsift.fsdp as gf

    def run(steps, start=0, ck=None, save_at=None):
        model = _sharded(_mlp())
        state = gf.register(model, "topk", ratio=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)
        if ck is not None:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(ck))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            state.load_state_dict(torch.load(Path(ck) / f"gradsift-rank{rank}.pt", weights_only=True))
        for step in range(steps):
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            if step < start:
                continue  # the data stream of the steps already taken
            torch.nn.functional.cross_entropy(model(x), y).backward()
            state.end_step()
            opt.step()
            opt.zero_grad()
            if save_at == step + 1:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(outdir) / "ck"))
                torch.save(state.state_dict(), Path(outdir) / "ck" / f"gradsift-rank{rank}.pt")
                return None
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]), state

    straight, s1 = run(20)
    run(20, save_at=10)
    resumed, s2 = run(20, start=10, ck=Path(outdir) / "ck")
    torch.save({"straight": straight, "resumed": resumed, "steps": (s1.step, s2.step),
                "totals": (s1.totals["steps"], s2.totals["steps"])}, Path(outdir) / f"rank{rank}.pt")


def test_a_run_resumed_from_a_checkpoint_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    spawn(_resume, 2, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(r["straight"], r["resumed"])
        assert r["steps"] == (20, 20) and r["totals"] == (20, 20)


BASE = dict(task="digits-cnn", ratio=0.05, steps=12, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000,
            fsdp=True, wire_plan="auto")
MOMENTUM = ("dgc", "topk:memory=momentum")  # momentum correction: the optimizer's momentum handed over, applied once


def _runtime(rank, world, outdir, specs, replicas=1):
    from gradsift.launch import train_ddp
    from gradsift.runtime.runconfig import RunConfig

    for spec in specs:
        res = train_ddp(RunConfig(**dict(BASE, compressor=spec, workers=world, replicas=replicas)), out=None)
        if rank == 0:
            torch.save({"params": res["params"], "wire": [r["wire_bytes_per_worker"] for r in res["records"]],
                        "bytes": [r["bytes_per_worker"] for r in res["records"]],
                        "density": [r["density"] for r in res["records"]]}, Path(outdir) / f"{spec}.pt")
    if world == 2:  # FSDP's own exchange, timed as a baseline (--torch-hook fsdp)
        from gradsift.experiments.ddp_runs import train

        res = train(RunConfig(**dict(BASE, compressor="dense", workers=world, torch_hook="fsdp")), out=None)
        if rank == 0:
            torch.save({"params": res["params"], "comm": [r["comm_s"] for r in res["records"]]},
                       Path(outdir) / "own.pt")


def _equal_to_the_simulator(tmp_path, world, specs, replicas=1):
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.simulate import Simulator

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spec in specs:
            sim = Simulator(RunConfig(**dict(BASE, compressor=spec, workers=world, replicas=replicas)))
            recs = sim.run()
            real = torch.load(tmp_path / f"{spec}.pt")
            for a, b in zip(real["params"], sim.params):
                assert torch.equal(a, b.detach()), spec
            assert real["wire"] == [r["wire_bytes_per_worker"] for r in recs], spec
            assert real["bytes"] == [r["bytes_per_worker"] for r in recs], spec
            assert max(real["density"]) < 0.5, (spec, real["density"])  # compressed (DGC's units included)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_runtime_equals_the_simulators_fsdp_exchange_bit_for_bit(world, tmp_path):
    """``gradsift train --runtime fsdp`` (real FSDP2 on gloo) and the simulator with ``fsdp=True`` (the same units,
    FSDP's padded shard layout, the shard route in process): the same parameters bit for bit and the same bytes --
    with momentum SGD, for DGC and momentum correction too (the optimizer's momentum handed over in both: applied
    once), and DGC compressing FSDP's units (its 1-D rule reads the parameters, not the flat unit)."""
    specs = ("topk", "dense", "sidco", *MOMENTUM) if world == 2 else ("topk", "sidco", "topk:residual_dtype=fp8")
    spawn(_runtime, world, str(tmp_path), specs)
    _equal_to_the_simulator(tmp_path, world, [s for s in specs if s != "dense"])
    dense = torch.load(tmp_path / "dense.pt") if world == 2 else None
    if world == 2:
        own = torch.load(tmp_path / "own.pt")
        for a, b in zip(own["params"], dense["params"]):
            assert float((a - b).abs().max()) <= 1e-6 * float(a.abs().max())
        assert all(c is not None and c > 0 for c in own["comm"])  # FSDP's own reduce-scatter, timed


def test_hsdp_runtime_equals_the_simulators_hsdp_exchange_bit_for_bit(tmp_path):
    """``--runtime hsdp`` at 2 replicas x 2 shards and the simulator's HSDP exchange (each replica's dense mean,
    then every shard's road among the replicas): the same parameters bit for bit, momentum applied once."""
    spawn(_runtime, 4, str(tmp_path), MOMENTUM, 2)
    _equal_to_the_simulator(tmp_path, 4, MOMENTUM, replicas=2)


def test_fsdp_settings_that_do_not_go_together_are_refused_in_one_line():
    from gradsift.errors import ConfigError
    from gradsift.runtime.runconfig import RunConfig

    for bad, said in ((dict(torch_hook="fsdp"), "--runtime fsdp"), (dict(replicas=2), "--runtime hsdp"),
                      (dict(fsdp=True, lags=True), "--lags"), (dict(fsdp=True, wire_plan="measure"), "--wire-plan"),
                      (dict(fsdp=True, torch_hook="powersgd"), "--torch-hook"), (dict(fsdp=True, replicas=0), "replicas")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            RunConfig(**bad).validate()


def test_gradsift_train_runtime_fsdp_and_hsdp_under_torchrun(tmp_path):
    """The issue's command: density under 5% on every step's median, the loss falls, the summary says fsdp; a
    flag FSDP cannot take is refused in one line."""
    import json
    import statistics

    from test_robustness import TORCHRUN, env, free_port, ours

    def run(*args, nproc="2", runtime="fsdp"):
        import procs

        return procs.run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", nproc, "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", "-m", "gradsift",
                          "train", "--runtime", runtime, "--task", "digits-mlp", *args], env=env(), timeout=300)

    r = run("--compressor", "topk", "--ratio", "0.01", "--steps", "40", "--wire-plan", "off", "--out",
            str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 40 and statistics.median(x["density"] for x in recs) < 0.05
    assert recs[-1]["loss"] < recs[0]["loss"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["runtime"] == "fsdp" and summary["status"] == "completed"
    hsdp = run("--compressor", "topk", "--ratio", "0.01", "--steps", "40", "--wire-plan", "off", "--out",
               str(tmp_path / "hsdp"), "--replicas", "2", nproc="4", runtime="hsdp")
    assert hsdp.returncode == 0, hsdp.stderr[-2000:]
    recs = [json.loads(line) for line in (tmp_path / "hsdp" / "metrics.jsonl").read_text().splitlines()]
    assert statistics.median(x["density"] for x in recs) < 0.05 and recs[-1]["loss"] < recs[0]["loss"]
    assert json.loads((tmp_path / "hsdp" / "summary.json").read_text())["runtime"] == "hsdp"
    bad = run("--compressor", "regtopk", "--steps", "2", "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and any("regtopk" in line for line in ours(bad.stderr)), bad.stderr[-2000:]


def _hsdp(rank, world, outdir):
    """2 replicas x 2 shards: native HSDP (a 2-D mesh) against gradsift's HSDP (1-D shard mesh + the replicas'
    road) with dense, then topk with a NaN on rank 1 at step 3 (skipped on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradsift.fsdp as gf
    from gradsift.errors import ConfigError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def train(spec, native=False, **kw):
        if native:
            return _train(rank, None, mesh=mesh)
        return _train(rank, spec, mesh=mesh["shard"], replicate_group=mesh["replicate"].get_group(), **kw)

    native, _, _ = train(None, native=True)
    dense, dstate, _ = train("dense")
    topk, tstate, skipped = train("topk", ratio=0.05, nan_at=3, on_nonfinite="skip")
    scatter, sstate, _ = train("topk", ratio=0.05, sparse_collective="scatter", steps=5)
    regtopk, _, _ = train("regtopk", ratio=0.05, steps=5)  # reads the replicas' mean of its shard: allowed here
    try:
        m = _mlp()
        fully_shard(m, mesh=mesh)
        gf.register(m, "topk", ratio=0.05)
        refused = "accepted"
    except ConfigError as e:
        refused = str(e)
    torch.save({"native": native, "dense": dense, "topk": topk, "skipped": skipped,
                "topk_last": tstate.last, "dense_last": dstate.last, "refused": refused,
                "scatter_finite": bool(torch.isfinite(scatter).all()), "regtopk_finite": bool(torch.isfinite(regtopk).all())},
               Path(outdir) / f"rank{rank}.pt")


def test_hsdp_two_replicas_of_two_shards(tmp_path):
    """Dense through gradsift's HSDP equals native HSDP (within 1e-6 relative); topk sends about 5% of each shard
    across replicas; a NaN on one rank skips the step on all four; a native 2-D mesh is refused in one line."""
    spawn(_hsdp, 4, str(tmp_path))
    for rank in range(4):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        rel = float((r["native"] - r["dense"]).abs().max() / r["native"].abs().max())
        assert rel < 1e-6, rel
        assert r["skipped"] == [3]
        assert 0.04 < r["topk_last"]["density"] < 0.06 and r["dense_last"]["density"] == 1.0
        assert r["topk_last"]["wire_bytes_per_worker"] < 0.25 * r["dense_last"]["wire_bytes_per_worker"]
        assert "replicate" in r["refused"] and "\n" not in r["refused"]
        assert r["scatter_finite"] and r["regtopk_finite"]


def _cli_resume(rank, world, outdir):
    from gradsift.launch import train_ddp
    from gradsift.runtime.runconfig import RunConfig

    cfg = dict(BASE, compressor="topk", workers=world)
    full = train_ddp(RunConfig(**cfg), out=None)
    ck = Path(outdir) / "ck"
    train_ddp(RunConfig(**dict(cfg, steps=6)), out=None, checkpoint_every=6, checkpoint_dir=ck)
    resumed = train_ddp(RunConfig(**cfg), out=None, resume=str(ck))
    if rank == 0:
        torch.save({"full": full["params"], "resumed": resumed["params"], "files": sorted(p.name for p in ck.iterdir()),
                    "steps": [rec["step"] for rec in resumed["records"]]}, Path(outdir) / "out.pt")


def test_a_sharded_run_checkpointed_and_resumed_is_bit_identical(tmp_path):
    """``--checkpoint-every`` / ``--resume`` under FSDP: the model and optimizer shards by
    torch.distributed.checkpoint, gradsift's per-rank state in the verified file beside them."""
    spawn(_cli_resume, 2, str(tmp_path))
    r = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(a, b) for a, b in zip(r["full"], r["resumed"]))
    assert r["files"] == ["ckpt-00000006.dcp", "ckpt-00000006.pt", "latest"]
    assert r["steps"] == list(range(7, 13))  # it went on from step 6


def test_fsdp_example_trains_and_resumes(tmp_path):
    """``examples/fsdp_train.py`` (the script docs/fsdp.md quotes): FSDP2 on 2 gloo ranks saves after step 6 and a
    second run resumes there to the uninterrupted run's loss and totals; HSDP (2 replicas of 2 shards) trains."""
    import procs
    from test_robustness import TORCHRUN, env, free_port

    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp_train.py"

    def run(nproc, *args):
        r = procs.run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", str(example),
                       "--steps", "12", *args], env=env(), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return [l for l in r.stdout.splitlines() if l.startswith("gradsift:")]

    whole = run(2, "--out", str(tmp_path / "a"), "--save-at", "6")
    resumed = run(2, "--out", str(tmp_path / "a"), "--resume")
    assert len(whole) == 1 and whole == resumed and "12 steps" in whole[0], (whole, resumed)
    hsdp = run(4, "--out", str(tmp_path / "h"), "--replicas", "2")
    assert len(hsdp) == 1 and "12 steps" in hsdp[0]


def _gptlm(rank, world, outdir, data):
    from gradsift.launch import train_ddp
    from gradsift.runtime.runconfig import RunConfig

    res = train_ddp(RunConfig(**GPT, data=data, workers=world), out=None)
    if rank == 0:
        torch.save({"params": res["params"]}, Path(outdir) / "gptlm.pt")


GPT = dict(task="gptlm", compressor="topk:residual_dtype=fp8", ratio=0.01, steps=3, batch_size=4, eval_every=1000,
           fsdp=True, wire_plan="auto")


def test_a_transformer_with_a_tied_head_trains_under_fsdp_as_in_the_simulator(tmp_path, shared_dir):
    """gptlm's head is the token embedding's weight, read by the root's forward: the embedding joins the root's FSDP
    unit (``FSDP_IN_ROOT``; sharded on its own it was resharded before the head read it, and the forward failed).
    Three steps with the fp8 residual under ``--runtime fsdp`` equal the simulator's FSDP exchange bit for bit."""
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.sharding import fsdp_units
    from gradsift.runtime.simulate import Simulator

    data = shared_dir / "data" / "tinyshakespeare.txt"
    if not data.exists():
        pytest.skip(f"{data} is not beside the project")
    spawn(_gptlm, 2, str(tmp_path), str(data))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = Simulator(RunConfig(**GPT, data=str(data), workers=2))
        sim.run()
    finally:
        torch.set_num_threads(threads)
    assert "tokens" not in dict(fsdp_units(sim.model)) and "tokens.weight" in dict(fsdp_units(sim.model))[""]
    real = torch.load(tmp_path / "gptlm.pt")
    for a, b in zip(real["params"], sim.params):
        assert torch.equal(a, b.detach())
