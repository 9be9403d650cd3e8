"""Local SGD with gradsift's compressors: gradsift.local.register on real gloo ranks against the simulator's
``local:`` runs (the same bits), resume, the non-finite rules, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_helpers import spawn
from gradsift.errors import ConfigError
from gradsift.runtime.localsgd import LocalSGD, local_options, sync_config
from gradsift.runtime.runconfig import RunConfig

BASE = dict(task="digits-mlp", ratio=0.05, steps=12, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000,
            wire_plan="off")
# (name, spec, config changes): sparse and dense, every outer step, 2-bit values, a warm-up, the wire plan on, a
# whole-model key
JOBS = [("topk", "local:period=4,compressor=topk", {}),
        ("nesterov", "local:period=4,outer=nesterov,compressor=topk", {}),
        ("nesterov-int2", "local:period=4,outer=nesterov,compressor=topk", {"value_dtype": "int2"}),
        ("ef", "local:period=3,outer=ef,compressor=topk", {}),
        ("dense-warmup", "local:period=4,start=3,outer=nesterov", {}),
        ("sidco-plan", "local:period=4,compressor=sidco,ratio=0.1", {"wire_plan": "auto"}),
        ("randomk-model", "local:period=5,compressor=randomk", {"granularity": "model", "optimizer": "adamw",
                                                                "lr": 0.003})]

TRAIN_LOOP = ("train-loop", "local:period=5,outer=nesterov,compressor=topk", {"wire_plan": "auto"})


def _config(spec: str, world: int, **changes) -> RunConfig:
    return RunConfig(**{**BASE, **changes, "compressor": spec, "workers": world})


class _Rank:
    """What a user's script holds on one real rank: the task's model, its optimizer, gradsift's local SGD."""

    def __init__(self, cfg: RunConfig, spec: str, rank: int, world: int, ddp: bool = False):
        import gradsift.local
        from gradsift.runtime.runconfig import make_optimizer
        from gradsift.tasks import make_task

        o = local_options(spec)
        self.task = make_task(cfg.task, world, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data,
                              **cfg.task_options)
        self.cfg = cfg.resolved(type(self.task))
        self.rank = rank
        self.model = self.task.build_model()
        named = [(k, p) for k, p in self.model.named_parameters() if p.requires_grad]
        self.opt = make_optimizer(self.cfg, named, decays=getattr(self.task, "decays", None))
        s = sync_config(self.cfg, o).settings("local")
        if ddp:  # a DDP user's script: the wrapper's all-reduce replaced by local SGD's hook
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.state = gradsift.local.register(self.model, s.compressor, s.ratio, period=o["period"], optimizer=self.opt,
                                             outer=o["outer"], outer_lr=o["outer_lr"],
                                             outer_momentum=o["outer_momentum"], warmup_steps=o["start"],
                                             **s.keywords())

    def step(self, s: int) -> None:
        from gradsift.runtime.runconfig import set_lr

        self.opt.zero_grad(set_to_none=True)
        self.task.loss(self.model, self.task.batch(self.rank, s)).backward()
        set_lr(self.cfg, self.opt, s)
        self.opt.step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def save(self) -> dict:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "opt": self.opt.state_dict(), "gradsift": self.state.state_dict()}

    def load(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.state.load_state_dict(sd["gradsift"])


def _ranks_run(rank, world, outdir):
    import io
    import pickle

    out = {}
    for name, spec, changes in JOBS:
        cfg = _config(spec, world, **changes)
        r = _Rank(cfg, spec, rank, world)
        for s in range(cfg.steps):
            r.step(s)
        out[name] = r.params()
    for name, spec, changes in (JOBS[0], JOBS[4]):  # a DDP model: the same bits (the warm-up through its hook)
        cfg = _config(spec, world, **changes)
        r = _Rank(cfg, spec, rank, world, ddp=True)
        for s in range(cfg.steps):
            r.step(s)
        out[f"{name}-ddp"] = r.params()
    # resume: 6 steps (mid-period), saved through bytes, a fresh model, optimizer and state, 6 more
    for name, spec, changes in JOBS[:3]:
        cfg = _config(spec, world, **changes)
        a = _Rank(cfg, spec, rank, world)
        for s in range(6):
            a.step(s)
        buf = io.BytesIO()
        torch.save(a.save(), buf)
        b = _Rank(cfg, spec, rank, world)
        b.load(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        for s in range(6, cfg.steps):
            b.step(s)
        out[f"{name}-resumed"] = b.params()
    # the training loop of `gradsift train --runtime ddp` (torchrun) with a local spec: the same model
    from gradsift.launch import train_ddp

    # (checkpoints every 6 steps; a second run resumes from the one mid-period, step 6, and must end alike)
    ckpt = Path(outdir) / "ckpt"
    out["train-loop"] = train_ddp(_config(TRAIN_LOOP[1], world, **TRAIN_LOOP[2]), out=None, checkpoint_every=6,
                                  checkpoint_dir=ckpt)["params"]
    out["train-loop-resumed"] = train_ddp(_config(TRAIN_LOOP[1], world, **TRAIN_LOOP[2]), out=None,
                                          resume=str(ckpt / "ckpt-00000006.pt"))["params"]
    (Path(outdir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def test_real_ranks_match_the_simulator_bit_for_bit_and_resume_as_if_never_stopped(tmp_path):
    """Two gloo ranks with gradsift.local.register and the simulator's ``local:`` run of the same configuration end
    on the same parameters, bit for bit, for sparse and dense syncs, every outer step, a warm-up, the wire plan and a
    whole-model key, on the plain module and (sparse; dense with a warm-up) on a DDP model; a run saved mid-period
    and resumed in fresh objects ends where the uninterrupted one does."""
    import pickle

    world = 2
    spawn(_ranks_run, world, str(tmp_path))
    got = {r: pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sims = {}
        for name, spec, changes in JOBS:
            sims[name] = LocalSGD(_config(spec, world, **changes), spec)
            sims[name].run()
    finally:
        torch.set_num_threads(threads)
    failures = []
    for name, _, _ in JOBS:
        for r in range(world):
            want = [p.detach() for p in sims[name].ranks[r].params]
            if not all(torch.equal(a, b) for a, b in zip(want, got[r][name])):
                failures.append((name, r, max(float((a - b).abs().max()) for a, b in zip(want, got[r][name]))))
    assert not failures, failures
    for name, _, _ in JOBS[:3]:
        for r in range(world):
            assert all(torch.equal(a, b) for a, b in zip(got[r][name], got[r][f"{name}-resumed"])), (name, r)
    for name in (JOBS[0][0], JOBS[4][0]):
        for r in range(world):
            assert all(torch.equal(a, b) for a, b in zip(got[r][name], got[r][f"{name}-ddp"])), (name, r)
    torch.set_num_threads(1)
    try:
        loop = LocalSGD(_config(TRAIN_LOOP[1], world, **TRAIN_LOOP[2]), TRAIN_LOOP[1])
        loop.run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a.detach(), b) for a, b in zip(loop.ranks[0].params, got[0]["train-loop"]))
    for r in range(world):  # (every rank: the checkpoint's model and optimizer are rank 0's, the state each rank's)
        assert all(torch.equal(a, b) for a, b in zip(got[r]["train-loop"], got[r]["train-loop-resumed"])), r
    # the runs really differ: a sparse sync is not a dense average, and the outer steps are not one another
    assert not all(torch.equal(a, b) for a, b in zip(got[0]["topk"], got[0]["nesterov"]))
    sim = sims["topk"]
    assert sim.ranks[0].syncs == 3 and sim.ranks[0].last["density"] == pytest.approx(0.05, abs=0.002)


def _nonfinite_run(rank, world, outdir):
    """A NaN gradient on rank 1 at step 2 (its own step skipped); a parameter made Inf on rank 1 before the second
    sync (that sync skipped everywhere, every rank back at the global model)."""
    import pickle

    cfg = _config("local:period=4,compressor=topk", world, on_nonfinite="skip")
    r = _Rank(cfg, "local:period=4,compressor=topk", rank, world)
    log = {}
    for s in range(8):
        r.opt.zero_grad(set_to_none=True)
        r.task.loss(r.model, r.task.batch(rank, s)).backward()
        if rank == 1 and s == 1:
            next(r.model.parameters()).grad[0, 0] = float("nan")
            log["before_nan_step"] = r.params()
        if s == 7:
            log["globals"] = [g.clone() for g in r.state.globals]
            log["residual"] = {k: v.clone() for k, v in r.state.compressor.stores()["residual"].items()}
            if rank == 1:
                with torch.no_grad():
                    next(r.model.parameters())[0, 0] = float("inf")
        r.opt.step()
        if rank == 1 and s == 1:
            log["after_nan_step"] = r.params()
    log["end"] = r.params()
    log["residual_end"] = {k: v.clone() for k, v in r.state.compressor.stores()["residual"].items()}
    log["counts"] = (r.state.syncs, r.state.skipped_syncs, r.state.skipped_inner)
    (Path(outdir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(log))


def test_a_nonfinite_gradient_skips_its_ranks_step_and_a_nonfinite_change_skips_the_sync(tmp_path, capfd):
    import pickle

    spawn(_nonfinite_run, 2, str(tmp_path))
    err = capfd.readouterr().err
    logs = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    one = logs[1]
    assert all(torch.equal(a, b) for a, b in zip(one["before_nan_step"], one["after_nan_step"]))
    assert "rank 1: a gradient was not finite at step 2: its optimizer step was skipped on this rank" in err
    assert "sync 2 (step 8) skipped on every rank: a change of the model was not finite" in err
    for log in logs:
        assert all(torch.equal(a, b) for a, b in zip(log["end"], log["globals"]))  # back at the global model
        assert all(torch.isfinite(p).all() for p in log["end"])
        assert log["residual"].keys() == log["residual_end"].keys()
        assert all(torch.equal(log["residual"][k], log["residual_end"][k]) for k in log["residual"])
    assert logs[0]["counts"] == (2, 1, 0) and logs[1]["counts"] == (2, 1, 1)


def _hooked_ddp():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp


def _bad_input_run(rank, world, outdir):
    import gradsift.local

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    said = []
    cases = [
        lambda: gradsift.local.register(model, "topk", 0.1, period=0, optimizer=opt),
        lambda: gradsift.local.register(_hooked_ddp(), "topk", 0.1, optimizer=opt),
        lambda: gradsift.local.register(model, "topk", 0.1),
        lambda: gradsift.local.register(model, "topk", 0.1, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(),
                                                                                       lr=0.1)),
        lambda: gradsift.local.register(model, "topk", 0.1, optimizer=opt, outer="adam"),
        lambda: gradsift.local.register(model, "dense", optimizer=opt, outer="ef"),
        lambda: gradsift.local.register(model, "topk", 0.1, optimizer=opt, memory="momentum"),
        lambda: gradsift.local.register(model, "powersgd", optimizer=opt),
        lambda: gradsift.local.register(model, "topk", 0.1, optimizer=opt, outer="average", outer_lr=0.5),
    ]
    for case in cases:
        try:
            case()
            said.append(None)
        except ConfigError as e:
            said.append(str(e))
    try:  # another period on one rank: refused on both, naming the difference, before any step
        other = torch.nn.Linear(4, 2)
        gradsift.local.register(other, "topk", 0.1, period=8 + rank, optimizer=torch.optim.SGD(other.parameters(),
                                                                                               lr=0.1))
        said.append(None)
    except Exception as e:  # noqa: BLE001 (ConfigMismatch)
        said.append(f"{type(e).__name__}: {e}")
    gradsift.local.register(model, "topk", 0.1, optimizer=opt)
    try:
        gradsift.local.register(model, "topk", 0.1, optimizer=opt)
        said.append(None)
    except ConfigError as e:
        said.append(str(e))
    if rank == 0:
        Path(outdir, "said.txt").write_text("\n".join(repr(s) for s in said))


def test_bad_input_is_one_line_naming_what_is_allowed(tmp_path):
    for spec in ("local:period=0", "local:outer=adam", "local:start=-1", "local:outer_momentum=2,outer=nesterov",
                 "local:ratio=0", "local:compressor=topk,ratio=2"):
        with pytest.raises(ConfigError) as e:
            local_options(spec)
        assert "\n" not in str(e.value) and str(e.value).startswith("local: "), e.value
    with pytest.raises(ConfigError, match="needs a process group"):
        import gradsift.local

        gradsift.local.register(torch.nn.Linear(2, 2), "topk", 0.1, optimizer=torch.optim.SGD(
            torch.nn.Linear(2, 2).parameters(), lr=0.1))
    spawn(_bad_input_run, 2, str(tmp_path))
    said = [eval(line) for line in (tmp_path / "said.txt").read_text().splitlines()]
    expected = ["period must be an integer >= 1", "already has a communication hook", "needs optimizer=",
                "the optimizer does not step 2 of the model's parameters", "outer must be one of average, nesterov, ef",
                "outer='ef' decays an error-feedback memory", "memory=momentum does not apply",
                "where a sync of local SGD is one exchange", "for another outer_lr or a momentum use outer='nesterov'",
                "ConfigMismatch", "already has gradsift's local SGD"]
    assert len(said) == len(expected)
    for got, want in zip(said, expected):
        assert got is not None and want in got and "\n" not in got, (want, got)


def test_a_rank_killed_mid_period_under_torchrun_resumes_to_the_same_bits(tmp_path):
    """torchrun --max-restarts 1 --resume auto, sparse local SGD with Nesterov's outer step and 2-bit values, a
    checkpoint every 6 steps (mid-period: the period is 4): a rank SIGKILLed after the first checkpoint, the job
    restarts from it -- every rank its own parameters, optimizer, residual and outer momentum -- and ends on the
    weights of the run no one killed."""
    import json

    import procs
    from test_launch import TORCHRUN, env, free_port

    def job(out, kill):
        cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{free_port()}", "--max-restarts", "1", "-m", "gradsift", "train", "--runtime", "ddp",
               "--task", "digits-mlp", "--compressor", "local:period=4,outer=nesterov,compressor=topk",
               "--value-dtype", "int2", "--ratio", "0.05", "--optimizer", "momentum", "--lr", "0.05",
               "--batch-size", "16", "--steps", "24", "--eval-every", "1000", "--checkpoint-every", "6",
               "--resume", "auto", "--timeout", "60", "--quiet", "--out", str(out)]
        return procs.restarted_job(cmd, out, {k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"},
                                   "1" if kill else None)

    straight, _ = job(tmp_path / "straight", kill=False)
    restarted, err = job(tmp_path / "killed", kill=True)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["totals"]["steps"] == 24
    assert "rank 1" in err and "went away" in err, err[-2000:]  # (the kill was felt, and the job restarted)
    assert all(torch.equal(straight[k], restarted[k]) for k in straight), "restarted weights differ"


def _fsdp_run(rank, world, outdir):
    """2 replicas x 2 shards (ranks 0-1 replica 0, 2-3 replica 1): local SGD across replicas on an FSDP2 module
    sharded inside each, against a plain module on every rank whose gradient is its replica's mean (what FSDP's
    reduce-scatter gives a shard); resume mid-period; a NaN on one rank of a replica; the refusals."""
    import io
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradsift.local

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas, shard = mesh["replicate"].get_group(), mesh["shard"].get_group()

    def model(sharded, fsdp_mesh=None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        if sharded:
            for layer in (m[0], m[2]):
                fully_shard(layer, mesh=fsdp_mesh or mesh["shard"])
            fully_shard(m, mesh=fsdp_mesh or mesh["shard"])
        return m

    class Run:
        def __init__(self, sharded, spec="topk", ratio=0.1, **kw):
            self.sharded = sharded
            self.m = model(sharded)
            self.opt = torch.optim.AdamW(self.m.parameters(), lr=0.01)
            where = {"replicate_group": replicas} if sharded else {"process_group": replicas}
            self.state = gradsift.local.register(self.m, spec, ratio, period=4, optimizer=self.opt, outer="nesterov",
                                                 wire_plan="off", **where, **kw)

        def step(self, s, nan=False):
            gen = torch.Generator().manual_seed(1000 * s + rank)
            x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 1, generator=gen)
            if nan:
                x[0, 0] = float("nan")
            torch.nn.functional.mse_loss(self.m(x), y).backward()
            if not self.sharded:  # the replica's mean gradient, as FSDP's reduce-scatter leaves each shard
                for p in self.m.parameters():
                    dist.all_reduce(p.grad, group=shard)
                    p.grad.div_(2)
            self.opt.step()
            self.opt.zero_grad()

        def full(self):
            return [(p.full_tensor() if self.sharded else p).detach().clone() for p in self.m.parameters()]

    out = {}
    for spec, ratio in (("dense", None), ("topk", 0.1)):
        for sharded in (True, False):
            r = Run(sharded, spec, ratio)
            for s in range(12):
                r.step(s)
            out[(spec, sharded)] = r.full()
        out[(spec, "density")] = r.state.last["density"]
    a = Run(True, value_dtype="int2")  # saved mid-period through bytes, resumed in fresh objects
    for s in range(6):
        a.step(s)
    buf = io.BytesIO()
    torch.save(a.state.state_dict(), buf)
    b = Run(True, value_dtype="int2")
    b.state.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for s in range(6, 12):
        b.step(s)
    for s in range(6, 12):
        a.step(s)
    out["straight"], out["resumed"] = a.full(), b.full()
    n = Run(True)
    for s in range(8):
        n.step(s, nan=(rank == 1 and s == 2))
    out["nan"] = (n.state.skipped_inner, n.state.syncs, n.full())
    said = []

    def register(m, **kw):
        return gradsift.local.register(m, "topk", 0.1, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), **kw)

    for case in (lambda: register(model(True)), lambda: register(model(True, mesh), replicate_group=replicas),
                 lambda: register(model(False), replicate_group=replicas),
                 lambda: register(model(True), replicate_group=shard)):
        try:
            case()
            said.append(None)
        except ConfigError as e:
            said.append(str(e))
    out["said"] = said
    (Path(outdir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def test_fsdp_replicas_take_local_steps_and_sync_their_shards(tmp_path):
    """Local SGD across the replicas of an FSDP2 module (``replicate_group=``): with dense syncs the same bits as
    a plain module whose gradient is its replica's mean; with top-k every rank of every replica holds the same model
    after a sync, about the ratio of each shard's change sent; resumed mid-period in fresh objects, the same bits; a
    NaN on one rank of a replica skips that replica's step on both of its ranks; bad set-ups refused in one line."""
    import pickle

    spawn(_fsdp_run, 4, str(tmp_path))
    got = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    for r in range(4):
        g = got[r]
        assert all(torch.equal(a, b) for a, b in zip(g[("dense", True)], g[("dense", False)])), r
        assert all(torch.equal(a, b) for a, b in zip(g[("topk", True)], got[0][("topk", True)])), r
        assert not all(torch.equal(a, b) for a, b in zip(g[("topk", True)], g[("dense", True)]))
        assert g[("topk", "density")] == pytest.approx(0.1, abs=0.02) and g[("dense", "density")] == 1.0
        assert all(torch.equal(a, b) for a, b in zip(g["straight"], g["resumed"])), r
        skipped, syncs, params = g["nan"]
        assert (skipped, syncs) == ((1, 2) if r in (0, 1) else (0, 2)), (r, skipped, syncs)
        assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(params, got[0]["nan"][2]))
        want = ["pass replicate_group=", "2-D mesh (HSDP)", "replicate_group= is for an FSDP module",
                "replicate_group must hold one rank of each replica"]
        for said, w in zip(g["said"], want):
            assert said is not None and w in said and "\n" not in said, (w, said)
