"""What a step sent and what it cost, counted once for both runtimes: one schema, one record, one set of totals.

Every aggregated group (a DDP bucket; a tensor in the simulator) becomes a
:class:`GroupReport` built from the payloads and the delivery -- the counts every
worker contributed are in the delivery, so every worker reports the same
figures. A :class:`StepTally` sums a step's groups into the fields of
:data:`FIELDS`, which every step record (:func:`step_record`), the running
:class:`Totals`, ``state.last`` and the Lightning logger use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..route.netmodel import NetworkModel
from ..payload import allreduce_wire_bytes
from ..transport.base import Delivery


FIELDS = {  # the per-step telemetry every runtime reports, in this order
    "density": "mean over workers of (entries sent / entries)",
    "k_ratio": "mean over workers of (entries sent / entries targeted)",
    "bytes_per_worker": "mean over workers of the payload bytes (values and coded indices, no padding)",
    "bytes_per_entry": "bytes_per_worker over the mean entries sent: 8 for an int32 index and an fp32 value",
    "wire_bytes_per_worker": "what the collectives move per worker (gradsift.transport.wire)",
    "est_comm_s": "the alpha-beta time of the step's collectives, one group after another",
    "select_s": "this worker's time in memory and selection",
    "code_s": "(DDP) this rank's time coding its payloads for the wire and issuing the collectives",
    "decode_s": "(DDP) this rank's time decoding what arrived and summing it (in the collectives' callback)",
    "overflow": "entries this worker selected beyond its wire capacity (kept in memory)",
    "owner_deferred": "(scatter route) entries this worker's owned regions summed but held back for a later step",
    "owner_residual_norm": "(scatter route) L2 norm of what this worker holds back as an owner, after the step",
    "comm_s": "(DDP) measured: this rank's wall time with a gradsift collective in flight; None where not observable",
}
SUMMED = ("bytes_per_worker", "wire_bytes_per_worker", "est_comm_s", "select_s", "code_s", "decode_s", "overflow",
          "owner_deferred", "comm_s")


@dataclass
class GroupReport:
    keys: list[str]
    numel: int
    target: int
    counts: list[int]  # per worker
    nbytes: list[int]  # per worker
    wire_bytes: float
    est_comm_s: float
    overflow: int
    select_s: float
    started: float
    finished: float
    code_s: float = 0.0
    decode_s: float = 0.0
    comm_per_key: list[float] = field(default_factory=list)


def group_report(trip, delivery: Delivery, net: NetworkModel) -> GroupReport:
    """The report of one finished trip (:class:`gradsift.runtime.road.Trip`)."""
    ps = trip.payloads
    counts, nbytes = delivery.sums(tuple((p.value_bytes, p.index_bytes, p.value_bits) for p in ps))
    traffic = trip.pending.traffic
    t = net.group_s(traffic)
    return GroupReport(
        keys=list(trip.keys), numel=sum(trip.numels), target=sum(p.target for p in ps), counts=counts,
        nbytes=nbytes, wire_bytes=traffic.wire_bytes, est_comm_s=t, overflow=sum(p.overflow for p in ps),
        select_s=sum(trip.select_s), started=trip.pending.started,
        finished=trip.pending.finished or trip.pending.started, comm_per_key=[t] if len(ps) == 1 else [],
        code_s=trip.pending.code_s, decode_s=trip.pending.decode_s)


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total time covered by the intervals (communication in flight)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@dataclass
class StepTally:
    """The groups of one step, summed."""

    reports: list[GroupReport] = field(default_factory=list)
    select_s: float = 0.0  # selection outside group reports (a runtime may add to it)
    owner_deferred: int = 0  # (scatter route) what this worker's owned regions held back, set when the step closes
    owner_residual_norm: float = 0.0

    def add(self, report: GroupReport) -> None:
        self.reports.append(report)

    def fields(self) -> dict[str, Any]:
        """The per-step telemetry fields (module docstring)."""
        rs = self.reports
        if not rs:
            return {"density": 0.0, "k_ratio": 0.0, "bytes_per_worker": 0.0, "bytes_per_entry": 0.0,
                    "wire_bytes_per_worker": 0.0,
                    "est_comm_s": 0.0, "select_s": self.select_s, "code_s": 0.0, "decode_s": 0.0, "overflow": 0,
                    "owner_deferred": self.owner_deferred,
                    "owner_residual_norm": self.owner_residual_norm, "comm_s": 0.0}
        n = len(rs[0].counts)
        numel = sum(r.numel for r in rs)
        target = sum(r.target for r in rs)
        sent = [sum(col) for col in zip(*(r.counts for r in rs))]  # per worker (integers: any order)
        nbytes = sum(sum(r.nbytes) for r in rs)
        return {
            "density": sum(s / max(numel, 1) for s in sent) / n,
            "k_ratio": sum(s / max(target, 1) for s in sent) / n,
            "bytes_per_worker": nbytes / n,
            "bytes_per_entry": nbytes / max(sum(sent), 1),
            "wire_bytes_per_worker": sum(r.wire_bytes for r in rs),
            "est_comm_s": sum(r.est_comm_s for r in rs),
            "select_s": self.select_s + sum(r.select_s for r in rs),
            "code_s": sum(r.code_s for r in rs),
            "decode_s": sum(r.decode_s for r in rs),
            "overflow": sum(r.overflow for r in rs),
            "owner_deferred": self.owner_deferred,
            "owner_residual_norm": self.owner_residual_norm,
            "comm_s": self.comm_in_flight_s(),
        }

    def comm_in_flight_s(self) -> float:
        return union_length([(r.started, r.finished) for r in self.reports])


def step_record(task, model, step: int, batch_loss: float, evaluate: bool, fields: dict[str, Any],
                probe_every: int = 1) -> dict[str, Any]:
    """One ``metrics.jsonl`` record, both runtimes: the step, the probe loss (every ``probe_every`` steps and where
    evaluated; else None), the batch loss, the task metric where evaluated, then the telemetry of :data:`FIELDS` (a
    runtime adds its timings after)."""
    probe = evaluate or step % probe_every == 0
    rec: dict[str, Any] = {"step": step, "loss": task.probe_loss(model) if probe else None, "batch_loss": batch_loss}
    if evaluate:
        rec.update(task.evaluate(model))
    rec.update({k: fields.get(k, 0.0) for k in FIELDS if k != "comm_s"})
    return rec


class Totals(dict):
    """Running sums of a run's steps (``state.totals``): steps, skipped steps, every field of :data:`SUMMED`,
    what dense all-reduce would have sent (``dense_bytes_per_worker``) and the ratio to the payload bytes
    (``compression``); given the world size, what dense all-reduce's ring would have moved
    (``dense_wire_bytes_per_worker``) and its ratio to the bytes the collectives moved (``wire_compression``:
    what costs time).
    Checkpointed with the hook's state, so a resumed run continues its totals."""

    def __init__(self, dense_bytes_per_step: int = 0, world_size: int = 1):
        super().__init__(steps=0, skipped_steps=0, **{k: 0.0 for k in SUMMED}, dense_bytes_per_worker=0.0,
                         dense_wire_bytes_per_worker=0.0, compression=None, wire_compression=None)
        self.dense_bytes_per_step = int(dense_bytes_per_step)
        self.dense_wire_per_step = allreduce_wire_bytes(self.dense_bytes_per_step, world_size)

    def world_size(self, n: int, sharded: bool = False) -> None:
        """The world size, once known: what the dense exchange's ring would move depends on it (an all-reduce's
        ``2(N-1)/N``, or with ``sharded`` FSDP's reduce-scatter's ``(N-1)/N`` of the gradient)."""
        full = allreduce_wire_bytes(self.dense_bytes_per_step, n)
        self.dense_wire_per_step = full / 2 if sharded else full

    def add(self, fields: dict[str, Any], skipped: bool) -> None:
        if skipped:
            self["skipped_steps"] += 1
            return
        self["steps"] += 1
        for k in SUMMED:
            self[k] += float(fields.get(k) or 0.0)
        self["dense_bytes_per_worker"] += self.dense_bytes_per_step
        sent = self["bytes_per_worker"]
        self["compression"] = self["dense_bytes_per_worker"] / sent if sent else None
        self["dense_wire_bytes_per_worker"] += self.dense_wire_per_step
        wire = self["wire_bytes_per_worker"]
        self["wire_compression"] = self["dense_wire_bytes_per_worker"] / wire if wire and self.dense_wire_per_step \
            else None

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        self.update({k: v for k, v in (sd or {}).items() if k in self})


