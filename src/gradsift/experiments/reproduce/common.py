"""What every reproduction shares: the report section, the run context, one run, table and plot helpers."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ...runtime.records import read_metrics
from ...runtime.runconfig import RunConfig
from ...tasks import task_class
from ..compare import safe_name
from ..runner import Progress, train_to_dir

# The papers' claims need models that send thousands of entries per step: mnist1d-cnn at 128 channels has 105,738
# parameters (1,057 entries per worker per step at 1%); --quick keeps the 32-channel, 8,010-parameter CNN
WIDE_CNN = {"channels": 128}

# ../shared beside a source checkout (tests and the committed report use it); --data overrides
SHAKESPEARE = Path(__file__).resolve().parents[5] / "shared" / "data" / "tinyshakespeare.txt"  # (src/gradsift/...)


CHANCE_MARGIN = 0.05  # final accuracy this close to chance: the run did not learn


@dataclass
class Section:
    name: str
    title: str
    claim: str
    config: str
    result: str
    verdict: str  # reproduced | partly | not | inconclusive
    reason: str
    summary: str  # one line for the summary table
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def judged_against_chance(self, accuracies: Sequence[float], chance: float = 0.1) -> "Section":
        """The verdict "inconclusive" when every compared run's final accuracy is within 5 points of chance: an ordering
        among runs that did not learn says nothing about the paper's claim (a quick run, a budget too short)."""
        acc = [a for a in accuracies if a == a]
        if acc and max(acc) < chance + CHANCE_MARGIN:
            self.verdict = "inconclusive"
            self.reason = (f"At this scale every run compared ends within {100 * CHANCE_MARGIN:.0f} points of chance "
                           f"({chance:g}; the best {max(acc):.3f}): nothing learned, so no ordering among them "
                           "speaks for or against the claim. " + self.reason)
            self.summary += " (all near chance)"
        return self

    def markdown(self) -> str:
        lines = [f'<a id="{self.name}"></a>', "", f"## {self.title} (`{self.name}`)", "",
                 f"**Paper's claim.** {self.claim}", "",
                 f"**Our configuration.** {self.config}", ""]
        for t in self.tables:
            lines += [t, ""]
        for f in self.figures:
            lines += [f"![{self.name}]({f})", ""]
        lines += [f"**Our result.** {self.result}", "",
                  f"**Verdict: {self.verdict}.** {self.reason}", ""]
        return "\n".join(lines)


@dataclass
class Ctx:
    out: Path
    quick: bool
    progress: Progress
    data: Path | None = None
    scale: float = 1.0  # multiplies the full-size step budgets (never the paper's fixed counts, nor --quick)
    reuse: bool = False  # take a finished simulated run from DIR when its resolved config matches (--reuse)
    reused_s: float = 0.0  # the recorded wall time of the runs taken so, counted in the experiment's time
    sizes: dict[str, dict[tuple, list]] = field(default_factory=dict)  # per experiment: what each run sent

    def cnn(self) -> dict[str, Any]:
        """mnist1d-cnn's options: the wide CNN at full size, the small one under --quick."""
        return {} if self.quick else dict(WIDE_CNN)

    def steps(self, quick: int, full: int) -> int:
        """The step budget: ``quick`` under --quick, else ``full`` times --scale (at least ``quick``)."""
        return quick if self.quick else max(quick, int(round(full * self.scale)))

    def dir(self, name: str) -> Path:
        d = self.out / name
        d.mkdir(parents=True, exist_ok=True)
        return d


