"""Compressor and memory state as plain data: copied for checkpoints and rollback, moved between devices."""

from __future__ import annotations

import copy
from typing import Any

import torch


def _map_state(obj: Any, tensor, other) -> Any:
    """Plain state (dicts, lists, tuples) rebuilt with ``tensor(t)`` for each tensor and ``other(v)`` for the rest."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        return {k: _map_state(v, tensor, other) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_state(v, tensor, other) for v in obj)
    return other(obj)


_ATOMS = (int, float, bool, str, type(None))  # immutable: a copy may share them


def clone_state(obj: Any) -> Any:
    """A deep copy of plain state (tensors cloned). A flat dict of numbers (a selection's per-tensor state: its step
    and its guesses) is copied as a dict: one call, not one per entry (the road checkpoints every tensor each step);
    numbers and strings anywhere are shared, not copied (immutable), only other objects are deep-copied."""
    if type(obj) is dict and all(type(v) in _ATOMS for v in obj.values()):
        return dict(obj)
    return _map_state(obj, lambda t: t.detach().clone(), lambda v: v if type(v) in _ATOMS else copy.deepcopy(v))


class UndoLog:
    """What a step wrote into the tensors a checkpoint shares: (tensor, positions, their values before), in order
    (the sampling methods' checkpoints, :class:`gradsift.compressors.sampling._Sampling`)."""

    __slots__ = ("entries", "__weakref__")

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def restore(store: dict[str, Any], token: dict[str, Any]) -> None:
    """Put back into ``store`` what a checkpoint token copied of it (None: the key was absent then)."""
    for k, t in token.items():
        if t is None:
            store.pop(k, None)
        else:
            store[k] = t


def move_state(obj: Any, device: torch.device) -> Any:
    """Plain state with every tensor on ``device`` (a checkpoint read on the CPU, resumed on a GPU)."""
    return _map_state(obj, lambda t: t.to(device), lambda v: v)


def fill_from(accs, srcs) -> None:
    """``accs[i] = srcs[i]`` where a source is given (one foreach copy): the start of a path that accumulates in
    place (``Compressor.select_many_into``)."""
    pairs = [(a, s) for a, s in zip(accs, srcs or ()) if s is not None]
    if pairs:
        torch._foreach_copy_([a for a, _ in pairs], [s for _, s in pairs])
