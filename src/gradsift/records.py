"""Writing run records: ``metrics.jsonl`` (one whole JSON line per step) and atomic JSON files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def clean(v: Any) -> Any:
    """JSON has no NaN/Inf: write them as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def dumps(obj: Any) -> str:
    return json.dumps(clean(obj), allow_nan=False)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary file, fsync, rename): a crash never leaves a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(clean(obj), indent=2, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl``, each line in a single write."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC), 0o644)

    def write(self, rec: dict[str, Any]) -> None:
        data = (dumps(rec) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
