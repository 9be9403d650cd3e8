"""Rollback without a copy, for the memories that keep a float32 residual (error feedback, Adam's direction).

A skipped step (``on_nonfinite="skip"``: a worker's gradient held NaN or Inf, known after the exchange) must leave a
memory as if the step never ran. Copying every store before every step costs a pass over the memory, and Python
work per tensor, for a rollback that almost never happens. Instead a checkpoint keeps *references* to the tensors the
stores hold, and a step never writes into a tensor a checkpoint holds: it writes its result into another tensor that
then takes the store's place (the residual: :meth:`KeptResidual.accumulator`; Adam's moments: out-of-place foreach
operations, :meth:`KeptResidual.fresh`). Rolling back puts the held tensors back. A clean step copies nothing.

A narrow residual (bf16, fp16, fp8 codes: :mod:`gradsift.memory.narrow`) is decoded into a new tensor every step
anyway; it checkpoints by copying, as :class:`gradsift.memory.feedback.Memory` does.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import payload as P
from ..compressors.base import fit_capacity, is_finite, restore
from .wirecast import cast_for_wire, cast_many_for_wire, cut_to_capacity
from ..kernels.buffers import reuse_spare


class KeptResidual:
    """Mixed into a memory with a ``residual`` store (before :class:`~gradsift.memory.narrow.NarrowResidual`)."""

    residual: dict[str, torch.Tensor]
    store_dtype: torch.dtype | None

    def init_kept(self) -> None:
        # keys whose stored tensors an open checkpoint holds as they are (not copied): a step writes them out of
        # place, or copies them at the first write in place (:meth:`held`)
        self._kept: set[str] = set()
        self._spare: dict[str, torch.Tensor] = {}  # per key, the residual a step replaced: the next one's target

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """The stores' tensors themselves, not copies (module docstring); a narrow residual is copied as before."""
        if self.store_dtype is not None:
            return super().checkpoint(keys, deep)  # type: ignore[misc]
        keys = list(keys)
        kept = {name: {k: store.get(k) for k in keys} for name, store in self.stores().items()}  # type: ignore
        self._kept.update(k for k, t in kept["residual"].items() if t is not None)
        return {"inner": self.compressor.checkpoint(keys, deep), "kept": kept}  # type: ignore[attr-defined]

    def rollback(self, token: dict[str, Any]) -> None:
        if "kept" not in token:
            return super().rollback(token)  # type: ignore[misc]
        self.compressor.rollback(token["inner"])  # type: ignore[attr-defined]
        for name, saved in token["kept"].items():
            restore(getattr(self, name), saved)
        self._kept.update(k for k, t in token["kept"]["residual"].items() if t is not None)  # (others may hold them)

    def fresh(self, keys) -> bool:
        """Whether an open checkpoint holds any of ``keys``' tensors: the step must write them out of place."""
        return any(k in self._kept for k in keys)

    def held(self, store: dict[str, torch.Tensor], key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """As ``Memory.held``; a residual an open checkpoint holds is copied first (the caller may write it)."""
        t = super().held(store, key, flat)  # type: ignore[misc]
        if t is not None and store is self.residual and key in self._kept:
            t = store[key] = t.clone()
            self._kept.discard(key)
        return t

    def accumulator(self, key: str, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor to accumulate ``flat`` into, the tensor to read the residual from, or None: the first
        itself) for a float32 residual. A residual an open checkpoint holds is read where it is and the sum written
        into another tensor, which becomes the residual: no copy. That tensor is the one the key's last such step
        replaced, once nothing holds it any more (the step closed, its checkpoint dropped), so the memory is not
        allocated again either: as with a copy per step, two residuals per key are held."""
        t = super().held(self.residual, key, flat)  # type: ignore[misc]
        if t is None:
            return torch.zeros_like(flat), None
        if key not in self._kept:
            return t, None
        self._kept.discard(key)
        out = reuse_spare(self._spare, key, t)
        self.residual[key], self._spare[key] = out, t
        return out, t

    def accumulators(self, keys, flats) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """:meth:`accumulator` of a group's tensors, in one loop (a residual held and not kept: itself)."""
        rs: list[torch.Tensor] = []
        srcs: list[torch.Tensor | None] = []
        residual, kept = self.residual, self._kept
        for key, f in zip(keys, flats):
            t = residual.get(key)
            if t is not None and key not in kept and t.numel() == f.numel():
                rs.append(t)
                srcs.append(None)
            else:
                r, src = self.accumulator(key, f)
                rs.append(r)
                srcs.append(src)
        return rs, srcs

    def settle_fused(self, key: str, r: torch.Tensor, sent: P.Payload, check_finite: bool,
                     owners: P.Partition | None, cast: bool = True) -> P.Payload:
        """After a selection that accumulated into ``r`` and zeroed what it took (``select_many_into``): the wire's
        capacity (what did not fit goes back into ``r``), an overflow, and (``cast``; else the caller casts a group at
        once, :func:`gradsift.memory.wirecast.cast_many_for_wire`) the wire's cast. ``r`` becomes the residual."""
        c = self.compressor  # type: ignore[attr-defined]
        sent.capacity = c.capacity_for(sent.target, sent.numel)
        sent.owners = owners
        dropped = fit_capacity(sent)
        if dropped is not None:  # selected beyond the wire capacity: back into memory
            r.index_put_((dropped.indices,), dropped.values.to(r.dtype), accumulate=True)
        if not (sent.finite or is_finite(sent.values)):  # Inf in memory plus gradient: among the largest, selected
            self.residual[key] = r
            return self.overflowed(key, sent, check_finite)  # type: ignore[attr-defined]
        if cast:
            cast_for_wire(c, r, sent)
        self.residual[key] = r
        return sent

    def settle_fused_many(self, keys, rs, sents) -> list[P.Payload]:
        """:meth:`settle_fused` of a group's payloads (``select_many_into``'s, no owners): cut to their capacity in
        one call (:func:`cut_to_capacity`), settled, and those not overflowed cast for the wire at once
        (:func:`cast_many_for_wire`). A payload within its capacity whose values are finite (its pass read them, or
        one read of the group's values here) needs nothing more than its residual kept: that is all its settling
        does, here without a call per tensor."""
        c = self.compressor  # type: ignore[attr-defined]
        cut_to_capacity(c, rs, sents)
        unknown = [s for s in sents if not s.finite]  # (values no pass read whole: random-k's draws)
        if len(unknown) > 1 and P.all_finite([s.values for s in unknown]):  # (one foreach read for the group)
            for s in unknown:
                s.finite = True
        wire = c.sparse_wire_dtype()
        residual, out, casts = self.residual, [], []  # type: ignore[attr-defined]
        for key, r, sent in zip(keys, rs, sents):
            if sent.finite and sent.kind == P.SPARSE and sent.owners is None and sent.count <= sent.capacity:
                residual[key] = r  # (its capacity set by the cut)
            else:
                sent = self.settle_fused(key, r, sent, False, None, cast=False)
            out.append(sent)
            if not sent.nonfinite and (wire is None or sent.values.dtype != wire):
                casts.append((r, sent))
        if casts:
            cast_many_for_wire(c, [r for r, _ in casts], [p for _, p in casts])
        return out
