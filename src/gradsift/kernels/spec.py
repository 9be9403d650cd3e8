"""The layout of ``gs_topk_many``'s spec rows, read from ``spec.h``: the one definition ``select.c`` includes and
:mod:`gradsift.kernels.many` fills rows by (``F.X``, ``F.CAP``, ...), so a field moved or added there moves on both
sides."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SPEC_H = Path(__file__).with_name("spec.h")


def spec_fields(text: str | None = None) -> tuple[Any, int]:
    """The spec rows' fields by name (``SP_X`` as ``X``) and their count, read from ``spec.h`` (or ``text``);
    refused unless they number 0..count-1 once each."""
    text = SPEC_H.read_text() if text is None else text
    fields = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define SP_(\w+) (\d+)", text, re.M)}
    count = int(re.search(r"^#define SPEC (\d+)", text, re.M).group(1))
    if sorted(fields.values()) != list(range(count)):
        raise RuntimeError(f"{SPEC_H}: the spec fields must number 0..{count - 1} once each")
    return SimpleNamespace(**fields), count


F, SPEC = spec_fields()


def blank_row(one_bits: int) -> list[int]:
    """A spec row asking for nothing beyond the pass: factor 1 everywhere (``one_bits``: 1.0's float bits), stride 1."""
    row = [0] * SPEC
    row[F.SCORE_BASE], row[F.SAMPLE_STRIDE] = one_bits, 1
    return row
