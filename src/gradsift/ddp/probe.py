"""The measured wire plan (``wire_plan="measure"``): time real steps compressed and whole, keep the faster.

The alpha-beta plan (:mod:`gradsift.plan`) prices bytes and selection; it does
not see what a real DDP step hides or adds: DDP overlaps its all-reduce with
backward, so on a fast link the dense all-reduce costs little of the step,
while compressing still costs selection, the all-gather's latency and decoding
(the cluster bench at 1 Gbit/s: charlm's step 0.79-0.99x of plain DDP with
every sparsifier). Here the hook measures instead, once, on every rank:

1. ``warmup`` steps as the model plans them (caches, compiled kernels), untimed;
2. ``rounds`` rounds of blocks of ``block`` steps: one block as planned
   (``compressed``), one with every tensor sent whole (``whole``), and, for a
   method whose values go narrower than the gradient (GSB's fp16), one whole
   in the gradient's own dtype (``whole-native``: DDP's own bucket summed in
   place, the route a fast link wants -- casting to fp16 and back costs passes
   and, on gloo, a software fp16 sum, and keeps the hook from standing aside,
   ``GradsiftState.stand_aside``). Each step is timed from one ``end_step`` to
   the next (the user's whole step: forward, backward, communication,
   optimizer), except the first of a block: it carries the switch (the
   error-feedback memory sent along with a first whole step -- nothing is lost,
   see ``feedback.py`` -- or a memory building up again). Interleaving the
   blocks spreads a machine's drift (warming caches, a neighbour's load) over
   every phase alike: timed one after the other, the phase timed last read
   3-9% faster on charlm at 4 ranks;
3. the medians are combined over ranks (one blocking all-reduce, max: the
   slowest rank sets the pace). Compression stays only if its step is at least
   ``margin`` (10%) faster than the fastest whole one; narrow values stay only if
   their whole step is ``narrow_margin`` (5%) faster than the gradient's dtype. The choice
   (``compressed``, ``whole``, ``whole-native``) holds for the rest of the run,
   is reported in ``summary.json`` and travels in ``state_dict()``, so a
   resumed run does not measure again.

After the first round, when compression took under half of the narrow whole
step (a slow link), ``whole-native`` is dropped from the rounds left: it would
have to be more than twice as fast as fp16 whole while moving twice its bytes
(one blocking all-reduce of the first round's medians decides it alike on
every rank).

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
BLOCK = 3
ROUNDS = 4
MARGIN = 0.10  # compression must pay clearly: it costs accuracy, and 4 ranks on 2 cores scatter steps by +-15%
NARROW_MARGIN = 0.05  # fp16 values cost next to nothing in accuracy


class WireProbe:
    """Per rank; driven by :meth:`GradsiftState.end_step` (see the module docstring)."""

    def __init__(self, plan, group=None, *, narrow=None, warmup: int = WARMUP_STEPS, block: int = BLOCK,
                 rounds: int = ROUNDS, margin: float = MARGIN, narrow_margin: float = NARROW_MARGIN,
                 clock: Callable[[], float] = time.perf_counter):
        """``narrow``: the compressor (``.inner``) whose ``value_dtype`` is narrower than the gradients, if any --
        its whole steps are then also timed in the gradient's own dtype."""
        if block < 2 or rounds < 1:
            raise ValueError(f"measured wire plan: block must be >= 2 (its first step is not timed) and rounds >= 1, "
                             f"got block={block}, rounds={rounds}")
        self.plan, self.group, self.narrow = plan, group, narrow
        self.wire_dtype = narrow.value_dtype if narrow is not None else None
        self.warmup, self.block, self.rounds, self.clock = warmup, block, rounds, clock
        self.margin, self.narrow_margin = margin, narrow_margin
        self._restart()
        self.result: dict[str, Any] | None = None

    def _restart(self) -> None:
        self.seen = self.done = 0  # warm-up steps seen, steps of the rounds done
        self.order = ["compressed", "whole"] + (["whole-native"] if self.narrow is not None else [])
        self.times: dict[str, list[float]] = {name: [] for name in self.order}
        self._last: float | None = None

    @staticmethod
    def steps_for(narrow: bool, warmup: int = WARMUP_STEPS, block: int = BLOCK, rounds: int = ROUNDS) -> int:
        """Steps the measurement takes (before its choice holds)."""
        return warmup + rounds * block * (3 if narrow else 2)

    @property
    def phase(self) -> str:
        if self.result is not None:
            return "done"
        if self.seen < self.warmup:
            return "warmup"
        k = self.done // self.block
        return "deciding" if k >= self.rounds * len(self.order) else self.order[k % len(self.order)]

    def after_step(self, skipped: bool = False) -> None:
        """One step closed. A skipped step is not timed (and restarts the interval)."""
        now = self.clock()
        if self.result is not None:
            return
        if skipped:
            self._last = None
            return
        phase = self.phase
        if phase == "warmup":
            self.seen += 1
        else:
            first = self.done % self.block == 0  # a block's first step: not timed
            if self._last is not None and not first:
                self.times[phase].append(now - self._last)
            if first or self._last is not None:  # (a step right after a skipped one is not timed: one more)
                self.done += 1
        following = self.phase
        if following == "whole-native" and self.done == 2 * self.block and self._native_cannot_win():
            self.order.remove("whole-native")  # (at the end of round 1: the rounds left have two blocks)
            del self.times["whole-native"]
            following = self.phase
        if following == "deciding":
            self.decide()
        else:
            self._set(following)
        self._last = self.clock()  # the decision's collective is not part of the next step

    def _set(self, phase: str) -> None:
        """The next step goes as ``phase`` says."""
        if phase in ("whole", "whole-native"):
            self.plan.override = "measuring: every tensor whole for a few steps"
        elif phase == "compressed":
            self.plan.override = None
        if self.narrow is not None:
            self.narrow.value_dtype = None if phase == "whole-native" else self.wire_dtype

    def _combine(self, names: list[str]) -> dict[str, float]:
        """The slowest rank's median step (ms) of each phase in ``names`` (one blocking all-reduce)."""
        t = torch.tensor([statistics.median(self.times[n]) for n in names], dtype=torch.float64)
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return {n: 1e3 * float(v) for n, v in zip(names, t)}

    def _native_cannot_win(self) -> bool:
        """Compression took under half the fp16 whole step: whole in the gradient's dtype would have to be more
        than twice as fast as fp16 whole while moving twice its bytes (it saves only the casts, two passes over
        the gradient), so it is not timed again (on a slow link that saves the slowest steps there are). The same
        on every rank: decided on the combined medians of the first round."""
        ms = self._combine(["compressed", "whole"])
        return ms["compressed"] <= 0.5 * ms["whole"]

    def decide(self) -> None:
        ms = self._combine(list(self.times))
        whole = "whole"
        if "whole-native" in ms and not ms["whole"] <= (1.0 - self.narrow_margin) * ms["whole-native"]:
            whole = "whole-native"  # narrow values did not pay for their casts
        choice = "compressed" if ms["compressed"] <= (1.0 - self.margin) * ms[whole] else whole
        self.result = {"choice": choice, **{f"{n.replace('-', '_')}_step_ms": v for n, v in ms.items()},
                       "margin": self.margin, **({"narrow_margin": self.narrow_margin} if "whole-native" in ms else {})}
        self.apply()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            said = {"compressed": "compressing", "whole": "sending every tensor whole",
                    "whole-native": "sending every tensor whole in the gradient's own dtype"}[choice]
            print(f"gradsift: measured wire plan: {self._timings()}: {said} from now on", file=sys.stderr)

    def _timings(self) -> str:
        r = self.result
        native = (f", {r['whole_native_step_ms']:.1f} ms whole in the gradient's own dtype"
                  if "whole_native_step_ms" in r else "")
        return (f"{r['compressed_step_ms']:.1f} ms a step compressed, {r['whole_step_ms']:.1f} ms with every tensor "
                f"whole{native}")

    def apply(self) -> None:
        """The choice holds: its route and value dtype from now on."""
        choice = self.result["choice"]
        self._set(choice)
        if choice != "compressed":
            self.plan.override = f"measured: {self._timings()}"

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return dict(self.result) if self.result is not None else None

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """A finished measurement holds on (no new one); an unfinished one starts over."""
        if sd:
            self.result = dict(sd)
            self.apply()
        else:
            self.result = None
            self._restart()
            self._set("compressed")
