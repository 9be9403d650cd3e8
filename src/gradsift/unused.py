"""Parameters a step did not use keep their memory.

DDP with ``find_unused_parameters=True`` (or ``static_graph=True``) discards what a communication hook returns
for a parameter that no rank used in the step (an expert the router did not pick, a weight frozen after
wrapping): its ``.grad`` stays as it was. The hook has already folded that parameter's memory into its
selection by then -- error feedback's residual, momentum correction's velocities, the owners' residuals of the
scatter route -- so what it sent for the parameter would be lost (the issue measured 46% of an expert's
gradient neither applied nor kept). The rule here: **a parameter no worker used in a step leaves every memory
of gradsift as it was before the step**, as if the step had not happened for it. A parameter that some worker
used is delivered as usual, and the workers that did not use it contribute their memory (which then arrives).

The runtime says which parameters this worker did not use before the road takes a group (:meth:`save`, a copy
of their state, only for them), and at the step's end which parameters no worker used (:meth:`restore`). Per
layer, the saved keys are rolled back whole (compressor state included); for whole-model compression, only the
entries of those parameters go back, in every per-entry tensor of the ``"model"`` state (the owners' region
mapped through the partition), and the rest of the step stands.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class UnusedParams:
    """One worker's copies of the state of the parameters it did not use this step (see the module docstring)."""

    def __init__(self, road):
        self.road = road
        self._layer: dict[str, tuple[Any, Any]] = {}  # name -> (compressor token, owners token)
        self._model: list[tuple[set[str], list[str], list[int], Any, Any]] = []

    def save(self, layout, unused: Sequence[str], sizes: Sequence[int]) -> None:
        """Before the road takes a group of ``layout`` (``sizes``: its parameters' element counts, in parameter
        order): copy the state of the parameters named in ``unused``, which this worker did not use."""
        names = set(layout.names)
        unused = [n for n in unused if n in names]
        if not unused:
            return
        c, owners = self.road.compressor, self.road.owners
        if layout.granularity == "model":
            self._model.append((set(unused), list(layout.names), list(sizes), c.checkpoint(["model"]),
                                owners.checkpoint(["model"])))
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
        back: list[str] = []
        for name, (token, owned) in self._layer.items():
            if name in unused_everywhere:
                c.rollback(token)
                owners.rollback(owned)
                back.append(name)
        for mine, names, sizes, token, owned in self._model:
            hit = [n for n in names if n in mine and n in unused_everywhere]
            if not hit:
                continue
            mask = _mask(names, sizes, set(hit), token)
            now = c.checkpoint(["model"])
            _put_back(now, token, mask)
            c.rollback(now)
            if owned.get("model") is not None or "model" in owners.residual:
                region = self._region_mask(mask)
                if region is not None:
                    cur = owners.checkpoint(["model"])
                    _put_back(cur, owned, region)
                    owners.rollback(cur)
            back.extend(hit)
        self.clear()
        return back

    def clear(self) -> None:
        self._layer, self._model = {}, []

    def _region_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """``mask`` (over the whole model's entries) read in this worker's region of the scatter route."""
        road = self.road
        numel = mask.numel()
        part = road._partitions.get(("model", numel))
        if part is None:
            return None
        pos = torch.arange(part.region, device=mask.device)
        valid = pos + road.compressor.rank * part.region < numel
        flat = part.index(road.compressor.rank, pos)
        return valid & mask[flat]


def _mask(names: Sequence[str], sizes: Sequence[int], hit: set[str], like: Any) -> torch.Tensor:
    device = _device(like)
    return torch.cat([torch.full((s,), n in hit, dtype=torch.bool, device=device) for n, s in zip(names, sizes)])


def _device(obj: Any) -> torch.device:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for v in obj:
            d = _device(v)
            if d.type != "cpu":
                return d
    return torch.device("cpu")


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
