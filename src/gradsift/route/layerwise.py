"""LAGS-SGD: layer-wise adaptive sparsification pipelined with backprop -- the planning maths.

Shi, Tang, Wang, Zhao, Chu. "Layer-wise Adaptive Gradient Sparsification for
Distributed Deep Learning with Convergence Guarantees." ECAI 2020
(lags-layerwise-adaptive-sparsification.md).

Every layer is sparsified on its own (Algorithm 1, eq. (5)) as soon as its
gradient is ready, so its communication overlaps the backward computation of
the layers below it (Fig. 1c). The per-layer compression ratio ``c = d/k``
follows eq. (19): the smallest ``c`` whose predicted communication plus
selection time hides under the backward computation that follows the layer,
capped by the upper bound ``c_u`` (``--ratio`` sets ``c_u = 1/ratio``); where
nothing hides -- the first layer, whose gradient is the last one ready -- ``c_u``.

This module is pure planning: it imports neither runtime. Each runtime owns a
controller built on :class:`LagsSchedule` (the simulator's in
:mod:`gradsift.runtime.simulate`, DDP's in :mod:`gradsift.ddp.lags`).

Deviations, with reasons:

* Eq. (19) is printed ``c = max{c_u, min{c | ...}}``; with ``c_u`` called an
  upper bound, that expression would always be at least ``c_u``. We implement
  ``min{c_u, min{c | t_comm(c) + t_spar <= t_comp}}``.
* Layer communications queue on one link. A layer's communication starts when
  its gradient is ready *and* the link is free; the budget of layer l is the
  time from that start to the end of backward. The paper's condition treats
  each layer independently (``t_comm^(l) + t_spar^(l) <= t_comp^(l-1)``); with
  a shared link, several layers that each fit alone can together overflow it.
  Layers are planned greedily in backward order.
* ``t_comm`` is the alpha-beta cost of the all-gather of one wire segment
  (:mod:`gradsift.transport.wire`); ``t_spar`` is the compressor's selection
  time measured on tensors of each layer's size; per-layer backward times come
  from timestamps of gradient readiness (``register_post_accumulate_grad_hook``)
  over a few profiling steps, averaged over ranks in distributed training so
  every rank computes the same plan.

The pipelined step-time model (Fig. 1a/1c) and the maximum pipelining speedup
of eq. (20), written with ``t_h = t_b``::

    S_max = 1 + min(t_b, t_c) / (t_f + max(t_b, t_c))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .netmodel import NetworkModel
from ..transport.wire import HEADER_BYTES, pad


@dataclass
class LayerProfile:
    """Measured timing of one step's backward, per tensor, in communication (backward) order."""

    keys: list[str]
    numels: list[int]
    ready_s: list[float]  # gradient ready, seconds after backward started
    select_s: list[float]  # selection time of a tensor of that size
    forward_s: float
    backward_s: float


def sparse_comm_s(net: NetworkModel, numel: int, ratio: float, world: int, value_bytes: int = 4,
                  index_bytes: int = 4) -> float:
    """Predicted time of one tensor's sparse aggregation: the all-gather of its wire segment."""
    k = max(1, round(ratio * numel))
    return net.allgather_s(HEADER_BYTES + pad(k * index_bytes) + pad(k * value_bytes), world)


