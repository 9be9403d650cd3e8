"""What a rank is configured with: one settings type, one set of defaults and names for every runtime.

:func:`gradsift.ddp.register`, :func:`gradsift.fsdp.register` and :func:`gradsift.ddp.hook_state` take these as
keywords (anything else is the compressor's option), and ``gradsift train`` builds them from its run description
(:meth:`gradsift.runtime.runconfig.RunConfig.settings`). They are checked once, where they are given, for the runtime
that will run them (:meth:`Settings.check`): a bad spec or a setting the runtime cannot take is one line there,
not an error inside backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..route.owners import SCATTER_KEEP
from ..errors import ConfigError, OptionError
from ..memory.factory import make_compressor
from ..memory.recipes import recipe_spec
from ..route.measure import check_settings
from ..route.routing import RUNTIMES, SPARSE_COLLECTIVES, check_support
from ..options import Option
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


SETTINGS = {
    "granularity": Option.choice("layer", GRANULARITIES, doc="layer: each parameter (under FSDP each FSDP module) "
                                 "compressed on its own, keyed by name; model: each DDP bucket (in the simulator the "
                                 "whole model) flattened into one tensor, not under FSDP"),
    "seed": Option.integer(0, lo=0, hi=2 ** 63 - 1, doc="the compressors' seed (every rank the same)"),
    "weights": Option.custom(None, takes="a list of numbers > 0, one per rank (or unset)",
                             doc="a weighted mean instead of the plain one (DDP only)"),
    "on_nonfinite": Option.choice(None, NONFINITE, optional=True,
                                  doc="a NaN or Inf gradient raises NonFiniteGradient on every rank (error) or skips "
                                      "the step on every rank (skip: end_step() returns True, the optimizer's step "
                                      "does nothing, rank 0 says so); unset: skip where an optimizer is handed over, "
                                      "as AMP's gradient scaler, else error"),
    "bandwidth_gbps": Option.number(1.0, lo=0.0, lo_open=True, doc="the link's bandwidth in Gbit/s, for the wire "
                                                                   "plan and the alpha-beta estimates"),
    "latency_us": Option.number(50.0, lo=0.0, doc="the link's latency per message in microseconds, for the wire plan "
                                                  "and the alpha-beta estimates"),
    "wire_plan": Option.choice("auto", WIRE_PLANS, doc="what may be sent other than the method says: auto (or True): "
                               "tiny tensors whole, an all-gather slower than an all-reduce densified; measure: that "
                               "plan kept only if timed steps beat whole ones (DDP only); off (or False): every "
                               "tensor as the method says"),
    "measure": Option.custom(None, takes="a dict of warmup, block, rounds, margin, narrow_margin",
                             doc="the measured plan's steps and margins (wire_plan='measure')"),
    "min_numel": Option.integer(None, lo=0, optional=True, doc="tensors up to this size go whole (unset: what one "
                                                               "message's latency carries)"),
    "merge_small": Option.flag(True, doc="(DDP) small per-layer payloads wait for the next bucket's message (LAGS "
                                         "Sec. 5)"),
    "sum_order": Option.choice("backend", SUM_ORDERS, doc="backend: the all-reduce sums in its own order; rank: in "
                               "rank order, the simulator's bits at any world size (sums then travel by all-gather)"),
    "sparse_collective": Option.choice("auto", SPARSE_COLLECTIVES, doc="gather: every rank receives every sparse "
                                       "payload; auto: the same, densified where the plan prices an all-reduce cheaper; "
                                       "scatter: owners of index regions sum and keep scatter_keep times k (costs "
                                       "quality; only when asked). Under FSDP every tensor goes to its shards' owners"),
    "scatter_keep": Option.number(SCATTER_KEEP, lo=1.0, hi=1e6, doc="on the scatter route the owners keep this many "
                                  "times k of the sum; a rank receives about 1.25 + scatter_keep times k a step"),
    "process_group": Option.custom(None, takes="a torch.distributed process group",
                                   doc="(DDP) the group to communicate on (unset: the DDP model's, or the default)"),
    "recipe": Option.flag(True, doc="the method's measured training for the optimizer handed over (with momentum "
                                    "SGD, Nesterov momentum; with AdamW, Adam's direction compressed); False keeps "
                                    "the method and the optimizer as given"),
}


@dataclass
class Settings:
    """A rank's settings besides the model: the same names, defaults and checks for DDP, FSDP, HSDP and local SGD.

    ``compressor`` is a spec (``"topk"``, ``"sidco:dist=gp"``, or a :class:`gradsift.memory.spec.Spec`) and
    ``ratio`` its ratio in (0, 1]; each other setting is declared once in :data:`SETTINGS` (its type, default,
    bounds and meaning; the API reference lists them); ``options`` holds everything else: the compressor's options
    (``value_dtype``, ``momentum``, ...).
    """

    compressor: Any
    ratio: float | None = None
    granularity: str = SETTINGS["granularity"].default
    seed: int = SETTINGS["seed"].default
    weights: Sequence[float] | None = None
    on_nonfinite: str | None = None  # None: "skip" with an optimizer handed over, else "error"
    bandwidth_gbps: float = SETTINGS["bandwidth_gbps"].default
    latency_us: float = SETTINGS["latency_us"].default
    wire_plan: bool | str = SETTINGS["wire_plan"].default
    measure: dict[str, Any] | None = None
    min_numel: int | None = None
    merge_small: bool = SETTINGS["merge_small"].default
    sum_order: str = SETTINGS["sum_order"].default
    sparse_collective: str = SETTINGS["sparse_collective"].default
    scatter_keep: float = SETTINGS["scatter_keep"].default
    process_group: Any = None
    recipe: bool = SETTINGS["recipe"].default
    options: dict[str, Any] = field(default_factory=dict)
    said = None  # (not a setting) the line saying what the method's recipe changed: set by of(), printed on rank 0

    @classmethod
    def of(cls, compressor: str, ratio: float | None, kwargs: dict[str, Any], runtime: str, *,
           optimizer=None) -> "Settings":
        """Settings from keyword arguments (the ones that are not settings are the compressor's options), checked
        for ``runtime``. ``optimizer``: handed over (``register(..., optimizer=)``): the method takes its recipe
        for it unless ``recipe=False`` (:func:`gradsift.memory.recipes.recipe_spec`; not Adam's under FSDP, where the
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
        if self.on_nonfinite is None:
            self.on_nonfinite = "error"
        self.wire_plan = wire_plan_name(self.wire_plan) or "auto"
        for name, option in SETTINGS.items():
            try:
                setattr(self, name, option.check(name, getattr(self, name)))
            except OptionError as e:
                raise ConfigError(str(e)) from None
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
