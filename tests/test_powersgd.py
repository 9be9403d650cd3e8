"""gradsift's powersgd (simulator) gives PyTorch's powerSGD_hook's result on the same bucket and seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_helpers import spawn
from gradsift import make_compressor
from gradsift.compressors.powersgd import orthogonalize
from gradsift.runtime.road import Group, Road
from gradsift.transport.local import LocalGroup

STEPS, START, RANK, LR = 7, 2, 2, 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64))  # one bucket: the weight is compressed, the bias is not


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 64, generator=g)


def _torch_hook(rank, world, outdir):
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(), bucket_cap_mb=25)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                               warm_start=True, use_error_feedback=True, min_compression_rate=2, random_seed=0)
    model.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], Path(outdir) / "torch.pt")


def _simulated(world: int):
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    roads = [Road(make_compressor(f"powersgd:approx_rank={RANK},start={START}", rank=r, world_size=world))
             for r in range(world)]
    group = LocalGroup(world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = []
        for r in range(world):
            x, y = _batch(r, step)
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, (name, p) in enumerate(model.named_parameters()):
            trips = [road.start(Group([name], [grads[r][i].shape], grads[r][i].dtype, lambda g=grads[r][i]: [g]),
                                group.endpoint(r)) for r, road in enumerate(roads)]
            while True:
                ds = [t.pending.wait() for t in trips]
                nxt = [road.advance(t, d) for road, t, d in zip(roads, trips, ds)]
                if nxt[0] is None:
                    break
                trips = nxt
            p.grad = roads[0].finish(trips[0], ds[0])[0].view_as(p)
            for road, t, d in zip(roads[1:], trips[1:], ds[1:]):
                road.finish(t, d)
        opt.step()
    return [p.detach() for p in model.parameters()], names


def test_same_result_as_pytorchs_hook(tmp_path):
    spawn(_torch_hook, 2, str(tmp_path))
    theirs = torch.load(tmp_path / "torch.pt")
    ours, _ = _simulated(2)
    moved = sum(float((a - b.detach()).norm()) for a, b in zip(ours, _model().parameters()))
    assert moved > 0.01  # training moved the parameters
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rank_r_orthogonalization_and_factor_sizes():
    m = torch.randn(50, 3, generator=torch.Generator().manual_seed(1))
    q = orthogonalize(m.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(3), atol=1e-5, rtol=0)
    comp = make_compressor("powersgd:approx_rank=4,start=0")
    p = comp.compress("w", torch.randn(40, 30))
    assert p.count == 40 * 4  # round 1 carries P, n x r
    small = comp.compress("b", torch.randn(30))
    assert small.count == 30  # not worth compressing: whole
    with pytest.raises(Exception, match="ratio is required"):
        make_compressor("topk")


def test_a_simulated_run_takes_the_torch_hooks_defaults():
    """``--compressor powersgd`` in a run compresses as ``--torch-hook powersgd`` does: rank 2, plain all-reduce
    for the first 10% of the steps (not PyTorch's 1000, which a short run never reaches); what the spec names
    stays."""
    from gradsift.runtime.runconfig import RunConfig
    from gradsift.runtime.simulate import Simulator

    opts = Simulator(RunConfig(task="linreg", compressor="powersgd", workers=2, steps=50)).compressors[0].inner.options
    assert (opts["approx_rank"], opts["start"]) == (2, 5)
    opts = Simulator(RunConfig(task="linreg", compressor="powersgd:approx_rank=1,start=7", workers=2,
                               steps=50)).compressors[0].inner.options
    assert (opts["approx_rank"], opts["start"]) == (1, 7)
