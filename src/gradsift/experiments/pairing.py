"""``gradsift train --runtime ddp --paired-ddp BLOCK``: gradsift's hook and DDP's own all-reduce timed in the same
processes (a benchmark tool, outside the library core).

A fresh process on a small shared machine draws its compute speed at start (``docs/results.md``: charlm's forward
pass 1.3x apart from one start to the next, fixed for the life of the process), so two runs compare their draws as
much as their communication. Here one run holds both: DDP's own all-reduce through a hookless twin of the user's
wrapper (:func:`gradsift.ddp.aside.hookless_twin`), and once the hook has settled
(:attr:`GradsiftState.settled <gradsift.ddp.state.GradsiftState.settled>`, after the first ``WARMUP`` steps) and
``LEAD`` steps more, the steps alternate in blocks of ``BLOCK``: gradsift's, then DDP's, and so on. gradsift's
steps are what ``gradsift train`` runs without pairing: where the hook stands aside they too go by DDP's own
all-reduce (their records say ``ddp_allreduce``), and the pair then times the same thing. Both sides train the one
model (a timing run: its curve is not the method's alone). The records of the alternating steps say which side
ran (``paired``); :meth:`Pairing.summary` gives both medians and DDP's over gradsift's (above 1: gradsift's step
is faster).
"""

from __future__ import annotations

import statistics
from typing import Any

from ..ddp.aside import hookless_twin


class Pairing:
    WARMUP = 3
    LEAD = 2  # steps after settling left out of both sides: the hook's last steps before it stands aside, and
    # the twin's construction (a collective), which would otherwise fall on one side's first block

    def __init__(self, block: int, state, ddp=None):
        self.block, self.state, self.ddp, self.first = block, state, ddp, None
        self._twin = None

    def side(self, it: int) -> str | None:
        """Which wrapper runs step ``it``: None before the pairing starts, then "gradsift" or "ddp"."""
        if self.first is None:
            if it < self.WARMUP or not self.state.settled:
                return None
            self.first = it + self.LEAD
            if self.ddp is not None:
                self._twin = hookless_twin(self.ddp)  # built now, on every rank alike, in neither side's steps
        if it < self.first:
            return None
        return "gradsift" if (it - self.first) // self.block % 2 == 0 else "ddp"

    def wrapper(self, side: str | None):
        """The wrapper that runs a step of ``side``."""
        return self._twin if side == "ddp" else self.ddp

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        times = {k: [r["step_s"] for r in records if r.get("paired") == k] for k in ("gradsift", "ddp")}
        out: dict[str, Any] = {"block": self.block, "gradsift_steps": len(times["gradsift"]),
                               "ddp_steps": len(times["ddp"])}
        if times["gradsift"] and times["ddp"]:
            g, d = statistics.median(times["gradsift"]), statistics.median(times["ddp"])
            out.update(gradsift_step_ms=1e3 * g, ddp_step_ms=1e3 * d, speedup=d / g)
        else:
            out["speedup"] = None  # the run ended before both sides ran
        return out
