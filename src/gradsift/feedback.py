"""Memory around a compressor: error feedback, and momentum correction with masking.

Both wrap a :class:`~gradsift.compressors.base.Compressor` and offer its calls
(``compress``, ``observe``, ``state_dict``, ``load_state_dict``, ``checkpoint``,
``rollback``), so a runtime never knows whether memory is on. They are
composed around a compressor by :func:`gradsift.factory.make_compressor`;
compressors never import this module.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019),
as every paper here writes it (REGTOP-k Sec. 1.1, rTop-k Alg. 1, LAGS Alg. 1)::

    a_t      = residual_t + g_t            # accumulated gradient (in place: the residual buffer)
    sent_t   = select(a_t)
    residual = a_t - sent_t

``sent_t`` is what the receivers decode: the wire values cast back, so the
rounding of fp16 values stays in memory instead of being lost. Entries a
threshold method selected beyond its wire capacity are not sent and stay in
memory. Memory is kept in at least float32. Nothing enters memory before the
gradient is known to be finite.
"""

from __future__ import annotations

from typing import Any

import torch

from . import payload as P
from .errors import ConfigError
from .compressors.base import (Compressor, NonFiniteGradient, OptionError, as_bool, as_number, check_input,
                               clone_state, fit_capacity, is_finite, restore)


def subtract_sent(acc: torch.Tensor, sent: P.Payload) -> torch.Tensor:
    """``acc - decode(sent)``, in place.

    A compressor may return values that alias ``acc`` (e.g. everything, with no
    dtype change); they are copied first so the payload keeps what was sent.
    """
    if sent.values.numel() and sent.values.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr():
        sent.values = sent.values.clone()
    if sent.kind == P.DENSE:
        return acc.sub_(sent.values.to(acc.dtype))
    if sent.count:
        acc.index_put_((sent.indices,), sent.values.to(acc.dtype).neg(), accumulate=True)
    return acc


class Memory:
    """Forwards everything a runtime may ask to the wrapped compressor; subclasses keep per-tensor stores.

    A subclass defines :meth:`accumulate` (the vector to select from, kept as its
    memory) and :meth:`settle` (memory after sending).
    """

    memory_name = ""
    STORES: tuple[str, ...] = ()  # names of the per-tensor memory dicts (checkpointed, rolled back)
    OPTIONS: dict[str, Any] = {}

    def __init__(self, compressor: Compressor, **options: Any):
        self.compressor = compressor
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            raise OptionError(f"{self.memory_name} memory: unknown option {sorted(unknown)[0]!r}")
        self.memory_options = {**self.OPTIONS, **options}
        for name in self.STORES:
            setattr(self, name, {})

    @property
    def inner(self) -> Compressor:
        return self.compressor

    def __getattr__(self, name: str) -> Any:
        # ratio, name, OBSERVES, EXACT_K, set_layer_ratio, rank, ... come from the compressor
        if name == "compressor":
            raise AttributeError(name)
        return getattr(self.compressor, name)

    # --------------------------------------------------------------- the step
    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        raise NotImplementedError

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        c = self.compressor
        check_input(c.name, key, grad)
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        if dense is None:
            dense = c.sends_dense(key, grad.shape)
        acc = self.accumulate(key, flat)
        if not (dense or c.SELECTS_LARGEST) and not is_finite(acc):  # an overflow a selection might miss
            return self.overflowed(key, P.dense(torch.zeros_like(flat), flat.dtype), check_finite)
        sent = c.send_dense(key, acc, native) if dense else c.emit(key, acc, owners)[0]
        sent.grad_dtype = flat.dtype
        if (c.value_dtype is None or (dense and native)) and sent.values.dtype != flat.dtype:
            # memory is wider than the gradient (fp16/bf16 models): send in the gradient's dtype
            sent.values = sent.values.to(flat.dtype)
        if not is_finite(sent.values):  # the largest entries are selected first, so an overflow shows here
            return self.overflowed(key, sent, check_finite)
        self.settle(key, acc, sent)
        return sent

    def overflowed(self, key: str, sent: P.Payload, raise_it: bool) -> P.Payload:
        """Memory plus gradient left the float range: the key's memory is dropped (it holds Inf), and the caller
        gets an error -- or, inside the road (``check_finite=False``), zeroed values of the same shape with
        ``nonfinite`` set, so that every worker still issues the same collectives and the flag stops the step."""
        for store in self.stores().values():
            store.pop(key, None)
        if raise_it:
            raise NonFiniteGradient(f"the accumulated gradient of {key!r} overflowed the float range; its memory "
                                    "was dropped")
        sent.values = torch.zeros_like(sent.values)
        sent.nonfinite = True
        return sent

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        self.compressor.observe(key, sent, mean)

    # ------------------------------------------------------------ state
    def stores(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: getattr(self, name) for name in self.STORES}

    def describe(self) -> str:
        return f"{self.compressor.describe()}+{self.memory_name}"

    def config(self) -> dict[str, Any]:
        return {**self.compressor.config(), "memory": self.memory_name,
                "memory_options": dict(sorted(self.memory_options.items()))}

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"compressor": self.compressor.state_dict(), "memory": self.memory_name,
                              "memory_options": dict(self.memory_options), "rank": self.compressor.rank,
                              "world_size": self.compressor.world_size}
        for name, store in self.stores().items():
            sd[name] = {k: v.detach().clone() for k, v in store.items()}
        return sd

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        if sd.get("memory") != self.memory_name:
            raise ValueError(f"state was saved with memory {sd.get('memory')!r}, this compressor uses "
                             f"{self.memory_name!r}")
        if {**self.OPTIONS, **dict(sd.get("memory_options", self.memory_options))} != self.memory_options:
            raise ValueError(f"state was saved with memory options {sd.get('memory_options')}, this compressor "
                             f"uses {self.memory_options}")
        reset = self.compressor.rank_mismatch(sd["compressor"], reset_memory)
        self.compressor.load_state_dict(sd["compressor"], reset_memory=reset_memory)
        for name in self.STORES:
            setattr(self, name, {} if reset else {k: v.detach().clone() for k, v in sd[name].items()})

    def checkpoint(self, keys) -> dict[str, Any]:
        keys = list(keys)
        return {"inner": self.compressor.checkpoint(keys),
                "stores": {name: {k: clone_state(store.get(k)) for k in keys} for name, store in self.stores().items()}}

    def rollback(self, token: dict[str, Any]) -> None:
        self.compressor.rollback(token["inner"])
        for name, saved in token["stores"].items():
            restore(getattr(self, name), saved)


