"""LAGS Sec. 5 in DDP: small per-layer payloads wait for the next bucket and travel in its message."""

from __future__ import annotations

import torch

from ddp_helpers import spawn


def _run(rank, world, merge, latency_us, outdir, nan_step=None):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    torch.manual_seed(0)
    layers = [nn.Linear(200, 200) for _ in range(3)] + [nn.Linear(200, 3)]
    model = DDP(nn.Sequential(*layers), bucket_cap_mb=0.0005)  # a bucket per tensor, about
    state = gddp.register(model, "topk:value_dtype=fp32", 0.05, latency_us=latency_us, wire_plan=False,
                          merge_small=merge)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(5):
        x = torch.randn(16, 200, generator=g)
        if nan_step == step and rank == 1:
            x[0, 0] = float("nan")
        try:
            model(x).square().mean().backward()
            state.end_step()
        except Exception as e:  # noqa: BLE001 - the error mode raises from backward (the hook's future)
            rows.append({"error": str(e)})
            break
        rows.append({"grads": [p.grad.clone() for p in model.parameters()], "buckets": state.last["buckets"],
                     "messages": state.last["messages"], "bytes": state.last["wire_bytes_per_worker"]})
        model.zero_grad()
    torch.save(rows, f"{outdir}/{'m' if merge else 'u'}{latency_us}-rank{rank}.pt")


def _both(rank, world, outdir):
    for merge, latency in ((False, 50.0), (True, 50.0), (True, 20000.0)):
        _run(rank, world, merge, latency, outdir)


def test_merged_messages_give_the_same_means_as_one_message_per_bucket(tmp_path):
    spawn(_both, 2, str(tmp_path))
    for r in (0, 1):
        alone = torch.load(tmp_path / f"u50.0-rank{r}.pt")
        some = torch.load(tmp_path / f"m50.0-rank{r}.pt")
        all_in_one = torch.load(tmp_path / f"m20000.0-rank{r}.pt")
        for step, (a, b, c) in enumerate(zip(alone, some, all_in_one)):
            for ga, gb, gc in zip(a["grads"], b["grads"], c["grads"]):
                assert torch.equal(ga, gb) and torch.equal(ga, gc)  # each tensor kept its own selection
            assert a["bytes"] == b["bytes"] == c["bytes"]
            if step == 0:
                continue  # DDP's first pass runs one bucket; it rebuckets after it
            assert a["buckets"] == b["buckets"] == c["buckets"] >= 6  # several buckets really were used
            assert a["messages"] == a["buckets"]  # off: one message per bucket
            # 6.25 kB a latency: a weight's 2,000 entries (9.6 kB: fp32 values, coded indices) go, each bias waits
            assert b["messages"] == 3
            assert c["messages"] == 1  # 2.5 MB a latency: everything goes with the last bucket


def _nan(rank, world, outdir):
    _run(rank, world, True, 20000.0, outdir, nan_step=2)


def test_a_non_finite_gradient_in_a_waiting_bucket_stops_every_rank(tmp_path):
    spawn(_nan, 2, str(tmp_path))
    for r in (0, 1):
        rows = torch.load(tmp_path / f"m20000.0-rank{r}.pt")
        assert len(rows) == 3 and "error" in rows[2], rows[-1]
        # the flags travel in the all-gather: every rank names the one that sent it
        assert "non-finite gradient on rank 1 at step 3" in rows[2]["error"]
