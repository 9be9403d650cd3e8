"""Running one simulated training run to disk: ``metrics.jsonl`` and ``summary.json``."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..compressors.base import NonFiniteGradient
from ..runtime.records import MetricsWriter, dumps, progress_info, read_metrics, write_json
from ..runtime.runconfig import RunConfig
from ..runtime.localsgd import LocalSGD
from ..runtime.simulate import Simulator


class Progress:
    """Progress on stderr with elapsed time and an estimate of what is left: a rich bar on a terminal, plain
    periodic lines otherwise (logs, CI)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._progress = None

    def note(self, text: str) -> None:
        """One line between tasks (overall progress)."""
        if self.enabled:
            print(f"gradsift: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int, str], None]]:
        if not self.enabled:
            yield lambda n=1, info="": None
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        console = Console(stderr=True)
        if not console.is_terminal:
            state = {"done": 0, "next": 0.0}
            start = time.perf_counter()

            def advance(n: int = 1, info: str = "") -> None:
                state["done"] += n
                now = time.perf_counter() - start
                if state["done"] >= total or now >= state["next"]:
                    left = now / state["done"] * (total - state["done"]) if state["done"] else 0.0
                    eta = f", ~{left:.0f}s left" if state["done"] < total else ""
                    console.print(f"{description}: {state['done']}/{total} {info} [{now:.0f}s{eta}]", highlight=False)
                    state["next"] = now + 10.0

            yield advance
            return
        with RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                          console=console, transient=False) as prog:
            tid = prog.add_task(description, total=total, info="")

            def advance(n: int = 1, info: str = "") -> None:
                prog.update(tid, advance=n, info=info)

            yield advance


def train_to_dir(cfg: RunConfig, out: Path, *, progress: Progress | None = None, label: str | None = None,
                 sim: Simulator | None = None, tolerate_divergence: bool = False) -> dict[str, Any]:
    """Run the simulator for ``cfg`` and write ``metrics.jsonl`` and ``summary.json`` under ``out``.

    ``summary.json`` always says how the run ended: ``completed``, ``diverged``
    (with ``tolerate_divergence``, as comparisons run: a non-finite gradient ends
    the run instead of raising), ``failed: ...`` or ``interrupted`` -- the last two
    written on the way out, with the records so far. The caller owns the folder
    (:class:`gradsift.runtime.records.OutputDir`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if sim is None:  # (``local:...``: local SGD's workers, :mod:`gradsift.runtime.localsgd`)
        sim = LocalSGD(cfg, cfg.compressor) if cfg.compressor.split(":")[0] == "local" else Simulator(cfg)
    progress = progress or Progress(False)
    writer = MetricsWriter(out / "metrics.jsonl")
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    metric = sim.task.metric
    status: dict[str, Any] = {"status": "completed"}

    def finish(how: dict[str, Any]) -> dict[str, Any]:
        writer.close()
        summary = sim.summary(records, time.perf_counter() - t0, extra=how)
        write_json(out / "summary.json", summary)
        return summary

    try:
        with progress.task(label or f"{sim.cfg.compressor} on {sim.cfg.task}", sim.cfg.steps) as advance:
            def on_record(rec: dict[str, Any]) -> None:
                records.append(rec)
                writer.write(rec)
                advance(1, progress_info(rec, metric))

            try:
                sim.run(on_record=on_record)
            except NonFiniteGradient as e:
                if not tolerate_divergence:
                    raise
                status = {"status": "diverged", "diverged_at": sim.updates + 1, "error": str(e)}
    except KeyboardInterrupt:
        finish({"status": "interrupted"})
        raise
    except BaseException as e:
        finish({"status": f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"})
        raise
    return finish(status)


__all__ = ["MetricsWriter", "Progress", "dumps", "progress_info", "read_metrics", "train_to_dir", "write_json"]
