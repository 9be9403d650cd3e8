"""Memory around a compressor: error feedback, and DGC's momentum correction.

Both wrap a :class:`~gradsift.compressors.base.Compressor` and offer its four
calls (``compress``, ``observe``, ``state_dict``, ``load_state_dict``), so a
runtime never knows whether memory is on.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019),
as every paper here writes it (REGTOP-k Sec. 1.1, rTop-k Alg. 1, LAGS Alg. 1)::

    a_t      = residual_t + g_t            # accumulated gradient
    sent_t   = select(a_t)
    residual = a_t - sent_t

``sent_t`` is what the receivers decode: the wire values cast back, so the
rounding of fp16 values stays in memory instead of being lost. Memory is kept
in at least float32. Nothing enters memory before the gradient is known to be
finite.
"""

from __future__ import annotations

from typing import Any

import torch

from . import payload as P
from .compressors.base import Compressor, NonFiniteGradient, is_finite


def subtract_sent(acc: torch.Tensor, sent: P.Payload) -> torch.Tensor:
    """``acc - decode(sent)``, in place where ``acc`` may be reused.

    A compressor may return values that alias ``acc`` (e.g. everything, with no
    dtype change); they are copied first so the payload keeps what was sent.
    """
    if sent.values.numel() and sent.values.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr():
        sent.values = sent.values.clone()
    if sent.kind == P.DENSE:
        return acc - sent.values.to(acc.dtype)
    if sent.count:
        acc.index_put_((sent.indices,), sent.values.to(acc.dtype).neg(), accumulate=True)
    return acc


class _Wrapper:
    """Forwards everything a runtime may ask to the wrapped compressor."""

    def __init__(self, compressor: Compressor):
        self.compressor = compressor

    @property
    def inner(self) -> Compressor:
        return self.compressor

    def __getattr__(self, name: str) -> Any:
        # ratio, name, OBSERVES, EXACT_K, set_layer_ratio, rank, ... come from the compressor
        if name == "compressor":
            raise AttributeError(name)
        return getattr(self.compressor, name)

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        self.compressor.observe(key, sent, mean)

    def describe(self) -> str:
        return f"{self.compressor.describe()}+{self.memory_name}"

    memory_name = ""
    STORES: tuple[str, ...] = ()  # names of the per-tensor memory dicts (checkpointed, snapshotted)

    def stores(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: getattr(self, name) for name in self.STORES}

    def config(self) -> dict[str, Any]:
        return {**self.compressor.config(), "memory": self.memory_name}

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"compressor": self.compressor.state_dict(), "memory": self.memory_name}
        for name, store in self.stores().items():
            sd[name] = {k: v.detach().clone() for k, v in store.items()}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("memory") != self.memory_name:
            raise ValueError(f"state was saved with memory {sd.get('memory')!r}, this compressor uses {self.memory_name!r}")
        self.compressor.load_state_dict(sd["compressor"])
        for name in self.STORES:
            setattr(self, name, {k: v.detach().clone() for k, v in sd[name].items()})


class ErrorFeedback(_Wrapper):
    """Error feedback around any compressor: nothing is ever lost, only delayed."""

    memory_name = "ef"
    STORES = ("residual",)

    def __init__(self, compressor: Compressor):
        super().__init__(compressor)
        self.residual: dict[str, torch.Tensor] = {}

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True) -> P.Payload:
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        acc_dtype = P.accumulate_dtype(flat.dtype)
        r = self.residual.get(key)
        if r is None:
            acc = flat.to(acc_dtype, copy=True)
        elif r.numel() != flat.numel():
            raise ValueError(f"tensor {key!r} changed size: {r.numel()} elements before, {flat.numel()} now")
        else:
            acc = r.add_(flat)  # the residual buffer becomes the accumulator: no new allocation
        sent = self.compressor.select(key, acc)
        sent.grad_dtype = flat.dtype
        if self.compressor.value_dtype is None and sent.values.dtype != flat.dtype:
            # memory is wider than the gradient (fp16/bf16 models): send in the gradient's dtype
            sent.values = sent.values.to(flat.dtype)
        self.residual[key] = subtract_sent(acc, sent)
        return sent


class MomentumCorrection(_Wrapper):
    """DGC's momentum correction with momentum factor masking (Lin et al. 2018, Sec. 3.2).

    Per tensor, with momentum m::

        u <- m u + g                  (Nesterov: u <- (u + g) m)
        v <- v + u                    (Nesterov: v <- v + u + g)
        send select(v); v <- v - sent; u <- 0 where sent (masking)

    The optimizer must then apply no momentum itself. Tensors the compressor
    sends dense (DGC's 1-D rule) keep plain momentum: ``v = u`` is sent whole
    and ``u`` is not masked. Nothing is lost: the sum of everything sent plus
    ``v`` equals the sum of the momentum-corrected updates ``u``.
    """

    memory_name = "momentum"
    STORES = ("u", "v")
    applies_momentum = True

    def __init__(self, compressor: Compressor):
        super().__init__(compressor)
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The velocity not yet sent (the analogue of the error-feedback residual)."""
        return self.v

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True) -> P.Payload:
        c = self.compressor
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        acc_dtype = P.accumulate_dtype(flat.dtype)
        g = flat.to(acc_dtype)
        clip = float(c.options.get("clip", 0.0) or 0.0)
        if clip > 0:
            limit = clip / (c.world_size ** 0.5)
            norm = float(torch.linalg.vector_norm(g))
            if norm > limit:
                g = g * (limit / norm)
        m = float(c.options["momentum"])
        u = self.u.get(key)
        v = self.v.get(key)
        if u is None:
            u = torch.zeros_like(g)
            v = torch.zeros_like(g)
        elif u.numel() != g.numel():
            raise ValueError(f"tensor {key!r} changed size: {u.numel()} elements before, {g.numel()} now")
        if c.options.get("nesterov"):
            u = (u + g).mul_(m)
            v = v + u + g
        else:
            u = u.mul(m).add_(g)
            v = v + u
        if c.sends_dense(key, grad):
            c.begin(key, v)
            sent = P.dense(c.wire(v), flat.dtype)
            if sent.values.dtype != flat.dtype and c.value_dtype is None:
                sent.values = sent.values.to(flat.dtype)
            self.u[key] = u
            self.v[key] = v - sent.values.to(acc_dtype)
            return sent
        sent = c.select(key, v)
        sent.grad_dtype = flat.dtype
        if c.value_dtype is None and sent.values.dtype != flat.dtype:
            sent.values = sent.values.to(flat.dtype)
        self.v[key] = subtract_sent(v, sent)
        if c.options.get("masking", True) and sent.count:
            u.index_fill_(0, sent.indices, 0.0)
        self.u[key] = u
        return sent