def smallest_hidden_ratio_c(net: NetworkModel, numel: int, budget_s: float, world: int, c_u: float,
                            value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Eq. (19): the smallest c in [1, c_u] with t_comm(c) <= budget; c_u when none hides."""
    if world <= 1:
        return 1.0
    fixed = net.allgather_s(HEADER_BYTES, world)
    room = budget_s - fixed
    if room <= 0:
        return c_u
    c = (world - 1) / net.beta * numel * (value_bytes + index_bytes) / room
    return float(min(c_u, max(1.0, c)))


def plan_ratios(profile: LayerProfile, net: NetworkModel, world: int, c_u: float,
                value_bytes: int = 4, index_bytes: int = 4) -> dict[str, float]:
    """Per-layer ratios (1/c) for LAGS-SGD: greedy in backward order over one shared link."""
    ratios: dict[str, float] = {}
    link_free = 0.0
    for key, numel, ready, sel in zip(profile.keys, profile.numels, profile.ready_s, profile.select_s):
        start = max(ready + sel, link_free)
        budget = profile.backward_s - start
        c = smallest_hidden_ratio_c(net, numel, budget, world, c_u, value_bytes, index_bytes)
        ratio = max(1.0 / c, 1.0 / numel)
        ratios[key] = ratio
        link_free = start + sparse_comm_s(net, numel, ratio, world, value_bytes, index_bytes)
    return ratios


def pipelined_step_s(forward_s: float, backward_s: float, ready_s: Sequence[float], select_s: Sequence[float],
                     comm_s: Sequence[float]) -> tuple[float, float]:
    """(step time, time the link is busy) when each tensor communicates as soon as it is ready.

    Tensors are taken in the given (backward) order on one link: a tensor starts
    at max(its ready time + selection, the previous tensor's end).
    """
    link_free = 0.0
    busy = 0.0
    for ready, sel, comm in zip(ready_s, select_s, comm_s):
        start = max(ready + sel, link_free)
        link_free = start + comm
        busy += comm
    return forward_s + max(backward_s, link_free), busy


def s_max(t_f: float, t_b: float, t_c: float) -> float:
    """Eq. (20) with t_h = t_b: the largest speedup pipelining can give over SLGS."""
    if t_f + max(t_b, t_c) <= 0:
        return 1.0
    return 1.0 + min(t_b, t_c) / (t_f + max(t_b, t_c))


def delta_l(sent_sum: torch.Tensor, residual_sum: torch.Tensor, k: int, d: int) -> float:
    """Eq. (21) with the random-k denominator in expectation (eq. (8)):

    ``delta = ||sum_p x_p - sum_p TopK(x_p)||^2 / ((1 - k/d) ||sum_p x_p||^2)``

    where ``x_p`` is worker p's accumulated gradient, so ``sum_p x_p - sum_p TopK(x_p)``
    is the sum of the workers' residuals after sending. Assumption 1 holds where it is <= 1.
    """
    total = sent_sum + residual_sum
    denom = (1.0 - k / d) * float(total.square().sum())
    if denom <= 0:
        return float("nan")
    return float(residual_sum.square().sum()) / denom


class ReadyClock:
    """Timestamps when each parameter's gradient is ready during a backward pass."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]]):
        self.t0 = 0.0
        self.ready: dict[str, float] = {}
        self.handles = []
        self.active = False
        for name, p in named:
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str):
        def fn(_p):
            if self.active:
                self.ready[name] = time.perf_counter() - self.t0
        return fn

    def start(self, t0: float | None = None) -> None:
        self.ready = {}
        self.active = True
        self.t0 = time.perf_counter() if t0 is None else t0

    def stop(self) -> tuple[dict[str, float], float]:
        self.active = False
        return dict(self.ready), time.perf_counter() - self.t0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def measure_selection(make, numels: Sequence[int], calls: int = 5, device: torch.device | str = "cpu") -> list[float]:
    """Median selection time of a fresh compressor from ``make()`` on random tensors of each size."""
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for n in numels:
        comp = make()
        x = torch.randn(n, generator=g, device=device)
        comp.compress("t", x, check_finite=False)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            comp.compress("t", x, check_finite=False)
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts))
    return out


def c_upper(ratio: float) -> float:
    """``c_u = 1/ratio`` (``--ratio`` sets the upper bound of the compression ratio)."""
    return 1.0 / ratio


