"""``gradsift reproduce``: each paper's headline experiments at laptop scale, with an honest verdict.

Every experiment runs through the same simulator (and, for LAGS, the same DDP
runtime) that users run, writes its runs under ``DIR/<name>/runs``, its plots
next to them, and a markdown section: the paper's claim, our configuration,
our numbers, and a verdict -- reproduced, partly, or not -- with the likely
reason. ``DIR/REPORT.md`` gathers the sections behind a summary table.

Rules kept: every method in a comparison gets the same seeds, data order,
initialization and budget; a setting is changed for one method only where the
paper did so; differences that are small are reported with their spread over
at least 3 seeds (full size). ``--quick`` runs CI-sized versions (about 15 s each)
whose verdicts only speak for that size.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Sequence

from ...runtime.records import write_json
from ..runner import Progress
from .common import SHAKESPEARE, Ctx, Section, size_table
from .gsb import exp_gsb
from .lags import exp_lags
from .regtopk import exp_regtopk_cnn, exp_regtopk_linreg, exp_regtopk_toy
from .report import kept_entries, write_report
from .rtopk import exp_rtopk, exp_rtopk_lstm
from .sidco import exp_sidco

EXPERIMENTS: dict[str, Callable[[Ctx], Section]] = {
    "regtopk-toy": exp_regtopk_toy,
    "regtopk-linreg": exp_regtopk_linreg,
    "regtopk-cnn": exp_regtopk_cnn,
    "rtopk": exp_rtopk,
    "rtopk-lstm": exp_rtopk_lstm,
    "gsb": exp_gsb,
    "sidco": exp_sidco,
    "lags": exp_lags,
}


def run_reproduce(names: Sequence[str], out: Path, *, quick: bool = False, progress: Progress | None = None,
                  data: str | None = None, command: str | None = None, scale: float = 1.0,
                  reuse: bool = False) -> Path:
    """Run the named experiments (or ``all``) and write ``out/REPORT.md``.

    Sections already in ``out/report.json`` from a run of the same size (same --quick and --scale) are kept
    for the experiments not named now, so ``reproduce sidco --out DIR`` updates one section of DIR's report.
    """
    if list(names) == ["all"]:
        names = list(EXPERIMENTS)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_path = Path(data) if data else (SHAKESPEARE if SHAKESPEARE.exists() else None)
    ctx = Ctx(out, quick, progress or Progress(False), data_path, scale, reuse)
    entries = {e["name"]: e for e in kept_entries(out / "report.json", list(EXPERIMENTS), names, quick, scale)}
    for n in names:
        t0, r0 = time.perf_counter(), ctx.reused_s
        sec = EXPERIMENTS[n](ctx)
        if ctx.sizes.get(n):
            sec.tables.insert(0, "Scale of the runs:\n\n" + size_table(ctx.sizes[n]))
        (ctx.dir(n) / "section.md").write_text(sec.markdown())
        seconds = time.perf_counter() - t0 + ctx.reused_s - r0  # reused runs count with their recorded time
        entries[n] = dataclasses.asdict(sec) | {"seconds": seconds, "quick": quick,
                                                "scale": scale, "command": command}
        # written after every experiment, so an interrupted `all` leaves a report of what finished
        ordered = [entries[e] for e in EXPERIMENTS if e in entries]
        write_report(out, ordered, quick, scale)
        write_json(out / "report.json", ordered)
    return out / "REPORT.md"


__all__ = ["EXPERIMENTS", "Ctx", "Section", "run_reproduce", "write_report"]
