"""memory=adam: each worker's Adam direction sent with error feedback, the optimizer applying the mean
(gradsift.memory.adam), and the recipe that picks it under Adam-family optimizers."""

import copy

import pytest
import torch

from gradsift import make_compressor
from gradsift.compressors.base import OptionError
from gradsift.memory.adam_step import take_over_adam
from gradsift.memory.recipes import recipe_spec
from gradsift.memory.spec import Spec
from gradsift.errors import ConfigError
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from helpers import payload_equal


def _decoded(payload, like):
    return payload.to_dense(torch.float32).view_as(like)


def test_one_worker_sending_everything_is_adamw_step_for_step():
    """ratio 1, one worker, the worker's own second moment and no look-ahead: AdamW itself (weight decay, the
    learning rate changed between steps, bias correction), to float rounding."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(40, 30))
    ref = copy.deepcopy(w)
    opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    c = make_compressor("topk:memory=adam,scale=worker,nesterov=false,value_dtype=fp32", ratio=1.0)
    assert take_over_adam(c, opt)
    assert c.memory_options["beta1"] == 0.8 and c.memory_options["eps"] == 1e-6
    for step in range(12):
        g = torch.randn(40, 30) * (1 + step)
        for group in (opt.param_groups[0], ref_opt.param_groups[0]):
            group["lr"] = 1e-2 / (1 + step)
        w.grad = _decoded(c.compress("w", g), g)
        opt.step()
        ref.grad = g.clone()
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert opt.state_dict()["state"] == {}  # the optimizer applied the direction; the moments are the memory's


def test_nothing_is_lost_what_is_sent_plus_the_residual_is_every_direction():
    """At ratio 0.05 the sum of what was sent plus the residual equals the sum of the directions sent whole by
    the same memory at ratio 1 (the moments do not depend on what was sent without masking)."""
    torch.manual_seed(1)
    sparse = make_compressor("topk:memory=adam", ratio=0.05, world_size=4)
    whole = make_compressor("topk:memory=adam", ratio=1.0, world_size=4)
    sent_sparse = torch.zeros(500)
    sent_whole = torch.zeros(500)
    for _ in range(20):
        g = torch.randn(500) * torch.linspace(0.01, 3, 500)
        sent_sparse += _decoded(sparse.compress("x", g.clone()), g)
        sent_whole += _decoded(whole.compress("x", g.clone()), g)
    # (whole's residual holds what its bf16 values rounded off)
    torch.testing.assert_close(sent_sparse + sparse.residual["x"], sent_whole + whole.residual["x"], rtol=1e-5,
                               atol=1e-5)
    assert int((sent_sparse != 0).sum()) < 500


def test_the_mean_scale_estimates_the_second_moment_of_the_mean_gradient():
    """N workers, gradients mean + own noise: the mean of their directions with ``scale=mean`` matches Adam's step
    on the mean gradient (within 10%), where the workers' own second moments make it about half as long."""
    torch.manual_seed(2)
    n, d, steps = 8, 2000, 300
    mu = torch.randn(d) * 0.1
    mean_cs = [make_compressor("topk:memory=adam,nesterov=false", ratio=1.0, world_size=n) for _ in range(n)]
    worker_cs = [make_compressor("topk:memory=adam,nesterov=false,scale=worker", ratio=1.0, world_size=n)
                 for _ in range(n)]
    ref = make_compressor("topk:memory=adam,nesterov=false,scale=worker", ratio=1.0, world_size=1)
    for _ in range(steps):
        gs = [mu + torch.randn(d) for _ in range(n)]
        a = sum(_decoded(c.compress("x", g.clone()), g) for c, g in zip(mean_cs, gs)) / n
        b = sum(_decoded(c.compress("x", g.clone()), g) for c, g in zip(worker_cs, gs)) / n
        mean = sum(gs) / n
        r = _decoded(ref.compress("x", mean), mean)
    size = lambda x: float(x.abs().mean())  # noqa: E731
    assert abs(size(a) / size(r) - 1) < 0.1, (size(a), size(r))
    assert size(b) / size(r) < 0.6, (size(b), size(r))


def test_clip_bounds_the_workers_whole_gradient_through_its_tensors():
    c = make_compressor("topk:memory=adam,clip=1.0", ratio=1.0)
    c.tensor_count = 4
    g = torch.full((100,), 10.0)
    c.compress("x", g)
    assert torch.allclose(c.m["x"], torch.full((100,), 0.1 * 0.5 / 10))  # (1 - b1) * (1 / sqrt(4)) / sqrt(100)


def test_state_round_trip_continues_as_if_never_stopped():
    torch.manual_seed(3)
    grads = [torch.randn(300) for _ in range(8)]
    a = make_compressor("topk:memory=adam", ratio=0.1, world_size=2)
    outs = [_decoded(a.compress("x", g.clone()), g) for g in grads]
    b = make_compressor("topk:memory=adam", ratio=0.1, world_size=2)
    for g in grads[:4]:
        b.compress("x", g.clone())
    c = make_compressor("topk:memory=adam", ratio=0.1, world_size=2)
    c.load_state_dict(b.state_dict())
    for g, want in zip(grads[4:], outs[4:]):
        assert torch.equal(_decoded(c.compress("x", g.clone()), g), want)


