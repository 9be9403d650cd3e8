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
4. for a method whose values go narrower than the gradient (GSB's fp16), ``steps``
   steps more sent whole in the gradient's own dtype: the first carries the
   rounding residual the narrow steps left in memory, the later ones are DDP's
   own bucket summed in place -- the route a fast link wants, since casting to
   fp16 and back costs two passes a bucket and keeps the hook from standing
   aside (``GradsiftState.stand_aside``);
5. the medians are combined over ranks (one blocking all-reduce, max: the
   slowest rank sets the pace). Compression stays only if its step is at least
   ``margin`` faster than the fastest whole one; narrow values stay only if
   their whole step is ``margin`` faster than the gradient's dtype. The choice
   (``compressed``, ``whole``, ``whole-native``) holds for the rest of the run,
   is reported in ``summary.json`` and travels in ``state_dict()``, so a
   resumed run does not measure again.

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

    def __init__(self, plan, group=None, *, narrow=None, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS,
                 margin: float = MARGIN, clock: Callable[[], float] = time.perf_counter):
        """``narrow``: the compressor (``.inner``) whose ``value_dtype`` is narrower than the gradients, if any --
        its whole steps are then also timed in the gradient's own dtype (phase 4)."""
        self.plan, self.group, self.narrow = plan, group, narrow
        self.wire_dtype = narrow.value_dtype if narrow is not None else None
        self.warmup, self.steps, self.margin, self.clock = warmup, steps, margin, clock
        self.seen = 0
        self.times: dict[str, list[float]] = self._empty()
        self.slowest: dict[str, float] = {}
        self.result: dict[str, Any] | None = None
        self._last: float | None = None

    def _empty(self) -> dict[str, list[float]]:
        return {"compressed": [], "whole": [], **({"whole-native": []} if self.narrow is not None else {})}

    @property
    def phase(self) -> str:
        if self.result is not None:
            return "done"
        if self.seen < self.warmup:
            return "warmup"
        return next((name for name, t in self.times.items() if len(t) < self.steps), "deciding")

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
        following = self.phase
        if following == "whole-native" and not self.slowest and self._native_cannot_win():
            del self.times["whole-native"]
            following = "deciding"
        if following in ("whole", "whole-native") and self.plan.override is None:
            self.plan.override = "measuring: every tensor whole for a few steps"
        if following == "whole-native":
            self.narrow.value_dtype = None  # the gradient's own dtype on the wire
        if following == "deciding":
            self.decide()
        self._last = self.clock()  # the decision's collective is not part of the next step

    def _combine(self) -> dict[str, float]:
        """The slowest rank's median step (ms) of every phase timed so far (one blocking all-reduce for the
        phases not yet combined)."""
        names = [n for n, t in self.times.items() if t and n not in self.slowest]
        t = torch.tensor([statistics.median(self.times[n]) for n in names], dtype=torch.float64)
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.slowest.update({n: 1e3 * float(v) for n, v in zip(names, t)})
        return self.slowest

    def _native_cannot_win(self) -> bool:
        """Compression took under half the fp16 whole step: whole in the gradient's dtype would have to be more
        than twice as fast as fp16 whole while moving twice its bytes (it saves only the casts, two passes over
        the gradient), so phase 4 is not timed (on a slow link that saves ``steps`` of the slowest steps there
        are). The same on every rank: decided on the combined medians."""
        ms = self._combine()
        return ms["compressed"] <= 0.5 * ms["whole"]

    def decide(self) -> None:
        ms = self._combine()
        keep = 1.0 - self.margin
        whole = "whole"
        if "whole-native" in ms and not ms["whole"] <= keep * ms["whole-native"]:
            whole = "whole-native"  # narrow values did not pay for their casts
        choice = "compressed" if ms["compressed"] <= keep * ms[whole] else whole
        self.result = {"choice": choice, **{f"{n.replace('-', '_')}_step_ms": v for n, v in ms.items()},
                       "margin": self.margin}
        self.apply()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            said = {"compressed": "compressing", "whole": "sending every tensor whole",
                    "whole-native": "sending every tensor whole in the gradient's own dtype"}[choice]
            native = (f", {ms['whole-native']:.1f} ms whole in the gradient's own dtype" if "whole-native" in ms
                      else "")
            print(f"gradsift: measured wire plan: {ms['compressed']:.1f} ms a step compressed, {ms['whole']:.1f} ms "
                  f"with every tensor whole{native}: {said} from now on", file=sys.stderr)

    def apply(self) -> None:
        choice = self.result["choice"]
        if self.narrow is not None:
            self.narrow.value_dtype = None if choice == "whole-native" else self.wire_dtype
        self.plan.override = None if choice == "compressed" else (
            f"measured: steps took {self.result['whole_step_ms']:.1f} ms with every tensor whole, "
            f"{self.result['compressed_step_ms']:.1f} ms compressed"
            + (f", {self.result['whole_native_step_ms']:.1f} ms whole in the gradient's own dtype"
               if "whole_native_step_ms" in self.result else ""))

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
            self.times, self.slowest = self._empty(), {}
            self.plan.override = None
            if self.narrow is not None:
                self.narrow.value_dtype = self.wire_dtype