RESIDUAL_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ErrorFeedback(Memory):
    """Error feedback around any compressor: nothing is ever lost, only delayed. ``residual_dtype`` bf16/fp16 stores
    the residual in half the bytes, losing its rounding (~2**-8 of it a step in bf16); sums still run in fp32."""

    memory_name = "ef"
    STORES = ("residual",)
    OPTIONS = {"residual_dtype": "fp32"}

    def __init__(self, compressor: Compressor, **options: Any):
        super().__init__(compressor, **options)
        if (name := self.memory_options["residual_dtype"]) not in RESIDUAL_DTYPES:
            raise OptionError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got {name!r}")
        self.store_dtype = RESIDUAL_DTYPES[name]

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        c = self.compressor
        if dense is None:
            dense = c.sends_dense(key, grad.shape)
        if dense and key not in self.residual:  # nothing held back for this tensor: it goes as it is
            return c.compress(key, grad, check_finite=check_finite, dense=True, native=native)
        if not dense and c.FUSES_MEMORY and grad.dtype == torch.float32 and grad.is_contiguous() \
                and grad.numel() and self.store_dtype is None:
            return self._fused(key, grad, check_finite, owners)
        return super().compress(key, grad, check_finite=check_finite, dense=dense, native=native, owners=owners)

    def holds_back(self, keys) -> bool:
        """Whether a residual is held for any of ``keys`` (sending them whole must carry it along)."""
        return any(k in self.residual for k in keys)

    def continues_from_mean(self, keys) -> bool:
        """With no residual, a tensor sent whole is the plain mean: steps may arrive by another route."""
        return not self.holds_back(keys)

    def _fused(self, key: str, grad: torch.Tensor, check_finite: bool, owners: P.Partition | None) -> P.Payload:
        """The compressor accumulates, selects and zeroes in its own two passes (:mod:`gradsift.kernels`)."""
        c = self.compressor
        check_input(c.name, key, grad)
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        r = self.residual.get(key)
        if r is None:
            r = torch.zeros_like(flat)
        elif r.numel() != flat.numel():
            raise ValueError(f"tensor {key!r} changed size: {r.numel()} elements before, {flat.numel()} now")
        sent = c.select_into(key, r, flat)  # r += g; selected entries zeroed: r is the residual
        sent.capacity = c.capacity_for(sent.target, sent.numel)
        sent.owners = owners
        dropped = fit_capacity(sent)
        if dropped is not None:  # selected beyond the wire capacity: back into memory
            r.index_put_((dropped.indices,), dropped.values, accumulate=True)
        if not is_finite(sent.values):  # Inf in memory plus gradient is among the largest: selected first
            self.residual[key] = r
            return self.overflowed(key, sent, check_finite)
        wire = c.wire(sent.values)
        if wire.dtype != sent.values.dtype and sent.count:  # what the receivers decode; the rounding stays here
            r.index_put_((sent.indices,), sent.values - wire.to(sent.values.dtype), accumulate=True)
        sent.values = wire
        self.residual[key] = r
        return sent

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        r = self.residual.get(key)
        if r is None:
            return flat.to(P.accumulate_dtype(flat.dtype), copy=True)
        if r.numel() != flat.numel():
            raise ValueError(f"tensor {key!r} changed size: {r.numel()} elements before, {flat.numel()} now")
        # the residual buffer becomes the accumulator (no new allocation), unless it is narrow
        return r.add_(flat) if self.store_dtype is None else r.to(P.accumulate_dtype(flat.dtype)).add_(flat)

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        if sent.kind == P.DENSE and sent.values.dtype == acc.dtype:
            self.residual.pop(key, None)  # everything went, exactly: no memory left (the values may be acc itself)
            return
        left = subtract_sent(acc, sent)
        self.residual[key] = left if self.store_dtype is None else left.to(self.store_dtype)


