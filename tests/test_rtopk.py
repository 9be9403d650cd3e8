"""rTop-k: Proposition 1's identity, exactly k sent, r = N*k by default."""

from __future__ import annotations

import pytest
import torch

from gradsift import make_compressor


def test_proposition_1_identity_monte_carlo():
    d, k, r, trials = 200, 10, 40, 6000
    w = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sq = w.square().sort(descending=True).values
    expect = (1 - k / r) * sq[:r].sum() + sq[r:].sum()
    comp = make_compressor("rtopk:feedback=false", k / d, r_over_k=r / k)
    errs = []
    for t in range(trials):
        p = comp.compress("w", w)
        assert p.count == k
        errs.append((w - p.to_dense()).square().sum())
    errs = torch.stack(errs)
    mean, se = errs.mean(), errs.std() / trials ** 0.5
    assert abs(mean - expect) < 4 * se + 1e-12, (float(mean), float(expect), float(se))
    # and it is no worse than the compression-operator bound (1 - k/d)||w||^2
    assert mean <= (1 - k / d) * w.square().sum()


def test_rtopk_picks_only_from_top_r_and_r_defaults_to_n_times_k():
    n, d, k = 4, 1000, 10
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    top_r = set(torch.topk(x.abs(), n * k).indices.tolist())
    comps = [make_compressor("rtopk:feedback=false", k / d, rank=r, world_size=n, seed=2) for r in range(n)]
    seen = set()
    for c in comps:
        for _ in range(5):
            p = c.compress("w", x)
            assert p.count == k
            assert set(p.indices.tolist()) <= top_r
            seen |= set(p.indices.tolist())
    assert len(seen) > 2 * k  # workers and steps draw different subsets of the top r
    assert comps[0].inner.r_for(k, d) == n * k


def test_rtopk_with_r_equal_k_is_topk():
    x = torch.randn(500, generator=torch.Generator().manual_seed(3))
    a = make_compressor("rtopk:r_over_k=1,feedback=false", 0.02)
    b = make_compressor("topk:feedback=false", 0.02)
    assert set(a.compress("w", x).indices.tolist()) == set(b.compress("w", x).indices.tolist())


def test_a_tasks_momentum_is_folded_into_the_step_for_rtopk_unless_an_optimizer_is_asked_for():
    """rTop-k's top entries wait ~r/k steps for their draw and a momentum optimizer replays each burst: with a task's
    default momentum optimizer, runs step with plain SGD at lr / (1 - momentum) and say so in one line."""
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.tasks import task_class

    task = task_class("mnist1d-cnn")  # defaults: momentum 0.9, lr 0.05
    got = RunConfig(task="mnist1d-cnn", compressor="rtopk:r_over_k=2").resolved(task)
    assert (got.optimizer, round(got.lr, 12)) == ("sgd", 0.5)
    assert "plain SGD at lr 0.5" in RunConfig(task="mnist1d-cnn", compressor="rtopk").folded_momentum(task)
    kept = RunConfig(task="mnist1d-cnn", compressor="rtopk", optimizer="momentum")
    assert (kept.resolved(task).optimizer, kept.resolved(task).lr) == ("momentum", 0.05)
    assert kept.folded_momentum(task) is None
    for spec in ("topk", "dgc"):  # other methods keep the task's optimizer
        assert RunConfig(task="mnist1d-cnn", compressor=spec).resolved(task).optimizer == "momentum"
    assert RunConfig(task="mnist1d-cnn", compressor="not-a-method").folded_momentum(task) is None  # (reported later)
    assert got.resolved(task) == got  # resolving twice folds once


def test_rtopk_trains_with_the_defaults_a_user_gets():
    """``gradsift train --task mnist1d-cnn --compressor rtopk --ratio 0.01 --workers 4 --steps 200 --seed 0``: above
    0.3 accuracy, and the probe loss never 10% higher than 100 steps before (under the task's momentum it swung
    between 1.9 and 2.3 and ended at chance)."""
    pytest.importorskip("mnist1d")
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.simulate import Simulator

    sim = Simulator(RunConfig(task="mnist1d-cnn", compressor="rtopk", ratio=0.01, workers=4, steps=200, seed=0,
                              wire_plan="off", eval_every=200))
    recs = sim.run()
    loss = [r["loss"] for r in recs]
    assert recs[-1]["accuracy"] > 0.3
    assert max(b / a for a, b in zip(loss, loss[100:])) <= 1.1
