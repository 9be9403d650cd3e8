"""The simulator: exact dense equivalence, the toy example, determinism, telemetry."""

from __future__ import annotations

import math

import pytest
import torch

from gradsift.payload.indexcode import layout
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from gradsift.tasks import make_task


def test_dense_workers_equal_single_process_on_concatenated_batch():
    """N workers of batch B with dense == one process on the N*B batch (float64, 20 steps)."""
    n, b, steps = 4, 8, 20
    cfg = RunConfig(task="digits-mlp", compressor="dense", workers=n, steps=steps, batch_size=b, lr=0.2,
                    optimizer="momentum", task_options={"dtype": "float64"}, eval_every=100)
    sim = Simulator(cfg)
    task = make_task("digits-mlp", n, seed=0, batch_size=b, dtype="float64")
    ref = task.build_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for p, q in zip(ref.parameters(), sim.model.parameters()):
        assert torch.equal(p, q)
    for s in range(steps):
        sim.step()
        xs, ys = zip(*(task.batch(w, s) for w in range(n)))
        opt.zero_grad()
        task.loss(ref, (torch.cat(xs), torch.cat(ys))).backward()
        opt.step()
    for p, q in zip(ref.parameters(), sim.model.parameters()):
        rel = (p - q).norm() / p.norm()
        assert rel < 1e-6, float(rel)
    # and training moved the parameters: the check is not vacuous
    assert any((p - q).norm() > 0.1 for p, q in zip(ref.parameters(), task.build_model().parameters()))


def _losses(spec, steps=100, **kw):
    cfg = RunConfig(task="logistic-toy", compressor=spec, ratio=0.5, workers=2, steps=steps, wire_plan=False, **kw)
    return [r["loss"] for r in Simulator(cfg).run()]


def test_logistic_toy_topk_stalls_dense_descends():
    initial = math.log(1 + math.exp(-1))
    top = _losses("topk")  # ratio 0.5 of 2 entries: k = 1, with error feedback
    assert all(abs(l - initial) < 1e-12 for l in top[:90]), "TOP-1 moved within 90 steps"
    dense = _losses("dense")
    assert dense[99] < 0.02
    assert dense[0] < initial


def test_simulator_is_deterministic_and_granularities_differ():
    def run(gran, seed=0):
        cfg = RunConfig(task="digits-cnn", compressor="randomk", ratio=0.05, workers=3, steps=8, seed=seed,
                        granularity=gran, eval_every=4)
        sim = Simulator(cfg)
        recs = sim.run()
        return recs, torch.cat([p.detach().reshape(-1) for p in sim.model.parameters()])

    ra, pa = run("layer")
    rb, pb = run("layer")
    assert torch.equal(pa, pb)
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    rc, pc = run("model")
    assert not torch.equal(pa, pc)
    rd, pd = run("layer", seed=1)
    assert not torch.equal(pa, pd)


def test_telemetry_fields_and_accounting():
    cfg = RunConfig(task="digits-cnn", compressor="topk", ratio=0.01, workers=4, steps=3, eval_every=2, wire_plan=False)
    sim = Simulator(cfg)
    recs = sim.run()
    need = {"step", "loss", "density", "bytes_per_worker", "wire_bytes_per_worker", "select_s", "compute_s",
            "est_comm_s", "est_step_s", "k_ratio", "overflow"}
    for r in recs:
        assert need <= set(r)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert "accuracy" in recs[1] and "accuracy" in recs[2] and "accuracy" not in recs[0]
    # bytes: per tensor k bf16 values and the k indices coded (gradsift.payload.indexcode: the smallest fixed code)
    ks = [max(1, round(0.01 * p.numel())) for p in sim.params]
    coded = [layout(p.numel(), k, 4)[1] for p, k in zip(sim.params, ks)]
    assert recs[0]["bytes_per_worker"] == sum(ks) * 2 + sum(coded)
    assert recs[0]["bytes_per_entry"] == pytest.approx((sum(ks) * 2 + sum(coded)) / sum(ks))
    # the wire: per tensor an all-gather segment of (N-1) * (16-byte header + 8-aligned indices + 8-aligned values)
    pad = lambda n: (n + 7) // 8 * 8  # noqa: E731
    assert recs[0]["wire_bytes_per_worker"] == pytest.approx(3 * sum(16 + pad(c) + pad(2 * k) for k, c in zip(ks, coded)))
    assert recs[0]["density"] == pytest.approx(sum(ks) / sim.total_numel)
    # per-layer runs overlap communication with backward (the pipelined model); the serial figure is SLGS's
    r = recs[0]
    assert r["est_step_serial_s"] == pytest.approx(r["forward_s"] + r["backward_s"] + r["select_s"] + r["est_comm_s"])
    assert r["est_step_s"] == r["est_step_pipelined_s"] <= r["est_step_serial_s"] + 1e-12
    assert r["est_step_s"] >= r["forward_s"] + r["backward_s"] - 1e-12
    assert 1.0 <= r["s_max"] <= 2.0
    m = Simulator(RunConfig(task="digits-cnn", compressor="topk", ratio=0.01, workers=4, steps=1,
                            granularity="model")).run()[0]
    assert m["est_step_s"] == m["est_step_serial_s"] and "est_step_pipelined_s" not in m


