"""The measured wire plan (``wire_plan="measure"``): time real steps compressed and whole, keep the faster.

The alpha-beta plan (:mod:`gradsift.plan`) prices bytes and selection; it does
not see what a real DDP step hides or adds: DDP overlaps its all-reduce with
backward, so on a fast link the dense all-reduce costs little of the step,
while compressing still costs selection, the all-gather's latency and decoding
(the cluster bench at 1 Gbit/s: charlm's step 0.79-0.99x of plain DDP with
every sparsifier). Here the hook measures instead, once, on every rank:

1. ``warmup`` steps as the model plans them (caches, compiled kernels), untimed;
2. ``steps`` steps as planned, each timed from one ``end_step`` to the next
   (the user's whole step: forward, backward, communication, optimizer);
3. ``steps`` steps with every tensor sent whole (error-feedback memory is sent
   along with the first of them: nothing is lost, see ``feedback.py``);
4. the medians are combined over ranks (one blocking all-reduce, max: the
   slowest rank sets the pace) and compression stays only if its step is at
   least ``margin`` faster than the whole one; the choice holds for the rest of
   the run, is reported in ``summary.json`` and travels in ``state_dict()``, so
   a resumed run does not measure again.

The choice depends on measured time, so two runs on a busy machine can choose
differently; ``wire_plan=True`` (the alpha-beta plan alone) is deterministic.
The simulator has no real step to time and refuses this mode.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

WARMUP_STEPS = 3
TIMED_STEPS = 5
MARGIN = 0.05


class WireProbe:
    """Per rank; driven by :meth:`GradsiftState.end_step` (see the module docstring)."""

    def __init__(self, plan, group=None, *, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS,
                 margin: float = MARGIN, clock: Callable[[], float] = time.perf_counter):
        self.plan, self.group = plan, group
        self.warmup, self.steps, self.margin, self.clock = warmup, steps, margin, clock
        self.seen = 0
        self.times: dict[str, list[float]] = {"compressed": [], "whole": []}
        self.result: dict[str, Any] | None = None
        self._last: float | None = None

    @property
    def phase(self) -> str:
        if self.result is not None:
            return "done"
        if self.seen < self.warmup:
            return "warmup"
        return "compressed" if len(self.times["compressed"]) < self.steps else "whole"

    def after_step(self, skipped: bool = False) -> None:
        """One step closed. A skipped step is not timed (and restarts the interval)."""
        now = self.clock()
        if self.result is not None:
            return
        if skipped:
            self._last = None
            return
        phase = self.phase
        if phase != "warmup" and self._last is not None:
            self.times[phase].append(now - self._last)
        else:
            self.seen += 1
        if self.phase == "whole" and self.plan.override is None:
            self.plan.override = "measuring: every tensor whole for a few steps"
        if len(self.times["whole"]) >= self.steps:
            self.decide()
        self._last = self.clock()  # the decision's collective is not part of the next step

    def decide(self) -> None:
        t = torch.tensor([statistics.median(self.times["compressed"]), statistics.median(self.times["whole"])],
                         dtype=torch.float64)
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        compressed, whole = float(t[0]), float(t[1])
        keep = compressed <= (1.0 - self.margin) * whole
        self.result = {"choice": "compressed" if keep else "whole", "compressed_step_ms": 1e3 * compressed,
                       "whole_step_ms": 1e3 * whole, "margin": self.margin}
        self.apply()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(f"gradsift: measured wire plan: {1e3 * compressed:.1f} ms a step compressed, {1e3 * whole:.1f} ms "
                  f"with every tensor whole: {'compressing' if keep else 'sending every tensor whole'} from now on",
                  file=sys.stderr)

    def apply(self) -> None:
        keep = self.result["choice"] == "compressed"
        self.plan.override = None if keep else (
            f"measured: steps took {self.result['whole_step_ms']:.1f} ms with every tensor whole, "
            f"{self.result['compressed_step_ms']:.1f} ms compressed")

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return dict(self.result) if self.result is not None else None

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """A finished measurement holds on (no new one); an unfinished one starts over."""
        if sd:
            self.result = dict(sd)
            self.apply()
        else:
            self.result, self.seen, self._last = None, 0, None
            self.times = {"compressed": [], "whole": []}
            self.plan.override = None
