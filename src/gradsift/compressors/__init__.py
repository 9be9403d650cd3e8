"""Registry of compressors, and the spec strings the CLI and API share.

A spec is ``"name"`` or ``"name:key=value,key=value"``. Values parse as int,
float, ``true``/``false``, else string. Building a compressor from a spec, with
its memory, is :func:`gradsift.memory.factory.make_compressor` (the keys every
compressor accepts are listed there).
"""

from __future__ import annotations

from .base import Compressor, InputError, NonFiniteGradient, OptionError, target_count
from .registry import available, compressor_class, parse_spec, parse_value, register

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
from . import powersgd as _powersgd  # noqa: E402,F401

__all__ = [
    "Compressor",
    "InputError",
    "NonFiniteGradient",
    "OptionError",
    "available",
    "compressor_class",
    "parse_spec",
    "parse_value",
    "register",
    "target_count",
]
