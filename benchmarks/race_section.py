"""Assemble docs/results.md section 10 (time to dense's quality) from the race reports named on the command line:
``python benchmarks/race_section.py runs/docs/race-*/race.md runs/docs/cluster-race-*/race.md``. Each report's table
and first paragraph are copied under its own heading, its plot copied to docs/img/; the section replaces the one in
docs/results.md (appended the first time)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAD = "## 10. Time to dense's quality: the race"


def piece(md: Path, intro: str) -> str:
    text = md.read_text()
    title = text.splitlines()[0].lstrip("# ").strip()
    body = text.split("\n", 1)[1].strip()
    img = md.parent / "race.png"
    if img.exists():
        name = md.parent.name if md.parent.name.startswith("race") else f"race-{md.parent.name}"
        name += ".png"
        shutil.copy(img, ROOT / "docs" / "img" / name)
        body = body.replace("](race.png)", f"](img/{name})")
    return f"### {title}\n\n{intro}\n\n{body}\n"


def main(argv: list[str]) -> None:
    intro_path, reports = Path(argv[0]), [Path(a) for a in argv[1:]]
    intros = dict(re.findall(r"^\[(.+?)\]\n(.*?)(?=^\[|\Z)", intro_path.read_text(), re.M | re.S))
    parts = [intros.get("head", "").strip(), ""]
    for md in reports:
        parts.append(piece(md, intros.get(md.parent.name, "").strip()))
    parts.append(intros.get("tail", "").strip())
    section = HEAD + "\n\n" + "\n".join(parts).strip() + "\n"
    results = ROOT / "docs" / "results.md"
    text = results.read_text()
    if HEAD in text:
        start = text.index(HEAD)
        nxt = text.find("\n## ", start + len(HEAD))
        text = text[:start] + section + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    results.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
