"""Options declared once: each method, memory and setting names its options here, with a type, a default, bounds
and one line of documentation; the checks, the defaults, the errors and the API reference all come from that.

    OPTIONS = {"tol": Option.number(0.2, lo=0.0, hi=1.0, lo_open=True, doc="the threshold search's tolerance")}

:func:`check_options` takes what a user gave (spec keys, keywords), refuses an unknown key or a bad value in one
line and returns every option with its value: the given ones checked and converted, the rest at their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import OptionError

KINDS = ("number", "integer", "flag", "choice", "text", "custom")


@dataclass(frozen=True, kw_only=True)
class Option:
    """One option: its ``kind`` (``number``, ``integer``, ``flag`` (true/false), ``choice`` (one of ``choices``),
    ``text``, or ``custom``: a value its owner checks, described by ``takes``), ``default``, bounds for numbers
    (``lo``/``hi``, open or closed), whether ``None`` is allowed (``optional``: the default then means "the owner
    decides", said in ``doc``) and ``doc``, one line."""

    kind: str
    default: Any
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[Any, ...] = ()
    optional: bool = False
    takes: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option kind must be one of {KINDS}, got {self.kind!r}")
        if not self.doc:
            raise ValueError("an option needs its one line of documentation")
        if self.kind == "choice" and not self.choices:
            raise ValueError("a choice option needs its choices")
        if (self.kind == "custom") != bool(self.takes):
            raise ValueError("a custom option, and only one, says what it takes")
        if not (self.default is None and self.optional):
            self.check("default", self.default)  # a declaration that contradicts itself fails at import

    # constructors, one per kind
    @classmethod
    def number(cls, default, *, doc: str, lo=None, hi=None, lo_open=False, hi_open=False, optional=False) -> "Option":
        return cls(kind="number", default=default, doc=doc, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open,
                   optional=optional)

    @classmethod
    def integer(cls, default, *, doc: str, lo=None, hi=None, optional=False) -> "Option":
        return cls(kind="integer", default=default, doc=doc, lo=lo, hi=hi, optional=optional)

    @classmethod
    def flag(cls, default, *, doc: str, optional=False) -> "Option":
        return cls(kind="flag", default=default, doc=doc, optional=optional)

    @classmethod
    def choice(cls, default, choices, *, doc: str, optional=False) -> "Option":
        return cls(kind="choice", default=default, doc=doc, choices=tuple(choices), optional=optional)

    @classmethod
    def text(cls, default, *, doc: str, optional=False) -> "Option":
        return cls(kind="text", default=default, doc=doc, optional=optional)

    @classmethod
    def custom(cls, default, *, takes: str, doc: str) -> "Option":
        return cls(kind="custom", default=default, doc=doc, takes=takes, optional=True)

    # ------------------------------------------------------------------ checks
    def range_text(self) -> str:
        """The bounds in words: ``>= 1``, ``> 0``, ``in (0, 1]``; empty without bounds."""
        def text(v):
            return str(int(v)) if self.kind == "integer" else f"{v:g}"
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{text(self.lo)}, {text(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {text(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {text(self.hi)}"
        return ""

    def allowed(self) -> str:
        """What this option takes, in words (the error's and the reference's)."""
        if self.kind == "custom":
            return self.takes
        if self.kind == "flag":
            what = "true or false"
        elif self.kind == "choice":
            what = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.kind == "text":
            what = "a string"
        else:
            bounds = self.range_text()
            what = ("an integer" if self.kind == "integer" else "a number") + (f" {bounds}" if bounds else "")
        return what + (" (or unset)" if self.optional else "")

    def check(self, name: str, value: Any) -> Any:
        """``value`` checked and converted (an integral float for an integer, an int for a number: float); an
        :class:`OptionError` of one line otherwise."""
        if (value is None and self.optional) or self.kind == "custom":
            return value
        if self.kind == "flag":
            if isinstance(value, bool):
                return value
        elif self.kind == "choice":
            if not isinstance(value, bool) and value in self.choices:
                return value
        elif self.kind == "text":
            if isinstance(value, str):
                return value
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            ok = self.kind == "number" or int(value) == value
            if ok and self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
                ok = False
            if ok and self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
                ok = False
            if ok:
                return int(value) if self.kind == "integer" else float(value)
        raise OptionError(f"{name} must be {self.allowed()}, got {value!r}")

    def default_text(self) -> str:
        d = self.default
        if d is None:
            return "unset"
        if isinstance(d, bool):
            return "true" if d else "false"
        return f"{d:g}" if isinstance(d, float) else str(d)


def check_options(declared: Mapping[str, Option], given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """Every declared option's value: ``given`` checked (an unknown key or a bad value is an
    :class:`OptionError` naming ``owner``), the rest at their defaults, in declaration order."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise OptionError(f"{owner}: unknown option {unknown[0]!r}; allowed: {', '.join(declared) or 'none'}")
    out = {}
    for name, opt in declared.items():
        if name in given:
            try:
                out[name] = opt.check(name, given[name])
            except OptionError as e:
                raise OptionError(f"{owner}: {e}") from None
        else:
            out[name] = opt.default
    return out


def defaults(declared: Mapping[str, Option]) -> dict[str, Any]:
    """The declared options at their defaults."""
    return {name: opt.default for name, opt in declared.items()}


def reference(declared: Mapping[str, Option]) -> list[str]:
    """One markdown row per option: ``| name | what it takes | default | doc |``."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    return [f"| `{name}` | {cell(opt.allowed())} | {cell(opt.default_text())} | {cell(opt.doc)} |"
            for name, opt in declared.items()]
