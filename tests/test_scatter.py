"""The scatter route (a sparse reduce-scatter): partitions, per-owner capacity, the owners' residual, nothing lost,
what the wire carries at any N, the plan's choice, and the same bits in DDP as in the simulator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddp_helpers import spawn
from gradsift import make_compressor
from gradsift.route.netmodel import NetworkModel
from gradsift.payload import Partition, fit_capacity, sparse
from gradsift.route.plan import WirePlan
from gradsift.route.routing import Routing
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from gradsift.transport.wire import owner_segment_bytes, partition_for, scatter_block_bytes

BASE = dict(task="digits-cnn", ratio=0.05, steps=20, batch_size=16, lr=0.05, optimizer="momentum", eval_every=1000)


def test_the_partition_is_a_bijection_that_spreads_contiguous_and_periodic_hot_spots():
    d, n = 12000 * 200 + 7, 8
    part = partition_for("embed.weight", d, n, seed=3)
    assert part == partition_for("embed.weight", d, n, seed=3) != partition_for("embed.weight", d, n, seed=4)
    idx = torch.arange(d)
    owner, pos = part.place(idx)
    assert int(owner.max()) == n - 1 and int(pos.max()) < part.region
    assert torch.equal(torch.cat([part.index(j, pos[owner == j]) for j in range(n)]).sort().values, idx)
    assert torch.equal(torch.cat([part.owned(j)[1] for j in range(n)]).sort().values, idx)  # the padding left out
    for hot in (torch.arange(5000, 5000 + 4000),  # a run of hot rows (an embedding's frequent words)
                torch.arange(3, d, 200)[:4000]):  # a hot column of a [rows, 200] matrix (period 200)
        counts = torch.bincount(part.place(hot)[0], minlength=n).float()
        assert counts.max() / counts.mean() < 1.15, counts  # even within a few percent: no owner overloaded


def test_a_sender_keeps_at_most_its_slots_per_owner_and_the_rest_stays_in_memory():
    part = Partition("w", 1000, 4, 1, 0, 1)  # identity permutation: owner j holds [250 j, 250 (j+1))
    vals = torch.arange(1.0, 41.0)
    idx = torch.cat([torch.arange(0, 30), torch.arange(250, 260)])  # 30 entries for owner 0, 10 for owner 1
    p = sparse(vals, idx, 1000, torch.float32, 40)
    p.capacity, p.owners = 40, part
    slots = part.dest_slots(40)
    assert slots == 15  # ceil(1.25 * 40 / 4) + 2
    dropped = fit_capacity(p)
    assert p.count == 15 + 10 and dropped.count == 15 and p.overflow == 15
    assert set(p.indices.tolist()) == set(range(15, 30)) | set(range(250, 260))  # owner 0's 15 largest stay
    # with error feedback, what did not fit is still in memory: nothing lost
    comp = make_compressor("topk", 0.04, world_size=4)
    g = torch.zeros(1000)
    g[:30] = torch.arange(30.0) + 1
    g[250:260] = 1
    sent = comp.compress("w", g, owners=part)
    assert sent.count == 25 and sent.overflow == 15  # k = 40 selected, owner 0's 15 smallest held back
    assert set(sent.indices.tolist()) == set(range(15, 30)) | set(range(250, 260))
    torch.testing.assert_close(sent.to_dense() + comp.residual["w"], g)


def test_nothing_is_lost_with_the_owners_residuals_counted():
    """Error-feedback invariant, 50 steps, 4 workers: everything applied (the means times N) plus every sender's
    residual plus every owner's residual equals the sum of every worker's gradient."""
    sim = Simulator(RunConfig(**dict(BASE, compressor="topk", ratio=0.02, workers=4, steps=50, sparse_collective="scatter",
                                     optimizer="sgd")))
    keys = sim.layout.keys
    applied = {k: torch.zeros(p.numel(), dtype=torch.float64) for k, p in zip(keys, sim.params)}
    given = {k: torch.zeros(p.numel(), dtype=torch.float64) for k, p in zip(keys, sim.params)}
    scattered = set()
    for _ in range(50):
        rec = sim.step()
        assert rec is not None
        for i, k in enumerate(keys):
            applied[k] += sim.last_means[i].double().reshape(-1) * sim.n
            given[k] += sum(g[i].double().reshape(-1) for g in sim.last_grads)
            if sim.last_payloads[0][i].owners is not None:
                scattered.add(k)
    assert scattered == {k for k, p in zip(keys, sim.params) if p.numel() > 1}  # (1-element tensors: k of 1)
    for i, (k, p) in enumerate(zip(keys, sim.params)):
        held = sum(c.residual[k].double() for c in sim.compressors if k in c.residual)
        owned = torch.zeros(p.numel(), dtype=torch.float64)
        part = partition_for(k, p.numel(), 4, 0)
        for j, road in enumerate(sim.roads):
            r = road.owners.residual.get(k)
            if r is not None:
                owned[part.index(j, torch.arange(r.numel()))[:part.numel]] += r.double()
        torch.testing.assert_close(applied[k] + held + owned, given[k], rtol=0, atol=1e-4)
    assert rec["owner_deferred"] > 0 and rec["owner_residual_norm"] > 0


def test_what_a_worker_receives_does_not_grow_with_the_number_of_workers():
    """Entries a worker receives per step for one 2.4M-entry tensor at 1%: the all-gather route (N-1)k, the scatter
    route at most about 2.25k + 2N at any N (all-to-all slots from N-1 senders, then N-1 owners' selections)."""
    d, k = 2_400_000, 24_000
    for n in (2, 4, 8, 16, 64):
        part = partition_for("w", d, n, 0)
        entries = (n - 1) * (part.dest_slots(k) + part.own_slots(k))
        assert entries <= 2.25 * k + 2 * n + n, (n, entries / k)
        p = sparse(torch.zeros(k), torch.arange(k), d, torch.float32, k)
        p.capacity, p.owners = k, part
        wire = (n - 1) * (scatter_block_bytes(p) + owner_segment_bytes(p))
        assert wire <= 8 * (2.25 * k + 3 * n) + 32 * n  # 4-byte positions and values, headers and padding


def test_the_owners_keep_factor_trades_bytes_for_a_denser_mean():
    d, k, n = 2_400_000, 24_000, 16
    one, four = partition_for("w", d, n, 0), partition_for("w", d, n, 0, keep=4.0)
    assert n * one.own_slots(k) == k and n * four.own_slots(k) == 4 * k
    recs = {}
    for keep in (1.0, 4.0):
        sim = Simulator(RunConfig(**dict(BASE, compressor="topk", ratio=0.02, workers=4, steps=3,
                                         sparse_collective="scatter", scatter_keep=keep)))
        recs[keep] = sim.run()[-1]
    assert recs[4.0]["wire_bytes_per_worker"] > recs[1.0]["wire_bytes_per_worker"]
    assert recs[4.0]["owner_deferred"] < recs[1.0]["owner_deferred"]  # more of each sum goes out at once
    from gradsift.errors import ConfigError

    with pytest.raises(ConfigError, match=r"scatter_keep must be a number in \[1, "):
        Simulator(RunConfig(**dict(BASE, compressor="topk", workers=4, steps=1, scatter_keep=0.5)))


def test_the_plan_scatters_only_when_asked_and_never_for_methods_that_read_the_mean():
    topk, regtopk = make_compressor("topk", 0.01), make_compressor("regtopk", 0.01)
    net = NetworkModel(bandwidth_gbps=0.1, latency_us=50.0)
    def plan(n, **kw):
        return Routing(WirePlan(net, n, **kw), [])

    # the owners' re-selection costs quality the prices do not see (gptlm at 8 workers, docs/results.md section 15):
    # on its own the plan keeps the all-gather at any N and keep, even where the scatter route is cheaper
    for n, keep in ((2, None), (4, None), (8, None), (16, None), (4, 1.0), (8, 1.0), (16, 1.0)):
        kw = {"scatter_keep": keep} if keep else {}
        assert plan(n, **kw).planned(topk, "w", (2000, 1200)).route == "gather", (n, keep)
        asked = plan(n, sparse_collective="scatter", **kw).planned(topk, "w", (2000, 1200))
        assert asked.route == "scatter" and asked.by_plan, (n, keep, asked)
        assert "--sparse-collective scatter" in asked.reason and "all-gather" in asked.reason
    assert plan(8, sparse_collective="scatter").planned(regtopk, "w", (2000, 1200)).route != "scatter"
    assert plan(8, sparse_collective="gather").planned(topk, "w", (2000, 1200)).route == "gather"
    off = plan(8, enabled=False, sparse_collective="scatter")
    assert off.planned(topk, "w", (2000, 1200)).route == "scatter" and off.planned(regtopk, "w", (9, 9)).route == "gather"
    from gradsift.errors import ConfigError

    with pytest.raises(ConfigError, match="regtopk reads the round's mean"):  # asked for explicitly: one line
        Simulator(RunConfig(task="linreg", compressor="regtopk", ratio=0.1, workers=4, steps=2,
                            sparse_collective="scatter"))


# ---------------------------------------------------------------- DDP: the same bytes and the same bits
def _jobs(world):
    order = {"sum_order": "rank"} if world > 2 else {}  # (the tensors sent whole: the simulator's sum order)
    return [(f"{spec}-{gran}", dict(BASE, compressor=spec, workers=world, granularity=gran, wire_plan="auto",
                                    sparse_collective="scatter", **order), cap)
            for spec in ("topk", "dgc") for gran, cap in (("layer", 0.005), ("model", None))]


def _run_jobs(rank, world, jobs, outdir):
    from gradsift.launch import train_ddp

    for name, cfg, cap in jobs:
        res = train_ddp(RunConfig(**cfg), out=None, bucket_cap_mb=cap)
        if rank == 0:
            torch.save({"params": res["params"], "wire": [r["wire_bytes_per_worker"] for r in res["records"]],
                        "bytes": [r["bytes_per_worker"] for r in res["records"]]}, Path(outdir) / f"{name}.pt")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_scatter_matches_the_simulator_bit_for_bit(world, tmp_path):
    jobs = _jobs(world)
    spawn(_run_jobs, world, jobs, str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one thread: the gradients' own bits agree
    try:
        for name, cfg, _ in jobs:
            sim = Simulator(RunConfig(**cfg))
            recs = sim.run()
            got = torch.load(tmp_path / f"{name}.pt")
            assert got["wire"] == [r["wire_bytes_per_worker"] for r in recs], name
            assert got["bytes"] == [r["bytes_per_worker"] for r in recs], name
            assert all(torch.equal(a.detach(), b) for a, b in zip(sim.params, got["params"])), name
            assert any(p.owners is not None for p in sim.last_payloads[0]), name  # the route really ran
    finally:
        torch.set_num_threads(threads)


def _skip_and_resume(rank, world, outdir):
    from gradsift.launch import train_ddp

    out = Path(outdir)
    base = dict(BASE, compressor="topk", workers=world, sparse_collective="scatter", sum_order="rank",
                wire_plan="auto")
    try:
        train_ddp(RunConfig(**dict(base, steps=5, fault_nan_step=4)), out=None, bucket_cap_mb=0.005)
        error = "no error"
    except Exception as e:  # noqa: BLE001 - the error mode: every rank raises
        error = f"{type(e).__name__}: {e}"
    res = train_ddp(RunConfig(**dict(base, steps=8, fault_nan_step=4, on_nonfinite="skip")), out=None,
                    bucket_cap_mb=0.005)
    full = train_ddp(RunConfig(**base), out=None, bucket_cap_mb=0.005)
    ck = out / "ck"
    train_ddp(RunConfig(**dict(base, steps=10)), out=None, bucket_cap_mb=0.005, checkpoint_every=10,
              checkpoint_dir=ck)
    resumed = train_ddp(RunConfig(**base), out=None, bucket_cap_mb=0.005, resume=str(ck))
    owned = [resumed["state"].road.owners.state_dict(), full["state"].road.owners.state_dict()]
    torch.save({"error": error, "skip": res["params"], "skipped": res["state"].totals["skipped_steps"], "full": full["params"],
                "resumed": resumed["params"], "owned": owned}, out / f"rank{rank}.pt")


def test_ddp_scatter_skips_a_non_finite_step_on_every_rank_and_resumes_exactly(tmp_path):
    """A NaN on one rank: every rank skips the step and the owners' residuals roll back with it (the run equals the
    simulator's, bit for bit); a run resumed from a checkpoint equals an uninterrupted one, owners' residuals
    included (they travel in the checkpoint)."""
    spawn(_skip_and_resume, 3, str(tmp_path))
    cfg = dict(BASE, compressor="topk", workers=3, sparse_collective="scatter", sum_order="rank", wire_plan="auto",
               steps=8, fault_nan_step=4, on_nonfinite="skip")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = Simulator(RunConfig(**cfg))
        sim.run()
    finally:
        torch.set_num_threads(threads)
    assert sim.skipped == 1
    for r in range(3):
        got = torch.load(tmp_path / f"rank{r}.pt")
        who = "rank 2" if r == 2 else "(rank 2|another rank)"
        assert re.match(rf"NonFiniteGradient: non-finite gradient on {who} at step 4", got["error"]), got["error"]
        assert got["skipped"] == 1
        assert all(torch.equal(a.detach(), b) for a, b in zip(sim.params, got["skip"]))
        assert all(torch.equal(a, b) for a, b in zip(got["full"], got["resumed"]))
        mine, uninterrupted = got["owned"]
        assert mine.keys() == uninterrupted.keys() and mine
        assert all(torch.equal(mine[k], uninterrupted[k]) for k in mine)
