"""Assemble investigation 10 (time to dense's quality; its page under docs/results/) from the race reports named on
the command line: ``python benchmarks/race_section.py runs/docs/race-*/race.md runs/docs/cluster-race-*/race.md``.
Each report's table and first paragraph are copied under its own heading, its plot copied to docs/img/."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Time to dense's quality: the race"


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
    from make_results import write_section  # (benchmarks/: this script's folder)

    write_section(10, TITLE, "\n".join(parts).strip().split("\n"))


if __name__ == "__main__":
    main(sys.argv[1:])
