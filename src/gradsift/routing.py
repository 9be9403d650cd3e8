"""How each step travels: one owner, with explicit state, that the road and both runtimes read.

A step travels in one of four modes::

              wire_plan="measure"                the measurement's choice
    start ──► MEASURING ─────────────────────────┬──► COMPRESSED ──┐
      │        (phase per step: compressed,      └──► WHOLE ───────┤ a step closed with every tensor whole exactly
      │         whole, whole-native; measure.py)                   │ as it is, nothing held back, settled, and the
      └──────────────────────────────────────────────► COMPRESSED  │ runtime can (DDP, wire plan on, plain mean)
                                                                   ▼
                                                                 ASIDE  (DDP's own all-reduce takes the steps)

* ``compressed``: every tensor as the wire plan (:mod:`gradsift.plan`) decides it -- sparse, densified, or whole
  where the method or the plan says so -- in the method's wire dtype;
* ``whole``: every tensor whole, in the method's wire dtype or (``native``) in the gradient's own: the measured
  plan found whole steps faster. The first such step carries what error feedback held back; from then on a group
  that lives in one buffer is summed in it (:meth:`in_place`);
* ``measuring``: the measured plan times blocks of steps sent each way, then chooses (:mod:`gradsift.measure`);
* ``aside``: nothing would compress any more, so every later step would be the plain mean: the DDP adapter builds
  a hookless twin of the user's wrapper and DDP's own all-reduce (C++) takes the steps; the hook adapter closes
  them (non-finite rule, momentum correction from the mean). The simulator never stands aside.

Values sent narrower than the gradient (GSB's fp16) are a wire decision held here (``native``), never a
compressor flag flipped from outside: the compressor's configuration stays what the user named.

The state (mode, ``native``, why, the measurement's result, the events with their steps) is checkpointed, so a
resumed run continues as it was; :meth:`summary` and :meth:`notices` say what was sent other than the method
named, per tensor, and why.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .measure import COMPRESSED, GATHERED, WHOLE, WHOLE_NATIVE, Measurement
from .plan import DENSE_ROUTE, DENSIFY_ROUTE, SCATTER_ROUTE, SPARSE_ROUTE, Decision, WirePlan
from .protocols import Selector

MEASURING, ASIDE = "measuring", "aside"
MODES = (MEASURING, COMPRESSED, WHOLE, ASIDE)


class Routing:
    """The route owner of one run (shared by a simulator's workers, one per DDP rank).

    ``tensors``: ``(key, shape, dtype)`` of every compression input (per parameter, or the one ``"model"``).
    ``measurement``: the measured plan, if asked for. ``aside``: why this runtime cannot stand aside (None: it can).
    """

    def __init__(self, plan: WirePlan, tensors: Sequence[tuple[str, Sequence[int], torch.dtype]], *,
                 measurement: Measurement | None = None, aside: str | None = "this runtime cannot"):
        self.plan = plan
        self.tensors = [(k, tuple(int(s) for s in shape), dtype) for k, shape, dtype in tensors]
        self.measurement = measurement
        self.why_not_aside = aside if plan.enabled else "the wire plan is off (every tensor as the method says)"
        self.mode = MEASURING if measurement is not None else COMPRESSED
        self.native = False  # whole tensors travel in the gradient's own dtype
        self.gathered = False  # the measured plan found all-gathers faster than the plan's scatters
        self.reason = "measuring" if measurement is not None else ""
        self.events: list[dict[str, Any]] = []

    # ------------------------------------------------------------ per step
    @property
    def sends(self) -> str:
        """How this step's tensors go: ``compressed`` (as planned), ``gathered`` (as planned, scatters by
        all-gather), ``whole`` or ``whole-native``."""
        if self.mode == MEASURING:
            phase = self.measurement.phase
            return phase if phase in (GATHERED, WHOLE, WHOLE_NATIVE) else COMPRESSED
        if self.mode == COMPRESSED:
            return GATHERED if self.gathered else COMPRESSED
        return WHOLE_NATIVE if self.native or self.mode == ASIDE else WHOLE

    @property
    def settled(self) -> bool:
        """Whether every step from now on goes as the rest of the run will (nothing left to measure)."""
        return self.mode != MEASURING

    def decide(self, compressor: Selector, key: str, shape, dtype: torch.dtype | None = None) -> Decision:
        """Tensor ``key``'s route this step: the wire plan's, or whole where the step goes whole."""
        d = self.plan.decide(compressor, key, shape, dtype)
        how = self.sends
        if how == GATHERED and d.route == SCATTER_ROUTE:
            return Decision(SPARSE_ROUTE, "measured: all-gathers were faster than the owners' scatter", by_plan=True)
        if how in (COMPRESSED, GATHERED) or compressor.inner.ROUNDS > 1:  # (a multi-round method: its own rule)
            return d
        native = how == WHOLE_NATIVE
        if d.route == DENSE_ROUTE:
            return d if d.native == native else Decision(DENSE_ROUTE, d.reason, native, d.by_plan)
        return Decision(DENSE_ROUTE, self.reason or "measuring: every tensor whole for a few steps", native, True)

    def in_place(self, compressor: Selector, keys: Sequence[str], shapes: Sequence, dtype: torch.dtype) -> bool:
        """Whether a group may be summed in the buffer it lives in: every tensor goes whole exactly as it is -- no
        memory held back for it, no momentum applied by the method, values in the gradient's own dtype -- and the
        method has one round. The mean is then the whole route's, with no copy."""
        if compressor.inner.ROUNDS != 1 or compressor.applies_momentum or not dtype.is_floating_point:
            return False
        return all(self._as_it_is(compressor, self.decide(compressor, k, s, dtype), dtype)
                   for k, s in zip(keys, shapes)) and not compressor.holds_back(keys)

    @staticmethod
    def _as_it_is(compressor: Selector, d: Decision, dtype: torch.dtype) -> bool:
        vd = compressor.inner.value_dtype
        return d.dense and (d.native or vd is None or vd == dtype)

    def after_step(self, compressor: Selector, *, step: int, skipped: bool = False, others_settled: bool = True) -> str | None:
        """One step closed (``step``: steps applied so far). Advances the measurement and takes the transitions of
        the module docstring; returns the new mode when it changed (the runtime acts on ``aside``)."""
        if self.mode == MEASURING:
            result = self.measurement.after_step(skipped)
            if result is None:
                return None
            choice = result["choice"]
            if choice in (COMPRESSED, GATHERED):
                self.gathered = choice == GATHERED
                how = " with all-gathers for the scatters" if self.gathered else ""
                self._become(COMPRESSED, f"measured: {self.measurement.timings()}: compressing{how}", step)
            else:
                self.native = choice == WHOLE_NATIVE
                dtype = " in the gradient's own dtype" if self.native else ""
                self._become(WHOLE, f"measured: {self.measurement.timings()}: every tensor whole{dtype}", step)
            return self.mode
        if self.mode in (COMPRESSED, WHOLE) and not skipped and others_settled and self._may_stand_aside(compressor):
            self._become(ASIDE, "every tensor goes whole exactly as it is and nothing is held back: DDP's own "
                                "all-reduce takes the steps (the hook would only repeat it)", step)
            return ASIDE
        return None

    def _may_stand_aside(self, compressor: Selector) -> bool:
        if self.why_not_aside is not None or compressor.inner.ROUNDS != 1:
            return False
        # the decisions first (dictionary lookups); only then memory (momentum correction reads its velocity)
        return all(self._as_it_is(compressor, self.decide(compressor, k, s, dt), dt) for k, s, dt in self.tensors) \
            and compressor.continues_from_mean([k for k, _, _ in self.tensors])

    def _become(self, mode: str, reason: str, step: int) -> None:
        self.mode, self.reason = mode, reason
        self.events.append({"step": step, "mode": mode, "reason": reason})

    # ------------------------------------------------------------ what was sent
    def changed(self, compressor: Selector) -> dict[str, dict[str, str]]:
        """Every tensor the wire plan sends other than the method names it: ``{key: {"route", "reason"}}`` (the
        method's own rules -- DGC's 1-D tensors, an uncompressed method -- are the method's, not listed)."""
        out = {}
        for key, shape, dtype in self.tensors:
            d = self.plan.decide(compressor, key, shape, dtype)
            if d.by_plan and d.route != SPARSE_ROUTE:
                out[key] = {"route": "whole" if d.route == DENSE_ROUTE else d.route, "reason": d.reason}
        return out

    def notices(self, compressor: Selector, method: str, off: str) -> list[str]:
        """One line per kind of change the plan makes at the start (``off``: how the user turns it off)."""
        lines = []
        changed = self.changed(compressor)
        for route in ("whole", DENSIFY_ROUTE, SCATTER_ROUTE):
            keys = [k for k, v in changed.items() if v["route"] == route]
            if not keys:
                continue
            what = {"whole": "sent whole (no compression, no error)",
                    DENSIFY_ROUTE: "compressed as named but summed by an all-reduce of the densified payloads",
                    SCATTER_ROUTE: "compressed as named, then reduced by the owners of their regions (the mean keeps "
                                   "the sum's k largest; the rest follows from the owners' residuals)"}[route]
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            lines.append(f"gradsift: wire plan: {len(keys)} of {len(self.tensors)} tensors {what}: {shown} "
                         f"({changed[keys[0]]['reason']}); {off} sends every tensor as {method} says")
        return lines

    def summary(self, compressor: Selector) -> dict[str, Any]:
        """What ``summary.json`` records: the mode the run ended in and why, its events, the tensors the plan
        changed, the measurement."""
        out: dict[str, Any] = {"enabled": self.plan.enabled, "mode": self.mode, "native": self.native,
                               "reason": self.reason, "events": list(self.events), "tensors": len(self.tensors),
                               "changed": self.changed(compressor)}
        if self.measurement is not None:
            out["measured"] = self.measurement.result or {"choice": "unfinished (the run ended while measuring)"}
        return out

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "native": self.native, "gathered": self.gathered, "reason": self.reason,
                "events": list(self.events),
                "measurement": self.measurement.state_dict() if self.measurement is not None else None}

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """The mode a checkpoint was taken in holds; an unfinished measurement starts over."""
        sd = sd or {}
        if self.measurement is not None:
            self.measurement.load_state_dict(sd.get("measurement"))
        mode = sd.get("mode", MEASURING if self.measurement is not None else COMPRESSED)
        if mode == MEASURING and (self.measurement is None or self.measurement.result is not None):
            mode = COMPRESSED
        native = bool(sd.get("native", False)) or mode == ASIDE  # (aside, the steps are the gradient's own dtype)
        if mode == ASIDE and self.why_not_aside is not None:
            mode = WHOLE  # this runtime cannot stand aside: the hook sends the same whole steps
        self.mode, self.native, self.gathered = mode, native, bool(sd.get("gathered", False))
        self.reason = sd.get("reason", "measuring" if mode == MEASURING else "")
        self.events = list(sd.get("events", []))
