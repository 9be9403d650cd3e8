"""The fold rule of an elastic resume (gradsift.runtime.elastic): N ranks' residuals and owner residuals onto M ranks, with
nothing lost -- the M-rank run's next update, every entry sent, is the N-rank run's."""

from __future__ import annotations

import pytest
import torch

from gradsift import make_compressor
from gradsift.runtime.elastic import fold_memory
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from gradsift.transport.wire import partition_for

BASE = dict(task="digits-cnn", ratio=0.05, steps=20, batch_size=16, lr=0.05, optimizer="sgd", eval_every=1000)


def _saved(sim: Simulator) -> list[dict]:
    """Every worker's state as a DDP rank saves it (GradsiftState.state_dict's memory and owners)."""
    return [{"compressor_state": road.compressor.state_dict(), "owners": road.owners.state_dict()}
            for road in sim.roads]


def test_the_fold_keeps_what_the_ranks_still_had_to_send():
    """A 4-worker run over the scatter route (sender and owner residuals both non-zero), folded onto 1 and 3 ranks:
    every new rank holds U = (sum of residuals + owners' residuals in place) / 4, and a step that sends every entry
    (top-k at ratio 1: a dense payload) from the folded memory applies, for one gradient, what the 4 ranks would
    have applied from theirs -- to rounding."""
    sim = Simulator(RunConfig(**dict(BASE, compressor="topk", workers=4, sparse_collective="scatter")))
    for _ in range(6):
        assert sim.step() is not None
    saved = _saved(sim)
    numel = {n: p.numel() for n, p in sim.named}
    assert any(st["owners"] for st in saved) and all(st["compressor_state"]["residual"] for st in saved)
    gen = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in sim.named}

    def step(world: int, memories: list[dict[str, torch.Tensor]], owners: list[dict[str, torch.Tensor]]):
        """The mean update of one step sending every entry: (1/world) sum_r (g + memory_r) + owners' residuals."""
        out = {}
        for n, g in grads.items():
            total = torch.zeros(g.numel(), dtype=torch.float64)
            for r, mem in enumerate(memories):
                c = make_compressor("topk:value_dtype=fp32", 1.0, rank=r, world_size=world)
                if n in mem:
                    c.residual[n] = mem[n].clone()
                total += c.compress(n, g.clone()).to_dense(torch.float32).double().reshape(-1)
            part = partition_for(n, g.numel(), world, 0)
            for j, own in enumerate(owners):
                if n in own:
                    pos, at = part.owned(j)
                    total.index_add_(0, at, own[n].double()[pos])
            out[n] = total / world
        return out

    before = step(4, [st["compressor_state"]["residual"] for st in saved], [st["owners"] for st in saved])
    for world in (1, 3):
        folded = fold_memory(saved, ("residual",), "residual", numel, seed=0)["residual"]
        after = step(world, [folded] * world, [])
        for n in grads:
            torch.testing.assert_close(after[n], before[n], rtol=1e-6, atol=1e-6)
    # the owners' part is really in it: without it, the fold would be short by what they held
    bare = fold_memory([{**st, "owners": {}} for st in saved], ("residual",), "residual", numel, seed=0)["residual"]
    short = step(1, [bare], [])
    assert max(float((short[n] - before[n]).abs().max()) for n in grads) > 1e-4


@pytest.mark.parametrize("spec", ["topk:residual_dtype=fp8", "dense"])
def test_a_rank_folds_narrow_residuals_by_their_values_and_a_method_without_memory_has_nothing_to_fold(spec):
    """Rank.load_elastic with 3 saved ranks onto a 2-rank run: an fp8 residual becomes the mean of the saved
    ranks' decoded residuals (codes with their own scales cannot be averaged), re-encoded; a method without memory
    (dense) loads, with nothing to fold."""
    cfg = dict(BASE, compressor=spec, steps=3)
    saved = Simulator(RunConfig(**dict(cfg, workers=3)))
    saved.run()
    sds = [r.state_dict() for r in saved.ranks]
    new = Simulator(RunConfig(**dict(cfg, workers=2)))
    new.ranks[0].load_elastic(sds)
    if spec == "dense":
        return
    mem = new.ranks[0].road.compressor
    for key in saved.compressors[0].residual:
        want = sum(c.residual_of(key) for c in saved.compressors) / 3
        got = mem.residual_of(key)
        assert mem.residual[key].dtype == torch.float8_e4m3fn
        assert float((got - want).norm()) <= 2**-3 * float(want.norm()), key
