"""Parameters a step did not use keep their memory (gradsift.runtime.unused): an expert layer used every third step, a
weight frozen after wrapping. DDP (find_unused_parameters=True) discards what the hook returns for a parameter no
rank used, so nothing may have been taken out of its memory for it. Invariant, measured from the weights: what the
optimizer applied plus what the ranks still hold equals the sum of the gradients."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_helpers import spawn
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from gradsift.tasks.base import Task
from gradsift.transport.wire import partition_for

LR = 0.5
STEPS = 14


class ExpertNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 24)
        self.expert = nn.Linear(24, 24)
        self.head = nn.Linear(24, 4)

    def forward(self, x, use_expert: bool):
        h = torch.relu(self.inp(x))
        if use_expert:  # a router's choice: the expert has no gradient on the other steps, on any rank
            h = h + torch.relu(self.expert(h))
        return self.head(h)


class ExpertTask(Task):
    """Each worker's fixed random data; the expert is used on steps 0, 3, 6, ..."""

    name = "expert-toy"
    defaults = {"lr": LR, "batch_size": 16, "steps": STEPS, "optimizer": "sgd", "eval_every": 1000}

    def setup(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.x = torch.randn(self.workers, 64, 8, generator=g)
        self.y = torch.randint(0, 4, (self.workers, 64), generator=g)

    def make_model(self) -> nn.Module:
        return ExpertNet()

    def batch(self, worker: int, step: int):
        i = (step * self.batch_size) % 64
        return self.x[worker, i:i + self.batch_size], self.y[worker, i:i + self.batch_size], step

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y, step = batch
        return F.cross_entropy(model(x, step % 3 == 0), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"accuracy": 0.0}

    def probe_loss(self, model: nn.Module) -> float:
        return 0.0


CASES = {  # name: (HookSettings/RunConfig options, DDP bucket cap in MB); the wire plan off: these tensors are
    # small enough for the plan to send them whole
    "layer": ({"granularity": "layer", "wire_plan": "off"}, 0.0005),
    "model": ({"granularity": "model", "wire_plan": "off"}, 1.0),
    "scatter": ({"granularity": "layer", "sparse_collective": "scatter", "wire_plan": "off"}, 0.0005),
    "model-scatter": ({"granularity": "model", "sparse_collective": "scatter", "wire_plan": "off"}, 1.0),
}


def _flat_unsent(compressors, owners_of, named, granularity, world):
    """Every worker's residual plus every owner's residual (``owners_of``: (rank, Owners) pairs), in the model's
    flat order (summed over workers)."""
    total = sum(p.numel() for _, p in named)
    held = torch.zeros(total, dtype=torch.float64)
    keys = [("model", 0, total)] if granularity == "model" else []
    off = 0
    for n, p in named:
        if granularity == "layer":
            keys.append((n, off, p.numel()))
        off += p.numel()
    for key, start, size in keys:
        for c in compressors:
            if key in c.residual:
                held[start:start + size] += c.residual[key].double().reshape(-1)
        part = partition_for(key, size, world, 0)
        for j, owners in owners_of:
            r = owners.residual.get(key)
            if r is not None:
                pos, at = part.owned(j)
                held[start:start + size].index_add_(0, at, r.double()[pos])
    return held


def _handed(params) -> torch.Tensor:
    """What the optimizer is handed this step, flat (a parameter without a gradient: nothing)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).double()


def test_simulator_keeps_an_idle_experts_memory_and_loses_nothing():
    """The simulator's rule (a parameter without a gradient on every worker: memory as it was, no update), for
    each case: applied (the gradients handed to the optimizer) + held = the sum of the gradients, to 1e-6
    relative; the expert's residual does not move on the steps it was idle."""
    for name, (opts, _) in CASES.items():
        task = ExpertTask(2, seed=1)
        sim = Simulator(RunConfig(task="digits-mlp", compressor="topk", ratio=0.1, workers=2, steps=STEPS,
                                  eval_every=1000, **opts), task=task)
        total = sum(p.numel() for p in sim.params)
        given = torch.zeros(total, dtype=torch.float64)
        applied = torch.zeros(total, dtype=torch.float64)
        key = "model" if opts["granularity"] == "model" else "expert.weight"
        expert = slice(8 * 24 + 24, 8 * 24 + 24 + 24 * 24 + 24)
        idle_checked = 0
        for step in range(STEPS):
            before = torch.cat([p.detach().reshape(-1) for p in sim.params])
            res_before = [c.residual.get(key) for c in sim.compressors]
            res_before = [None if r is None else r.clone() for r in res_before]
            rec = sim.step()
            assert rec is not None and rec["density"] < 0.2, name
            applied += _handed(sim.params) * sim.n
            if step % 3:  # the idle expert did not move
                after = torch.cat([p.detach().reshape(-1) for p in sim.params])
                assert torch.equal(after[expert], before[expert]), name
            given += sum(torch.cat([g.reshape(-1) for g in gs]).double() for gs in sim.last_grads)
            if step % 3 and key == "expert.weight":  # idle: its memory is as it was, its weight too
                for c, r in zip(sim.compressors, res_before):
                    assert r is not None and torch.equal(c.residual[key], r), name
                idle_checked += 1
        owners = list(enumerate(r.owners for r in sim.roads))
        held = _flat_unsent(sim.compressors, owners, sim.named, opts["granularity"], 2)
        off = 0
        for n, p in sim.named:
            sl = slice(off, off + p.numel())
            err = float((applied[sl] + held[sl] - given[sl]).norm() / given[sl].norm())
            assert err < 1e-6, (name, n, err)
            off += p.numel()
        assert idle_checked == (STEPS - (STEPS + 2) // 3 if key == "expert.weight" else 0)


def _ddp_runs(rank, world, outdir):
    import gradsift.ddp
    from gradsift.runtime.runconfig import make_optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name, (opts, cap) in CASES.items():
        task = ExpertTask(world, seed=1)
        net = task.build_model()
        plain = copy.deepcopy(net)
        ddp = DDP(net, find_unused_parameters=True, bucket_cap_mb=cap)
        cfg = RunConfig(task="digits-mlp", compressor="topk", ratio=0.1, workers=world, steps=STEPS, lr=LR,
                        optimizer="sgd").resolved(ExpertTask)
        opt = make_optimizer(cfg, list(net.parameters()))
        state = gradsift.ddp.register(ddp, "topk", 0.1, **opts)
        named = list(net.named_parameters())
        total = sum(p.numel() for _, p in named)
        given = torch.zeros(total, dtype=torch.float64)
        applied = torch.zeros(total, dtype=torch.float64)
        frozen_res = frozen_w = None
        unused_counts = []
        for step in range(STEPS):
            if name == "layer" and step == 7:  # a weight frozen after wrapping: DDP still buckets it
                net.head.weight.requires_grad_(False)
                plain.head.weight.requires_grad_(False)
                frozen_res = state.compressor.residual["head.weight"].clone()
                frozen_w = net.head.weight.detach().clone()
            batch = task.batch(rank, step)
            plain.load_state_dict(net.state_dict())
            plain.zero_grad(set_to_none=True)
            task.loss(plain, batch).backward()
            local = _handed(list(plain.parameters()))
            dist.all_reduce(local)
            given += local
            opt.zero_grad(set_to_none=True)
            task.loss(ddp, batch).backward()
            assert not state.end_step() and state.last["density"] < 0.2
            unused_counts.append(state.last["params_unused"])
            applied += _handed([p for _, p in named]) * world
            opt.step()
        held = _flat_unsent([state.compressor], [(rank, state.road.owners)], named, opts["granularity"], world)
        dist.all_reduce(held)
        if rank == 0:
            torch.save({"params": [p.detach().clone() for _, p in named], "applied": applied, "given": given,
                        "held": held, "unused": unused_counts,
                        "frozen": None if frozen_res is None else
                        (frozen_res, state.compressor.residual["head.weight"].clone(),
                         torch.equal(frozen_w, net.head.weight.detach()))},
                       Path(outdir) / f"{name}.pt")


@pytest.mark.parametrize("world", [2])
def test_ddp_keeps_memory_of_unused_parameters_and_matches_the_simulator(world, tmp_path):
    """2 gloo ranks, DDP(find_unused_parameters=True): the invariant from the weights to 1e-6 relative for every
    parameter, the idle expert counted as unused on its idle steps, a frozen weight's residual unchanged while
    frozen, and the same bits as the simulator (which applies the same rule) in every case but the frozen one."""
    spawn(_ddp_runs, world, str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (opts, _) in CASES.items():
            got = torch.load(tmp_path / f"{name}.pt")
            off = 0
            for p in got["params"]:
                sl = slice(off, off + p.numel())
                err = float((got["applied"][sl] + got["held"][sl] - got["given"][sl]).norm() / got["given"][sl].norm())
                assert err < 1e-6, (name, err)
                off += p.numel()
            idle = [0 if s % 3 == 0 else 2 for s in range(STEPS)]  # the expert's weight and bias
            if name == "layer":
                idle = [u + (1 if s >= 7 else 0) for s, u in enumerate(idle)]
                before, after, still = got["frozen"]
                assert before.abs().sum() > 0 and torch.equal(before, after) and still
            assert got["unused"] == idle, name
            if name == "layer":
                continue
            sim = Simulator(RunConfig(task="digits-mlp", compressor="topk", ratio=0.1, workers=world, steps=STEPS,
                                      eval_every=1000, **opts), task=ExpertTask(world, seed=1))
            for _ in range(STEPS):
                sim.step()
            assert all(torch.equal(a.detach(), b) for a, b in zip(sim.params, got["params"])), name
    finally:
        torch.set_num_threads(threads)