def test_the_recipe_picks_adams_direction_under_adamw_and_says_so():
    w = [torch.nn.Parameter(torch.zeros(3))]
    adamw = torch.optim.AdamW(w, lr=1e-3)
    assert recipe_spec("topk", adamw)[0] == Spec.parse("topk:memory=adam")
    assert recipe_spec("sidco:stages=2", adamw)[0] == Spec.parse("sidco:stages=2,memory=adam")
    assert recipe_spec("dgc", adamw)[0] == Spec.parse("dgc:memory=adam")
    assert recipe_spec("topk:clip=1.0", adamw)[0] == Spec.parse("topk:clip=1.0,memory=adam")  # the clip docs/ddp.md names
    assert make_compressor("topk:clip=1.0,memory=adam", ratio=0.1).memory_options["clip"] == 1.0
    # a recipe returns a new Spec (never edited text); written back, the memory comes after the ratio
    assert str(recipe_spec("sidco:stages=2,ratio=0.1", adamw)[0]) == "sidco:ratio=0.1,memory=adam,stages=2"
    spec, said = recipe_spec("topk", adamw)
    assert "Adam direction" in said and "memory=ef" in said and "topk:clip=C" in said
    assert recipe_spec("topk:memory=ef", adamw) == ("topk:memory=ef", None)
    assert recipe_spec("gsb", adamw) == ("gsb", None)  # no memory: the gradient as the paper sends it
    assert recipe_spec("dense", adamw) == ("dense", None)
    assert recipe_spec("topk", adamw, adam=False) == ("topk", None)  # FSDP
    coupled = torch.optim.Adam(w, lr=1e-3, weight_decay=0.01)  # its decay is part of the gradient
    with pytest.raises(ConfigError) as e:  # compressing the gradient under Adam would train markedly worse, silently
        recipe_spec("topk", coupled)
    assert "use AdamW" in str(e.value) and "topk:memory=ef" in str(e.value) and "\n" not in str(e.value)
    assert recipe_spec("topk:memory=ef", coupled) == ("topk:memory=ef", None)  # said: the gradient compressed
    assert recipe_spec("topk", coupled, adam=False) == ("topk", None)  # FSDP: no Adam recipe to miss
    assert recipe_spec("gsb", coupled) == ("gsb", None)  # no memory: the gradient as the paper sends it
    assert recipe_spec("topk", torch.optim.Adam(w, lr=1e-3))[0] == Spec.parse("topk:memory=adam")
    sgd = torch.optim.SGD(w, lr=0.1, momentum=0.9)
    assert recipe_spec("topk", sgd) == ("topk", None)
    assert recipe_spec("dgc", sgd)[0] == Spec.parse("dgc:memory=ef")


def test_refusals_are_one_line():
    w = [torch.nn.Parameter(torch.zeros(3))]
    c = make_compressor("topk:memory=adam", ratio=0.5)
    for opt, said in ((torch.optim.SGD(w, lr=0.1, momentum=0.9), "SGD"),
                      (torch.optim.Adam(w, lr=0.1, weight_decay=0.1), "with weight decay"),
                      (torch.optim.AdamW(w, lr=0.1, amsgrad=True), "amsgrad")):
        with pytest.raises(ConfigError) as e:
            take_over_adam(c, opt)
        assert said in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(OptionError, match="scale must be"):
        make_compressor("topk:memory=adam,scale=global", ratio=0.5)
    with pytest.raises(OptionError, match="beta2"):
        make_compressor("topk:memory=adam,beta2=1", ratio=0.5)
    with pytest.raises(OptionError, match="memory=adam"):
        make_compressor("topk:memory=ef,scale=mean", ratio=0.5)


def test_the_simulator_under_adamw_trains_with_the_recipe_and_the_optimizer_holds_no_moments():
    sim = Simulator(RunConfig(task="digits-mlp", compressor="topk", ratio=0.05, workers=4, steps=60, eval_every=60,
                              optimizer="adamw", lr=3e-3, clip_norm=1.0))
    assert sim.cfg.compressor == "topk:memory=adam" and sim.adam
    c = sim.compressors[0]
    assert c.memory_options["clip"] == 1.0 and c.tensor_count == len(sim.layout.keys)
    recs = sim.run()
    assert recs[-1]["accuracy"] > 0.8, recs[-1]
    assert sim.optimizer.state_dict()["state"] == {}


# ---------------------------------------------------------------- real processes
ADAM_BASE = dict(task="digits-cnn", ratio=0.05, steps=16, batch_size=16, lr=3e-3, optimizer="adamw",
                 weight_decay=0.01, clip_norm=1.0, eval_every=1000, wire_plan="auto", compressor="topk")


