"""On a CUDA GPU: the selection kernels, every compressor, the DDP hook over NCCL (world size 1) and torchrun.

Skipped where torch sees no GPU (CI never has one); run them where one is: ``python -m pytest tests/test_cuda.py``.
Everything here compares the GPU against what the CPU suite already pins down: the eager kernels on CUDA
give the compiled CPU kernels' payloads bit for bit, each compressor loses nothing to error feedback on the
GPU, and DDP over NCCL trains to the CPU simulator's parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.memory.feedback import ErrorFeedback
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator

from ddp_helpers import spawn
from helpers import all_specs
from test_ddp import _jobs, _run_jobs
from test_kernels import CASES, N, adversarial, ks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)
EQUIV_SPECS = ["dense", "topk", "rtopk", "regtopk", "redsync", "gaussiank"]
# methods whose GPU run cannot be the CPU's: draws from CUDA's generator (random-k, GSB, DGC's sample), or
# statistics from another path (SIDCo fits from the one-pass moments on the CPU, from the histogram on a GPU)
RANDOM_SPECS = ["randomk:shared=true", "gsb:tau=5", "dgc", "sidco"]


def exact_float32() -> None:
    """No TF32 in matrix products or convolutions: the GPU's arithmetic stays comparable with the CPU's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True


@pytest.mark.parametrize("case", CASES)
def test_topk_and_threshold_on_cuda_are_the_cpu_kernels_results(case):
    x = adversarial(case)
    with kernels.using("auto"):
        for k in ks(N):
            ic, vc = kernels.topk(x, k)
            ig, vg = kernels.topk(x.to(CUDA), k)
            assert ig.device.type == "cuda" and vg.device.type == "cuda"
            assert torch.equal(ic, ig.cpu()) and torch.equal(vc, vg.cpu()), (case, k)
        a = x.abs()
        for t in [0.0, float(a.median()), float(a.max())]:
            ic, vc = kernels.select_above(x, t)
            ig, vg = kernels.select_above(x.to(CUDA), t)
            assert torch.equal(ic, ig.cpu()) and torch.equal(vc, vg.cpu()), (case, t)


def test_fused_accumulate_select_zero_is_exact_on_cuda():
    g = torch.Generator().manual_seed(7)
    r, grad = torch.randn(N, generator=g).to(CUDA), torch.randn(N, generator=g).to(CUDA)
    acc = r + grad
    h = kernels.abs_histogram(r, add=grad)
    assert torch.equal(r, acc)
    idx, vals = kernels.topk(r, N // 100, hist=h, zero=True)
    assert torch.equal(vals, acc[idx])
    expect = acc.clone()
    expect[idx] = 0
    assert torch.equal(r, expect)


DETERMINISTIC = {"dense", "topk", "topk:value_dtype=fp16", "sidco:dist=gamma", "regtopk", "regtopk:form=paper",
                 "redsync", "gaussiank", "topk:warmup=3", "topk:memory=momentum", "sidco:paper=true"}
# SIDCo's exp and gp fits read the one-pass moments on the CPU from a tensor's second call on, and the histogram's
# on a GPU (compressors/sidco.py): the same estimator on other statistics, so the counts agree only roughly
FITTED = {"sidco", "sidco:dist=gp", "sidco:stages=1,adapt=false"}


@pytest.mark.parametrize("spec", all_specs())
def test_every_compressor_on_cuda_stays_on_the_gpu_and_loses_nothing(spec):
    """Payloads and memory stay on the GPU; sent + residual = accumulated; selections without randomness give
    the CPU's payloads exactly."""
    if spec.startswith("powersgd"):
        pytest.skip("powersgd's two dependent rounds need the road's transport (simulator only); on DDP PyTorch's "
                    "own hook runs it, timed on the GPU by benchmarks/cuda_runs.sh")
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(300, 400, generator=g) / torch.rand(300, 400, generator=g).clamp_min(0.05) for _ in range(5)]
    runs = {}
    for dev in ("cpu", "cuda"):
        comp = make_compressor(spec, 0.01, world_size=1)
        sent = torch.zeros(120_000, dtype=torch.float64, device=dev)
        pays = []
        for x in grads:
            p = comp.compress("w", x.to(dev))
            assert p.values.device.type == dev and (p.indices is None or p.indices.device.type == dev), spec
            if comp.OBSERVES:
                comp.observe("w", p, p.to_dense())
            sent += p.to_dense(torch.float64)
            pays.append(p)
        res = getattr(comp, "residual", {}).get("w")
        runs[dev] = (pays, sent, res)
        if res is not None:
            assert res.device.type == dev
            if isinstance(comp, ErrorFeedback):  # momentum correction's memory is the unsent velocity instead
                total = sum(x.reshape(-1).double() for x in grads).to(dev)
                torch.testing.assert_close(sent + res.double(), total, rtol=1e-6, atol=1e-4)
    if spec in FITTED:
        for pc, pg in zip(runs["cpu"][0], runs["cuda"][0]):
            assert abs(pc.count - pg.count) <= 0.1 * pc.target, (spec, pc.count, pg.count)
    if spec in DETERMINISTIC:  # the same entries with the same values (their order in a payload is the path's own)
        for pc, pg in zip(runs["cpu"][0], runs["cuda"][0]):
            assert pc.kind == pg.kind and pc.count == pg.count, spec
            if pc.indices is None:
                assert torch.equal(pc.values, pg.values.cpu()), spec
                continue
            oc, og = pc.indices.argsort(), pg.indices.cpu().argsort()
            assert torch.equal(pc.indices[oc], pg.indices.cpu()[og]), spec
            assert torch.equal(pc.values[oc], pg.values.cpu()[og]), spec


