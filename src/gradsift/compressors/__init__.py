"""Registry of compressors, and the spec strings the CLI and API share.

A spec is ``"name"`` or ``"name:key=value,key=value"``. Values parse as int,
float, ``true``/``false``, else string. Two keys are accepted by every
compressor: ``feedback`` (error feedback on/off; default per method) and
``value_dtype`` (``fp32``/``fp16``/``bf16``/``fp64``; default: the gradient's
own dtype, fp16 for GSB).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .base import Compressor, NonFiniteGradient, OptionError, target_count

_REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"cannot register compressor {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> dict[str, type[Compressor]]:
    """Registered compressors by name, in registration order."""
    return dict(_REGISTRY)


def parse_value(text: str) -> Any:
    t = text.strip()
    low = t.lower()
    if low == "true":
        return True
    if low == "false":
        return False
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    try:
        return float(t)
    except ValueError:
        return t


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,..."`` -> ``(name, {key: value})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise OptionError("compressor spec must be a non-empty string like 'topk' or 'sidco:dist=gp'")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    opts: dict[str, Any] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise OptionError(f"bad option {item.strip()!r} in spec {spec!r}: expected key=value")
            if key in opts:
                raise OptionError(f"option {key!r} given twice in spec {spec!r}")
            opts[key] = parse_value(value)
    return name, opts


def compressor_class(name: str) -> type[Compressor]:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise OptionError(f"unknown compressor {name!r}; available: {', '.join(_REGISTRY)}")
    return cls


def make_compressor(
    spec: str,
    ratio: float | None = None,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    weight: float | None = None,
    **options: Any,
):
    """Build a compressor from a spec string, wrapped in its default memory.

    ``ratio`` may also come from the spec (``topk:ratio=0.01``). ``seed``,
    ``rank``, ``world_size`` and ``weight`` (this worker's weight in the mean,
    default 1/world_size) place the compressor in its run: shared-index methods
    draw from ``seed`` only, everything else from ``(seed, rank)``.
    Options given both in the spec and as keywords are an error.
    """
    name, spec_opts = parse_spec(spec)
    cls = compressor_class(name)
    both = set(spec_opts) & set(options)
    if both:
        raise OptionError(f"option {sorted(both)[0]!r} given both in the spec {spec!r} and as a keyword")
    opts = {**spec_opts, **options}
    if "ratio" in opts:
        if ratio is not None:
            raise OptionError("ratio given both in the spec and as an argument")
        ratio = opts.pop("ratio")
    if ratio is None:
        ratio = 1.0 if name == "dense" else 0.01
    feedback = opts.pop("feedback", None)
    if feedback is None:
        feedback = cls.FEEDBACK
    elif not isinstance(feedback, bool):
        raise OptionError(f"feedback must be true or false, got {feedback!r}")
    value_dtype = opts.pop("value_dtype", None)
    comp = cls(ratio, seed=seed, rank=rank, world_size=world_size, weight=weight, value_dtype=value_dtype, **opts)
    return comp.with_memory(feedback)


def sparsify(spec: str, tensor: torch.Tensor, ratio: float | None = None, **options: Any):
    """Run a fresh compressor once on one tensor; return ``(values, indices)``.

    Indices are int64 positions in the flattened tensor (for a dense payload,
    every position).
    """
    comp = make_compressor(spec, ratio, **options)
    p = comp.compress("tensor", tensor)
    if p.indices is None:
        return p.values, torch.arange(p.numel, device=p.values.device)
    return p.values, p.indices


# Importing the modules registers their compressors (order = `gradsift list` order).
from . import dense as _dense  # noqa: E402,F401
from . import topk as _topk  # noqa: E402,F401
from . import randomk as _randomk  # noqa: E402,F401
from . import regtopk as _regtopk  # noqa: E402,F401
from . import rtopk as _rtopk  # noqa: E402,F401
from . import sampling as _sampling  # noqa: E402,F401
from . import sidco as _sidco  # noqa: E402,F401
from . import dgc as _dgc  # noqa: E402,F401
from . import redsync as _redsync  # noqa: E402,F401
from . import gaussiank as _gaussiank  # noqa: E402,F401

__all__ = [
    "Compressor",
    "NonFiniteGradient",
    "OptionError",
    "available",
    "compressor_class",
    "make_compressor",
    "parse_spec",
    "register",
    "sparsify",
    "target_count",
]
