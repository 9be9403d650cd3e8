"""One rank of local SGD, whatever runs it (the optimizer's hooks on ``torch.distributed``, :mod:`gradsift.local`, or the
simulator's workers, :mod:`gradsift.runtime.localsgd`): the global model, the outer step, the steps, and the
:class:`~gradsift.runtime.rank.Rank` whose road carries the pseudo-gradients. :mod:`gradsift.local` says what local
SGD does and which outer steps it offers."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..messages import warn
from ..compressors.base import NonFiniteGradient, restore
from ..payload import all_finite
from .road import Layout, Trip
from .telemetry import StepTally
from ..errors import ConfigError
from .rank import Rank
from .rankstate import RankState
from .settings import Settings

OUTERS = {"average": (1.0, 0.0), "nesterov": (0.7, 0.9), "ef": (1.0, 0.95)}  # (lr, momentum) defaults


def outer_defaults(outer: str, lr: float | None, momentum: float | None) -> tuple[float, float]:
    """The outer step's (lr, momentum), checked; None takes the outer step's default (:data:`OUTERS`)."""
    if outer not in OUTERS:
        raise ConfigError(f"outer must be one of {', '.join(OUTERS)}, got {outer!r}")
    d_lr, d_mu = OUTERS[outer]
    lr, momentum = (d_lr if lr is None else lr), (d_mu if momentum is None else momentum)
    for name, v, hi in (("outer_lr", lr, 10.0), ("outer_momentum", momentum, 1.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= hi:
            raise ConfigError(f"{name} must be a number in [0, {hi:g}], got {v!r}")
    if outer == "average" and (lr, momentum) != (1.0, 0.0):
        raise ConfigError("outer='average' moves the global model by the mean change (lr 1, no momentum): for "
                          "another outer_lr or a momentum use outer='nesterov'")
    return float(lr), float(momentum)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (DTensor's) local shard, the tensor itself otherwise; read without autograd, so it is the
    shard's own storage (writes into it are the parameter's)."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def check_period(period: Any, warmup_steps: Any) -> None:
    for name, v, lo in (("period", period, 1), ("warmup_steps", warmup_steps, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")


class LocalState(RankState):
    """One rank of local SGD (module docstring): the global model, the outer momentum, the steps, and the
    :class:`~gradsift.runtime.rank.Rank` (``core``) whose road carries the pseudo-gradients. A runtime calls
    :meth:`before_inner_step` and :meth:`after_inner_step` around each optimizer step, and at a sync
    :meth:`start_sync` on every rank, then :meth:`finish_sync` (the simulator starts every worker's before any
    finishes; :func:`register` does both from the optimizer's hooks)."""

    def __init__(self, settings: Settings, named: Sequence[tuple[str, torch.nn.Parameter]], *, period: int = 8,
                 outer: str = "average", outer_lr: float | None = None, outer_momentum: float | None = None,
                 warmup_steps: int = 0, runtime: str = "local", holders: Sequence[torch.nn.Parameter] | None = None):
        """``named``: the tensors this rank syncs, by name; ``holders``: the parameters whose ``.grad`` the optimizer
        reads, one per tensor (an FSDP module's sharded parameters, whose local shards ``named`` holds; default the
        tensors themselves)."""
        check_period(period, warmup_steps)
        self.named = list(named)
        if not self.named:
            raise ConfigError("local SGD needs a model with parameters that require gradients")
        dtypes = {p.dtype for _, p in self.named}
        if len(dtypes) > 1:
            raise ConfigError(f"local SGD sends the model's change in one buffer: its parameters must share one "
                              f"dtype, got {', '.join(sorted(str(d) for d in dtypes))}")
        params = [p for _, p in self.named]
        dense = sum(p.numel() * p.element_size() for p in params)
        tensors = ([("model", (sum(p.numel() for p in params),), params[0].dtype)] if settings.granularity == "model"
                   else [(n, tuple(p.shape), p.dtype) for n, p in self.named])
        self.period, self.warmup_steps, self.outer = period, warmup_steps, outer
        self.outer_lr, self.outer_momentum = outer_defaults(outer, outer_lr, outer_momentum)
        # what must agree between ranks beside the road: when and how they sync (a rank that syncs on other steps
        # would wait for the others until the process group's timeout)
        agreed = {"local": {"period": period, "warmup_steps": warmup_steps, "outer": outer,
                            "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}}
        self.core = Rank(settings, tensors, runtime=runtime, dense_bytes=dense, device=params[0].device,
                         agreed=agreed)
        self.params = params
        self.holders = list(holders) if holders is not None else params
        with torch.no_grad():
            self.globals = [p.detach().clone() for p in params]  # the model at the last sync
        self.outer_m = [torch.zeros_like(p) for p in params] if outer == "nesterov" else []
        self.buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in params]), params)]
        self.layout = Layout([n for n, _ in self.named], settings.granularity)
        self.optimizer: torch.optim.Optimizer | None = None  # this rank's inner optimizer (saved with the state)
        self.inner_steps = 0  # optimizer steps seen (warm-up ones included)
        self.syncs = self.skipped_syncs = self.skipped_inner = 0
        self._undecayed: dict[str, torch.Tensor] | None = None

    def build(self, transport, **kwargs) -> Any:
        """The rank's road on ``transport`` (:meth:`gradsift.runtime.rank.Rank.build`), refused for a method that
        cannot carry a change of the model."""
        road = self.core.build(transport, **kwargs)
        comp = road.compressor
        if comp.inner.ROUNDS > 1:
            raise ConfigError(f"local SGD: {comp.name} runs {comp.inner.ROUNDS} dependent rounds; a sync takes "
                              "one-round methods (dense, topk, sidco, rtopk, ...)")
        if comp.applies_momentum or comp.applies_adam:
            raise ConfigError(f"local SGD sends the ranks' changes of the model, not gradients: memory="
                              f"{comp.memory_name} does not apply; use memory=ef (the default) or memory=none")
        if self.outer == "ef" and (comp.inner.name == "dense" or getattr(comp, "memory_name", None) != "ef"
                                   or comp.store_dtype is not None):
            raise ConfigError("outer='ef' decays an error-feedback memory: it needs a sparsifier with memory=ef and "
                              "a float32 residual (residual_dtype='fp32')")
        return road

    # ------------------------------------------------------------ the steps
    @property
    def warming(self) -> bool:
        """Whether the optimizer's next step is a warm-up step (gradients averaged every step)."""
        return self.inner_steps < self.warmup_steps

    def before_inner_step(self) -> bool:
        """Before this rank's optimizer step: whether its gradients are finite. A rank whose gradient is not finite
        drops them (``p.grad = None``: the optimizer leaves parameters and state alone) and says so."""
        if self.grads_finite(self.grads()):
            return True
        for p in self.holders:
            p.grad = None
        self.skipped_inner += 1
        warn(f"gradsift: {'worker' if self.runtime == 'sim' else 'rank'} {self.global_rank}: a gradient was not "
             f"finite at step {self.inner_steps + 1}: its optimizer step was skipped on this "
             f"{'worker' if self.runtime == 'sim' else 'rank'}")
        return False

    def grads(self) -> list[torch.Tensor]:
        """This rank's gradients of the tensors it syncs (an FSDP module's: their local shards)."""
        grads = [p.grad for p in self.holders if p.grad is not None]
        return grads if self.holders is self.params else [local_tensor(g) for g in grads]

    def grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """Whether this rank's gradients are finite (a runtime whose ranks hold one model between them agrees)."""
        return not grads or all_finite(grads)

    def after_inner_step(self) -> bool:
        """After the optimizer's step: count it; whether a sync is due now. The last warm-up step sets the global
        model (every rank holds the same one then)."""
        self.inner_steps += 1
        self.last = {**StepTally().fields(), "skipped": False}  # (a step without a sync sends nothing)
        if self.inner_steps <= self.warmup_steps:
            if self.inner_steps == self.warmup_steps:
                with torch.no_grad():
                    torch._foreach_copy_(self.globals, [p.detach() for p in self.params])
            return False
        return (self.inner_steps - self.warmup_steps) % self.period == 0

    def start_sync(self) -> Trip:
        """This rank's pseudo-gradient (global model minus its own) on its way through the road."""
        self.ensure_ready()
        self.core.opened()
        with torch.no_grad():
            torch._foreach_copy_(self.views, self.globals)
            torch._foreach_sub_(self.views, [p.detach() for p in self.params])
        if self.outer == "ef":  # SparseLoCo: e <- mu e before the change is added (kept undecayed for a rollback)
            store = self.road.compressor.stores()["residual"]
            self._undecayed = dict(store)
            keys = list(store)
            if keys:
                store.update(zip(keys, torch._foreach_mul([store[k] for k in keys], self.outer_momentum)))
        return self.road.start(self.layout.group(self.views, self.buffer), self.transport)

    def finish_sync(self, trip: Trip) -> bool:
        """The mean pseudo-gradient arrived: the outer step, every rank back at the global model, the sync closed.
        Returns whether it was skipped (a pseudo-gradient was not finite on some rank)."""
        try:
            means = self.road.finish(trip, trip.pending.wait())
        except NonFiniteGradient as e:  # (on_nonfinite="error"): said as what it is here, a change of the model
            raise NonFiniteGradient(f"a change of the model since the last sync (pseudo-gradient) was not finite at "
                                    f"sync {self.syncs + 1} (step {self.inner_steps}): {str(e).split(' (', 1)[0]}; to "
                                    "skip such syncs: on_nonfinite='skip'") from None
        if means is not None:
            with torch.no_grad():
                d = self.layout.views(means, [p.shape for p in self.params])
                if self.outer == "nesterov":
                    torch._foreach_mul_(self.outer_m, self.outer_momentum)
                    torch._foreach_add_(self.outer_m, d)
                    step = torch._foreach_add(d, self.outer_m, alpha=self.outer_momentum)
                    torch._foreach_mul_(step, self.outer_lr)
                    torch._foreach_sub_(self.globals, step)
                elif self.outer == "ef" and self.outer_lr != 1.0:
                    torch._foreach_sub_(self.globals, torch._foreach_mul(d, self.outer_lr))
                else:
                    torch._foreach_sub_(self.globals, d)
        skipped = self.core.close_step(lambda tally: tally.fields())
        if skipped and self._undecayed is not None:
            restore(self.road.compressor.stores()["residual"], self._undecayed)
        self._undecayed = None
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self.globals)
        self.syncs += 1
        if skipped:
            self.skipped_syncs += 1
            if self.global_rank == 0:
                warn(f"gradsift: sync {self.syncs} (step {self.inner_steps}) skipped on every "
                     f"{'worker' if self.runtime == 'sim' else 'rank'}: a change of the model was not finite (memory "
                     "rolled back; every rank restarts from the global model)")
        return skipped

    def end_step(self, backward_start: float | None = None, loss: torch.Tensor | None = None) -> bool:
        """Nothing to close after backward: a local step is never skipped on every rank (a sync is, after the
        optimizer's step)."""
        return False

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rank's road state (:meth:`Rank.state_dict`) and local SGD's own: the global model, the outer
        momentum, the steps -- and, since between syncs every rank's model and optimizer differ, this rank's own
        parameters and its optimizer's state (``optimizer.state_dict()``: references, as PyTorch's), so a framework
        that saves rank 0's model and optimizer still resumes every rank as it was."""
        sd = super().state_dict()
        sd["local"] = {"period": self.period, "warmup_steps": self.warmup_steps, "outer": self.outer,
                       "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                       "globals": [g.clone() for g in self.globals], "outer_m": [m.clone() for m in self.outer_m],
                       "params": [p.detach().clone() for p in self.params],
                       "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                       "inner_steps": self.inner_steps, "syncs": self.syncs, "skipped_syncs": self.skipped_syncs,
                       "skipped_inner": self.skipped_inner}
        return sd

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """This rank's state back (:meth:`state_dict`): its parameters and optimizer too. Another configuration
        (period, outer step) or another model is refused in one line."""
        mine = sd.get("local")
        if not isinstance(mine, dict):
            raise ValueError("not a local SGD state (gradsift.local.register(...).state_dict()): it holds no global "
                             "model")
        for what in ("period", "warmup_steps", "outer", "outer_lr", "outer_momentum"):
            if mine.get(what) != getattr(self, what):
                raise ValueError(f"state saved with {what} {mine.get(what)!r}, this run has {getattr(self, what)!r}")
        if [tuple(g.shape) for g in mine["globals"]] != [tuple(p.shape) for p in self.params]:
            raise ValueError("state saved for another model: its global model's shapes differ from this model's")
        super().load_state_dict(sd, reset_memory=reset_memory)
        with torch.no_grad():
            torch._foreach_copy_(self.globals, [g.to(self.device) for g in mine["globals"]])
            torch._foreach_copy_([p.detach() for p in self.params], [p.to(self.device) for p in mine["params"]])
            if self.outer_m:
                torch._foreach_copy_(self.outer_m, [m.to(self.device) for m in mine["outer_m"]])
        if self.optimizer is not None and mine.get("optimizer") is not None:
            self.optimizer.load_state_dict(mine["optimizer"])
        for what in ("inner_steps", "syncs", "skipped_syncs", "skipped_inner"):
            setattr(self, what, int(mine[what]))
