"""One rank, one object: DDP, FSDP, HSDP and the simulator share what a rank is -- its settings and defaults, the
cross-rank check, its checkpointed state -- and FSDP/HSDP resume, verify and refuse as DDP does."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from ddp_helpers import spawn

pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")

RUN = dict(task="digits-mlp", ratio=0.05, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000, fsdp=True,
           replicas=2)


# ---------------------------------------------------------------- one set of defaults
def test_ddp_and_fsdp_take_the_same_settings_with_the_same_defaults():
    """Neither ``register`` defines a setting of its own: both take :class:`Settings` by keyword, so both get the
    one set of defaults (the link model, the wire plan, the sparse collective included)."""
    import gradsift.ddp as gd
    import gradsift.fsdp as gf
    from gradsift.runtime.settings import Settings

    names = Settings.names()
    for register in (gd.register, gf.register):
        params = inspect.signature(register).parameters
        assert not names & set(params), (register.__module__, names & set(params))
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    ddp, fsdp, hsdp = (Settings.of("topk", 0.01, {}, rt) for rt in ("ddp", "fsdp", "hsdp"))
    assert ddp.describe() == fsdp.describe() == hsdp.describe()
    assert (ddp.bandwidth_gbps, ddp.latency_us, ddp.wire_plan, ddp.sparse_collective) == (1.0, 50.0, "auto", "auto")


def _registered(rank, world, outdir):
    """Both runtimes' states built with no settings given, and what a second register, settings that differ across
    ranks and another rank's state do under FSDP and HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradsift.fsdp as gf
    from gradsift.runtime.consensus import ConfigMismatch
    from gradsift.errors import ConfigError

    def sharded(mesh=None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    def said(make):
        try:
            make()
            return "accepted"
        except (ConfigError, ConfigMismatch, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    out = {}
    model = sharded()
    state = gf.register(model, "topk", ratio=0.1)
    out["fsdp_settings"] = state.settings.describe()
    out["twice"] = said(lambda: gf.register(model, "topk", ratio=0.1))
    out["spec"] = said(lambda: gf.register(sharded(), "topk" if rank == 0 else "randomk", ratio=0.1))
    out["ratio"] = said(lambda: gf.register(sharded(), "topk", ratio=0.1 if rank < 3 else 0.2))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()
    out["hsdp_ratio"] = said(lambda: gf.register(sharded(mesh["shard"]), "topk", ratio=0.1 if rank != 2 else 0.3,
                                                 replicate_group=replicate))
    hsdp = gf.register(sharded(mesh["shard"]), "topk", ratio=0.5, replicate_group=replicate)
    sd = hsdp.state_dict()
    every: list = [None] * world
    torch.distributed.all_gather_object(every, sd)
    other = every[(rank + 1) % world]  # rank 1 holds shard 1 of replica 0: the same compressor rank as rank 0's
    out["other_rank"] = said(lambda: hsdp.load_state_dict(other))
    out["own_rank"] = said(lambda: hsdp.load_state_dict(every[rank]))
    out["group_rank"], out["saved_rank"] = hsdp.rank, sd["rank"]
    fresh = Path(outdir) / "new" / "folder" / "metrics.jsonl"  # a folder that does not exist yet: made
    gf.register(sharded(), "topk", ratio=0.1, metrics_path=fresh)
    torch.distributed.barrier()
    out["made"] = fresh.exists()
    blocker = Path(outdir) / "a-file"
    if rank == 0:
        blocker.write_text("")
    torch.distributed.barrier()
    out["unwritable"] = said(lambda: gf.register(sharded(), "topk", ratio=0.1, metrics_path=blocker / "m.jsonl"))
    torch.save(out, Path(outdir) / f"rank{rank}.pt")


def test_fsdp_and_hsdp_refuse_what_ddp_refuses_in_one_line_on_every_rank(tmp_path):
    """Registering twice; a method or a ratio that differs on one rank (FSDP and HSDP: every rank raises
    ConfigMismatch naming it, none hangs); another rank's state (an HSDP shard of the same replica shares its
    compressor rank: the global rank decides); a metrics file in a folder not made yet (made), or where rank 0
    cannot write (one line on every rank)."""
    from gradsift.runtime.settings import Settings

    spawn(_registered, 4, str(tmp_path))
    for rank in range(4):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["fsdp_settings"] == Settings.of("topk", 0.1, {}, "ddp").describe()
        assert "registered already" in r["twice"]
        assert r["spec"].startswith("ConfigMismatch") and "randomk" in r["spec"], r["spec"]
        assert r["ratio"].startswith("ConfigMismatch") and "rank 3" in r["ratio"], r["ratio"]
        assert r["hsdp_ratio"].startswith("ConfigMismatch") and "rank 2" in r["hsdp_ratio"], r["hsdp_ratio"]
        assert r["other_rank"].startswith("ValueError") and f"this is rank {rank}" in r["other_rank"], r["other_rank"]
        assert r["own_rank"] == "accepted"
        assert r["saved_rank"] == rank and r["group_rank"] == rank // 2
        assert r["made"] and "cannot be written" in r["unwritable"], r["unwritable"]  # one line on every rank
        assert all("\n" not in v for v in r.values() if isinstance(v, str))


# ---------------------------------------------------------------- HSDP checkpoints
def _hsdp_resume(rank, world, outdir):
    """Per route: 16 steps straight; 8 steps with a checkpoint, resumed for 8 more. Then corrupt shards: a flipped
    byte and a truncated file, each resumed from."""
    import shutil

    from gradsift.launch import train_ddp
    from gradsift.launch.checkpoint import CheckpointError
    from gradsift.runtime.runconfig import RunConfig

    out = {}
    for route in ("gather", "scatter"):
        # (owners keeping k, not the default 4k: at 2 replicas the owners then hold something back to checkpoint)
        cfg = dict(RUN, compressor="topk", steps=16, sparse_collective=route, workers=world, scatter_keep=1.0)
        full = train_ddp(RunConfig(**cfg), out=None)
        ck = Path(outdir) / route
        train_ddp(RunConfig(**dict(cfg, steps=8)), out=None, checkpoint_every=8, checkpoint_dir=ck)
        resumed = train_ddp(RunConfig(**cfg), out=None, resume=str(ck))
        owners = resumed["state"].road.owners.residual
        out[route] = (full["params"], resumed["params"], sum(float(t.abs().sum()) for t in owners.values()))
    base = Path(outdir) / "gather"
    shard = sorted((base / "ckpt-00000008.dcp").glob("*.distcp"))[-1]
    for damage in ("flipped", "truncated"):
        bad = Path(outdir) / damage
        if rank == 0:
            shutil.copytree(base, bad)
            f = bad / "ckpt-00000008.dcp" / shard.name
            raw = bytearray(f.read_bytes())
            if damage == "flipped":
                raw[len(raw) // 2] ^= 0x01
            else:
                raw = raw[: len(raw) // 2]
            f.write_bytes(bytes(raw))
        torch.distributed.barrier()
        try:
            train_ddp(RunConfig(**dict(RUN, compressor="topk", steps=16, sparse_collective="gather", workers=world,
                                        scatter_keep=1.0)), out=None, resume=str(bad))
            out[damage] = "resumed"
        except CheckpointError as e:
            out[damage] = str(e)
    torch.save(out, Path(outdir) / f"rank{rank}.pt")


def test_hsdp_resumes_bit_identical_over_both_routes_and_refuses_damaged_shards(tmp_path):
    """HSDP 2 replicas x 2 shards, ``--checkpoint-every`` then ``--resume``: bit-identical to the uninterrupted run
    over the all-gather and the owners' scatter (whose owners' residuals the checkpoint carries: without them the
    resumed weights were off by 0.0136). A flipped byte or a truncated shard file: one line on every rank."""
    spawn(_hsdp_resume, 4, str(tmp_path))
    for rank in range(4):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        for route in ("gather", "scatter"):
            full, resumed, _ = r[route]
            assert all(torch.equal(a, b) for a, b in zip(full, resumed)), route
        assert any(torch.load(tmp_path / f"rank{q}.pt")["scatter"][2] > 0 for q in range(4))  # owners held some
        assert "corrupted" in r["flipped"] and "truncated" in r["truncated"], (r["flipped"], r["truncated"])
        assert all("\n" not in r[d] and ".distcp" in r[d] for d in ("flipped", "truncated"))


def test_hsdp_killed_and_restarted_by_torchrun_is_bit_identical(tmp_path):
    """torchrun --max-restarts 1 --resume auto, HSDP 2x2 over the owners' scatter: a rank SIGKILLed after a
    checkpoint, the job restarts from it and ends with the weights of the run no one killed."""
    import procs
    from test_robustness import TORCHRUN, env, free_port

    def job(out, kill):
        cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{free_port()}", "--max-restarts", "1", "-m", "gradsift", "train", "--runtime", "hsdp",
               "--replicas", "2", "--task", "digits-mlp", "--compressor", "topk", "--ratio", "0.05",
               "--sparse-collective", "scatter", "--optimizer", "momentum", "--lr", "0.05", "--batch-size", "16",
               "--steps", "60", "--eval-every", "1000", "--checkpoint-every", "10", "--resume", "auto",
               "--timeout", "60", "--quiet", "--out", str(out)]
        return procs.restarted_job(cmd, out, {k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"},
                                   "3" if kill else None)

    straight, _ = job(tmp_path / "straight", kill=False)
    restarted, err = job(tmp_path / "killed", kill=True)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["totals"]["steps"] == 60
    assert all(torch.equal(straight[k], restarted[k]) for k in straight), "restarted weights differ"
