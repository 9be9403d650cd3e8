"""The compressor registry and the spec strings the CLI and API share."""

from __future__ import annotations

import re
from typing import Any

from .base import Compressor, OptionError

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
