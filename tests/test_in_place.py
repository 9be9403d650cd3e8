"""Buckets sent whole with nothing held back are summed in DDP's own buffer (Road.in_place / start_in_place)."""

from __future__ import annotations

import torch

from gradsift import make_compressor
from gradsift.netmodel import NetworkModel
from gradsift.plan import WirePlan
from gradsift.road import Road

from ddp_helpers import plain_mean_grads, spawn

SHAPES = [torch.Size([256, 64]), torch.Size([256])]


def road(spec: str, ratio: float | None = 0.05, **options) -> Road:
    comp = make_compressor(spec, ratio, world_size=2, **options)
    return Road(comp, plan=WirePlan(NetworkModel(1.0, 50.0), 2, enabled=True, min_numel=0))


def test_only_groups_that_go_whole_exactly_as_they_are_qualify():
    keys = ["w", "b"]
    assert road("dense", None).in_place(keys, SHAPES, torch.float32)
    topk = road("topk")
    assert not topk.in_place(keys, SHAPES, torch.float32)  # the plan compresses w
    topk.plan.override = "measured: whole is faster"
    assert topk.in_place(keys, SHAPES, torch.float32)
    topk.compressor.residual["w"] = torch.ones(256 * 64)  # something held back must travel with it: the road
    assert not topk.in_place(keys, SHAPES, torch.float32)
    half = road("topk", value_dtype="fp16")
    half.plan.override = "measured"
    assert not half.in_place(keys, SHAPES, torch.float32)  # whole in fp16 is not the bucket as it is
    dgc = road("dgc")
    dgc.plan.override = "measured"
    assert not dgc.in_place(keys, SHAPES, torch.float32)  # momentum correction applies momentum itself
    assert not road("powersgd", None).in_place(keys, SHAPES, torch.float32)  # two rounds, its own rule


def _whole(rank, world, spec, mode, outdir):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    state = gddp.register(model, spec, None, on_nonfinite=mode)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(4):
        x = torch.randn(8, 32, generator=g)
        if rank == 1 and step == 2:
            x[0, 0] = float("nan")
        expected = plain_mean_grads(model.module, x, world)
        model(x).square().mean().backward()
        try:
            skipped = state.end_step()
        except Exception as e:  # noqa: BLE001 - the error mode raises in the hook's future
            rows.append({"error": str(e)})
            break
        got = [p.grad.clone() for p in model.parameters()]
        rows.append({"skipped": skipped, "in_place": state.last["buckets_in_place"], "buckets": state.last["buckets"],
                     "gap": max(float((a - b).abs().max()) for a, b in zip(got, expected)),
                     "zero": all(float(a.abs().max()) == 0 for a in got)})
        model.zero_grad()
    torch.save(rows, f"{outdir}/rank{rank}.pt")


def test_in_place_gives_the_plain_mean_and_every_rank_skips_a_non_finite_step(tmp_path):
    spawn(_whole, 2, "dense", "skip", str(tmp_path))
    for r in (0, 1):
        rows = torch.load(tmp_path / f"rank{r}.pt")
        assert len(rows) == 4 and all(row["buckets"] >= 1 and row["in_place"] == row["buckets"] for row in rows)
        for step, row in enumerate(rows):
            assert row["skipped"] == (step == 2)
            if step == 2:
                assert row["zero"]  # nothing applied, on every rank
            else:
                assert row["gap"] < 1e-6


def test_a_non_finite_sum_names_the_rank_that_sent_it(tmp_path):
    errs = spawn(_whole, 2, "dense", "error", str(tmp_path), expect_failure=True)
    assert set(errs) == {0, 1}
    assert "non-finite gradient on rank 1 at step 3" in errs[1]
    assert "non-finite gradient on another rank at step 3" in errs[0]
