"""The compiled kernels have bodies for several instruction sets (AVX-512, AVX2, none): a machine runs one of them,
and another machine of a cluster may run another. Every body must compute the same numbers. Here the kernels are
compiled again with the wider sets turned off and every method's selections, memories and the watch's figures are
compared with this machine's own build, bit for bit."""

from __future__ import annotations

import platform

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.kernels import native
from gradsift.kernels.figures import figures_many

METHODS = ["topk", "rtopk", "randomk", "regtopk", "sidco", "dgc", "dgc:nesterov=true", "gaussiank", "redsync", "gsb",
           "topk:memory=momentum"]
SHAPES = [(3000,), (64, 3, 7, 7), (300, 400), (1000, 257), (50_001,), (96,)]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def variants() -> list[tuple[str, list[str]]]:
    """The narrower builds this machine can run: without AVX-512 (where it has AVX-512), without AVX2 (x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    out = []
    if "avx512f" in flags:
        out.append(("avx2", ["-O3", "-march=native", "-mno-avx512f"]))
    out.append(("plain", ["-O3", "-march=x86-64"]))
    return out


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    if kernels.backend() != "compiled":
        pytest.skip("no compiled kernels here")
    if not variants():
        pytest.skip("no narrower instruction set to build for on this machine")
    d = tmp_path_factory.mktemp("isa")
    return {name: native.build_with(flags, d / f"select-{name}.so") for name, flags in variants()}


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for shape in SHAPES:
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 1.5)  # heavy tails
        out.append(x)
    out[0][::7] = out[0][3]  # ties at one magnitude
    fixed = torch.randperm(50_001, generator=torch.Generator().manual_seed(7))  # the same places every step:
    out[4].clamp_(-400.0, 400.0)  # thousands of entries tie exactly at the k-th magnitude, step after step
    out[4][fixed[:2000]] = 500.0 * torch.sign(torch.randn(2000, generator=g))
    out[4][fixed[2000:2300]] = 1000.0
    bits = torch.randint(0x3F800000, 0x41000000, (1200,), generator=g, dtype=torch.int64)
    halfway = (((bits >> 16) << 16) | 0x8000).to(torch.int32).view(torch.float32) * 64.0  # (large, and halfway
    out[2].view(-1)[::100] = halfway  # between two bf16 values: their rounding goes to even)
    return out


def run(spec: str, lib) -> list:
    """Five steps of ``spec`` over SHAPES on library ``lib``: every payload's indices and value bits, then the
    memory's stores."""
    old = kernels._state["lib"]
    kernels._state["lib"] = lib
    try:
        c = make_compressor(spec, 0.01, seed=3, rank=0)
        keys = [f"t{i}" for i in range(len(SHAPES))]
        got = []
        for step in range(5):
            sents = c.compress_many(keys, gradients(step))
            for p in sents:
                got.append((p.kind, None if p.indices is None else p.indices.clone(), p.values.float().clone()))
            if c.OBSERVES:
                c.observe_many(keys, sents, [v.reshape(-1) * 0.5 for v in gradients(step + 50)])
        stores = getattr(c, "stores", lambda: {})()
        got.append({name: {k: t.clone() for k, t in store.items()} for name, store in stores.items()})
        return got
    finally:
        kernels._state["lib"] = old


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                                                         b.view(torch.uint8) if b.numel() else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("spec", METHODS)
def test_every_instruction_set_selects_the_same_entries_and_keeps_the_same_memory(libraries, spec):
    mine = run(spec, kernels._state["lib"])
    for name, lib in libraries.items():
        assert same(run(spec, lib), mine), (spec, name)


def test_every_instruction_set_gives_the_same_figures(libraries):
    gs = gradients(0) + [torch.tensor([1.0, float("nan"), 2.0]), torch.empty(0)]
    flat = [g.reshape(-1) for g in gs]
    mine = figures_many(flat)
    old = kernels._state["lib"]
    try:
        for name, lib in libraries.items():
            kernels._state["lib"] = lib
            got = figures_many(flat)
            assert same(got[0], mine[0]) and torch.equal(got[1].isnan(), mine[1].isnan()), name
            assert torch.equal(torch.nan_to_num(got[1]), torch.nan_to_num(mine[1])), name
    finally:
        kernels._state["lib"] = old