class MomentumCorrection(Memory):
    """Momentum correction with momentum factor masking (DGC, Lin et al. 2018, Sec. 3.2), for any sparsifier.

    Per tensor, with momentum m::

        u <- m u + g                  (Nesterov: u <- (u + g) m)        [velocity, :meth:`_advance`]
        v <- v + u                    (Nesterov: v <- v + u + g)        [the step momentum SGD takes]
        send select(v); v <- v - sent; u <- 0 where sent (masking)

    The optimizer must then apply no momentum itself (:func:`take_over_momentum`). Tensors sent whole (the
    method's or the wire plan's choice) keep plain momentum: ``v = u`` is sent and ``u`` is not masked; by
    linearity, once every worker holds the same ``u``, that equals momentum on the mean gradient
    (:meth:`step_from_mean`, the route when DDP's own all-reduce takes the steps). Nothing is lost: the sum of
    everything sent plus ``v`` equals the sum of the momentum-corrected updates. ``clip`` > 0 scales each worker's
    gradient to norm at most ``clip / sqrt(N)`` first (DGC's local clipping; per tensor here, where DGC clips the
    whole gradient).
    """

    memory_name = "momentum"
    STORES = ("u", "v")
    OPTIONS = {"momentum": 0.9, "nesterov": False, "masking": True, "clip": 0.0}
    applies_momentum = True

    def __init__(self, compressor: Compressor, **options: Any):
        super().__init__(compressor, **options)
        o = self.memory_options
        # a momentum given with the method (spec or keyword) is the user's: an optimizer's may not replace it
        self.explicit_momentum = bool({"momentum", "nesterov"} & set(options))
        try:
            o["momentum"] = float(as_number("momentum", o["momentum"], lo=0.0, hi=1.0))
            o["clip"] = float(as_number("clip", o["clip"], lo=0.0))
            as_bool("nesterov", o["nesterov"])
            as_bool("masking", o["masking"])
        except OptionError as e:
            raise OptionError(f"{compressor.name}: {e}") from None

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The velocity not yet sent (the analogue of the error-feedback residual)."""
        return self.v

    def holds_back(self, keys) -> bool:
        """Whether any of ``keys`` has velocity not yet sent (``u`` itself is not held back: it is the momentum)."""
        return any(k in self.v and bool(self.v[k].any()) for k in keys)

    def continues_from_mean(self, keys) -> bool:
        """Momentum on the mean gradient (:meth:`step_from_mean`) continues this memory when every tensor has its
        velocity, none is held back, and no worker clips its own gradient (DGC's local clipping has no mean)."""
        return (self.memory_options["clip"] == 0 and all(k in self.u for k in keys)
                and not self.holds_back(keys))

    def _advance(self, u: torch.Tensor, g: torch.Tensor) -> None:
        """The velocity's update, in place: ``u <- m u + g`` (Nesterov: ``u <- (u + g) m``)."""
        m = self.memory_options["momentum"]
        if self.memory_options["nesterov"]:
            u.add_(g).mul_(m)
        else:
            u.mul_(m).add_(g)

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        o = self.memory_options
        g = flat.to(P.accumulate_dtype(flat.dtype))
        if o["clip"] > 0:
            limit = o["clip"] / (self.compressor.world_size ** 0.5)
            norm = float(torch.linalg.vector_norm(g))
            if norm > limit:
                g = g * (limit / norm)
        u, v = self.u.get(key), self.v.get(key)
        if u is None:
            u, v = torch.zeros_like(g), torch.zeros_like(g)
        elif u.numel() != g.numel():
            raise ValueError(f"tensor {key!r} changed size: {u.numel()} elements before, {g.numel()} now")
        self._advance(u, g)
        v.add_(u)
        if o["nesterov"]:
            v.add_(g)
        self.u[key], self.v[key] = u, v
        return v

    def step_from_mean(self, key: str, mean: torch.Tensor) -> None:
        """A tensor sent whole whose mean gradient arrived by another route (DDP's own all-reduce): the velocity
        advances from the mean (:meth:`_advance`) and ``mean`` becomes the step the hook would have sent, ``u``
        (Nesterov: ``u + g``). Needs the same ``u`` on every worker and nothing held back in ``v``. Nothing to do
        at momentum 0: the mean already is that step."""
        if self.memory_options["momentum"] == 0:
            return
        u = self.u[key].view_as(mean)
        self._advance(u, mean)
        if self.memory_options["nesterov"]:
            mean.add_(u)
        else:
            mean.copy_(u)

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        self.v[key] = subtract_sent(acc, sent)
        if sent.kind != P.DENSE and self.memory_options["masking"] and sent.count:
            self.u[key].index_fill_(0, sent.indices, 0.0)


def take_over_momentum(memory, optimizer: torch.optim.Optimizer) -> float | None:
    """The one hand-off between momentum correction and the optimizer: momentum is applied once.

    ``memory`` is a compressor in its memory (:func:`gradsift.factory.make_compressor`; for several workers, call
    once per worker's compressor before the optimizer's momentum is zeroed -- or pass them as a list). With momentum
    correction (``dgc``, ``memory=momentum``) the optimizer's momentum and Nesterov flag become the memory's and the
    optimizer's are set to 0 -- unless the method was given a momentum of its own (then the optimizer must have
    none). Refused in one line: an optimizer other than SGD, parameter groups with different momenta, two momenta.
    Returns the momentum taken over (None when there was nothing to do). ``gradsift train``'s ``--optimizer sgd``
    hands over momentum 0, ``momentum``/``nesterov`` theirs."""
    memories = list(memory) if isinstance(memory, (list, tuple)) else [memory]
    ours = [c for c in memories if c.applies_momentum]
    if not ours:
        return None
    name = ours[0].name
    if not isinstance(optimizer, torch.optim.SGD):
        raise ConfigError(f"{name} applies momentum correction, which is defined for SGD (--optimizer sgd, momentum "
                          f"or nesterov); the optimizer is {type(optimizer).__name__}")
    groups = optimizer.param_groups
    m, nesterov = groups[0].get("momentum", 0.0), bool(groups[0].get("nesterov", False))
    if any(g.get("momentum", 0.0) != m or bool(g.get("nesterov", False)) != nesterov for g in groups):
        raise ConfigError(f"{name}: the optimizer's parameter groups use different momentum; momentum correction "
                          "applies one momentum to every tensor")
    if any(c.explicit_momentum for c in ours):
        if m:
            raise ConfigError(f"{name} sets its own momentum and the optimizer adds momentum={m:g}: use an "
                              "optimizer without momentum (--optimizer sgd), or drop momentum from the method's options")
        return None
    for c in ours:
        c.memory_options.update(momentum=float(m), nesterov=nesterov)
    for g in groups:
        g["momentum"], g["nesterov"] = 0.0, False
    return float(m)


MEMORIES: dict[str, type[Memory] | None] = {"ef": ErrorFeedback, "momentum": MomentumCorrection, "none": None}


def with_memory(compressor: Compressor, memory: str, **options: Any):
    """``compressor`` inside the named memory (``ef``, ``momentum`` or ``none``)."""
    if memory not in MEMORIES:
        raise OptionError(f"memory must be one of {', '.join(MEMORIES)}, got {memory!r}")
    cls = MEMORIES[memory]
    if cls is None:
        if options:
            raise OptionError(f"{compressor.name}: option {sorted(options)[0]!r} needs memory=momentum")
        return compressor
    return cls(compressor, **options)