def _adam_jobs(rank, world, outdir):
    from pathlib import Path

    from gradsift.launch import train_ddp

    out = Path(outdir)
    for gran, cap in (("layer", 0.005), ("model", None)):
        res = train_ddp(RunConfig(**dict(ADAM_BASE, workers=world, granularity=gran)), out=None, bucket_cap_mb=cap)
        if rank == 0:
            torch.save(res["params"], out / f"{gran}.pt")
    base = dict(ADAM_BASE, workers=world)
    ck = out / "ck"
    train_ddp(RunConfig(**dict(base, steps=8)), out=None, bucket_cap_mb=0.005, checkpoint_every=8, checkpoint_dir=ck)
    resumed = train_ddp(RunConfig(**base), out=None, bucket_cap_mb=0.005, resume=str(ck))["params"]
    if rank == 0:
        torch.save(resumed, out / "resumed.pt")


def test_ddp_with_adamw_matches_the_simulator_and_resumes_exactly(tmp_path):
    """The recipe under AdamW in real processes (2 gloo ranks, clipping handed to the workers): the same bits as
    the simulator after 16 steps, per layer in several buckets and the whole model in one; a checkpoint at step 8
    resumed to 16 ends on the same bits (the moments, the residual and the step counts travel)."""
    from ddp_helpers import spawn

    spawn(_adam_jobs, 2, str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sims = {}
        for gran in ("layer", "model"):
            sims[gran] = Simulator(RunConfig(**dict(ADAM_BASE, workers=2, granularity=gran)))
            assert sims[gran].cfg.compressor == "topk:memory=adam"
            sims[gran].run()
    finally:
        torch.set_num_threads(threads)
    for gran, sim in sims.items():
        got = torch.load(tmp_path / f"{gran}.pt")
        assert all(torch.equal(a.detach(), b) for a, b in zip(sim.params, got)), gran
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a.detach(), b) for a, b in zip(sims["layer"].params, resumed))


def test_fsdps_exchange_keeps_error_feedback_under_adamw_in_the_simulator_as_in_register():
    sim = Simulator(RunConfig(task="digits-mlp", compressor="topk", ratio=0.05, workers=2, steps=1, optimizer="adamw",
                              fsdp=True))
    assert sim.cfg.compressor == "topk" and not sim.adam


@pytest.mark.parametrize("options", ["scale=mean,nesterov=true,clip=0", "scale=worker,nesterov=false,clip=0.5",
                                     "scale=mean,nesterov=true,clip=0,value_dtype=fp16",
                                     "scale=mean,nesterov=true,clip=0.5,residual_dtype=fp8",
                                     "scale=mean,nesterov=false,clip=0,residual_dtype=bf16"])
@pytest.mark.parametrize("backend", ["compiled", "eager"])
def test_a_groups_adam_update_in_foreach_operations_gives_the_same_bits_as_tensor_by_tensor(options, backend):
    """compress_many advances every tensor's moments and direction in one compiled pass each (``compiled``) or one
    foreach operation per line of the update (``eager``); the numbers are those of the update written out for one
    tensor (_accumulate_one), over steps with a clip that bites and tensors of several shapes."""
    from gradsift import kernels

    if backend == "compiled" and kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    with kernels.using(backend):
        _same_bits_as_tensor_by_tensor(options)


def _same_bits_as_tensor_by_tensor(options):
    shapes = [(30, 20), (20,), (7, 3, 5), (1,), (200,)]
    keys = [f"k{i}" for i in range(len(shapes))]
    spec = f"topk:memory=adam,{options}"
    many, one = (make_compressor(spec, 0.1, world_size=4, rank=1) for _ in range(2))
    many.tensor_count = one.tensor_count = len(shapes)
    one.accumulate = one._accumulate_one
    gen = torch.Generator().manual_seed(3)
    whole = [f"whole{i}" for i in range(len(shapes))]  # the same tensors sent whole, some in their own dtype
    natives = [i % 2 == 0 for i in range(len(shapes))]
    for step in range(4):
        grads = [torch.randn(s, generator=gen) * (10.0 if step == 2 else 1.0) for s in shapes]
        got = many.compress_many(keys, [g.clone() for g in grads])
        want = [one.compress(k, g.clone(), check_finite=False, dense=False) for k, g in zip(keys, grads)]
        assert all(payload_equal(a, b) for a, b in zip(got, want)), step
        got = many.send_whole_many(whole, [g.clone() for g in grads], natives)
        want = [one.compress(k, g.clone(), check_finite=False, dense=True, native=n)
                for k, g, n in zip(whole, grads, natives)]
        assert all(payload_equal(a, b) for a, b in zip(got, want)), step
    a, b = many.state_dict(), one.state_dict()
    for store in ("m", "v", "w", "residual"):
        assert a[store].keys() == b[store].keys(), store
        assert all(torch.equal(a[store][k], b[store][k]) for k in a[store]), store
