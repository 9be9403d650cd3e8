"""The hook's settings, documented and checked once (``register`` and ``hook_state`` take the same), and the road
they build on a process group."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..factory import make_compressor
from ..measure import Measurement, check_settings
from ..netmodel import NetworkModel
from ..plan import SCATTER_ROUTE, WirePlan, check_collective
from ..road import Road
from ..routing import Routing
from ..runconfig import GRANULARITIES, NONFINITE, SUM_ORDERS, wire_plan_name
from ..transport.dist import DistTransport


@dataclass
class HookSettings:
    """What :func:`gradsift.ddp.register` and :func:`gradsift.ddp.hook_state` accept besides the model.

    ``compressor``     a spec (``"topk"``, ``"sidco:dist=gp"``); ``ratio`` its ratio in (0, 1]
    ``granularity``    ``"layer"`` (each parameter, keyed by name) or ``"model"`` (one bucket, flattened)
    ``seed``           the compressors' seed (every rank the same)
    ``weights``        one per rank: a weighted mean instead of the plain one
    ``on_nonfinite``   ``"error"`` (every rank raises ``NonFiniteGradient``) or ``"skip"`` (the step is skipped on
                       every rank: ``end_step()`` returns True)
    ``bandwidth_gbps``, ``latency_us``   the link, for the wire plan and the alpha-beta estimates
    ``wire_plan``      ``True``/``"auto"`` (tiny tensors whole, slow all-gathers densified), ``"measure"`` (that
                       plan kept only if timed steps beat whole ones, :mod:`gradsift.measure`), ``False``/``"off"``
                       (every tensor as the method says)
    ``measure``        the measured plan's settings: ``warmup``, ``block``, ``rounds``, ``margin``, ``narrow_margin``
    ``min_numel``      tensors up to this size go whole (default: what one message latency carries)
    ``merge_small``    small per-layer payloads wait for the next bucket's message (LAGS Sec. 5)
    ``sum_order``      ``"backend"`` (the all-reduce's own order) or ``"rank"`` (the simulator's bits at any world
                       size; sums travel by all-gather, :mod:`gradsift.transport.dist`)
    ``sparse_collective``  ``"auto"`` (the wire plan picks all-gather or the owners' scatter per tensor), ``"gather"``
                       or ``"scatter"`` (:mod:`gradsift.plan`)
    ``scatter_keep``   the owners keep this many times k of the sum (1: the sum's k largest); a rank receives
                       about ``1.25 + scatter_keep`` times k a step
    ``process_group``  the group to communicate on (default: the DDP model's, or the default group)
    ``options``        everything else: the compressor's options (``value_dtype``, ``momentum``, ...)
    """

    compressor: str
    ratio: float | None = None
    granularity: str = "layer"
    seed: int = 0
    weights: Sequence[float] | None = None
    on_nonfinite: str = "error"
    bandwidth_gbps: float = 1.0
    latency_us: float = 50.0
    wire_plan: bool | str = True
    measure: dict[str, Any] | None = None
    min_numel: int | None = None
    merge_small: bool = True
    sum_order: str = "backend"
    sparse_collective: str = "auto"
    scatter_keep: float = 1.0
    process_group: Any = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, compressor: str, ratio: float | None, kwargs: dict[str, Any]) -> "HookSettings":
        """Settings from keyword arguments; the ones that are not settings are the compressor's options."""
        names = {f.name for f in fields(cls)} - {"compressor", "ratio", "options"}
        s = cls(compressor, ratio, **{k: v for k, v in kwargs.items() if k in names},
                options={k: v for k, v in kwargs.items() if k not in names})
        return s.check()

    def check(self) -> "HookSettings":
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.on_nonfinite not in NONFINITE:
            raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {self.on_nonfinite!r}")
        if self.sum_order not in SUM_ORDERS:
            raise ConfigError(f"sum_order must be one of {', '.join(SUM_ORDERS)}, got {self.sum_order!r}")
        self.wire_plan = wire_plan_name(self.wire_plan) or "auto"
        self.measure = check_settings(self.measure)
        if self.measure and self.wire_plan != "measure":
            raise ConfigError("measure= sets the measured wire plan's steps: it needs wire_plan='measure'")
        # bad specs fail now, not inside backward
        check_collective(make_compressor(self.compressor, self.ratio, **self.options), self.sparse_collective,
                         self.scatter_keep)
        return self

    def build(self, named: Sequence[tuple[str, torch.nn.Parameter]], group, aside: str | None):
        """(transport, road) for this rank of ``group``; ``aside``: why the runtime cannot stand aside, if so."""
        transport = DistTransport(group, self.weights, self.sum_order)
        n, rank = transport.world_size, transport.rank
        comp = make_compressor(self.compressor, self.ratio, seed=self.seed, rank=rank, world_size=n,
                               weight=self.weights[rank] if self.weights is not None else None, **self.options)
        net = NetworkModel(self.bandwidth_gbps, self.latency_us)
        plan = WirePlan(net, n, enabled=self.wire_plan != "off", min_numel=self.min_numel,
                        sparse_collective=self.sparse_collective, scatter_keep=self.scatter_keep)
        dtypes = {p.dtype for _, p in named}
        dtype = named[0][1].dtype if named else torch.float32
        tensors = ([("model", (sum(p.numel() for _, p in named),), dtype)] if self.granularity == "model"
                   else [(name, tuple(p.shape), p.dtype) for name, p in named])
        measurement = None
        if self.wire_plan == "measure" and n > 1:
            narrow = comp.inner.value_dtype is not None and dtypes != {comp.inner.value_dtype}
            scattered = any(plan.decide(comp, k, s, dt).route == SCATTER_ROUTE for k, s, dt in tensors)
            measurement = Measurement(narrow=narrow, scattered=scattered, combine=lambda v: max_over_ranks(v, group),
                                      **self.measure)
        why = aside
        if why is None and transport.weights is not None:
            why = "the mean is weighted (DDP's own all-reduce is not)"
        if why is None and transport.ranked:
            why = "sums run in rank order (sum_order='rank'; DDP's own all-reduce sums in the backend's)"
        routing = Routing(plan, tensors, measurement=measurement, aside=why)
        return transport, Road(comp, routing, net=net, on_nonfinite=self.on_nonfinite, party="rank")

    def describe(self) -> dict[str, Any]:
        """The settings that must agree between ranks (beside the compressor's configuration)."""
        return {"granularity": self.granularity, "on_nonfinite": self.on_nonfinite, "merge_small": self.merge_small,
                "sum_order": self.sum_order, "sparse_collective": self.sparse_collective,
                "scatter_keep": self.scatter_keep,
                "wire_plan": {"plan": self.wire_plan, "measure": self.measure, "min_numel": self.min_numel,
                              "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}}


def max_over_ranks(values: list[float], group) -> list[float]:
    """The largest of every rank's values, element by element (one blocking all-reduce; outside the hook)."""
    from .consensus import control_device

    t = torch.tensor(values, dtype=torch.float64, device=control_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def bucket_mb_for(named: Sequence[tuple[str, torch.nn.Parameter]]) -> float:
    """The ``bucket_cap_mb`` that puts every gradient in one DDP bucket (whole-model compression, PowerSGD on
    gloo): their size in MiB, 5% and 0.01 MiB over."""
    total = sum(p.numel() * p.element_size() for _, p in named)
    return total / 2**20 * 1.05 + 0.01
