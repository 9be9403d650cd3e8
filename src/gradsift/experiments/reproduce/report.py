"""The report: ``REPORT.md`` from the sections, kept across reruns of some experiments."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from .common import Section


def kept_entries(path: Path, known: Sequence[str], names: Sequence[str], quick: bool, scale: float) -> list[dict[str, Any]]:
    """The sections of an earlier report at the same size, for experiments not being rerun."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, list):
        return []
    return [e for e in old if isinstance(e, dict) and e.get("name") in known and e["name"] not in names
            and e.get("quick") == quick and e.get("scale") == scale]


def write_report(out: Path, entries: Sequence[dict[str, Any]], quick: bool, scale: float = 1.0) -> Path:
    """``REPORT.md`` from report.json-style entries (a Section's fields plus seconds and command)."""
    fields = {f.name for f in dataclasses.fields(Section)}
    sections = [Section(**{k: v for k, v in e.items() if k in fields}) for e in entries]
    lines = ["# Reproducing the five papers at laptop scale", ""]
    commands: dict[str, list[str]] = {}
    for e in entries:
        if e.get("command"):
            commands.setdefault(e["command"], []).append(e["name"])
    if len(commands) == 1:
        lines += [f"Made by `{next(iter(commands))}`.", ""]
    elif commands:
        lines += ["Made by " + "; ".join(f"`{c}` ({', '.join(n)})" for c, n in commands.items()) + ".", ""]
    lines += [("These are the **quick** (CI-sized) versions: verdicts speak only for that size." if quick else
               "Full-size versions, scaled to minutes per experiment on 2 CPU cores." if scale == 1.0 else
               f"Full-size configurations with every training budget cut to {scale:g}x its steps (`--scale "
               f"{scale:g}`; the toy's 100 updates, linreg's 3000 iterations and the GSB capture analysis's 100 "
               "iterations are fixed): "
               "verdicts speak for that budget."), "",
              "| experiment | paper's claim | our result | verdict |", "|---|---|---|---|"]
    for s in sections:
        claim = s.claim if len(s.claim) < 160 else s.claim[:157] + "..."
        lines.append(f"| [{s.name}](#{s.name}) | {claim.replace('|', '/')} "
                     f"| {s.summary.replace('|', '/')} | **{s.verdict}** |")
    lines += ["", "Time per experiment: " + ", ".join(f"{e['name']} {e['seconds']:.0f} s" for e in entries) + ".",
              ""]
    for s in sections:
        lines.append(s.markdown())
    path = Path(out) / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