def test_the_simulator_sends_the_method_as_named_unless_asked_for_a_plan():
    cfg = RunConfig(task="digits-cnn", compressor="topk", ratio=0.01, workers=4, steps=2)
    sim = Simulator(cfg)
    rec = sim.run()[-1]
    assert not [n for n in sim.notices() if "wire plan" in n] and sim.routing.changed(sim.compressors[0]) == {}
    ks = {n: max(1, round(0.01 * p.numel())) for n, p in sim.named}
    # every tensor top-k: bf16 values and coded indices
    assert rec["bytes_per_worker"] == sum(ks[n] * 2 + layout(p.numel(), ks[n], 4)[1] for n, p in sim.named)
    summary = sim.summary([rec], 0.0)
    assert summary["routing"]["enabled"] is False and summary["routing"]["changed"] == {}


def test_wire_plan_sends_small_tensors_whole_and_says_why():
    cfg = RunConfig(task="digits-cnn", compressor="topk", ratio=0.01, workers=4, steps=2, bandwidth_gbps=1.0,
                    latency_us=50.0, wire_plan="auto", optimizer="sgd")  # (error feedback: momentum SGD's recipe differs)
    sim = Simulator(cfg)
    rec = sim.run()[-1]
    small = 50e-6 * 1e9 / 8 / 4  # elements one message latency carries at 1 Gbit/s
    changed = sim.routing.changed(sim.compressors[0])
    dense = {k: v["reason"] for k, v in changed.items() if v["route"] == "whole"}
    assert set(dense) == {n for n, p in sim.named if p.numel() <= small} == set(changed)
    assert all("small" in why for why in dense.values())
    (line,) = sim.notices()  # one line: how many, which route, why, how to turn it off
    assert f"{len(dense)} of {len(sim.named)} tensors sent whole" in line and "small" in line
    assert "--wire-plan off" in line and "topk" in line
    assert sim.summary([rec], 0.0)["routing"]["changed"] == changed
    ks = {n: (p.numel() if n in dense else max(1, round(0.01 * p.numel()))) for n, p in sim.named}
    numel = {n: p.numel() for n, p in sim.named}
    assert rec["bytes_per_worker"] == sum(k * 4 if n in dense else k * 2 + layout(numel[n], k, 4)[1]
                                          for n, k in ks.items())
    for c in sim.compressors:  # tensors sent whole keep no memory
        assert not set(c.residual) & set(dense)


def test_dense_accounting_and_time_model():
    cfg = RunConfig(task="digits-mlp", compressor="dense", workers=4, steps=1, bandwidth_gbps=1.0, latency_us=0.0)
    sim = Simulator(cfg)
    rec = sim.run()[0]
    total = sum(p.numel() for p in sim.params) * 4
    assert rec["bytes_per_worker"] == total
    on_wire = total + 4 * len(sim.params)  # each tensor's all-reduce segment carries one flag element
    assert rec["wire_bytes_per_worker"] == pytest.approx(2 * 3 / 4 * on_wire)
    assert rec["est_comm_s"] == pytest.approx(2 * 3 / 4 * on_wire / (1e9 / 8))
    assert rec["density"] == 1.0


def test_nonfinite_skip_skips_the_step_on_every_worker():
    cfg = RunConfig(task="linreg", compressor="topk", ratio=0.5, workers=3, steps=6, on_nonfinite="skip",
                    fault_nan_step=3)
    sim = Simulator(cfg)
    recs = sim.run()
    assert sim.skipped == 1 and len(recs) == 5
    for c in sim.compressors:
        for r in c.residual.values():
            assert torch.isfinite(r).all()
    assert all(torch.isfinite(p).all() for p in sim.params)


def test_nonfinite_error_stops_before_the_model_and_memory_never_sees_it():
    from gradsift.compressors.base import NonFiniteGradient

    cfg = RunConfig(task="linreg", compressor="topk", ratio=0.5, workers=3, steps=6, fault_nan_step=3)
    sim = Simulator(cfg)
    sim.step()
    sim.step()
    params = [p.detach().clone() for p in sim.params]
    with pytest.raises(NonFiniteGradient, match="non-finite gradient on worker 2 at step 3"):
        sim.step()
    for p, q in zip(params, sim.params):
        assert torch.equal(p, q)
    for c in sim.compressors:
        assert all(torch.isfinite(r).all() for r in c.residual.values())


def test_weighted_mean():
    cfg = RunConfig(task="linreg", compressor="dense", workers=2, steps=1, weights=[0.25, 0.75])
    sim = Simulator(cfg)
    sim.step()
    # the same step by hand
    task = sim.task
    m = task.build_model()
    gs = []
    for w in range(2):
        m.zero_grad()
        task.loss(m, task.batch(w, 0)).backward()
        gs.append(m.weight.grad.clone())
    expect = m.weight.detach() - 0.01 * (0.25 * gs[0] + 0.75 * gs[1])
    torch.testing.assert_close(sim.model.weight.detach(), expect, rtol=1e-12, atol=1e-12)


def test_the_probe_loss_every_n_steps_and_at_every_evaluation():
    """``probe_every``: the probe batch's loss (a forward pass of its own) only every N steps and where the task is
    evaluated -- a cluster race's runs take it at their evaluations only; the training is the same."""
    base = dict(task="digits-cnn", compressor="topk", ratio=0.01, workers=2, steps=7, eval_every=5, wire_plan=False)
    every = Simulator(RunConfig(**base)).run()
    sparse = Simulator(RunConfig(**base, probe_every=3)).run()
    assert [r["loss"] is not None for r in sparse] == [False, False, True, False, True, True, True]
    for a, b in zip(every, sparse):  # (steps 3, 5: multiples and evaluations; 6: of 3; 7: the last, evaluated)
        assert a["batch_loss"] == b["batch_loss"] and (b["loss"] is None or b["loss"] == a["loss"])
    with pytest.raises(Exception, match="probe-every must be an integer >= 1"):
        RunConfig(**base, probe_every=0).validate()
