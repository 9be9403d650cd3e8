"""How each step and each tensor travel: one owner, with explicit state, that the road and every runtime read.

**How a tensor travels** (:meth:`Routing.decide`, identically on every worker, from the configuration alone and the
link's prices in :mod:`gradsift.route.plan`). A decision names one route -- the same words the wire uses
(:mod:`gradsift.transport.wire`) -- or ``whole``:

* ``whole`` -- sent uncompressed, no error, no memory, in the group's all-reduce (``reduce``; under FSDP as dense
  rows of the ``shard`` route): when the method says so (an uncompressed method; DGC's 1-D tensors); when the
  tensor costs no more than one message latency whole (``numel <= min_numel``, by default ``alpha * beta / value
  bytes``; LAGS-SGD Sec. 5 merges such tensors too); or when sending it whole takes no longer than selecting and
  sending its payload;
* ``densify`` -- compressed as configured (same selection, memory and mean), the workers' payloads summed by an
  all-reduce of their dense scatter: the all-gather of N sparse payloads would take longer;
* ``scatter`` -- the payload goes to the owners of its entries' regions (one all-to-all), each owner keeps its
  share of the sum's ``scatter_keep`` x k largest and one all-gather brings every owner's keep to everyone
  (:mod:`gradsift.route.owners`): about (1.25 + keep) k entries received per worker at any N against (N-1)k. Only
  when asked (``sparse_collective="scatter"``): the plan never picks it by price, because where it saves bytes
  (keep well under N) the owners' re-selection drops entries the all-gather would apply, and that costs quality
  beyond the seed spread on language models from 8 workers (docs/results.md, "The scatter route"). Never for methods that
  read the round's mean at the entries they sent (REGTOP-k), nor for tensors of 2**31 entries or more;
* ``shard`` -- the sharded exchange (FSDP's reduce-scatter): every tensor goes to its shards' owners, each needing
  only its shard of the sum (:mod:`gradsift.transport.shard`);
* ``gather`` -- everything else: the payload's own collective (a sparse payload by all-gather, a shared-index or
  dense one by all-reduce: :meth:`Routing.wire_route` maps a decision and a payload to the wire route).

``sparse_collective`` sets the collective of sparse payloads: ``auto`` and ``gather`` (the all-gather, or the
prices' densified all-reduce) or ``scatter`` (where the method allows it, whether or not the plan is on). The plan off
(``enabled=False``) keeps only the method's own rule (the papers' exact setting, used by the reproductions).

**How a step travels** -- one of four modes::

              wire_plan="measure"                the measurement's choice
    start ──► MEASURING ─────────────────────────┬──► COMPRESSED ──┐
      │        (phase per step: compressed,      └──► WHOLE ───────┤ a step closed with every tensor whole exactly
      │         whole, whole-native; measure.py)                   │ as it is, nothing held back, settled, and the
      └──────────────────────────────────────────────► COMPRESSED  │ runtime can (DDP, wire plan on, plain mean)
                                                                   ▼
                                                                 ASIDE  (DDP's own all-reduce takes the steps)

* ``compressed``: every tensor as decided above, in the method's wire dtype;
* ``whole``: every tensor whole, in the method's wire dtype or (``native``) in the gradient's own: the measured
  plan found whole steps faster. The first such step carries what error feedback held back; from then on a group
  that lives in one buffer is summed in it, or in its one cast (:meth:`in_place`);
* ``measuring``: the measured plan times blocks of steps sent each way, then chooses (:mod:`gradsift.route.measure`);
* ``aside``: nothing would compress any more, so every later step would be the plain mean: the DDP adapter builds
  a hookless twin of the user's wrapper and DDP's own all-reduce (C++) takes the steps; the hook adapter closes
  them (non-finite rule, momentum correction from the mean). The simulator and FSDP never stand aside.

Values sent narrower than the gradient (GSB's fp16) are a wire decision held here (``native``), never a compressor
flag flipped from outside. **What a runtime can carry** is checked here too, once (:func:`check_support`): several dependent rounds
(PowerSGD) only in the simulator; under FSDP no method that reads the whole round's mean or sends shared indices;
a forced scatter never for a method that reads the mean at the entries it sent.

The state (mode, ``native``, why, the measurement's result, the events with their steps) is checkpointed, so a
resumed run continues as it was; :meth:`summary` and :meth:`notices` say what was sent other than named, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .owners import SCATTER_KEEP
from .. import payload as P
from ..errors import ConfigError
from .measure import COMPRESSED, GATHERED, WHOLE, WHOLE_NATIVE, Measurement
from .plan import WirePlan
from ..payload.protocols import Selector
from ..transport.wire import DENSIFY, GATHER, REDUCE, SCATTER, SHARD

MEASURING, ASIDE = "measuring", "aside"
MODES = (MEASURING, COMPRESSED, WHOLE, ASIDE)
WHOLE_ROUTE = "whole"  # a decision's route when the tensor goes uncompressed (on the wire: reduce, or shard)
SPARSE_COLLECTIVES = ("auto", "gather", "scatter")
RUNTIMES = ("sim", "ddp", "fsdp", "hsdp", "local")


@dataclass(frozen=True)
class Decision:
    """How one tensor travels this step: ``route`` is ``whole`` or a wire route (module docstring)."""

    route: str
    reason: str = ""
    native: bool = False  # (whole) values in the gradient's own dtype, not the method's wire dtype
    by_plan: bool = False  # the plan's (or the route owner's) decision, not the method's own rule

    @property
    def whole(self) -> bool:
        return self.route == WHOLE_ROUTE


def wire_plan_for(asked: str | None, runtime: str) -> str:
    """The wire plan a runtime runs: the one asked for, else the simulator sends every tensor as the method says
    ("off": it is where methods are studied) and the real runtimes plan ("auto")."""
    return asked or ("off" if runtime == "sim" else "auto")


def check_support(compressor: Selector, *, runtime: str, sparse_collective: str = "auto",
                  scatter_keep: float = SCATTER_KEEP) -> None:
    """Refuse, in one line, what ``runtime`` (``sim``, ``ddp``, ``fsdp``, ``hsdp``, ``local``; the simulator of FSDP's or
    HSDP's exchange is checked as those) cannot carry: values below 16 bits where owners pass sums on, a method of
    several dependent rounds outside the simulator, a method that reads the whole mean or sends shared indices under
    the sharded exchange, a forced scatter for a method that reads the mean at the entries it sent. (Each setting's
    own type and bounds: :data:`gradsift.runtime.settings.SETTINGS`, checked before.)"""
    c = compressor.inner
    if c.value_bits and (runtime in ("fsdp", "hsdp") or sparse_collective == "scatter"):
        where = "FSDP's sharded exchange" if runtime in ("fsdp", "hsdp") else "the scatter route"
        raise ConfigError(f"value_dtype={c.value_dtype_name} codes what each worker sends by all-gather; in {where} owners pass sums on, which have no worker's levels: use value_dtype=bf16 there")
    if c.ROUNDS > 1 and runtime != "sim":
        how = {"ddp": "which a DDP hook can only chain from future callbacks (they hang on gloo with several "
                      "buckets): in DDP use PyTorch's hook, --torch-hook powersgd:rank=R",
               "fsdp": "which FSDP's reduce-scatter cannot take", "hsdp": "which FSDP's all-reduce hook cannot take",
               "local": "where a sync of local SGD is one exchange: use a one-round method (dense, topk, sidco, ...)"}
        raise ConfigError(f"{c.name} needs {c.ROUNDS} dependent collectives per step, {how[runtime]}")
    if runtime == "fsdp":
        if c.OBSERVES or c.ROUNDS > 1:
            raise ConfigError(f"{c.name} reads the round's whole mean or runs several rounds; under FSDP a rank holds "
                              "only its shard of the mean: use a method that selects alone (topk, rtopk, sidco, dgc, "
                              "...)")
        if c.payload_kind() == P.SHARED:
            raise ConfigError(f"{c.name} sends shared indices, which the sharded exchange does not route yet: use a "
                              "sparse method (topk, rtopk, sidco, dgc, randomk, ...)")
        if sparse_collective == "gather":
            raise ConfigError("under FSDP every rank receives only its shard of the sum (the shard route): "
                              "sparse_collective 'gather' does not apply; leave it 'auto'")
        return
    if sparse_collective == "scatter" and c.OBSERVES:
        raise ConfigError(f"{c.name} reads the round's mean at the entries it sent, and the owners' scatter keeps "
                          "only the sum's largest (the rest a step later), which it would read as cancellation: use "
                          "sparse_collective 'gather' or 'auto' (--sparse-collective)")


class Routing:
    """The route owner of one run (shared by a simulator's workers, one per DDP rank).

    ``tensors``: ``(key, shape, dtype)`` of every compression input (per parameter, or the one ``"model"``).
    ``measurement``: the measured plan, if asked for. ``aside``: why this runtime cannot stand aside (None: it can).
    """

    def __init__(self, plan: WirePlan, tensors: Sequence[tuple[str, Sequence[int], torch.dtype]], *,
                 measurement: Measurement | None = None, aside: str | None = "this runtime cannot"):
        self.plan = plan
        self._planned: dict[tuple, Decision] = {}
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
        """Tensor ``key``'s route this step: the planned one (:meth:`planned`), or whole where the step goes whole."""
        d = self.planned(compressor, key, shape, dtype)
        how = self.sends
        if how == GATHERED and d.route == SCATTER:
            return Decision(GATHER, "measured: all-gathers were faster than the owners' scatter", by_plan=True)
        if how in (COMPRESSED, GATHERED) or compressor.inner.ROUNDS > 1:  # (a multi-round method: its own rule)
            return d
        native = how == WHOLE_NATIVE
        if d.whole:
            return d if d.native == native else Decision(WHOLE_ROUTE, d.reason, native, d.by_plan)
        return Decision(WHOLE_ROUTE, self.reason or "measuring: every tensor whole for a few steps", native, True)

    def planned(self, compressor: Selector, key: str, shape, dtype: torch.dtype | None = None) -> Decision:
        """Tensor ``key``'s route (of ``shape`` and ``dtype``) under ``compressor``'s configuration, whatever the
        step's mode (module docstring); cached per configuration."""
        numel = 1
        for s in shape:
            numel *= int(s)
        inner = compressor.inner
        k = inner.k_for(key, numel)
        item = dtype.itemsize if dtype is not None else 4
        ck = (key, tuple(shape), k, item, inner.name)
        hit = self._planned.get(ck)
        if hit is None:
            hit = self._planned[ck] = self._plan(inner, key, tuple(shape), numel, k, item)
        return hit

    def _plan(self, c, key: str, shape: tuple, numel: int, k: int, item: int) -> Decision:
        kind, plan, n = c.payload_kind(), self.plan, self.plan.world_size
        if c.ROUNDS > 1:
            return Decision(GATHER)  # its own rule decides (PowerSGD's min_compression_rate)
        if kind == P.DENSE:
            return Decision(WHOLE_ROUTE, "uncompressed method")
        if c.sends_dense(key, shape):
            return Decision(WHOLE_ROUTE, "the method sends this tensor whole")
        if numel == 0:
            return Decision(WHOLE_ROUTE, "empty")
        vb = c.value_dtype.itemsize if c.value_dtype is not None else item
        small = plan.small_limit(vb)
        if plan.sharded:  # FSDP: every payload to its shards' owners; tiny tensors whole, as rows
            if plan.enabled and n > 1 and numel <= small:
                return Decision(WHOLE_ROUTE, f"small: {numel} elements, one message latency carries {small}",
                                by_plan=True)
            return Decision(SHARD)
        scatter_ok = kind == P.SPARSE and n > 1 and not c.OBSERVES and numel < 2**31 and not c.value_bits
        if not plan.enabled or n <= 1:
            forced = plan.sparse_collective == "scatter" and scatter_ok
            return Decision(SCATTER, "--sparse-collective scatter", by_plan=True) if forced else Decision(GATHER)
        if numel <= small:
            return Decision(WHOLE_ROUTE, f"small: {numel} elements, one message latency carries {small}", by_plan=True)
        # the scatter route only when asked: its owners' re-selection costs quality the prices do not see
        price = plan.prices(c, key, numel, k, item, scatter_ok and plan.sparse_collective == "scatter")
        route, t_sent = GATHER, price.sent_gather
        if kind == P.SPARSE:
            t = {GATHER: price.gather} if price.scatter is None else {SCATTER: price.scatter}
            route = next(iter(t))
            if price.densified < t[route]:  # the wire is the problem: keep the method, change the collective
                return Decision(DENSIFY, f"{route if route == SCATTER else 'all-gather'} of {1e3 * t[route]:.3g} ms is "
                                         f"slower than an all-reduce of {price.reduce_bytes} B "
                                         f"({1e3 * price.densified:.3g} ms)", by_plan=True)
            if route == SCATTER:
                t_sent = price.sent_scatter
        # merged into the group's collectives, a tensor adds bytes, not messages: compare bandwidth terms
        if price.whole <= price.select + t_sent:  # the selection costs more than the bytes it saves
            return Decision(WHOLE_ROUTE, f"compressing costs ~{1e3 * (price.select + t_sent):.3g} ms (selection "
                                         f"~{1e3 * price.select:.3g} ms), sending it whole {1e3 * price.whole:.3g} ms",
                            by_plan=True)
        if route == SCATTER:
            return Decision(SCATTER, f"--sparse-collective scatter: owners' all-to-all and all-gather "
                                     f"{1e3 * price.scatter:.3g} ms, all-gather {1e3 * price.gather:.3g} ms",
                            by_plan=True)
        return Decision(GATHER)

    def decisions(self) -> dict[str, Decision]:
        """The latest decision planned for every tensor key (a key's k may change: LAGS, warm-up)."""
        return {key: d for (key, *_), d in self._planned.items()}

    def wire_route(self, d: Decision, payload_kind: str) -> str:
        """The wire route (:mod:`gradsift.transport.wire`) of a payload of ``payload_kind`` sent as ``d`` says: the
        one mapping from decisions to the wire."""
        if self.plan.sharded:
            return SHARD
        return REDUCE if payload_kind != P.SPARSE else (d.route if d.route in (SCATTER, DENSIFY) else GATHER)

    def owner_split(self, d: Decision) -> str | None:
        """Which owners' split a tensor sent as ``d`` needs: the scatter route's hashed regions (``scatter``), the
        sharded exchange's contiguous shards (``shard``: every tensor under FSDP, whole ones as rows), or none."""
        if self.plan.sharded:
            return SHARD
        return SCATTER if d.route == SCATTER else None

    def in_place_routes(self, n: int) -> list[str]:
        """The wire routes of ``n`` tensors summed in the buffer they live in (:meth:`in_place`)."""
        return [REDUCE] * n

    def later_round_routes(self, n: int) -> list[str]:
        """The wire routes of a multi-round method's later rounds (PowerSGD's factors, all-reduced)."""
        return [REDUCE] * n

    def measure_with(self, compressor: Selector, settings: dict[str, Any],
                     combine: Callable[[list[float]], list[float]] | None) -> None:
        """Start the measured plan (``wire_plan="measure"``): its whole steps are also timed in the gradient's own
        dtype where the method's values are narrower, its compressed steps also by all-gather where the plan
        scatters (:class:`gradsift.route.measure.Measurement`)."""
        dtypes = {dt for _, _, dt in self.tensors}
        narrow = compressor.inner.value_dtype is not None and dtypes != {compressor.inner.value_dtype}
        scattered = any(self.planned(compressor, k, s, dt).route == SCATTER for k, s, dt in self.tensors)
        self.measurement = Measurement(narrow=narrow, scattered=scattered, combine=combine, **settings)
        self.mode, self.reason = MEASURING, "measuring"

    def in_place(self, compressor: Selector, keys: Sequence[str], shapes: Sequence, dtype: torch.dtype,
                 decisions: Sequence[Decision] | None = None) -> str | None:
        """How a group may be summed in its buffer (None: it may not): ``"as-is"``, every tensor whole in its own
        dtype, the whole route's mean with no copy; ``"cast"``, whole in a method's narrower wire dtype, no memory to
        keep the rounding: the buffer cast once, summed, the mean divided back into it (the whole route's arithmetic).
        Either way nothing held back, no momentum applied by the method, one round. (``decisions``: this step's.)"""
        c = compressor.inner
        if self.plan.sharded or c.ROUNDS != 1 or compressor.applies_momentum or compressor.applies_adam or \
                not dtype.is_floating_point:
            return None
        decisions = decisions or [self.decide(compressor, k, s, dtype) for k, s in zip(keys, shapes)]
        if not all(d.whole for d in decisions) or compressor.holds_back(keys):
            return None
        if all(self._as_it_is(compressor, d, dtype) for d in decisions):
            return "as-is"
        cast = c.value_dtype is not None and c.value_dtype.is_floating_point and not c.value_bits and compressor is c
        return "cast" if cast and not any(d.native for d in decisions) else None

    @staticmethod
    def _as_it_is(compressor: Selector, d: Decision, dtype: torch.dtype) -> bool:
        vd = compressor.inner.value_dtype
        return d.whole and (d.native or vd is None or vd == dtype)

    def after_step(self, compressor: Selector, *, step: int, skipped: bool = False,
                   others_settled: bool = True) -> str | None:
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
            d = self.planned(compressor, key, shape, dtype)
            if d.by_plan and d.route != GATHER:
                out[key] = {"route": d.route, "reason": d.reason}
        return out

    def notices(self, compressor: Selector, method: str, off: str) -> list[str]:
        """One line per kind of change the plan makes at the start (``off``: how the user turns it off)."""
        lines = []
        changed = self.changed(compressor)
        for route in (WHOLE_ROUTE, DENSIFY, SCATTER):
            keys = [k for k, v in changed.items() if v["route"] == route]
            if not keys:
                continue
            what = {WHOLE_ROUTE: "sent whole (no compression, no error)",
                    DENSIFY: "compressed as named but summed by an all-reduce of the densified payloads",
                    SCATTER: f"compressed as named, then reduced by the owners of their regions (the mean keeps "
                                   f"{self.plan.scatter_keep:g}k of the sum, the rest arrives later from the owners' "
                                   "residuals, at a cost in quality measured in docs/results.md, 'The scatter route')"}[route]
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
