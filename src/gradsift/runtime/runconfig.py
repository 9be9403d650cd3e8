"""One description of a training run, shared by the simulator and the DDP runtime."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..route.owners import SCATTER_KEEP
from ..compressors import parse_spec
from ..compressors.powersgd import beside_others
from ..memory.spec import Spec
from ..compressors.base import OptionError, check_ratio
from ..errors import ConfigError
from ..options import Option
from ..route.routing import wire_plan_for
from .settings import GRANULARITIES, NONFINITE, SETTINGS, Settings, wire_plan_name  # noqa: F401 (the CLI's)

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
# the rank settings a run description carries as its own fields (the rest are the run's: task, steps, lr, ...)
RUN_SETTINGS = ("seed", "granularity", "on_nonfinite", "bandwidth_gbps", "latency_us", "sum_order",
                "sparse_collective", "scatter_keep", "recipe")
SCHEDULES = ("constant", "cosine")

# the run's own options (the command line's --workers, --steps, ...): unset takes the task's default
RUN_OPTIONS = {
    "workers": Option.integer(4, lo=1, optional=True, doc="simulated workers (on real processes unset: the world's "
                                                          "size)"),
    "steps": Option.integer(None, lo=1, optional=True, doc="optimizer steps (unset: the task's)"),
    "lr": Option.number(None, lo=0.0, lo_open=True, optional=True, doc="the learning rate (unset: the task's)"),
    "batch_size": Option.integer(None, lo=1, optional=True, doc="the batch size per worker (unset: the task's)"),
    "optimizer": Option.choice(None, OPTIMIZERS, optional=True, doc="the optimizer (unset: the task's)"),
    "momentum": Option.number(0.9, lo=0.0, hi=1.0, hi_open=True, doc="the momentum of the momentum and nesterov "
                                                                     "optimizers"),
    "weight_decay": Option.number(None, lo=0.0, optional=True, doc="weight decay (unset: the task's; gptlm 0.1 on "
                                                                   "its matrices)"),
    "schedule": Option.choice(None, SCHEDULES, optional=True, doc="the learning rate over the steps: constant, or a "
                              "linear warm-up then a cosine decay to a tenth (unset: the task's; gptlm cosine)"),
    "warmup_steps": Option.integer(None, lo=0, optional=True, doc="the schedule's linear warm-up (unset: the task's)"),
    "schedule_steps": Option.integer(None, lo=1, optional=True, doc="the cosine's horizon (unset: steps; a race "
                                                                    "gives every method dense's)"),
    "eval_every": Option.integer(None, lo=1, optional=True, doc="evaluate the task metric every N steps (unset: "
                                                                "the task's)"),
    "probe_every": Option.integer(1, lo=1, doc="record the loss of the task's fixed probe batch every N steps and at "
                                               "every evaluation (a forward pass of its own; on real processes rank "
                                               "0's, which the others wait for)"),
    "clip_norm": Option.number(None, lo=0.0, lo_open=True, optional=True, doc="clip the aggregated gradient's norm "
                                                                              "(unset: the task's)"),
    "stop_at": Option.number(None, optional=True, doc="stop once the task metric reaches this value (checked at "
                                                      "every evaluation)"),
    "paired_ddp": Option.integer(None, lo=1, hi=1000, optional=True, doc="(DDP runtime) alternate blocks of this "
                                 "many steps with DDP's own all-reduce in the same processes, to time the hook"),
    "replicas": Option.integer(1, lo=1, doc="HSDP: this many replicas, each sharded over world / replicas ranks"),
}


def split_ratio(spec: str, ratio: float) -> tuple[str, float]:
    """``(spec without its ratio option, the ratio)``: a spec's own ``ratio=`` (``topk:ratio=0.001``) wins over
    ``ratio`` (``--ratio``, the ratio of every spec that names none). A malformed spec comes back as it is, to be
    reported where it is built (as is a local SGD spec: its ``ratio`` is the sync's, :mod:`gradsift.runtime.localsgd`)."""
    try:
        s = Spec.parse(spec)
    except (OptionError, ConfigError):
        return spec, ratio
    if s.ratio is None:
        return spec, ratio
    return str(s.replace(ratio=None)), s.ratio


@dataclass
class RunConfig:
    """Everything that defines a run. ``None`` means the task's default."""

    task: str = "digits-cnn"
    compressor: str = "topk"
    ratio: float = 0.01
    workers: int | None = 4
    steps: int | None = None
    seed: int = 0
    lr: float | None = None
    batch_size: int | None = None
    optimizer: str | None = None
    momentum: float = 0.9
    weight_decay: float | None = None  # None: the task's (gptlm's AdamW decays its matrices)
    granularity: str = "layer"
    value_dtype: str | None = None
    bandwidth_gbps: float = 1.0
    latency_us: float = 50.0
    eval_every: int | None = None
    probe_every: int = 1
    on_nonfinite: str = "error"
    data: str | None = None
    task_options: dict[str, Any] = field(default_factory=dict)
    weights: list[float] | None = None
    clip_norm: float | None = None
    schedule: str | None = None  # the learning rate over the steps: constant, or warm-up then cosine (lr_factor)
    warmup_steps: int | None = None  # the schedule's linear warm-up
    schedule_steps: int | None = None  # the cosine's horizon (None: steps; a race gives every method dense's)
    fault_nan_step: int | None = None
    dump_grads: str | None = None
    lags: bool = False
    delta_telemetry: bool = False
    # None: the runtime's default (simulator "off": the method as named; DDP "auto"); "auto" the alpha-beta plan;
    # "measure" (ddp) checked by timed steps; "off" none. True/False are accepted for "auto"/"off"
    wire_plan: bool | str | None = None
    sum_order: str = "backend"  # ddp: "rank" sums in rank order, the simulator's bits at any world size
    sparse_collective: str = "auto"  # all-gather or the owners' scatter per tensor (plan.py); or forced
    scatter_keep: float = SCATTER_KEEP  # the owners keep this many times k of the sum (owners.py)
    torch_hook: str | None = None  # ddp runtime: a PyTorch baseline instead of a gradsift compressor
    stop_at: float | None = None  # stop once the task metric reaches this value (checked at evaluations)
    paired_ddp: int | None = None  # ddp runtime: alternate blocks of this many steps with DDP's own all-reduce
    fsdp: bool = False  # FSDP's exchange: one group per FSDP unit in its shard layout (sharding.py), shard route
    replicas: int = 1  # (fsdp runtime) HSDP: this many replicas, each sharded over world / replicas ranks
    recipe: bool = True  # the method's measured training for the optimizer (momentum SGD: Nesterov; momentum_recipe)

    def validate(self) -> "RunConfig":
        try:
            self.compressor, ratio = split_ratio(self.compressor, self.ratio)
            self.ratio = check_ratio(ratio)
        except OptionError as e:
            raise ConfigError(str(e)) from None
        for name, declared, said in [*((n, SETTINGS[n], n) for n in RUN_SETTINGS),
                                     *((n, o, n.replace("_", "-")) for n, o in RUN_OPTIONS.items())]:
            try:  # the settings a run hands to its ranks and the run's own options, checked by their declarations
                setattr(self, name, declared.check(said, getattr(self, name)))
            except OptionError as e:
                raise ConfigError(str(e)) from None
        if self.paired_ddp is not None and self.torch_hook is not None:
            raise ConfigError("--paired-ddp times gradsift's hook against DDP's own all-reduce in the same "
                              "processes; with --torch-hook there is no gradsift hook to pair (drop one of them)")
        self.wire_plan = wire_plan_name(self.wire_plan)  # (None: the runtime's default)
        if self.lags and self.granularity != "layer":
            raise ConfigError("--lags compresses layer by layer: use --granularity layer")
        if self.torch_hook == "fsdp" and not self.fsdp:
            raise ConfigError("--torch-hook fsdp is FSDP's own exchange: use it with --runtime fsdp or hsdp")
        if self.replicas > 1 and not self.fsdp:
            raise ConfigError("--replicas is for HSDP: use it with --runtime hsdp (or the simulator's --fsdp)")
        if self.fsdp:
            for bad, what in ((self.lags, "--lags"), (self.weights is not None, "--weights"),
                              (self.wire_plan == "measure", "--wire-plan measure"),
                              (self.granularity != "layer", "--granularity model"),
                              (self.replicas == 1 and self.sparse_collective == "gather", "--sparse-collective gather"),
                              (self.torch_hook not in (None, "fsdp"), "--torch-hook (but fsdp)"),
                              (self.paired_ddp is not None, "--paired-ddp")):
                if bad:
                    raise ConfigError(f"{what} is not available with FSDP (--runtime fsdp or hsdp): FSDP's gradients "
                                      "go by its reduce-scatter, sparsified shard by shard")
        return self

    def resolved(self, task_cls) -> "RunConfig":
        """A copy with the task's defaults filled in. A method that holds top entries back for several steps
        (``Compressor.PLAIN_SGD``: rTop-k) takes the task's default momentum optimizer as plain SGD with the
        momentum folded into the step, ``lr / (1 - momentum)`` (:meth:`folded_momentum`; an explicit optimizer is
        kept)."""
        d = asdict(self)
        fold = self._folds(task_cls)
        for key in ("steps", "lr", "batch_size", "optimizer", "eval_every"):
            if d[key] is None:
                d[key] = task_cls.defaults.get(key, {"steps": 100, "lr": 0.1, "batch_size": 32,
                                                     "optimizer": "sgd", "eval_every": 10}[key])
        if fold:
            d["optimizer"], d["lr"] = "sgd", d["lr"] / (1.0 - self.momentum)
        for key, fallback in (("clip_norm", None), ("weight_decay", 0.0), ("schedule", "constant"),
                              ("warmup_steps", 0)):
            if d[key] is None:  # the task's (gradient clipping for LSTMs; gptlm's AdamW recipe), else none
                d[key] = task_cls.defaults.get(key, fallback)
        return RunConfig(**d).validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def for_method(self, spec: str, **changes: Any) -> "RunConfig":
        """This run with compressor ``spec``, at the spec's own ``ratio=`` where it names one, else this run's."""
        spec, ratio = split_ratio(spec, self.ratio)
        return replace(self, compressor=spec, ratio=ratio, **changes)

    @property
    def runtime(self) -> str:
        """The runtime whose exchange this run has: ``fsdp``/``hsdp`` (sharded, in the simulator or on processes),
        else ``sim`` (the simulator) -- a DDP run passes ``ddp`` to :meth:`settings` itself."""
        return ("hsdp" if self.replicas > 1 else "fsdp") if self.fsdp else "sim"

    def settings(self, runtime: str, *, simulated: bool = False, **extra: Any) -> Settings:
        """The rank settings (:class:`gradsift.runtime.settings.Settings`) of this run for ``runtime`` (``simulated``: in
        the simulator), checked; ``extra``: the compressor's options besides ``value_dtype``. The wire plan is the
        one asked for, else the runtime's default (:func:`gradsift.route.routing.wire_plan_for`: the simulator sends every
        tensor as the method says)."""
        options = dict(extra)
        if self.value_dtype is not None:
            options.setdefault("value_dtype", self.value_dtype)
        name, given = parse_spec(self.compressor)
        if name == "powersgd":  # as beside other methods (the --torch-hook baseline's): rank 2, a tenth plain
            for key, value in beside_others(self.steps).items():
                if key not in given:
                    options.setdefault(key, value)
        plan_runtime = "sim" if simulated else runtime
        spec, ratio = split_ratio(self.compressor, self.ratio)
        s = Settings(spec, ratio, granularity=self.granularity, seed=self.seed, weights=self.weights,
                     on_nonfinite=self.on_nonfinite, bandwidth_gbps=self.bandwidth_gbps, latency_us=self.latency_us,
                     wire_plan=wire_plan_for(self.wire_plan, plan_runtime), sum_order=self.sum_order,
                     sparse_collective=self.sparse_collective, scatter_keep=self.scatter_keep, recipe=self.recipe,
                     options=options)
        return s.check(runtime)

    def _folds(self, task_cls) -> bool:
        return self.optimizer is None and task_cls.defaults.get("optimizer") in ("momentum", "nesterov") \
            and 0 < self.momentum < 1 and _plain_sgd(self.compressor)

    def folded_momentum(self, task_cls) -> str | None:
        """The line that says a run folded its task's momentum into the step (:meth:`resolved`), or None."""
        if not self._folds(task_cls):
            return None
        got = self.resolved(task_cls)
        return (f"{parse_spec(self.compressor)[0]}: plain SGD at lr {got.lr:g} -- the task's momentum "
                f"{self.momentum:g} folded into the step (lr / (1 - momentum)): top entries wait several steps for "
                "their draw and momentum replays each burst, which oscillates (docs/methods/rtopk.md); "
                "--optimizer momentum keeps the task's optimizer")


def _plain_sgd(spec: str) -> bool:
    """Whether the method of ``spec`` asks for plain SGD (``Compressor.PLAIN_SGD``); False for a spec that does not
    parse (validation reports it)."""
    from ..compressors.registry import compressor_class

    try:
        return bool(compressor_class(parse_spec(spec)[0]).PLAIN_SGD)
    except (ConfigError, OptionError, KeyError, ValueError):
        return False


def make_optimizer(cfg: RunConfig, params, name: str | None = None, decays=None) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` (tensors, or ``(name, tensor)`` pairs). With weight decay and
    ``decays(name, tensor)`` (a task's rule, e.g. :meth:`gradsift.tasks.gptlm.GptLM.decays`) and named
    parameters, only the parameters it names decay (two groups); otherwise every one does."""
    name = name or cfg.optimizer or "sgd"
    wd = cfg.weight_decay or 0.0
    params = list(params)
    if params and isinstance(params[0], tuple):
        if wd and decays is not None:
            on = [p for n, p in params if decays(n, p)]
            off = [p for n, p in params if not decays(n, p)]
            params = [{"params": on, "weight_decay": wd}, {"params": off, "weight_decay": 0.0}]
        else:
            params = [p for _, p in params]
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=wd)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=(name == "nesterov"),
                               weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=wd)
    raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def reached_stop(cfg: RunConfig, task, record: dict[str, Any]) -> bool:
    """Whether ``record``'s task metric reached ``cfg.stop_at`` (a run that races to a target stops there)."""
    v = record.get(task.metric)
    return cfg.stop_at is not None and v is not None and (
        v >= cfg.stop_at if task.higher_is_better else v <= cfg.stop_at)


def lr_factor(cfg: RunConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``cfg.lr``: 1 (``constant``), or a
    linear warm-up over ``warmup_steps`` then a cosine decay to a tenth at ``schedule_steps`` (default ``steps``),
    held there after (``cosine``). A pure function of the step: a resumed run needs no scheduler state."""
    warm = cfg.warmup_steps or 0
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule != "cosine":
        return 1.0
    horizon = cfg.schedule_steps or cfg.steps or 1
    t = min(1.0, (step - warm) / max(1, horizon - warm))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))


def set_lr(cfg: RunConfig, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every parameter group's learning rate for optimizer step ``step`` (:func:`lr_factor`)."""
    lr = cfg.lr * lr_factor(cfg, step)
    for g in optimizer.param_groups:
        g["lr"] = lr
