"""Parameters a step did not use keep their memory.

DDP with ``find_unused_parameters=True`` (or ``static_graph=True``) discards what a communication hook returns
for a parameter that no rank used in the step (an expert the router did not pick, a weight frozen after
wrapping): its ``.grad`` stays as it was. The hook has already folded that parameter's memory into its
selection by then -- error feedback's residual, momentum correction's velocities, the owners' residuals of the
scatter route -- so what it sent for the parameter would be lost (in a mixture-of-experts run measured before this
rule, 46% of an expert's gradient was neither applied nor kept). The rule here: **a parameter no worker used in a
step leaves every memory of gradsift as it was before the step**, as if the step had not happened for it. A
parameter that some worker used is delivered as usual, and the workers that did not use it contribute their memory
(which then arrives).

The runtime says which parameters this worker did not use before the road takes a group (:meth:`save`, a copy
of their state, only for them), and at the step's end which parameters no worker used (:meth:`restore`). Per
layer, the saved keys are rolled back whole (compressor state included); for whole-model compression, only the
entries of those parameters go back, in every per-entry tensor of the ``"model"`` state (the owners' region
mapped through the partition), and the rest of the step stands.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch


class UnusedParams:
    """One worker's copies of the state of the parameters it did not use this step (see the module docstring)."""

    def __init__(self, road):
        self.road = road
        self._layer: dict[str, tuple[Any, Any]] = {}  # name -> (compressor token, owners token)
        self._model: tuple[set[str], list[str], list[int], torch.device, Any, Any] | None = None  # the "model" group

    def save(self, layout, unused: Sequence[str], sizes: Sequence[int], device: torch.device) -> None:
        """Before the road takes a group of ``layout``: copy the state of the parameters named in ``unused``, which
        this worker did not use (``sizes``: every parameter's element count, in parameter order, and ``device``:
        the gradients', for whole-model compression)."""
        names = set(layout.names)
        unused = [n for n in unused if n in names]
        if not unused:
            return
        c, owners = self.road.compressor, self.road.owners
        if layout.granularity == "model":
            self._model = (set(unused), list(layout.names), list(itertools.accumulate(sizes, initial=0)), device,
                           c.checkpoint(["model"]), owners.checkpoint(["model"]))
            return
        for name in unused:
            self._layer[name] = (c.checkpoint([name]), owners.checkpoint([name]))

    @property
    def pending(self) -> bool:
        """Whether this worker skipped any parameter this step (only then can one be unused everywhere)."""
        return bool(self._layer or self._model)

    def restore(self, unused_everywhere: set[str]) -> list[str]:
        """The step's end: every parameter no worker used gets the state it had before the step; the names."""
        c, owners = self.road.compressor, self.road.owners
        back = [n for n in self._layer if n in unused_everywhere]
        for name in back:
            token, owned = self._layer[name]
            c.rollback(token)
            owners.rollback(owned)
        if self._model is not None:
            mine, names, bounds, device, token, owned = self._model
            hit = [i for i, n in enumerate(names) if n in mine and n in unused_everywhere]
            if hit:
                mask = torch.zeros(bounds[-1], dtype=torch.bool, device=device)
                for i in hit:
                    mask[bounds[i]:bounds[i + 1]] = True
                # the state after the step (copied: a token may share tensors the rollback below writes), the state
                # before it (the rollback, copied), and the first with the second's entries under the mask
                now = c.checkpoint(["model"], deep=True)
                c.rollback(token)
                _put_back(now, c.checkpoint(["model"], deep=True), mask)
                c.rollback(now)
                part = self.road.partition_of("model", mask.numel())  # (the scatter route's, if it went so)
                if part is not None:
                    pos, at = part.owned(c.rank, mask.device)
                    region = torch.zeros(part.region, dtype=torch.bool, device=mask.device)
                    region[pos] = mask[at]
                    cur = owners.checkpoint(["model"])
                    _put_back(cur, owned, region)
                    owners.rollback(cur)
                back += [names[i] for i in hit]
        self.clear()
        return back

    def clear(self) -> None:
        self._layer, self._model = {}, None


def _put_back(now: Any, saved: Any, mask: torch.Tensor) -> None:
    """In ``now`` (a fresh checkpoint token), the entries under ``mask`` of every tensor with as many entries as
    the mask get ``saved``'s values (zero where ``saved`` had no such tensor: the state did not exist yet)."""
    if isinstance(now, torch.Tensor):
        if now.numel() == mask.numel():
            flat = now.view(-1)
            if isinstance(saved, torch.Tensor) and saved.numel() == mask.numel():
                flat[mask] = saved.reshape(-1)[mask].to(flat.dtype)
            else:
                flat[mask] = 0
        return
    if isinstance(now, dict):
        for k, v in now.items():
            _put_back(v, saved.get(k) if isinstance(saved, dict) else None, mask)
    elif isinstance(now, (list, tuple)):
        other = saved if isinstance(saved, (list, tuple)) and len(saved) == len(now) else [None] * len(now)
        for v, s in zip(now, other):
            _put_back(v, s, mask)
