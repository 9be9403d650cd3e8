"""What the road and the route owner need of the objects the runtimes hand them, typed once.

A runtime passes a compressor in its memory (:func:`gradsift.memory.factory.make_compressor`: a
:class:`~gradsift.compressors.base.Compressor`, or one wrapped by :mod:`gradsift.memory.feedback`) and a transport
(:mod:`gradsift.transport.local`, :mod:`gradsift.transport.dist`). Every attribute below exists on each of them,
so the core asks instead of probing with ``getattr``.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from . import Partition, Payload


class Selector(Protocol):
    """A compressor with its memory: selection (``compress``), the round's mean (``observe``), what memory holds
    (``residual``, ``holds_back``, ``continues_from_mean``), momentum correction's flag, undo and checkpoints."""

    name: str
    rank: int
    world_size: int
    ROUNDS: int
    OBSERVES: bool
    applies_momentum: bool
    applies_adam: bool
    memory_name: str

    @property
    def inner(self) -> Any: ...

    @property
    def memory_options(self) -> dict[str, Any]: ...

    @property
    def residual(self) -> dict[str, torch.Tensor]: ...

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: Partition | None = None) -> Payload: ...

    def compress_many(self, keys: Sequence[str], grads: Sequence[torch.Tensor]) -> list[Payload]: ...

    def observe(self, key: str, sent: Payload, mean: torch.Tensor) -> None: ...

    def observe_many(self, keys: Sequence[str], sents: Sequence[Payload], means: Sequence[torch.Tensor]) -> None: ...

    def stores(self) -> dict[str, dict[str, torch.Tensor]]: ...

    def holds_back(self, keys: Sequence[str]) -> bool: ...

    def continues_from_mean(self, keys: Sequence[str]) -> bool: ...

    def checkpoint(self, keys: Sequence[str], deep: bool = False) -> Any: ...

    def rollback(self, token: Any) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...


class Transport(Protocol):
    """One worker's end of a group of workers: what the road sends a group with."""

    rank: int
    world_size: int

    def start(self, payloads: Sequence[Payload], routes: Sequence[str], flag: int = 0, owners: Any = None,
              merge: bool = False) -> Any: ...

    def start_in_place(self, flat: torch.Tensor, payloads: Sequence[Payload], routes: Sequence[str],
                       flag: int = 0, out: torch.Tensor | None = None) -> Any: ...
