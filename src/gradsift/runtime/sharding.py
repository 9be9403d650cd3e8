"""Which modules gradsift's FSDP runtime shards, and FSDP's gradient layout, for both runtimes.

``gradsift train --runtime fsdp`` shards every module that has parameters of its own (children before their
parents, the root last; :func:`shard_model`), so each such module is one FSDP unit with one reduce-scatter per
step; a user's model may be sharded otherwise (only its blocks and the root, say): a unit then holds every
parameter below its module that no nested unit holds (:func:`fsdp_units`). :class:`ShardLayout` builds, from full
gradients, exactly the input FSDP hands a unit's reduce-scatter (``N`` rows; row j holds, parameter after
parameter, rank j's shard of each one, dim 0 padded with zeros to a multiple of ``N``) and maps a mean in that
layout back to full gradients. With it the simulator reproduces FSDP's exchange (``RunConfig.fsdp``), key for key
and bit for bit: the reference :mod:`gradsift.fsdp` is tested against.

**A unit's shape** is ``(N, row)`` -- rows per destination shard -- when any of its parameters has two or more
dimensions, and flat ``(N * row,)`` when all have at most one (a unit of biases and norms alone): a method's rule
for 1-D tensors (DGC sends them whole) then means what it means for parameters. Under HSDP the road sees one
shard of the unit, ``(1, row)`` or ``(row,)`` alike (:meth:`ShardLayout.shard_shapes`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def unit_key(name: str) -> str:
    """The key of the FSDP unit of module ``name`` (the root module: ``"root"``)."""
    return name or "root"


def fsdp_units(model: torch.nn.Module, roots: set[str] | None = None) -> list[tuple[str, list[str]]]:
    """``[(module name, [its trainable parameters' full names, in order])]`` of every FSDP unit with trainable
    parameters, in the model's module order. ``roots``: the names of the modules sharded as units (default: every
    module with parameters of its own, and the root, as :func:`shard_model` shards, except the modules the model
    names in ``FSDP_IN_ROOT``, whose parameters the root's own forward reads: they join the root's unit); a unit
    holds the parameters below its module that no nested unit holds."""
    modules = list(model.named_modules())
    if roots is None:  # (a model's FSDP_IN_ROOT: modules whose weights its own forward reads, e.g. a tied head)
        in_root = set(getattr(model, "FSDP_IN_ROOT", ()))
        roots = {name for name, m in modules if name not in in_root and any(True for _ in m.parameters(recurse=False))}
        roots |= {""}
    owner: dict[str, str] = {}
    for name, module in modules:
        unit = max((r for r in roots if r == "" or name == r or name.startswith(r + ".")), key=len, default=None)
        for p, t in module.named_parameters(recurse=False):
            full = f"{name}.{p}" if name else p
            if t.requires_grad and unit is not None and full not in owner:
                owner[full] = unit
    units: dict[str, list[str]] = {}
    for full in (n for n, t in model.named_parameters() if t.requires_grad and n in owner):
        units.setdefault(owner[full], []).append(full)
    order = [name for name, _ in modules]
    return sorted(units.items(), key=lambda u: order.index(u[0]))


def shard_model(model: torch.nn.Module, mesh=None, **fsdp_options) -> torch.nn.Module:
    """``fully_shard`` every module with parameters of its own, children first, then the root (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    names = {name for name, _ in fsdp_units(model)}
    modules = dict(model.named_modules())
    for name in reversed(list(modules)):  # post-order: a child is sharded before its parent
        if name in names and name:
            fully_shard(modules[name], mesh=mesh, **fsdp_options)
    return fully_shard(model, mesh=mesh, **fsdp_options)


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """CPU copies of every parameter, whole (an FSDP parameter is gathered: call it on every rank)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu").clone()
            for p in model.parameters()]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded tensor gathered whole (call it on every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu")
            for k, v in model.state_dict().items()}


class ShardLayout:
    """Full gradients in parameter order <-> one FSDP reduce-scatter input per unit (module docstring). The same
    interface as :class:`gradsift.runtime.road.Layout`."""

    granularity = "fsdp"

    def __init__(self, model: torch.nn.Module, names: Sequence[str], world_size: int, roots: set[str] | None = None):
        """``names``: the trainable parameters in parameter order; ``world_size``: the ranks a unit is sharded over;
        ``roots``: the modules sharded as units (:func:`fsdp_units`)."""
        index = {n: i for i, n in enumerate(names)}
        self.world_size = world_size
        self.units = [(unit_key(name), [index[p] for p in params]) for name, params in fsdp_units(model, roots)]
        missing = set(range(len(names))) - {i for _, ids in self.units for i in ids}
        if missing:
            raise ValueError(f"parameters outside every FSDP unit: {sorted(names[i] for i in missing)}")
        self.keys = [k for k, _ in self.units]
        self.names = list(names)

    def _rows(self, shape: torch.Size) -> tuple[int, int]:
        """(rows of dim 0 per shard, entries per row) of a parameter of ``shape``."""
        if len(shape) == 0:
            return 1, 1  # (a scalar: one entry, on rank 0's shard)
        per = -(-int(shape[0]) // self.world_size)
        return per, int(torch.Size(shape[1:]).numel())

    def inputs(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        n, out = self.world_size, []
        for (_, ids), shape in zip(self.units, self.shapes(grads)):
            parts = []
            for i in ids:
                g = grads[i].reshape(grads[i].shape[0], -1) if grads[i].dim() else grads[i].reshape(1, 1)
                per, _ = self._rows(grads[i].shape)
                padded = torch.zeros((per * n, g.shape[1]), dtype=g.dtype, device=g.device)
                padded[:g.shape[0]] = g
                parts.append(padded.view(n, -1))
            out.append(torch.cat(parts, dim=1).reshape(shape))
        return out

    def shapes(self, params: Sequence[torch.Tensor]) -> list[torch.Size]:
        """Every unit's shape (module docstring): ``(N, row)``, or ``(N * row,)`` for a unit of 1-D parameters."""
        out = []
        for _, ids in self.units:
            row = sum(math.prod(self._rows(params[i].shape)) for i in ids)
            flat = all(len(params[i].shape) <= 1 for i in ids)
            out.append(torch.Size([self.world_size * row]) if flat else torch.Size([self.world_size, row]))
        return out

    def shard_shapes(self, params: Sequence[torch.Tensor]) -> list[torch.Size]:
        """One shard of every unit (HSDP's all-reduce hook): ``(1, row)``, or ``(row,)`` for 1-D parameters."""
        return [torch.Size([s[0] // self.world_size]) if len(s) == 1 else torch.Size([1, s[1]])
                for s in self.shapes(params)]

    def views(self, means: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        n = self.world_size
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for (_, ids), mean in zip(self.units, means):
            rows = mean.view(n, -1)
            off = 0
            for i in ids:
                per, width = self._rows(shapes[i])
                block = rows[:, off:off + per * width].reshape(n * per, width)
                off += per * width
                d0 = int(shapes[i][0]) if len(shapes[i]) else 1
                out[i] = block[:d0].reshape(shapes[i])
        return out  # type: ignore[return-value]
