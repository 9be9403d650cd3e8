"""Resuming at another world size: the rule that folds N ranks' memory onto M ranks without losing any of it.

What a run still has to send is, in units of the mean update,

    U = (1/N) [ sum_r e_r + sum_j O_j ]

where ``e_r`` is rank r's unsent memory (error feedback's residual; momentum correction's velocity ``v``) and
``O_j`` is owner j's residual of the scatter route (its region of the sums it held back, in the tensor's positions).
The fold gives **every** new rank the memory ``U`` (and every other per-tensor store, momentum's ``u``, the
saved ranks' mean); the new owners start empty (the partition is the world size's). Then
``(1/M) sum_r' U = U``: the next mean update of the M-rank run carries exactly the mass the N-rank run would
have, and with every entry sent (a dense payload) it *is* the N-rank run's next update for the same mean gradient
(tested to rounding). A rank that saved no entry for a key counts as zero. The compressor's own state (random
streams, thresholds) is per rank and starts afresh, as does the data order (docs/ddp-reference.md).

:class:`AllRanks` carries every rank's state in one checkpoint and gives each rank its own back, or the fold.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..compressors.base import move_state
from ..transport.wire import partition_for


def fold_memory(states: Sequence[dict[str, Any]], stores: Sequence[str], unsent: str, numel: dict[str, int],
                seed: int, device: torch.device | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The stores every new rank holds (module docstring). ``states``: every saved rank's
    ``GradsiftState.state_dict()``, in rank order; ``stores``: the memory's store names, ``unsent`` the one that
    holds what is not yet sent; ``numel``: element count per key; ``seed``: the run's (its partitions')."""
    n = len(states)
    sums: dict[str, dict[str, torch.Tensor]] = {}
    dtypes: dict[tuple[str, str], torch.dtype] = {}
    for name in stores:
        per_rank = [sd["compressor_state"].get(name, {}) for sd in states]
        sums[name] = {}
        for k in sorted(set().union(*per_rank)):
            have = [m[k] for m in per_rank if k in m]
            sums[name][k] = torch.stack([t.float() for t in have]).sum(0)
            dtypes[(name, k)] = have[0].dtype
    for j, sd in enumerate(states if unsent in sums else ()):  # the owners' residuals, in the tensors' positions
        for k, region in (sd.get("owners") or {}).items():
            if k not in numel or not region.numel():
                continue
            pos, at = partition_for(k, numel[k], n, seed).owned(j, region.device)
            flat = torch.zeros(numel[k], dtype=torch.float32, device=region.device)
            flat.index_add_(0, at, region.float()[pos])
            if k in sums[unsent]:
                sums[unsent][k] += flat.view_as(sums[unsent][k])
            else:
                sums[unsent][k] = flat
                dtypes[(unsent, k)] = region.dtype
    return {name: {k: (t / n).to(dtypes[(name, k)]).to(device or t.device) for k, t in per.items()}
            for name, per in sums.items()}


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_shapes(compressor_state: dict[str, Any], tensors: Sequence[tuple]) -> None:
    """A memory saved for another model (a layer reshaped, a parameter renamed) is refused in one line at load, not
    at the first backward: every per-tensor store's entries must match the tensor's element count (0-d: a count)."""
    numel = {k: numel_of(s) for k, s, _ in tensors}
    for store, per_key in compressor_state.items():
        if not isinstance(per_key, dict):
            continue
        for key, t in per_key.items():
            if isinstance(t, torch.Tensor) and t.dim() and key in numel and t.numel() not in (numel[key], 0):
                raise ValueError(f"state {store}[{key!r}] holds {t.numel()} entries, this model's has {numel[key]}: "
                                 "the checkpoint is of another model")


class AllRanks:
    """Every rank's gradsift state in one object, for frameworks that save one checkpoint file from rank 0 and hand
    the same file to every rank on resume (Lightning's ``.ckpt``, Accelerate's ``save_state``).

    :meth:`state_dict` is a collective -- every rank calls it, as those frameworks do -- and returns every rank's
    :meth:`Rank.state_dict` (on the CPU) in rank order; :meth:`load_state_dict` gives each rank its own, or, from a
    run of another world size, folds them as :meth:`Rank.load_elastic` does. A checkpoint of one process's residuals
    would restart the other ranks' memory from zero without a word; this one cannot."""

    KEY = "gradsift"

    def __init__(self, rank):  # (a runtime.rank.Rank)
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        mine = move_state(self.rank.state_dict(), torch.device("cpu"))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        ranks: list[Any] = [mine]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
        return {"world_size": world, "ranks": ranks}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ranks = sd.get("ranks") if isinstance(sd, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("not gradsift's checkpoint state: expected every rank's state (AllRanks.state_dict())")
        if len(ranks) == self.rank.global_world:
            self.rank.load_state_dict(ranks[self.rank.global_rank])
        else:
            self.rank.load_elastic(ranks)
