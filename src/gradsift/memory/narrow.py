"""Error feedback's residual stored narrower than fp32: bf16, fp16, or 8 bits an entry (``residual_dtype``).

Under FSDP the residual is as large as each module's *unsharded* gradient on every rank: 4 bytes a parameter in
fp32, more than a rank's shard of parameters and Adam state from 8 ranks up. Stored narrow it costs 2 bytes
(bf16, fp16) or 1 (``fp8``), and every step rounds what is held back:

* ``fp8``: float8 e4m3 codes with one fp32 scale per tensor, ``scale = max|r| / 448`` (448 is e4m3's largest
  value), so the largest entry is represented and every other keeps e4m3's relative precision (3 mantissa bits:
  at most 2**-4 of the entry) down to ``max|r| / 28700`` (e4m3's smallest normal, 2**-6, over 448); below that
  subnormals hold fewer bits down to ``max|r| * 2**-17.8``, and smaller entries round to zero. The
  8-bit error compensation of LoCo (Xie et al. 2024) keeps an integer code with a scale per block; a float code
  carries each entry's own exponent, so one scale per tensor only places the range, and the store stays at one
  byte a parameter (a scale per block of B entries would add 4/B). LoCo's moving average of the error is not used:
  top-k's residual is gradient still to be sent, and averaging it would drop part of it.
* ``bf16``: fp32's range with 8 bits of precision; ``fp16``: 11 bits, 5 exponent bits (65504 at most).

fp8 and bf16 round stochastically (:func:`encode`: rounding to the nearest stalls a slowly growing residual), from
a stream per seed, rank, tensor and settle (the settle count is state), so a resumed run draws as an uninterrupted
one; fp16 rounds to the nearest.

The accumulation and selection always run in fp32 (the store is decoded, the gradient added, the send taken out,
the rest encoded again), so only the stored residual is rounded. What the rounding drops is counted
(:class:`Rounding`): ``sqrt(sum ||r - stored||^2 / sum ||r||^2)`` over every settle, reported as
``state.residual_rounding``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compressors.base import OptionError
from ..options import Option
from ..payload.seeds import derive_seed

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
RESIDUAL_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}
RESIDUAL_DTYPE = Option.choice("fp32", RESIDUAL_DTYPES, doc="the residual's stored dtype (narrower: fewer bytes, "
                                                           "rounded stochastically)")


def encode(left: torch.Tensor, dtype: torch.dtype,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``left`` (the residual, fp32) as stored: the codes, and for ``fp8`` its 0-d fp32 scale.

    With ``generator``, fp8 and bf16 round stochastically: each entry goes to one of its two neighbouring codes
    with the probabilities that keep its expected value. Rounding to the nearest would stall: an entry that grows by
    less than half a code's step each step would be rounded back every step (measured: of a residual growing by up
    to 0.1% of the largest entry a step, fp8 rounding to the nearest kept 11% of the mass after 200 steps). fp16
    rounds to the nearest (its narrow range is the larger risk: an entry past 65504 is an overflow)."""
    scale = None
    y = left.float()
    if dtype is FP8:
        amax = y.abs().amax() if y.numel() else torch.zeros((), device=y.device)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        y = y / scale
    drop = _DROPPED.get(dtype)
    if generator is not None and drop:  # add a uniform draw below the mantissa bits kept, then truncate
        y = y.clone() if y is left else y
        bits = y.view(torch.int32)
        bits.add_(torch.randint(0, 1 << drop, y.shape, generator=generator, dtype=torch.int32,
                                device=y.device)).bitwise_and_(-(1 << drop))
    return y.to(dtype), scale  # e4m3's cast saturates at 448 (the largest entry may round up to it)


_DROPPED = {FP8: 20, torch.bfloat16: 16}  # fp32's 23 mantissa bits less the code's 3 (e4m3) or 7 (bf16)


