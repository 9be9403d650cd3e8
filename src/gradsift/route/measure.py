"""The measured wire plan (``wire_plan="measure"``): time real steps compressed and whole, keep the faster.

The alpha-beta plan (:mod:`gradsift.route.plan`) prices bytes and selection; it does
not see what a real DDP step hides or adds: DDP overlaps its all-reduce with
backward, so on a fast link the dense all-reduce costs little of the step,
while compressing still costs selection, the all-gather's latency and decoding
(the cluster bench at 1 Gbit/s: charlm's step 0.79-0.99x of plain DDP with
every sparsifier). A :class:`Measurement` times the user's own steps instead,
once, on every rank; the route owner (:class:`gradsift.route.routing.Routing`) sends
each step as its :attr:`~Measurement.phase` says and applies its choice:

1. ``warmup`` steps as the model plans them (caches, compiled kernels), untimed;
2. ``rounds`` rounds of blocks of ``block`` steps: one block as planned
   (``compressed``); where the plan sends some tensors by the owners' scatter
   (:mod:`gradsift.route.owners`), one block with those by all-gather instead
   (``gathered``: the alpha-beta model's latency terms decide between two
   collectives and one, and a real link may disagree); one with every tensor
   sent whole (``whole``); and, for a
   method whose values go narrower than the gradient (GSB's fp16), one whole
   in the gradient's own dtype (``whole-native``: summed in DDP's own bucket,
   the route a fast link wants -- casting to fp16 and back costs passes and, on
   gloo, a software fp16 sum, and keeps the hook from standing aside). Each
   step is timed from one step's end to the next (the user's whole step:
   forward, backward, communication, optimizer), except the first of a block:
   it carries the switch (the error-feedback memory sent along with a first
   whole step -- nothing is lost -- or a memory building up again).
   Interleaving the blocks spreads a machine's drift (warming caches, a
   neighbour's load) over every phase alike: timed one after the other, the
   phase timed last read 3-9% faster on charlm at 4 ranks;
3. the medians are combined over ranks (``combine``: the runtime's one blocking
   all-reduce, max: the slowest rank sets the pace). The faster of ``compressed``
   and ``gathered`` stays only if its step is at least ``margin`` (10%) faster
   than the fastest whole one;
   narrow values stay only if their whole step is ``narrow_margin`` (5%) faster
   than the gradient's dtype. The choice (``compressed``, ``whole``,
   ``whole-native``) holds for the rest of the run and is checkpointed with the
   route owner, so a resumed run does not measure again.

After the first round, when compression took under half of the narrow whole
step (a slow link), ``whole-native`` is dropped from the rounds left: it would
have to be more than twice as fast as fp16 whole while moving twice its bytes
(decided on the combined medians: alike on every rank).

The choice depends on measured time, so two runs on a busy machine can choose
differently; the alpha-beta plan alone is deterministic. The simulator has no
real step to time and refuses this mode.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from ..errors import ConfigError

WARMUP_STEPS = 3
BLOCK = 3
ROUNDS = 4
MARGIN = 0.10  # compression must pay clearly: it costs accuracy, and 4 ranks on 2 cores scatter steps by +-15%
NARROW_MARGIN = 0.05  # fp16 values cost next to nothing in accuracy
SETTINGS = ("warmup", "block", "rounds", "margin", "narrow_margin")

COMPRESSED, GATHERED, WHOLE, WHOLE_NATIVE = "compressed", "gathered", "whole", "whole-native"


def check_settings(settings: dict[str, Any] | None) -> dict[str, Any]:
    """``measure=`` options: a subset of :data:`SETTINGS`; one-line errors."""
    settings = dict(settings or {})
    bad = set(settings) - set(SETTINGS)
    if bad:
        raise ConfigError(f"measure: unknown setting {sorted(bad)[0]!r}; allowed: {', '.join(SETTINGS)}")
    for k in ("warmup", "block", "rounds"):
        v = settings.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (2 if k == "block" else
                                                                                     0 if k == "warmup" else 1)):
            raise ConfigError(f"measure: {k} must be an integer >= {2 if k == 'block' else 0 if k == 'warmup' else 1} "
                              f"(a block's first step is not timed), got {v!r}")
    for k in ("margin", "narrow_margin"):
        v = settings.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 < v <= 1):
            raise ConfigError(f"measure: {k} must be a number in (-100, 1] (the fraction a step must be faster "
                              f"by), got {v!r}")
    return settings


class Measurement:
    """The schedule and the choice (module docstring); knows no runtime: ``combine`` reduces over ranks."""

    def __init__(self, *, narrow: bool, scattered: bool = False,
                 combine: Callable[[list[float]], list[float]] | None = None,
                 warmup: int = WARMUP_STEPS, block: int = BLOCK, rounds: int = ROUNDS, margin: float = MARGIN,
                 narrow_margin: float = NARROW_MARGIN, clock: Callable[[], float] = time.perf_counter):
        """``narrow``: the method's values are narrower than the gradients (its whole steps are then also timed
        in the gradient's own dtype); ``scattered``: the plan sends some tensors by the owners' scatter (its
        compressed steps are then also timed with those by all-gather)."""
        check_settings({"warmup": warmup, "block": block, "rounds": rounds, "margin": margin,
                        "narrow_margin": narrow_margin})
        self.narrow, self.scattered = narrow, scattered
        self.combine = combine or (lambda values: values)
        self.warmup, self.block, self.rounds, self.clock = warmup, block, rounds, clock
        self.margin, self.narrow_margin = margin, narrow_margin
        self.result: dict[str, Any] | None = None
        self._restart()

    def _restart(self) -> None:
        self.seen = self.done = 0  # warm-up steps seen, steps of the rounds done
        self.order = ([COMPRESSED] + ([GATHERED] if self.scattered else []) + [WHOLE]
                      + ([WHOLE_NATIVE] if self.narrow else []))
        self.times: dict[str, list[float]] = {name: [] for name in self.order}
        self._last: float | None = None

    @staticmethod
    def steps_for(narrow: bool, warmup: int = WARMUP_STEPS, block: int = BLOCK, rounds: int = ROUNDS,
                  scattered: bool = False) -> int:
        """Steps the measurement takes before its choice holds."""
        return warmup + rounds * block * (2 + int(narrow) + int(scattered))

    @property
    def phase(self) -> str:
        """``warmup``, ``compressed``, ``gathered``, ``whole``, ``whole-native``, ``deciding`` or ``done``."""
        if self.result is not None:
            return "done"
        if self.seen < self.warmup:
            return "warmup"
        k = self.done // self.block
        return "deciding" if k >= self.rounds * len(self.order) else self.order[k % len(self.order)]

    def after_step(self, skipped: bool = False) -> dict[str, Any] | None:
        """One step closed (a skipped one is not timed and restarts the interval). Returns the result on the step
        it is decided (one blocking combine), else None."""
        now = self.clock()
        if self.result is not None:
            return None
        if skipped:
            self._last = None
            return None
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
        if following == WHOLE_NATIVE and self.done == self.order.index(WHOLE_NATIVE) * self.block and \
                self._native_cannot_win():
            self.order.remove(WHOLE_NATIVE)  # (at the end of round 1: the rounds left have one block less)
            del self.times[WHOLE_NATIVE]
            following = self.phase
        decided = self._decide() if following == "deciding" else None
        self._last = self.clock()  # the decision's collective is not part of the next step
        return decided

    def _medians(self, names: list[str]) -> dict[str, float]:
        """The slowest rank's median step (ms) of each phase in ``names``."""
        values = self.combine([statistics.median(self.times[n]) for n in names])
        return {n: 1e3 * float(v) for n, v in zip(names, values)}

    def _native_cannot_win(self) -> bool:
        """Compression took under half the fp16 whole step: whole in the gradient's dtype would have to be more
        than twice as fast as fp16 whole while moving twice its bytes (it saves only the casts, two passes over
        the gradient), so it is not timed again (on a slow link that saves the slowest steps there are)."""
        ms = self._medians([n for n in (COMPRESSED, GATHERED, WHOLE) if n in self.times])
        return min(ms[COMPRESSED], ms.get(GATHERED, ms[COMPRESSED])) <= 0.5 * ms[WHOLE]

    def _decide(self) -> dict[str, Any]:
        ms = self._medians(list(self.times))
        whole = WHOLE
        if WHOLE_NATIVE in ms and not ms[WHOLE] <= (1.0 - self.narrow_margin) * ms[WHOLE_NATIVE]:
            whole = WHOLE_NATIVE  # narrow values did not pay for their casts
        sparse = GATHERED if GATHERED in ms and ms[GATHERED] < ms[COMPRESSED] else COMPRESSED
        choice = sparse if ms[sparse] <= (1.0 - self.margin) * ms[whole] else whole
        self.result = {"choice": choice, **{f"{n.replace('-', '_')}_step_ms": v for n, v in ms.items()},
                       "margin": self.margin, **({"narrow_margin": self.narrow_margin} if WHOLE_NATIVE in ms else {})}
        return self.result

    def timings(self) -> str:
        """The decided medians, in words."""
        r = self.result or {}
        native = (f", {r['whole_native_step_ms']:.1f} ms whole in the gradient's own dtype"
                  if "whole_native_step_ms" in r else "")
        gathered = f", {r['gathered_step_ms']:.1f} ms with all-gathers for scatters" if "gathered_step_ms" in r else ""
        return (f"{r.get('compressed_step_ms', float('nan')):.1f} ms a step compressed{gathered}, "
                f"{r.get('whole_step_ms', float('nan')):.1f} ms with every tensor whole{native}")

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return dict(self.result) if self.result is not None else None

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """A finished measurement holds (no new one); an unfinished one starts over."""
        self.result = dict(sd) if sd else None
        if not sd:
            self._restart()