@dataclass
class LagsSchedule:
    """Profile a few steps, then plan per-layer ratios once: the part both runtimes' controllers share.

    ``average`` (distributed training) turns this worker's profile vector into
    the mean over ranks, so every rank plans alike.
    """

    keys: list[str]
    numels: dict[str, int]
    net: NetworkModel
    world: int
    c_u: float
    profile_steps: int = 3
    skip_steps: int = 2
    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    ready: list[dict[str, float]] = field(default_factory=list)
    profile: LayerProfile | None = None
    ratios: dict[str, float] | None = None

    def wants(self, it: int) -> bool:
        """Whether step ``it`` is one to profile."""
        return self.ratios is None and it >= self.skip_steps

    def add(self, forward_s: float, backward_s: float, ready: dict[str, float]) -> bool:
        """Record one profiled step; True once enough are in to plan."""
        self.forward.append(forward_s)
        self.backward.append(backward_s)
        self.ready.append(ready)
        return len(self.backward) >= self.profile_steps

    def plan(self, select_s: dict[str, float],
             average: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
        keys = self.keys
        med = {k: statistics.median(r[k] for r in self.ready if k in r) if any(k in r for r in self.ready) else 0.0
               for k in keys}
        vec = [statistics.median(self.forward), statistics.median(self.backward)] + [med[k] for k in keys] + \
            [select_s[k] for k in keys]
        if average is not None:
            vec = average(vec)
        n = len(keys)
        ready = dict(zip(keys, vec[2:2 + n]))
        sel = dict(zip(keys, vec[2 + n:2 + 2 * n]))
        order = sorted(keys, key=lambda k: (ready[k], k))
        self.profile = LayerProfile(order, [self.numels[k] for k in order], [ready[k] for k in order],
                                    [sel[k] for k in order], vec[0], vec[1])
        self.ratios = {k: min(1.0, r) for k, r in plan_ratios(self.profile, self.net, self.world, self.c_u).items()}
        return self.ratios

    def report(self) -> dict[str, Any]:
        """The plan and its predicted timing (``summary.json``'s ``lags``)."""
        if self.profile is None or self.ratios is None:
            return {}
        prof, net = self.profile, self.net
        comm = [sparse_comm_s(net, n, self.ratios[k], self.world) for k, n in zip(prof.keys, prof.numels)]
        step, busy = pipelined_step_s(prof.forward_s, prof.backward_s, prof.ready_s, prof.select_s, comm)
        return {
            "c_u": self.c_u,
            "layers": [{"key": k, "numel": n, "ratio": self.ratios[k], "c": 1.0 / self.ratios[k], "ready_s": r,
                        "select_s": s} for k, n, r, s in zip(prof.keys, prof.numels, prof.ready_s, prof.select_s)],
            "forward_s": prof.forward_s,
            "backward_s": prof.backward_s,
            "predicted_step_s": step,
            "predicted_comm_s": busy,
            "s_max": s_max(prof.forward_s, prof.backward_s, busy),
            "bandwidth_gbps": net.bandwidth_gbps,
            "latency_us": net.latency_us,
        }

    def describe(self) -> str:
        """One line per layer, for the console: which layers hide, which run at c_u."""
        if self.profile is None or self.ratios is None:
            return "LAGS: not planned yet"
        lines = [f"LAGS plan (c_u = {self.c_u:g}, backward {1e3 * self.profile.backward_s:.1f} ms):"]
        for k in self.profile.keys:
            r = self.ratios[k]
            why = "dense: hides under backward" if r >= 1.0 else (
                "c_u: nothing left to hide under" if abs(1.0 / r - self.c_u) < 1e-9 * self.c_u else "partly hidden")
            lines.append(f"  {k}: ratio {r:.4g} (c = {1.0 / r:.4g}), {why}")
        return "\n".join(lines)


__all__ = ["LagsSchedule", "LayerProfile", "ReadyClock", "c_upper", "delta_l", "measure_selection",
           "pipelined_step_s", "plan_ratios", "s_max", "smallest_hidden_ratio_c", "sparse_comm_s"]
