"""Small helpers shared by the tests (not fixtures: plain functions)."""

from __future__ import annotations

from typing import Sequence

import torch

from gradsift import make_compressor
from gradsift.compressors import available
from gradsift.transport.local import LocalTransport

# Every registered compressor with its default options, plus option variants worth
# covering. Later methods add their variants here; names not listed are covered by
# their default spec automatically.
EXTRA_VARIANTS = ["randomk:shared=true", "topk:value_dtype=fp16", "regtopk:form=paper", "rtopk:r_over_k=3",
                  "gsb:tau=3", "gs:tau=2,unbiased=true", "rsb:tau=0", "gsb:tau=2,feedback=true", "topk:warmup=3",
                  "sidco:dist=gp", "sidco:dist=gamma", "sidco:stages=1,adapt=false", "dgc:nesterov=true,clip=1.0",
                  "dgc:feedback=false"]


def all_specs() -> list[str]:
    return list(available()) + EXTRA_VARIANTS


def make_workers(spec: str, n: int, ratio: float = 0.1, seed: int = 0, **kw):
    return [make_compressor(spec, ratio, seed=seed, rank=r, world_size=n, **kw) for r in range(n)]


def run_round(comps, keys: Sequence[str], grads_per_worker, transport: LocalTransport | None = None):
    """One synchronous round: every worker compresses, the transport aggregates, all observe.

    Returns (payloads[worker][tensor], means[tensor]).
    """
    n = len(comps)
    transport = transport or LocalTransport(n)
    payloads = [[c.compress(k, g) for k, g in zip(keys, gs)] for c, gs in zip(comps, grads_per_worker)]
    means = []
    for i in range(len(keys)):
        means.append(transport.aggregate([[payloads[w][i]] for w in range(n)]).means[0])
    for c, ps in zip(comps, payloads):
        for k, p, m in zip(keys, ps, means):
            c.observe(k, p, m)
    return payloads, means


def random_grads(n_workers: int, shapes, step: int, seed: int = 0, dtype=torch.float32, dist: str = "normal"):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    out = []
    for _ in range(n_workers):
        ts = []
        for s in shapes:
            t = torch.randn(s, generator=g, dtype=torch.float64)
            if dist == "heavy":
                t = t / torch.rand(s, generator=g, dtype=torch.float64).clamp_min(1e-3)
            ts.append(t.to(dtype))
        out.append(ts)
    return out


def payload_equal(a, b) -> bool:
    if a.kind != b.kind or a.numel != b.numel or a.count != b.count:
        return False
    if not torch.equal(a.values, b.values):
        return False
    if (a.indices is None) != (b.indices is None):
        return False
    return a.indices is None or torch.equal(a.indices, b.indices)
