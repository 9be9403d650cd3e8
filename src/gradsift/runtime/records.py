"""Writing run records: ``metrics.jsonl`` (one whole JSON line per step), atomic JSON files, and output folders
that one run owns at a time."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


def clean(v: Any) -> Any:
    """JSON has no NaN/Inf: write them as null; one-element tensors and NumPy scalars become numbers."""
    if isinstance(v, (np.generic, torch.Tensor)) and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a symbolic link where gradsift writes is refused, never followed


def dumps(obj: Any) -> str:
    return json.dumps(clean(obj), allow_nan=False)


def write_atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into a temporary binary file, fsync, rename over ``path``: a crash never leaves a half-written
    file; a link planted under the temporary name is removed, never followed; on a full disk (any OSError) the
    temporary file goes, ``path`` stays as it was and the error is one line (:class:`OutputError`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write it ({e.strerror or e}); what was there before is unchanged") \
            from None


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically."""
    _write_atomic(path, json.dumps(clean(obj), indent=2, allow_nan=False) + "\n")


def rewrite_metrics(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` with ``records``, atomically (one JSON line each, as :class:`MetricsWriter`)."""
    _write_atomic(path, "".join(dumps(r) + "\n" for r in records))


def refuse_link(path: Path) -> None:
    """One line when a run's records file is a symbolic link: gradsift never writes through one."""
    if path.is_symlink():
        raise OutputError(f"{path} is a symbolic link: gradsift writes its records only into a file of its own, "
                          "never through a link (remove it)")


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl``, each line in a single write."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        refuse_link(self.path)  # (O_NOFOLLOW refuses it too, where the platform has it)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | NOFOLLOW |
                          (0 if append else os.O_TRUNC), 0o644)

    def write(self, rec: dict[str, Any]) -> None:
        """Append one record, whole or not at all: a write cut short (a full disk) is cut back to the end of the
        record before, and says so in one line."""
        data = (dumps(rec) + "\n").encode()
        view = memoryview(data)
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, end)
            except OSError:
                pass
            raise OutputError(f"{self.path}: cannot append a record ({e.strerror or e}); the file keeps the whole "
                              "records before it") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def progress_info(rec: dict[str, Any], metric: str) -> str:
    """A step's record for a progress line: the loss, and the task metric where it was evaluated."""
    parts = [f"loss {rec['loss']:.4g}"] if rec.get("loss") is not None else []
    if metric != "loss" and rec.get(metric) is not None:
        parts.append(f"{metric} {rec[metric]:.4g}")
    return " ".join(parts)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_resumed_metrics(path: Path) -> list[dict[str, Any]]:
    """The records a resumed run keeps from its folder's ``metrics.jsonl``: a symbolic link is refused (one line),
    a last line torn by a crash or a full disk (no newline, not JSON) is dropped; any other bad line is refused."""
    path = Path(path)
    refuse_link(path)
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if n == len(lines):  # the last line, without its newline: torn mid-write
                break
            raise OutputError(f"{path}: line {n} is not a JSON record: not a gradsift run's metrics (remove it, or "
                              "resume into another --out)") from None
    return out


class OutputError(ValueError):
    """An output folder that cannot be used (not empty, in use, not writable); the message is one line."""


LOCK = ".gradsift.lock"
OURS = ("summary.json", "metrics.jsonl", "report.md", "compare.json", "REPORT.md", "report.json", "bench.json",
        "race.json", "cluster.json", "checkpoints", "final_model.pt")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs (a zombie its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class OutputDir:
    """An output folder owned by one run at a time.

    ``open()`` creates the folder (one line if it cannot be created or written),
    refuses one that already holds files unless ``overwrite`` (which clears it
    first, and only when it looks like a gradsift output folder) or ``reuse``
    (a run that continues what is there: ``--resume``, a report being updated),
    and takes a lock file so a second run into the same folder refuses instead
    of interleaving. ``close()`` releases the lock. Use it as a context manager.
    """

    def __init__(self, path, *, overwrite: bool = False, reuse: bool = False, what: str = "--out"):
        self.path = Path(path)
        self.overwrite, self.reuse, self.what = overwrite, reuse, what
        self._locked = False

    def open(self) -> "OutputDir":
        p = self.path
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{self.what} {p}: cannot create it ({e.strerror})") from None
        if not p.is_dir():
            raise OutputError(f"{self.what} {p} is a file, not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutputError(f"{self.what} {p} is not writable")
        self._lock()
        try:
            entries = [e for e in p.iterdir() if e.name != LOCK]
            if entries and not self.reuse:
                if not self.overwrite:
                    raise OutputError(f"{self.what} {p} is not empty: pass --overwrite to replace what is in it, or "
                                      "choose another folder")
                if not any(e.name in OURS for e in entries):
                    raise OutputError(f"{self.what} {p} holds files that are not a gradsift run's; --overwrite clears "
                                      "only gradsift output folders: choose another folder")
                for e in entries:
                    shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
        except BaseException:
            self.close()
            raise
        return self

    def _lock(self) -> None:
        lock = self.path / LOCK
        me = f"{os.getpid()} {socket.gethostname()}\n"
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    pid_s, host = lock.read_text().split()[:2]
                    pid = int(pid_s)
                except (OSError, ValueError):
                    pid, host = -1, ""
                if host == socket.gethostname() and pid > 0 and not process_alive(pid):
                    lock.unlink(missing_ok=True)  # left by a run that died: take it over
                    continue
                raise OutputError(f"{self.what} {self.path} is in use by another gradsift run "
                                  f"(pid {pid_s if pid > 0 else '?'} on {host or '?'}; {lock})") from None
            except OSError as e:
                raise OutputError(f"{self.what} {self.path} is not writable ({e.strerror})") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self._locked = True
            return
        raise OutputError(f"{self.what} {self.path}: could not take its lock {lock}")

    def close(self) -> None:
        if self._locked:
            (self.path / LOCK).unlink(missing_ok=True)
            self._locked = False

    def __enter__(self) -> "OutputDir":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
