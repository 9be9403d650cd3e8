"""Every declared option, grouped by its owner, for the API reference (``benchmarks/make_api.py``) and its test:
the keys every spec takes, each method's, each memory's, local SGD's and the rank settings'."""

from __future__ import annotations

from ..compressors import available
from ..compressors.base import COMMON_OPTIONS
from ..memory.spec import MEMORY_CLASSES, MEMORY_OPTIONS, MEMORY_OWNERS
from ..options import Option, reference
from ..runtime.localsgd import LOCAL_OPTIONS
from ..runtime.runconfig import RUN_OPTIONS
from ..runtime.settings import SETTINGS


def declared_options() -> list[tuple[str, str, dict[str, Option]]]:
    """``(heading, what it is, options)`` for every owner of options, in the reference's order."""
    out = [("Every spec", "Keys every method's spec takes (`topk:ratio=0.01,memory=ef`).",
            {**COMMON_OPTIONS, **MEMORY_OPTIONS})]
    for name, cls in available().items():
        if cls.OPTIONS:
            out.append((f"`{name}`", cls.SUMMARY + ".", dict(cls.OPTIONS)))
    for memory, owner in MEMORY_OWNERS.items():
        out.append((f"memory `{memory}`", f"{owner[0].upper()}{owner[1:]}: its keys in a spec (a key the method "
                    "also declares is written `memory.key`).", dict(MEMORY_CLASSES[memory].OPTIONS)))
    out.append(("Local SGD", "Keys of a `local:...` spec (`gradsift train --compressor local:period=8`, "
                "`gradsift.local.from_spec`).", dict(LOCAL_OPTIONS)))
    out.append(("Settings", "Keywords of `gradsift.ddp.register`, `gradsift.fsdp.register` and "
                "`gradsift.local.register` besides the spec and its ratio (`Settings`).", dict(SETTINGS)))
    out.append(("A run's own options", "What `gradsift train`, `race` and `compare` take beside the settings "
                "(`--steps`, `--lr`, ...; `RunConfig`'s fields); unset takes the task's.", dict(RUN_OPTIONS)))
    return out


def render_options() -> list[str]:
    """The reference's "Options" section, in markdown."""
    lines = ["## Options", "",
             "Every option is declared once, beside the code that reads it; this section is written from those "
             "declarations.", ""]
    for heading, what, options in declared_options():
        lines += [f"### {heading}", "", what, "", "| option | takes | default | what it does |",
                  "|---|---|---|---|", *reference(options), ""]
    return lines
