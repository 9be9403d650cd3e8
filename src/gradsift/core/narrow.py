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
* ``bf16``/``fp16``: a plain cast (bf16 keeps fp32's range with 8 bits of precision; fp16 5 exponent bits).

The accumulation and selection always run in fp32 (the store is decoded, the gradient added, the send taken out,
the rest encoded again), so only the stored residual is rounded. What the rounding drops is counted
(:class:`Rounding`): ``sqrt(sum ||r - stored||^2 / sum ||r||^2)`` over every settle, reported as
``state.residual_rounding``.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
RESIDUAL_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}


def encode(left: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``left`` (the residual, fp32 or wider) as stored: the codes, and for ``fp8`` its 0-d fp32 scale."""
    if dtype is not FP8:
        return left.to(dtype), None
    amax = left.abs().amax().float() if left.numel() else torch.zeros((), device=left.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (left / scale).to(FP8), scale  # e4m3's cast saturates at 448 (the largest entry may round up to it)


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