def run_summary(config: dict[str, Any], records: list[dict[str, Any]], wall_s: float, dense_bytes: int,
                skipped: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``: the config, the last record, and run totals (same fields for both runtimes)."""
    total_bytes = sum(r["bytes_per_worker"] for r in records)
    n = max(len(records), 1)
    out = {
        "config": config,
        "final": records[-1] if records else None,
        "totals": {
            "steps": len(records),
            "skipped_steps": skipped,
            "bytes_per_worker": total_bytes,
            "wire_bytes_per_worker": sum(r["wire_bytes_per_worker"] for r in records),
            "dense_bytes_per_worker": dense_bytes * len(records),
            "compression": (dense_bytes * len(records) / total_bytes) if total_bytes else float("inf"),
            "mean_density": sum(r["density"] for r in records) / n,
            "mean_k_ratio": sum(r["k_ratio"] for r in records) / n,
            "overflow": sum(r.get("overflow", 0) for r in records),
            "est_time_s": sum(r["est_step_s"] for r in records),
            "est_comm_s": sum(r["est_comm_s"] for r in records),
            "compute_s": sum(r["compute_s"] for r in records),
            "select_s": sum(r["select_s"] for r in records),
            "wall_s": wall_s,
        },
    }
    for key in ("comm_s", "step_s"):
        if records and all(r.get(key) is not None for r in records):
            out["totals"][key] = sum(r[key] for r in records)
    if extra:
        out.update(extra)
    return out
