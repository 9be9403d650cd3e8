"""What a rank is configured with: one settings type, one set of defaults and names for every runtime.

:func:`gradsift.ddp.register`, :func:`gradsift.fsdp.register` and :func:`gradsift.ddp.hook_state` take these as
keywords (anything else is the compressor's option), and ``gradsift train`` builds them from its run description
(:meth:`gradsift.runtime.runconfig.RunConfig.settings`). They are checked once, where they are given, for the runtime
that will run them (:meth:`Settings.check`): a bad spec or a setting the runtime cannot take is one line there,
not an error inside backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..route.owners import SCATTER_KEEP
from ..errors import ConfigError
from ..memory.factory import make_compressor
from ..memory.momentum import recipe_spec
from ..route.measure import check_settings
from ..route.routing import RUNTIMES, check_support
from ..transport.base import SUM_ORDERS

GRANULARITIES = ("layer", "model")
NONFINITE = ("error", "skip")
WIRE_PLANS = ("auto", "measure", "off")


def wire_plan_name(value: Any) -> str | None:
    """``True``/``"auto"``, ``"measure"``, ``False``/``"off"`` as a name; None stays None (the runtime's default)."""
    if value is None:
        return None
    if value is True or value == "auto":
        return "auto"
    if value is False or value == "off":
        return "off"
    if value == "measure":
        return "measure"
    raise ConfigError(f"wire_plan must be True, False, 'auto', 'measure' or 'off', got {value!r}")


@dataclass
class Settings:
    """A rank's settings besides the model (the same names and defaults for DDP, FSDP and HSDP).

    ``compressor``     a spec (``"topk"``, ``"sidco:dist=gp"``); ``ratio`` its ratio in (0, 1]
    ``granularity``    ``"layer"`` (each parameter -- under FSDP each FSDP module -- keyed by name) or ``"model"``
                       (one DDP bucket, flattened; DDP only)
    ``seed``           the compressors' seed (every rank the same)
    ``weights``        one per rank: a weighted mean instead of the plain one (DDP only)
    ``on_nonfinite``   ``"error"`` (every rank raises ``NonFiniteGradient``) or ``"skip"`` (the step is skipped on
                       every rank: ``end_step()`` returns True, the optimizer's step does nothing, rank 0 says so
                       in one line); default ``"skip"`` where an optimizer is handed over (``optimizer=``), as
                       AMP's gradient scaler skips a step with an infinite gradient, else ``"error"``
    ``bandwidth_gbps``, ``latency_us``   the link, for the wire plan and the alpha-beta estimates
    ``wire_plan``      ``True``/``"auto"`` (tiny tensors whole, slow all-gathers densified), ``"measure"`` (that
                       plan kept only if timed steps beat whole ones, DDP only, :mod:`gradsift.route.measure`),
                       ``False``/``"off"`` (every tensor as the method says)
    ``measure``        the measured plan's settings: ``warmup``, ``block``, ``rounds``, ``margin``, ``narrow_margin``
    ``min_numel``      tensors up to this size go whole (default: what one message latency carries)
    ``merge_small``    (DDP) small per-layer payloads wait for the next bucket's message (LAGS Sec. 5)
    ``sum_order``      ``"backend"`` (the all-reduce's own order) or ``"rank"`` (the simulator's bits at any world
                       size; sums travel by all-gather, :mod:`gradsift.transport.dist`)
    ``sparse_collective``  ``"auto"`` or ``"gather"`` (sparse payloads by all-gather, or densified where the plan
                       prices an all-reduce cheaper) or ``"scatter"`` (the owners' sparse reduce-scatter, only when
                       asked: it costs quality; :mod:`gradsift.route.routing`); under FSDP every tensor goes to its
                       shards' owners
    ``scatter_keep``   on the scatter route the owners keep this many times k of the sum (default 4); a rank
                       receives about ``1.25 + scatter_keep`` times k a step. Keeping less than the all-gather's
                       mean holds costs quality: at 8 workers keep 4 lost 0.3 perplexity on gptlm, 1.75 lost 0.9
    ``process_group``  (DDP) the group to communicate on (default: the DDP model's, or the default group)
    ``recipe``         the method's measured training for the optimizer handed over (default on; with momentum SGD,
                       Nesterov momentum: :func:`gradsift.memory.momentum.momentum_recipe`); False keeps it as given
    ``options``        everything else: the compressor's options (``value_dtype``, ``momentum``, ...)
    """

    compressor: str
    ratio: float | None = None
    granularity: str = "layer"
    seed: int = 0
    weights: Sequence[float] | None = None
    on_nonfinite: str | None = None  # None: "skip" with an optimizer handed over, else "error"
    bandwidth_gbps: float = 1.0
    latency_us: float = 50.0
    wire_plan: bool | str = True
    measure: dict[str, Any] | None = None
    min_numel: int | None = None
    merge_small: bool = True
    sum_order: str = "backend"
    sparse_collective: str = "auto"
    scatter_keep: float = SCATTER_KEEP
    process_group: Any = None
    recipe: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    said = None  # (not a setting) the line saying what the method's recipe changed: set by of(), printed on rank 0

    @classmethod
    def of(cls, compressor: str, ratio: float | None, kwargs: dict[str, Any], runtime: str, *,
           optimizer=None) -> "Settings":
        """Settings from keyword arguments (the ones that are not settings are the compressor's options), checked
        for ``runtime``. ``optimizer``: handed over (``register(..., optimizer=)``): the method takes its recipe
        for it unless ``recipe=False`` (:func:`gradsift.memory.momentum.recipe_spec`; not Adam's under FSDP, where the
        workers' moments would be unsharded copies of the model), the line that says so is ``said`` (for rank 0
        to print), and ``on_nonfinite`` defaults to skip."""
        said = None
        if optimizer is not None and kwargs.get("recipe", True):
            compressor, said = recipe_spec(compressor, optimizer, adam=runtime not in ("fsdp", "hsdp"))
        names = cls.names()
        s = cls(compressor, ratio, **{k: v for k, v in kwargs.items() if k in names},
                options={k: v for k, v in kwargs.items() if k not in names})
        if s.on_nonfinite is None:
            s.on_nonfinite = "skip" if optimizer is not None else "error"
        s.said = said
        return s.check(runtime)

    @classmethod
    def names(cls) -> set[str]:
        """The keyword names of the settings (besides the compressor and its ratio)."""
        return {f.name for f in fields(cls)} - {"compressor", "ratio", "options"}

    def check(self, runtime: str) -> "Settings":
        """Every setting checked for ``runtime`` (one of ``sim``, ``ddp``, ``fsdp``, ``hsdp``, ``local``), in one line
        each."""
        assert runtime in RUNTIMES, runtime
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.on_nonfinite is None:
            self.on_nonfinite = "error"
        if self.on_nonfinite not in NONFINITE:
            raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {self.on_nonfinite!r}")
        if self.sum_order not in SUM_ORDERS:
            raise ConfigError(f"sum_order must be one of {', '.join(SUM_ORDERS)}, got {self.sum_order!r}")
        for name, lo in (("bandwidth_gbps", 0.0), ("latency_us", -1e-300)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > lo):
                raise ConfigError(f"{name} must be a finite number {'> 0' if lo == 0 else '>= 0'}, got {v!r}")
        self.wire_plan = wire_plan_name(self.wire_plan) or "auto"
        self.measure = check_settings(self.measure)
        if self.measure and self.wire_plan != "measure":
            raise ConfigError("measure= sets the measured wire plan's steps: it needs wire_plan='measure'")
        if runtime in ("fsdp", "hsdp"):
            for bad, what in ((self.granularity != "layer", "granularity='model' (FSDP compresses each module)"),
                              (self.weights is not None, "weights="),
                              (self.wire_plan == "measure", "wire_plan='measure' (it times DDP's steps)"),
                              (self.process_group is not None, "process_group= (FSDP's own groups are used)")):
                if bad:
                    raise ConfigError(f"{what} is not available under FSDP or HSDP")
        # bad specs and what the runtime cannot carry fail now, not inside backward
        check_support(make_compressor(self.compressor, self.ratio, **self.options), runtime=runtime,
                      sparse_collective=self.sparse_collective, scatter_keep=self.scatter_keep)
        return self

    def keywords(self) -> dict[str, Any]:
        """These settings as the keywords ``register`` takes (the compressor's options among them)."""
        return {**{name: getattr(self, name) for name in self.names()}, **self.options}

    def describe(self) -> dict[str, Any]:
        """The settings that must agree between ranks (beside the compressor's configuration)."""
        return {"granularity": self.granularity, "on_nonfinite": self.on_nonfinite, "merge_small": self.merge_small,
                "sum_order": self.sum_order, "sparse_collective": self.sparse_collective,
                "scatter_keep": self.scatter_keep,
                "wire_plan": {"plan": self.wire_plan, "measure": self.measure, "min_numel": self.min_numel,
                              "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}}