def decode(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The residual a store holds, in ``dtype`` (a new tensor: the accumulator of the next step)."""
    out = codes.to(dtype)
    return out if scale is None else out.mul_(scale.to(dtype))


class Rounding:
    """What storing the residual narrow dropped, summed over every settle (0-d tensors on the residual's device:
    no host synchronisation a step)."""

    def __init__(self) -> None:
        self.lost_sq: torch.Tensor | None = None
        self.held_sq: torch.Tensor | None = None

    def add(self, left: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
        lost = torch.dist(decode(codes, scale, left.dtype), left).square()
        held = torch.linalg.vector_norm(left).square()
        self.lost_sq = lost if self.lost_sq is None else self.lost_sq + lost
        self.held_sq = held if self.held_sq is None else self.held_sq + held

    def relative(self) -> float:
        """``sqrt(dropped^2 / held^2)`` so far (0.0 before any narrow store)."""
        if self.lost_sq is None or not float(self.held_sq):
            return 0.0
        return float((self.lost_sq / self.held_sq).sqrt())


class NarrowResidual:
    """The ``residual`` store of a memory kept ``residual_dtype`` wide: mixed into error feedback and Adam's
    direction (:mod:`gradsift.memory.feedback`, :mod:`gradsift.memory.adam`), whose accumulators stay fp32."""

    residual: dict[str, torch.Tensor]
    STORES: tuple[str, ...]

    def init_residual(self, name: str) -> None:
        if name not in RESIDUAL_DTYPES:
            raise OptionError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got {name!r}")
        self.store_dtype = RESIDUAL_DTYPES[name]
        self.rounding = Rounding()
        self.residual_scale: dict[str, torch.Tensor] = {}
        self.residual_draws: dict[str, torch.Tensor] = {}
        if self.store_dtype is FP8:  # each tensor's scale beside its codes, and its rounding's draws (0-d: state)
            self.STORES = (*type(self).STORES, "residual_scale", "residual_draws")
        elif self.store_dtype in _DROPPED:
            self.STORES = (*type(self).STORES, "residual_draws")

    def scale_of(self, key: str) -> torch.Tensor | None:
        return self.residual_scale.get(key) if self.store_dtype is FP8 else None

    def residual_of(self, key: str) -> torch.Tensor | None:
        """The residual held for ``key``, decoded to fp32 (None: nothing held)."""
        r = self.residual.get(key)
        return r if r is None or self.store_dtype is None else decode(r, self.scale_of(key))

    def residual_in(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The residual as an accumulator of ``like``'s dtype and size: the store itself in fp32 (added to in place),
        else decoded into a new tensor; zeros when nothing is held."""
        r = self.residual.get(key)
        if r is None:
            return torch.zeros_like(like)
        return r if self.store_dtype is None else decode(r, self.scale_of(key), like.dtype)

    def keep_residual(self, key: str, left: torch.Tensor) -> None:
        """Store what is left to send (``left``, fp32): as it is, or encoded, its rounding counted."""
        if self.store_dtype is None:
            self.residual[key] = left
            return
        codes, scale = encode(left, self.store_dtype, self._draws(key, left.device))
        self.rounding.add(left, codes, scale)
        self.residual[key] = codes
        if scale is not None:
            self.residual_scale[key] = scale

    def rounding_lost(self) -> float | None:
        return None if self.store_dtype is None else self.rounding.relative()

    def _draws(self, key: str, device: torch.device) -> torch.Generator | None:
        """Stochastic rounding's stream (fp8, bf16): one per (seed, rank, tensor, settle), so runs and resumed runs
        draw alike (the settle count is state: ``residual_draws``)."""
        if self.store_dtype not in _DROPPED:
            return None
        n = int(self.residual_draws.get(key, 0))
        self.residual_draws[key] = torch.tensor(n + 1, dtype=torch.int64)
        c = self.compressor
        return torch.Generator(device=device).manual_seed(derive_seed("residual", c.seed, c.rank, key, n))

    def wide_stores(self, saved: dict[str, Any]) -> dict[str, Any]:
        if self.store_dtype is not FP8:
            return saved
        scales = saved.get("residual_scale", {})
        return {**{k: v for k, v in saved.items() if k != "residual_scale"},
                "residual": {k: decode(r, scales.get(k)) for k, r in saved.get("residual", {}).items()}}

    def take_stores(self, stores: dict[str, dict[str, torch.Tensor]]) -> None:
        for name in self.STORES:
            setattr(self, name, stores.get(name, {}))
        if self.store_dtype is not None:
            self.residual_scale = {}
            for k, r in list(self.residual.items()):
                self.residual[k], scale = encode(r.float(), self.store_dtype, self._draws(k, r.device))
                if scale is not None:
                    self.residual_scale[k] = scale
