"""LAGS-SGD: layer-wise adaptive sparsification pipelined with backprop.

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
* ``t_comm`` is the alpha-beta cost of the sparse all-gather gradsift issues
  (count exchange plus packed values and indices); ``t_spar`` is the
  compressor's selection time measured on tensors of each layer's size;
  per-layer backward times come from timestamps of gradient readiness
  (``register_post_accumulate_grad_hook``) over a few profiling steps, averaged
  over ranks in distributed training so every rank computes the same plan.

The pipelined step-time model (Fig. 1a/1c) and the maximum pipelining speedup
of eq. (20), written with ``t_h = t_b``::

    S_max = 1 + min(t_b, t_c) / (t_f + max(t_b, t_c))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .netmodel import NetworkModel


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
    """Predicted time of one tensor's sparse aggregation: count exchange + packed all-gather."""
    k = max(1, round(ratio * numel))
    return net.allgather_s(8, world) + net.allgather_s(k * (value_bytes + index_bytes), world)


def smallest_hidden_ratio_c(net: NetworkModel, numel: int, budget_s: float, world: int, c_u: float,
                            value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Eq. (19): the smallest c in [1, c_u] with t_comm(c) <= budget; c_u when none hides."""
    fixed = net.allgather_s(8, world) + (world - 1) * net.alpha
    per_byte = (world - 1) / net.beta
    room = budget_s - fixed
    if room <= 0 or world <= 1:
        return c_u if world > 1 else 1.0
    c = per_byte * numel * (value_bytes + index_bytes) / room
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

    def start(self) -> None:
        self.ready = {}
        self.active = True
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[dict[str, float], float]:
        self.active = False
        return dict(self.ready), time.perf_counter() - self.t0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def measure_selection(compressor_spec: str, numels: Sequence[int], ratio: float, calls: int = 5,
                      device: torch.device | str = "cpu") -> list[float]:
    """Median selection time of the compressor on random tensors of each size (no memory)."""
    from .compressors import make_compressor

    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for n in numels:
        comp = make_compressor(compressor_spec, ratio) if "feedback=" in compressor_spec else \
            make_compressor(compressor_spec, ratio, feedback=False)
        x = torch.randn(n, generator=g, device=device)
        comp.compress("t", x, check_finite=False)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            comp.compress("t", x, check_finite=False)
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts))
    return out


@dataclass
class ProfileAccumulator:
    """Per-step measurements collected during profiling, reduced to a :class:`LayerProfile`."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    ready: list[dict[str, float]] = field(default_factory=list)

    def add(self, forward_s: float, backward_s: float, ready: dict[str, float]) -> None:
        self.forward.append(forward_s)
        self.backward.append(backward_s)
        self.ready.append(ready)

    def reduce(self, keys: Sequence[str], numels: dict[str, int], select: dict[str, float]) -> LayerProfile:
        med = {k: statistics.median(r[k] for r in self.ready if k in r) for k in keys}
        order = sorted(keys, key=lambda k: med[k])
        return LayerProfile(order, [numels[k] for k in order], [med[k] for k in order],
                            [select[k] for k in order], statistics.median(self.forward),
                            statistics.median(self.backward))


def c_upper(ratio: float) -> float:
    """``c_u = 1/ratio`` (``--ratio`` sets the upper bound of the compression ratio)."""
    return 1.0 / ratio


def profile_vector(profile: LayerProfile) -> list[float]:
    return [profile.forward_s, profile.backward_s] + list(profile.ready_s) + list(profile.select_s)


def report(profile: LayerProfile | None, ratios: dict[str, float] | None, net: NetworkModel, world: int,
           c_u: float) -> dict[str, Any]:
    if profile is None or ratios is None:
        return {}
    comm = [sparse_comm_s(net, n, ratios[k], world) for k, n in zip(profile.keys, profile.numels)]
    step, busy = pipelined_step_s(profile.forward_s, profile.backward_s, profile.ready_s, profile.select_s, comm)
    return {
        "c_u": c_u,
        "layers": [{"key": k, "numel": n, "ratio": ratios[k], "c": 1.0 / ratios[k], "ready_s": r, "select_s": s}
                   for k, n, r, s in zip(profile.keys, profile.numels, profile.ready_s, profile.select_s)],
        "forward_s": profile.forward_s,
        "backward_s": profile.backward_s,
        "predicted_step_s": step,
        "predicted_comm_s": busy,
        "s_max": s_max(profile.forward_s, profile.backward_s, busy),
        "bandwidth_gbps": net.bandwidth_gbps,
        "latency_us": net.latency_us,
    }


class LagsController:
    """Profiles a DDP model for a few steps, plans the per-layer ratios, and applies them on every rank."""

    def __init__(self, ddp_model, state, cfg, profile_steps: int = 3, skip_steps: int = 2):
        import torch.distributed as dist

        self.dist = dist
        self.state = state
        self.cfg = cfg
        self.named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self.numels = {n: p.numel() for n, p in self.named}
        self.clock = ReadyClock(self.named)
        self.acc = ProfileAccumulator()
        self.profile_steps = profile_steps
        self.skip_steps = skip_steps
        self.profile: LayerProfile | None = None
        self.ratios: dict[str, float] | None = None
        self.c_u = c_upper(cfg.ratio)
        self.t_backward0 = 0.0
        if state.granularity != "layer":
            from .runconfig import ConfigError

            raise ConfigError("--lags compresses layer by layer: use --granularity layer")

    @property
    def planned(self) -> bool:
        return bool(self.state.compressor.inner.layer_ratios)

    def reapply(self) -> None:
        """After a resume the plan comes back with the compressor state; stop profiling."""
        if self.planned:
            self.ratios = dict(self.state.compressor.inner.layer_ratios)
            self.clock.remove()

    def before_backward(self, it: int) -> None:
        if not self.planned and it >= self.skip_steps:
            self.clock.start()

    def after_backward(self, it: int) -> None:
        if self.planned or it < self.skip_steps:
            return
        ready, backward = self.clock.stop()
        self.acc.add(0.0, backward, ready)
        if len(self.acc.backward) >= self.profile_steps:
            self.plan()

    def plan(self) -> None:
        keys = [n for n, _ in self.named]
        select = measure_selection(self.cfg.compressor, [self.numels[k] for k in keys], self.cfg.ratio)
        local = self.acc.reduce(keys, self.numels, dict(zip(keys, select)))
        # average the profile over ranks (in one fixed key order) so every rank plans alike
        vec = torch.tensor([local.forward_s, local.backward_s] + [local.ready_s[local.keys.index(k)] for k in keys]
                           + [local.select_s[local.keys.index(k)] for k in keys], dtype=torch.float64)
        from .ddp import control_device

        vec = vec.to(control_device(self.state.group))
        self.dist.all_reduce(vec, group=self.state.group)
        vec /= self.state.world_size
        vals = vec.cpu().tolist()
        n = len(keys)
        ready = dict(zip(keys, vals[2:2 + n]))
        sel = dict(zip(keys, vals[2 + n:2 + 2 * n]))
        order = sorted(keys, key=lambda k: (ready[k], k))
        self.profile = LayerProfile(order, [self.numels[k] for k in order], [ready[k] for k in order],
                                    [sel[k] for k in order], vals[0], vals[1])
        self.ratios = plan_ratios(self.profile, self.state.net, self.state.world_size, self.c_u)
        for k, r in self.ratios.items():
            self.state.compressor.inner.set_layer_ratio(k, min(1.0, r))
        from .ddp import verify_same_config

        verify_same_config(self.state)
        self.clock.remove()

    def report(self) -> dict[str, Any]:
        return report(self.profile, self.ratios, self.state.net, self.state.world_size, self.c_u)


class SimLags:
    """LAGS-SGD in the simulator: profile a few steps, plan per-layer ratios, apply them to every worker."""

    def __init__(self, sim, profile_steps: int = 3, skip_steps: int = 2):
        self.sim = sim
        self.profile_steps = profile_steps
        self.skip_steps = skip_steps
        self.acc = ProfileAccumulator()
        self.profile: LayerProfile | None = None
        self.ratios: dict[str, float] | None = None
        self.c_u = c_upper(sim.cfg.ratio)

    @property
    def planned(self) -> bool:
        return bool(self.sim.compressors[0].inner.layer_ratios)

    def observe_step(self, it: int, per_tensor_select: Sequence[float]) -> None:
        if self.planned or it < self.skip_steps or not self.sim.timing:
            return
        fwd, bwd, ready = max(self.sim.timing, key=lambda t: t[0] + t[1])
        self.acc.add(fwd, bwd, ready)
        if len(self.acc.backward) >= self.profile_steps:
            self.plan()

    def plan(self) -> None:
        sim = self.sim
        numels = {k: p.numel() for k, p in zip(sim.keys, sim.params)}
        select = measure_selection(sim.cfg.compressor, [numels[k] for k in sim.keys], sim.cfg.ratio)
        self.profile = self.acc.reduce(sim.keys, numels, dict(zip(sim.keys, select)))
        self.ratios = plan_ratios(self.profile, sim.net, sim.n, self.c_u)
        for comp in sim.compressors:
            for k, r in self.ratios.items():
                comp.inner.set_layer_ratio(k, min(1.0, r))

    def report(self) -> dict[str, Any]:
        return report(self.profile, self.ratios, self.sim.net, self.sim.n, self.c_u)


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


__all__ = ["LayerProfile", "LagsController", "delta_l", "pipelined_step_s", "plan_ratios", "s_max",
           "smallest_hidden_ratio_c", "sparse_comm_s"]
