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
                  "dgc:feedback=false", "powersgd:start=2,approx_rank=2", "topk:memory=momentum", "sidco:paper=true"]


def all_specs() -> list[str]:
    return list(available()) + EXTRA_VARIANTS


def make_workers(spec: str, n: int, ratio: float = 0.1, seed: int = 0, **kw):
    return [make_compressor(spec, ratio, seed=seed, rank=r, world_size=n, **kw) for r in range(n)]


def run_round(comps, keys: Sequence[str], grads_per_worker, transport: LocalTransport | None = None):
    """One synchronous round through the road every runtime uses (no wire plan): every worker remembers and
    selects, the in-process transport aggregates (in as many rounds as the method needs), all observe.

    Returns (payloads[worker][tensor] of the first round, means[tensor]).
    """
    from gradsift.runtime.road import Group, Road, round_trip

    n = len(comps)
    one = lambda key, x: Group([key], [x.shape], x.dtype, lambda: [x])  # noqa: E731 (no buffer: nothing in place)
    group = transport or LocalTransport(n)
    roads = [Road(c) for c in comps]
    payloads = [[] for _ in range(n)]
    means = []
    for i, key in enumerate(keys):
        trips, outs = round_trip(roads, [one(key, gs[i]) for gs in grads_per_worker],
                                 [group.endpoint(w) for w in range(n)])
        for w, t in enumerate(trips):
            payloads[w].append(t.payloads[0])
        means.append(outs[0][0])
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


def same_state(a, b, nonzero: bool = False) -> bool:
    """Two saved states equal bit for bit (nested dicts, lists and tensors); with ``nonzero``, some tensor in them
    also holds a non-zero entry (so the comparison is not of two empty memories)."""
    seen = []

    def eq(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.is_floating_point() and x.numel():
                seen.append(bool(x.ne(0).any()))
            return torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        return x == y

    return eq(a, b) and (not nonzero or any(seen))


def assert_same_rank_state(sa: dict, sb: dict, rank: int, step: int) -> None:
    """Two saved rank states (``Rank.state_dict()``) of a run that stopped and resumed and of one that did not: the
    same rank and step, the same counted totals (timings aside), the same memory bit for bit, and not empty."""
    counted = [{k: v for k, v in s["totals"].items() if not k.endswith("_s")} for s in (sa, sb)]
    assert sa["rank"] == sb["rank"] == rank and sa["step"] == sb["step"] == step, (rank, sa["step"], sb["step"])
    assert counted[0] == counted[1] and counted[0]["steps"] == step, (rank, counted)
    assert same_state(sa["compressor_state"], sb["compressor_state"], nonzero=True), rank
