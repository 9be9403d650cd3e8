"""Write docs/api.md, gradsift's API reference, from the docstrings of its public objects:
``python benchmarks/make_api.py`` (``--check`` exits 1 when docs/api.md differs from what the code says; a test runs
it, so the reference cannot drift from the code)."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

from gradsift.cli.reference import render_options

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"

# (section, module, names): functions, and classes with the methods a user calls
PUBLIC = [
    ("Compressors", "gradsift", ["make_compressor", "sparsify", "Spec", "Spec.parse", "Spec.replace",
                                 "Spec.resolved_memory", "parse_spec", "available", "Payload"]),
    ("DDP", "gradsift.ddp", ["register", "finish", "hook_state", "gradsift_hook", "GradsiftState.end_step"]),
    ("FSDP2 and HSDP", "gradsift.fsdp", ["register"]),
    ("Local SGD", "gradsift.local", ["register", "LocalState.state_dict"]),
    ("Settings", "gradsift.runtime.settings", ["Settings"]),
    ("A rank's state", "gradsift.runtime.rankstate",
     ["RankState", "RankState.take_optimizer", "RankState.state_dict", "RankState.load_state_dict",
      "RankState.load_elastic", "RankState.all_ranks", "RankState.memory", "RankState.memory_per_parameter",
      "RankState.residual_rounding"]),
    ("A rank's state", "gradsift.runtime.elastic", ["AllRanks"]),
    ("Hugging Face Trainer", "gradsift.integrations.transformers", ["compress", "GradsiftCallback"]),
    ("Lightning", "gradsift.integrations.lightning", ["GradsiftDDPStrategy"]),
    ("Errors", "gradsift.errors", ["ConfigError"]),
    ("Errors", "gradsift.compressors", ["OptionError", "InputError", "NonFiniteGradient"]),
]


class Raw(str):
    """An annotation as written in the source (``from __future__ import annotations`` keeps it a string)."""

    def __repr__(self) -> str:
        return str(self)


def signature(fn) -> str:
    sig = inspect.signature(fn)
    params = [p.replace(annotation=Raw(p.annotation)) if isinstance(p.annotation, str) else p
              for name, p in sig.parameters.items() if name != "self"]
    ret = Raw(sig.return_annotation) if isinstance(sig.return_annotation, str) else sig.return_annotation
    return str(sig.replace(parameters=params, return_annotation=ret))


def entry(module: str, name: str) -> str:
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    shown = f"{module}.{name}"
    if isinstance(obj, property):  # an attribute to read: its type, no call
        ret = inspect.signature(obj.fget).return_annotation
        sig = f": {ret}" if isinstance(ret, str) else ""
    elif inspect.isclass(obj):
        sig = "" if issubclass(obj, BaseException) else signature(obj.__init__).replace(" -> None", "")
    else:
        sig = signature(obj)
    head = f"### `{shown}{sig}`"
    doc = inspect.cleandoc(obj.__doc__ or "(no docstring)")
    return f"{head}\n\n{doc}\n"


def render() -> str:
    parts = ["# API reference", "",
             "Generated from the docstrings by `python benchmarks/make_api.py` (a test fails when this page and the "
             "code differ). Spec strings (`\"topk\"`, `\"sidco:stages=2\"`, ...): every key each method, memory "
             "and setting takes is in \"Options\" at the end; what the methods do: the pages in `docs/methods/`.", ""]
    section = None
    for title, module, names in PUBLIC:
        if title != section:
            parts += [f"## {title}", ""]
            section = title
        parts += [entry(module, n) for n in names]
    parts += render_options()
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} differs from the code's docstrings: run python benchmarks/make_api.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