# ------------------------------------------------------------------ helpers
def run(ctx: Ctx, exp: str, label: str, cfg: RunConfig, *,
        recipe: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One simulated run into ``DIR/<exp>/runs/<label>``; returns (records, summary).

    Every run takes the papers' exact setting: every tensor compressed as the method says (no wire plan), the
    optimizer as the experiment names it (gradsift's recipe off: no Nesterov momentum for the sparsifiers) unless
    ``recipe`` (a section that says so: the method's measured training for the optimizer, docs/recipes.md)."""
    cfg = dataclasses.replace(cfg, wire_plan=False, recipe=recipe)
    d = ctx.dir(exp) / "runs" / safe_name(label)
    if ctx.reuse and (summary := finished_run(d, cfg)) is not None:
        with ctx.progress.task(f"{exp}: {label} (reused from {d})", 1) as advance:
            advance(1, "")
        ctx.reused_s += float(summary.get("totals", {}).get("wall_s") or 0.0)
    else:
        summary = train_to_dir(cfg, d, progress=ctx.progress, label=f"{exp}: {label}", tolerate_divergence=True)
    note_size(ctx, exp, cfg, summary)
    return read_metrics(d / "metrics.jsonl"), summary


def note_size(ctx: Ctx, exp: str, cfg: RunConfig, summary: dict[str, Any]) -> None:
    """Remember the model's size and the entries a worker sent per step, for the experiment's scale table."""
    t = summary.get("totals") or {}
    steps = t.get("steps") or 0
    if not steps or cfg.compressor.split(":")[0] in ("dense", "powersgd"):
        return
    params = summary.get("parameters")  # (a run made before summaries counted them: its dense bytes / entry size)
    if params is None:
        params = t["dense_bytes_per_worker"] / steps / torch.empty(0, dtype=task_class(cfg.task).dtype).element_size()
    key = (cfg.task, cfg.ratio, tuple(sorted((cfg.task_options or {}).items())))
    ctx.sizes.setdefault(exp, {}).setdefault(key, []).append((params, t["mean_density"] * params))


def size_table(rows: dict[tuple, list]) -> str:
    """Parameters and entries sent per worker per step (mean over the compressed runs), per task and ratio; a line
    under the table names the rows that send fewer than 1,000 entries a step."""
    out, few = [], []
    for (task, ratio, opts), vals in rows.items():
        params = vals[0][0]
        sent = statistics.mean(v[1] for v in vals)
        label = task + (f" ({', '.join(f'{k}={v}' for k, v in opts)})" if opts else "")
        out.append([label, f"{params:,.0f}", f"{ratio:g}", f"{sent:,.0f}"])
        if sent < 1000 and params >= 1000:
            few.append(f"{label} at {ratio:g} ({sent:,.0f})")
    table = md_table(["task", "parameters", "ratio", "entries sent per worker per step (mean of compressed runs)"],
                     out)
    if few:
        table += ("\n\nFewer than 1,000 entries a step: " + "; ".join(few) + ". A selection's statistics (a fit, a "
                  "sample, a top-r to draw from) rest on that few; the papers' models send tens of thousands.")
    return table


def finished_run(d: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The summary of a run in ``d`` that finished (completed or diverged) with exactly ``cfg`` once resolved
    against its task's defaults; None otherwise. Its numbers come from the code that made it."""
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    want = json.loads(json.dumps(cfg.resolved(task_class(cfg.task)).as_dict()))
    if summary.get("config") != want or summary.get("status") not in ("completed", "diverged"):
        return None
    return summary if (d / "metrics.jsonl").exists() else None


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def final(records: Sequence[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in records if r.get(key) is not None]
    return vals[-1] if vals else float("nan")


def outcome(records: Sequence[dict[str, Any]], summary: dict[str, Any], key: str) -> float:
    """A run's final ``key`` for a report, NaN when the run diverged: its last evaluation before the loss went
    non-finite is not a result (:func:`spread` counts those seeds as diverged)."""
    return float("nan") if summary.get("status") == "diverged" else final(records, key)


def finite_mean(vals: Sequence[float]) -> float:
    """The mean over the seeds that did not diverge (NaN when all did); count those with :func:`diverged`."""
    v = [x for x in vals if x == x]
    return statistics.mean(v) if v else float("nan")


def diverged(vals: Sequence[float]) -> int:
    """How many seeds' outcomes are NaN (:func:`outcome`: diverged)."""
    return sum(1 for x in vals if x != x)


def spread(vals: Sequence[float]) -> str:
    """mean [min, max] over seeds; a single value says it is one seed; seeds that diverged (NaN) are left out of
    the numbers and counted beside them."""
    v = [x for x in vals if x == x]
    lost = len(vals) - len(v)
    said = f" ({lost} of {len(vals)} seeds diverged)" if lost else ""
    if not v:
        return f"n/a{said}"
    if len(v) == 1:
        return f"{v[0]:.4g} (one seed){said}"
    return f"{statistics.mean(v):.4g} [{min(v):.4g}, {max(v):.4g}]{said}"


def all_above(a: Sequence[float], b: Sequence[float]) -> bool:
    """Every value of ``a`` above every value of ``b``: their seed ranges do not overlap."""
    return min(a) > max(b)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save(fig, ctx: Ctx, exp: str, name: str) -> str:
    path = ctx.dir(exp) / name
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt().close(fig)
    return f"{exp}/{name}"


def net_note(bw: float, lat: float) -> str:
    return f"alpha-beta network model at {bw:g} Gbit/s and {lat:g} us per message (ring collectives)"
