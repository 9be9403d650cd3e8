"""Option checks and the one-line errors every compressor raises (split from :mod:`gradsift.compressors.base`)."""

from __future__ import annotations

from typing import Any

import torch

from .. import payload as P
from ..errors import OptionError  # noqa: F401  (the compressors' errors, raised beside their own)
from ..options import Option


# the options every method takes (spec keys beside the method's own; the memory's are in gradsift.memory.spec)
COMMON_OPTIONS = {
    "ratio": Option.number(None, lo=0.0, hi=1.0, lo_open=True, optional=True,
                           doc="the fraction of entries sent (required but for dense and powersgd; or the ratio "
                               "argument, --ratio)"),
    "value_dtype": Option.choice(None, [*P.VALUE_DTYPES, *P.VALUE_BITS], optional=True,
                                 doc="the values' type on the wire (unset: bf16 for a sparse payload with a memory, "
                                     "fp16 for GSB, else the gradient's)"),
    "warmup": Option.integer(0, lo=0, doc="steps of DGC's exponential density warm-up (ratio ** ((t+1)/(warmup+1)))"),
}


class InputError(ValueError):
    """A tensor a compressor cannot take (not floating point, meta, ...); the message is one line."""


class NonFiniteGradient(FloatingPointError):
    """A gradient held NaN or Inf; nothing of it was stored."""


def check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise OptionError(f"ratio must be a number in (0, 1], got {ratio!r}")
    r = float(ratio)
    if not (0.0 < r <= 1.0):  # also rejects NaN
        raise OptionError(f"ratio must be in (0, 1], got {ratio!r}")
    return r


def check_int(name: str, value: Any, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise OptionError(f"{name} must be an integer{bound}, got {value!r}")
    return int(value)




def target_count(ratio: float, numel: int) -> int:
    """k for a tensor of ``numel`` elements: max(1, round(ratio * numel)), at most numel (0 for an empty tensor)."""
    return min(numel, max(1, int(round(ratio * numel))))


def check_input(name: str, key: str, t: Any) -> None:
    """Refuse, in one line, tensors no compressor can take."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: gradient of {key!r} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise InputError(f"{name}: gradient of {key!r} must be floating point, got {t.dtype}")
    if t.device.type == "meta":
        raise InputError(f"{name}: gradient of {key!r} is a meta tensor (it holds no values)")