def test_the_adam_recipe_on_cuda_keeps_its_moments_there_and_loses_nothing():
    """``memory=adam``: the moments, the residual and the payloads stay on the GPU, the moments (which do not depend
    on what was sent) are the CPU's, and every step sends k entries. (Which k: Adam's first direction is
    ``sign(g)`` times a constant, all tied, so the devices may break the ties differently and diverge from there.)"""
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(200, 300, generator=g) for _ in range(4)]
    moments = {}
    for dev in ("cpu", "cuda"):
        comp = make_compressor("topk:memory=adam", 0.01, world_size=1)
        pays = [comp.compress("w", x.to(dev)) for x in grads]
        assert all(p.values.device.type == dev and p.indices.device.type == dev and p.count == 600 for p in pays)
        assert all(t.device.type == dev for t in (comp.m["w"], comp.v["w"], comp.residual["w"]))
        assert all(bool(torch.isfinite(p.values).all()) for p in pays)
        moments[dev] = (comp.m["w"].cpu(), comp.v["w"].cpu())
    for a, b in zip(moments["cpu"], moments["cuda"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _train_jobs(rank, world, jobs, outdir):
    exact_float32()
    _run_jobs(rank, world, jobs, outdir)


def test_the_gather_buffer_on_cuda_is_the_cpu_bytes_coded_on_the_host():
    """A GPU's all-gather buffer is written on the host by the compiled kernels (one copy each way): the same bytes
    as the CPU's buffer and as the eager per-segment path on the GPU, read back to the same values and indices."""
    from gradsift.transport.gather import pack_gather, unpack_gather
    from test_wirecode import _mixed_payloads

    for seed in range(3):
        ps = _mixed_payloads(seed)
        on_gpu = [dataclasses.replace(p, values=p.values.to(CUDA), indices=p.indices.to(CUDA)) for p in ps]
        want = pack_gather(ps, 1, torch.device("cpu"))
        got = pack_gather(on_gpu, 1, CUDA)
        with kernels.using("eager"):
            eager = pack_gather(on_gpu, 1, CUDA)
        assert got.is_cuda and torch.equal(got.cpu(), want) and torch.equal(eager.cpu(), want), seed
        for a, b in zip(unpack_gather(want, ps, 2), unpack_gather(got, on_gpu, 2)):
            assert b[2].is_cuda and b[3].is_cuda and a[:2] == b[:2]
            assert torch.equal(a[2], b[2].cpu()) and torch.equal(a[3], b[3].cpu())


def test_ddp_over_nccl_at_world_size_one_matches_the_cpu_simulator(tmp_path):
    """Methods without randomness train to the CPU simulator's parameters. Methods that draw (shared random-k,
    GSB's Bernoulli draws, DGC's threshold sample) draw from a generator on the gradient's device, and CUDA's
    Philox stream is not the CPU's; SIDCo fits other statistics on a GPU (the histogram's, not the one pass's):
    there a GPU run repeated must give the same parameters instead."""
    jobs = []
    for name, cfg, cap in _jobs(1, EQUIV_SPECS + RANDOM_SPECS):
        jobs.append((name, cfg, cap))
        if cfg["compressor"] in RANDOM_SPECS:
            jobs.append((name + "-again", cfg, cap))
    spawn(_train_jobs, 1, jobs, str(tmp_path), backend="nccl")

    def gap(a, b):
        return sum(float((x - y).detach().norm() ** 2) for x, y in zip(a, b)) ** 0.5 / \
            sum(float(x.detach().norm() ** 2) for x in a) ** 0.5

    gaps = {}
    for name, cfg, cap in jobs:
        params, buckets = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / f"{name}.buckets")
        buckets, aside = buckets  # (the most buckets a step hooked, whether DDP's own all-reduce took over)
        if not aside:
            assert (buckets > 1) if cfg["granularity"] == "layer" else (buckets == 1), name
        assert all(bool(torch.isfinite(p).all()) for p in params), name
        if name.endswith("-again"):
            gaps[name] = gap(torch.load(tmp_path / f"{name[:-6]}.pt"), params)
        elif cfg["compressor"] not in RANDOM_SPECS:
            sim = Simulator(RunConfig(**cfg))
            sim.run()
            gaps[name] = gap(sim.params, params)
    print("relative parameter gap (NCCL on the GPU vs the CPU simulator; '-again': vs the same GPU run):",
          json.dumps(gaps, indent=1))
    # the same selections on the same inputs: only float rounding (and atomics' summation order) differs
    bad = {k: v for k, v in gaps.items() if not v < 1e-5}
    assert not bad, bad


def _skip_and_in_place(rank, world, outdir):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift.ddp as gddp

    exact_float32()
    rows = []
    for spec, ratio in (("dense", None), ("topk", 0.05), ("sidco", 0.05), ("gsb:tau=2", 0.05)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 300)).to(CUDA)
        model = DDP(net, device_ids=[0], bucket_cap_mb=0.05)
        state = gddp.register(model, spec, ratio, on_nonfinite="skip")
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(8, 32, generator=g).to(CUDA)
            if step == 2:
                x[0, 0] = float("nan")
            plain = [p.clone() for p in torch.autograd.grad(net(x).square().mean(), list(net.parameters()))]
            model(x).square().mean().backward()
            skipped = state.end_step()
            got = [p.grad for p in model.parameters()]
            rows.append({"spec": spec, "step": step, "skipped": skipped,
                         "in_place": state.last.get("buckets_in_place"), "buckets": state.last.get("buckets"),
                         "aside": bool(state.last.get("ddp_allreduce")),
                         "on_gpu": all(p.grad.device.type == "cuda" for p in model.parameters()),
                         "nan": all(bool(a.isnan().all()) for a in got),
                         "gap": max(float((a - b).abs().max()) for a, b in zip(got, plain))})
            model.zero_grad()
        del model, state
    torch.save(rows, Path(outdir) / "rows.pt")


