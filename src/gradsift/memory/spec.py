"""A compressor's spec as one typed value: :class:`Spec`, parsed once from ``"name:key=value,..."``.

Every key has one owner, read from the declarations (:class:`gradsift.options.Option`):

- the keys every method takes (``ratio``, ``value_dtype``, ``warmup``: ``Compressor``'s ``COMMON_OPTIONS``) and the
  memory's choice (``memory``, or ``feedback=true/false``: :data:`MEMORY_OPTIONS`) are the spec's fields;
- a key the method declares (its ``OPTIONS``) is the method's;
- any other key is the memory's: the ``OPTIONS`` of the memory the spec names, or of the method's default memory
  (an optimizer's recipe may still choose the memory: :meth:`Spec.replace`), checked when the compressor is built.
  Where a method and a memory declare the same key (random-k's ``scale`` and the Adam memory's), the plain key is
  the method's and the memory's is written ``memory.key``: ``randomk:memory=adam,memory.scale=worker``.

Recipes change a spec with :meth:`Spec.replace` (``spec.replace(memory="adam")``), never by editing its text;
``str(spec)`` writes it back in the same syntax, and ``Spec.parse(str(spec)) == spec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..compressors import compressor_class, parse_spec
from ..compressors.base import COMMON_OPTIONS
from ..errors import OptionError
from ..options import Option
from .adam import AdamDirection
from .feedback import ErrorFeedback
from .momentum import MomentumCorrection

# the memories by the name ``memory=`` takes (``none``: the compressor alone), and who owns each one's options
MEMORY_CLASSES: dict[str, type | None] = {"ef": ErrorFeedback, "momentum": MomentumCorrection,
                                          "adam": AdamDirection, "none": None}
MEMORY_OWNERS = {name: f"{cls.TITLE} (memory={name})" for name, cls in MEMORY_CLASSES.items() if cls is not None}
MEMORY_OPTIONS = {
    "memory": Option.choice(None, MEMORY_CLASSES, optional=True,
                            doc="what the compressor keeps between steps: ef (error feedback), momentum (DGC's "
                                "momentum correction), adam (each worker's Adam direction), none (unset: the "
                                "method's, or its recipe for the optimizer handed over)"),
    "feedback": Option.flag(None, optional=True,
                            doc="true: the method's memory (error feedback where it has none); false: memory=none"),
}
PLACED = ("seed", "rank", "world_size", "weight")  # the run places a compressor; a spec cannot


def register_memory(cls: type) -> type:
    """Add a memory (a :class:`gradsift.memory.feedback.Memory` subclass with its ``memory_name``, ``TITLE`` and
    declared ``OPTIONS``): ``memory=<its name>`` then builds it, its options route to it, and the API reference
    lists them. Usable as a class decorator; docs/architecture.md, "Adding a memory"."""
    name = cls.memory_name
    if not name or name in MEMORY_CLASSES or "." in name or not getattr(cls, "TITLE", ""):
        raise ValueError(f"cannot register memory {name!r}: it needs a new memory_name (no dots) and a TITLE")
    MEMORY_CLASSES[name] = cls
    MEMORY_OWNERS[name] = f"{cls.TITLE} (memory={name})"
    MEMORY_OPTIONS["memory"] = replace(MEMORY_OPTIONS["memory"], choices=tuple(MEMORY_CLASSES))
    return cls


def unregister_memory(name: str) -> None:
    """Remove a memory :func:`register_memory` added (the built-in ones stay)."""
    if name in ("ef", "momentum", "adam", "none") or name not in MEMORY_CLASSES:
        raise ValueError(f"cannot unregister memory {name!r}")
    del MEMORY_CLASSES[name], MEMORY_OWNERS[name]
    MEMORY_OPTIONS["memory"] = replace(MEMORY_OPTIONS["memory"], choices=tuple(MEMORY_CLASSES))


def memory_options_of(memory: str) -> dict[str, Option]:
    cls = MEMORY_CLASSES[memory]
    return dict(cls.OPTIONS) if cls is not None else {}


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Spec:
    """A compressor's method and options, checked against their declarations: ``Spec.parse("topk:ratio=0.01")``.

    Wherever gradsift takes a spec string (``make_compressor``, every ``register``, ``Settings``) it takes a Spec;
    ``str(spec)`` writes it back. ``memory`` is the memory named (``None``: the method's default,
    :attr:`resolved_memory`, or its recipe for the optimizer handed over); ``options`` the method's options given,
    ``memory_options`` the memory's (defaults are not stored: ``str`` writes what was asked for). Every key, its
    type, default and bounds: the API reference's "Options"."""

    method: str
    ratio: float | None = None
    memory: str | None = None
    value_dtype: str | None = None
    warmup: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    memory_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: "str | Spec", **keywords: Any) -> "Spec":
        """``spec`` (a string or a Spec) with ``keywords`` added: each key checked and given to its owner; a key
        given both in the spec and as a keyword is an error."""
        if isinstance(spec, Spec):
            name, given = spec.method, spec.items()
        else:
            name, given = parse_spec(spec)
        both = sorted(set(given) & set(keywords))
        if both:
            raise OptionError(f"option {both[0]!r} given both in the spec {str(spec)!r} and as a keyword")
        return cls.of(name, {**given, **keywords})

    @classmethod
    def of(cls, method: str, given: Mapping[str, Any]) -> "Spec":
        """The spec of ``method`` with the keys of ``given`` (as in the spec string; ``None`` leaves a key out)."""
        mcls = compressor_class(method)
        given = {k: v for k, v in given.items() if v is not None}
        placed = sorted(set(given) & set(PLACED))
        if placed:
            raise OptionError(f"{method}: {placed[0]!r} is not a compressor option: the run sets it (--seed, the "
                              "worker's rank and count; make_compressor(..., seed=, rank=, world_size=, weight=) in "
                              "Python)")
        fields: dict[str, Any] = {}
        for key in ("ratio", "value_dtype", "warmup"):
            if key in given:
                fields[key] = _checked(method, key, COMMON_OPTIONS[key], given.pop(key))
        memory = _checked(method, "memory", MEMORY_OPTIONS["memory"], given.pop("memory", None))
        feedback = _checked(method, "feedback", MEMORY_OPTIONS["feedback"], given.pop("feedback", None))
        if memory is not None and feedback is not None:
            raise OptionError(f"{method}: give memory or feedback, not both")
        if feedback is not None:
            memory = (mcls.MEMORY if mcls.MEMORY != "none" else "ef") if feedback else "none"
        own, mem = {}, {}
        for key, value in given.items():
            prefix, _, bare = key.rpartition(".")
            if prefix:
                if prefix != "memory" or bare not in _memory_keys():
                    raise OptionError(f"{method}: unknown option {key!r}; a memory's option may be written "
                                      f"memory.key (one of {', '.join(_memory_keys())})")
                if bare in mem:
                    raise OptionError(f"{method}: option {bare!r} given twice")
                mem[bare] = value
            elif key in mcls.OPTIONS:
                own[key] = _checked(method, key, mcls.OPTIONS[key], value)
            elif key in _memory_keys():
                if key in mem:
                    raise OptionError(f"{method}: option {key!r} given twice")
                mem[key] = value
            else:
                raise OptionError(f"{method}: unknown option {key!r}; allowed: {mcls.allowed_options()}; with its "
                                  f"memory: {', '.join(_memory_keys())}")
        spec = cls(method, memory=memory, options=own, memory_options=mem, **fields)
        if memory is not None:
            spec.checked_memory_options()
        else:  # the memory may still change (a recipe): a value no memory that declares its key takes is wrong now
            for key, value in mem.items():
                declared = [memory_options_of(m)[key] for m in MEMORY_OWNERS if key in memory_options_of(m)]
                if not any(_takes(option, key, value) for option in declared):
                    _checked(method, key, declared[0], value)  # (raises, in one line)
        return spec

    # ------------------------------------------------------------------ reading
    @property
    def resolved_memory(self) -> str:
        """The memory the compressor is built with: the one named, else the method's default."""
        return self.memory if self.memory is not None else compressor_class(self.method).MEMORY

    @property
    def names_memory(self) -> bool:
        """Whether the spec chooses its memory (``memory``/``feedback``, or a momentum of its own): a recipe then
        leaves it alone."""
        return self.memory is not None or "momentum" in self.memory_options

    def checked_memory_options(self) -> dict[str, Any]:
        """The memory options, checked against :attr:`resolved_memory`'s declarations (one-line error: the key,
        who owns it, the memory this spec has)."""
        memory = self.resolved_memory
        declared = memory_options_of(memory)
        out = {}
        for key, value in self.memory_options.items():
            if key not in declared:
                owners = " or ".join(MEMORY_OWNERS[m] for m in MEMORY_OWNERS if key in memory_options_of(m))
                raise OptionError(f"{self.method}: option {key!r} belongs to {owners}; this compressor's memory "
                                  f"is {memory}")
            out[key] = _checked(self.method, key, declared[key], value)
        return out

    def items(self) -> dict[str, Any]:
        """The keys as the spec string writes them, in order (a memory's key the method also declares qualified)."""
        out: dict[str, Any] = {}
        for key in ("ratio", "memory", "value_dtype"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.warmup:
            out["warmup"] = self.warmup
        out.update(self.options)
        own = compressor_class(self.method).OPTIONS
        for key, value in self.memory_options.items():
            out[f"memory.{key}" if key in own else key] = value
        return out

    def replace(self, **changes: Any) -> "Spec":
        """A new spec with ``changes`` (fields or option keys; ``None`` removes one), checked as a parsed one."""
        method = changes.pop("method", self.method)
        items = self.items()
        if "feedback" in changes:  # (feedback is another way to write memory)
            items.pop("memory", None)
        return Spec.of(method, {**items, **changes})

    def __str__(self) -> str:
        items = self.items()
        return self.method + (":" + ",".join(f"{k}={format_value(v)}" for k, v in items.items()) if items else "")


def _checked(method: str, key: str, option: Option, value: Any) -> Any:
    try:
        return option.check(key, value)
    except OptionError as e:
        raise OptionError(f"{method}: {e}") from None


def _takes(option: Option, key: str, value: Any) -> bool:
    try:
        option.check(key, value)
        return True
    except OptionError:
        return False


def _memory_keys() -> list[str]:
    return list(dict.fromkeys(k for m in MEMORY_OWNERS for k in memory_options_of(m)))