def test_nccl_hook_skips_a_non_finite_step_and_sums_dense_buckets_in_place(tmp_path):
    spawn(_skip_and_in_place, 1, str(tmp_path), backend="nccl")
    rows = torch.load(tmp_path / "rows.pt")
    assert len(rows) == 16
    for row in rows:
        assert row["on_gpu"], row
        assert row["skipped"] == (row["step"] == 2), row
        if row["step"] == 2:
            assert row["nan"], row  # nothing applied: NaN, as DDP's own all-reduce leaves it (a GradScaler skips it)
        elif row["spec"] == "dense":  # summed in place by the hook, or by DDP's own all-reduce once it stood aside
            assert row["gap"] < 1e-6 and (row["aside"] or row["in_place"] == row["buckets"] >= 1), row


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "gradsift", "train", "--runtime", "ddp", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def test_torchrun_trains_on_the_gpu_over_nccl_and_resumes_from_its_checkpoint(tmp_path):
    env = dict(os.environ, GRADSIFT_DEVICE="cuda", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    common = ["--task", "digits-cnn", "--compressor", "sidco", "--ratio", "0.05", "--eval-every", "10", "--quiet"]
    full = _cli([*common, "--steps", "20", "--out", str(tmp_path / "full")], env, tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    half = _cli([*common, "--steps", "10", "--checkpoint-every", "10", "--out", str(tmp_path / "part")], env, tmp_path)
    assert half.returncode == 0, half.stderr[-3000:]
    resumed = _cli([*common, "--steps", "20", "--resume", str(tmp_path / "part" / "checkpoints"),
                    "--out", str(tmp_path / "part")], env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["status"] == "completed", summary
    a = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert len(a) >= 20 and all(r["loss"] == r["loss"] for r in a if "loss" in r)
    last_a = [r for r in a if r.get("step") == 20 and "loss" in r]
    last_b = [r for r in b if r.get("step") == 20 and "loss" in r]
    assert last_a and last_b and abs(last_a[-1]["loss"] - last_b[-1]["loss"]) <= 1e-5 * max(1.0, abs(last_a[-1]["loss"]))
    bad = _cli([*common, "--steps", "2", "--ratio", "2", "--out", str(tmp_path / "bad")], env, tmp_path)
    assert bad.returncode != 0 and "gradsift: error: ratio must be in (0, 1], got 2.0" in bad.stderr
