"""Memory around a compressor: the base class and error feedback (momentum correction: :mod:`gradsift.memory.momentum`).

Memories wrap a :class:`~gradsift.compressors.base.Compressor` and offer its calls
(``compress``, ``observe``, ``state_dict``, ``load_state_dict``, ``checkpoint``,
``rollback``), so a runtime never knows whether memory is on. They are
composed around a compressor by :func:`gradsift.memory.factory.make_compressor`;
compressors never import this module.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019),
as every paper here writes it (REGTOP-k Sec. 1.1, rTop-k Alg. 1, LAGS Alg. 1)::

    a_t      = residual_t + g_t            # accumulated gradient (in place: the residual buffer)
    sent_t   = select(a_t)
    residual = a_t - sent_t

``sent_t`` is what the receivers decode: the wire values cast back, so the
rounding of fp16 values stays in memory instead of being lost. Entries a
threshold method selected beyond its wire capacity are not sent and stay in
memory. Memory is kept in at least float32. Nothing enters memory before the
gradient is known to be finite.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import payload as P
from .kept import KeptResidual
from .narrow import RESIDUAL_DTYPE, NarrowResidual
from ..options import Option, check_options, defaults
from ..kernels import many as kernels
from ..kernels.scatter import subtract_at
from ..kernels.many import batchable
from ..compressors.base import (Compressor, NonFiniteGradient, check_input, clone_state, is_finite,
                               restore)
from .wirecast import (cast_for_wire, cast_many_for_wire,  # noqa: F401 (the memories import them from here)
                       cut_to_capacity)
from ..compressors.tails import tail_plans, tails_many


def subtract_sent(acc: torch.Tensor, sent: P.Payload, zero: torch.Tensor | None = None) -> torch.Tensor:
    """``acc - decode(sent)``, in place; with ``zero``, a sparse send's positions also zeroed there (momentum
    correction's masking), in the same sweep.

    A compressor may return values that alias ``acc`` (e.g. everything, with no
    dtype change); they are copied first so the payload keeps what was sent.
    """
    if sent.values.numel() and sent.values.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr():
        sent.values = sent.values.clone()
    if sent.kind == P.DENSE:
        return acc.sub_(sent.values.to(acc.dtype))
    if sent.count:  # (index_add_'s arithmetic: adds exactly -value; 2.3x faster than index_put_ accumulating)
        subtract_at(acc, sent.indices, sent.values.to(acc.dtype), zero)
    return acc


class Memory:
    """Forwards everything a runtime may ask to the wrapped compressor; subclasses keep per-tensor stores.

    A subclass defines :meth:`accumulate` (the vector to select from, kept as its
    memory) and :meth:`settle` (memory after sending).
    """

    memory_name = ""  # what memory= names it
    TITLE = ""  # what it is, in words (errors and the API reference)
    STORES: tuple[str, ...] = ()  # names of the per-tensor memory dicts (checkpointed, rolled back)
    UNSENT = ""  # the store holding what is not sent yet (``residual``'s): where an elastic resume folds it
    WHOLE_AS_METHOD = False  # a tensor it holds nothing of goes whole as the method alone sends it (the road joins them)
    OPTIONS: dict[str, Option] = {}  # the memory's options (spec keys), declared once

    def __init__(self, compressor: Compressor, **options: Any):
        self.compressor = compressor
        self.memory_options = check_options(self.OPTIONS, options, f"{compressor.name} ({self.memory_name} memory)")
        for name in self.STORES:
            setattr(self, name, {})
        self._casts: list[tuple[torch.Tensor, P.Payload]] | None = None  # (casts_for_group) settled, not cast yet

    def cast_settled(self, acc: torch.Tensor, sent: P.Payload) -> None:
        """The wire cast of a payload its pass settled (:func:`cast_for_wire`: the rounding back into ``acc``), or,
        inside :meth:`casts_for_group`, kept for the group's one cast."""
        if self._casts is None:
            cast_for_wire(self.compressor, acc, sent)
        else:
            self._casts.append((acc, sent))

    @contextlib.contextmanager
    def casts_for_group(self):
        """The settled payloads of a group cast once when it ends (:func:`cast_many_for_wire`, the same bits as one
        by one), where the memory keeps its tensors as they are (a narrow store encodes each when it is kept)."""
        if getattr(self, "store_dtype", None) is not None:
            yield
            return
        self._casts = []
        try:
            yield
            casts = self._casts
        finally:
            self._casts = None
        if casts:
            cast_many_for_wire(self.compressor, [a for a, _ in casts], [p for _, p in casts])

    @property
    def inner(self) -> Compressor:
        return self.compressor

    def sends_dense(self, key: str, shape: torch.Size) -> bool:
        """The compressor's rule (asked per tensor each step: forwarded here, not through :meth:`__getattr__`, which
        Python reaches only after a failed lookup)."""
        return self.compressor.sends_dense(key, shape)

    def __getattr__(self, name: str) -> Any:
        # ratio, name, OBSERVES, EXACT_K, set_layer_ratio, rank, ... come from the compressor
        if name == "compressor":
            raise AttributeError(name)
        return getattr(self.compressor, name)

    # --------------------------------------------------------------- the step
    def held(self, store: dict[str, torch.Tensor], key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """What ``store`` holds for ``key`` (None: nothing yet); a size other than the gradient's is an error."""
        t = store.get(key)
        if t is not None and t.numel() != flat.numel():
            raise ValueError(f"tensor {key!r} changed size: {t.numel()} elements before, {flat.numel()} now")
        return t

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        raise NotImplementedError

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        c = self.compressor
        check_input(c.name, key, grad)
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        if dense is None:
            dense = c.sends_dense(key, grad.shape)
        return self._send(key, flat, self.accumulate(key, flat), dense=dense, native=native, owners=owners,
                          check_finite=check_finite)

    def _send(self, key: str, flat: torch.Tensor, acc: torch.Tensor, *, dense: bool = False, native: bool = False,
              owners: P.Partition | None = None, check_finite: bool = False, acc_finite: bool | None = None,
              tail=None) -> P.Payload:
        """Select from the accumulated ``acc`` and settle the memory (``acc_finite``: known from the accumulating
        pass, else checked here when the selection might miss an overflow)."""
        c = self.compressor
        if not (dense or c.SELECTS_LARGEST) and not (is_finite(acc) if acc_finite is None else acc_finite):
            # an overflow a selection might miss
            return self.overflowed(key, P.dense(torch.zeros_like(flat), flat.dtype), check_finite)
        sent = c.send_dense(key, acc, native) if dense else c.emit(key, acc, owners, tail)[0]
        return self._settle_sent(key, flat, acc, sent, dense=dense, native=native, check_finite=check_finite,
                                 acc_finite=acc_finite)

    def _settle_sent(self, key: str, flat: torch.Tensor, acc: torch.Tensor, sent: P.Payload, *, dense: bool = False,
                     native: bool = False, check_finite: bool = False, acc_finite: bool | None = None) -> P.Payload:
        """:meth:`_send` once the payload is made: the gradient's dtype on the wire where the memory is wider, an
        overflow the selection shows, the memory settled."""
        c = self.compressor
        sent.grad_dtype = flat.dtype
        narrowed = False
        if (c.value_dtype is None or (dense and native)) and sent.values.dtype not in (flat.dtype, c.sparse_dtype):
            # memory is wider than the gradient (fp16/bf16 models): send in the gradient's dtype
            sent.values, narrowed = sent.values.to(flat.dtype), True
        # the largest entries are selected first, so an overflow shows here (known already where the pass read every
        # accumulated entry finite and nothing was narrowed: the values are some of them, or saturate on the wire)
        if not (acc_finite and not narrowed) and not is_finite(sent.values):
            return self.overflowed(key, sent, check_finite)
        self.settle(key, acc, sent)
        return sent

    def compress_many(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of each tensor of a group, as the road sends it (see ``Compressor.compress_many``)."""
        return [self.compress(key, grad, check_finite=False, dense=False) for key, grad in zip(keys, grads)]

    def overflowed(self, key: str, sent: P.Payload, raise_it: bool) -> P.Payload:
        """Memory plus gradient left the float range: the key's memory is dropped (it holds Inf), and the caller
        gets an error -- or, inside the road (``check_finite=False``), zeroed values of the same shape with
        ``nonfinite`` set, so that every worker still issues the same collectives and the flag stops the step."""
        for store in self.stores().values():
            store.pop(key, None)
        if raise_it:
            raise NonFiniteGradient(f"the accumulated gradient of {key!r} overflowed the float range; its memory "
                                    "was dropped")
        sent.values = torch.zeros_like(sent.values)
        sent.nonfinite = True
        return sent

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        self.compressor.observe(key, sent, mean)

    def observe_many(self, keys, sents, means) -> None:
        self.compressor.observe_many(keys, sents, means)

    # ------------------------------------------------------------ state
    def stores(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: getattr(self, name) for name in self.STORES}

    def rounding_lost(self) -> float | None:
        """What a narrow store of the memory has rounded off, relative to what it held (None: stored exactly)."""
        return None

    def wide_stores(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A saved state's stores as values (an elastic fold adds them): narrow codes decoded."""
        return saved

    def take_stores(self, stores: dict[str, dict[str, torch.Tensor]]) -> None:
        """Hold ``stores`` (values, as :meth:`wide_stores` gives them): an elastic fold's result."""
        for name in self.STORES:
            setattr(self, name, stores.get(name, {}))

    def describe(self) -> str:
        return f"{self.compressor.describe()}+{self.memory_name}"

    def config(self) -> dict[str, Any]:
        return {**self.compressor.config(), "memory": self.memory_name,
                "memory_options": dict(sorted(self.memory_options.items()))}

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"compressor": self.compressor.state_dict(), "memory": self.memory_name,
                              "memory_options": dict(self.memory_options), "rank": self.compressor.rank,
                              "world_size": self.compressor.world_size}
        for name, store in self.stores().items():
            sd[name] = {k: v.detach().clone() for k, v in store.items()}
        return sd

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        if sd.get("memory") != self.memory_name:
            raise ValueError(f"state was saved with memory {sd.get('memory')!r}, this compressor uses "
                             f"{self.memory_name!r}")
        if {**defaults(self.OPTIONS), **dict(sd.get("memory_options", self.memory_options))} != self.memory_options:
            raise ValueError(f"state was saved with memory options {sd.get('memory_options')}, this compressor "
                             f"uses {self.memory_options}")
        reset = self.compressor.rank_mismatch(sd["compressor"], reset_memory)
        self.compressor.load_state_dict(sd["compressor"], reset_memory=reset_memory)
        for name in self.STORES:
            setattr(self, name, {} if reset else {k: v.detach().clone() for k, v in sd[name].items()})

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        keys = list(keys)
        return {"inner": self.compressor.checkpoint(keys, deep),
                "stores": {name: {k: clone_state(store.get(k)) for k in keys} for name, store in self.stores().items()}}

    def rollback(self, token: dict[str, Any]) -> None:
        self.compressor.rollback(token["inner"])
        for name, saved in token["stores"].items():
            restore(getattr(self, name), saved)


class ErrorFeedback(KeptResidual, NarrowResidual, Memory):
    """Error feedback around any compressor: nothing is ever lost, only delayed. ``residual_dtype`` bf16/fp16 (2
    bytes an entry) or fp8 (1 byte: float8 codes and a scale per tensor) stores the residual narrower, losing its
    rounding, which is counted (:mod:`gradsift.memory.narrow`); sums and selection still run in fp32."""

    memory_name = "ef"
    TITLE = "error feedback"
    STORES = ("residual",)
    UNSENT = "residual"
    WHOLE_AS_METHOD = True  # (compress: nothing held back for a tensor sent whole, it goes as it is)
    OPTIONS = {"residual_dtype": RESIDUAL_DTYPE}

    def __init__(self, compressor: Compressor, **options: Any):
        super().__init__(compressor, **options)
        self.init_residual(self.memory_options["residual_dtype"])
        self.init_kept()  # rollback without a copy (:mod:`gradsift.memory.kept`)

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        c = self.compressor
        if dense is None:
            dense = c.sends_dense(key, grad.shape)
        if dense and key not in self.residual:  # nothing held back for this tensor: it goes as it is
            return c.compress(key, grad, check_finite=check_finite, dense=True, native=native)
        if not dense and self._fusable(grad):
            return self._fused(key, grad, check_finite, owners)
        return super().compress(key, grad, check_finite=check_finite, dense=dense, native=native, owners=owners)

    def holds_back(self, keys) -> bool:
        """Whether a residual is held for any of ``keys`` (sending them whole must carry it along)."""
        return any(k in self.residual for k in keys)

    def continues_from_mean(self, keys) -> bool:
        """With no residual, a tensor sent whole is the plain mean: steps may arrive by another route."""
        return not self.holds_back(keys)

    def _fusable(self, grad: torch.Tensor, fused: bool = True) -> bool:
        """Whether a kernel accumulates the residual: the method's own (``fused``; float32, on the CPU or a GPU) or
        the compiled scan (CPU)."""
        if self.store_dtype is not None or (fused and not self.compressor.FUSES_MEMORY):
            return False
        if fused and grad.is_cuda:
            return grad.dtype == torch.float32 and grad.is_contiguous() and grad.numel() > 0
        return batchable(grad)

    def compress_many(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of the tensors of a group (as the road sends what it compresses: no finiteness check,
        never whole); the fusing methods select them all in one call (``select_many_into``), with the same results."""
        c = self.compressor
        out: list[P.Payload | None] = [None] * len(keys)
        batch = []
        plain = self.store_dtype is None
        for i, (key, grad) in enumerate(zip(keys, grads)):
            if plain and batchable(grad):  # (float32 on the CPU: what check_input asks holds)
                batch.append(i)
            elif grad.is_cuda and self._fusable(grad):  # (a GPU's: the method's)
                check_input(c.name, key, grad)
                batch.append(i)
            else:
                out[i] = self.compress(key, grad, check_finite=False, dense=False)
        if not batch:
            return out
        flats, keys_b = P.flat_views([grads[i] for i in batch]), [keys[i] for i in batch]
        rs, srcs = self.accumulators(keys_b, flats)
        srcs = srcs if any(t is not None for t in srcs) else None
        if c.FUSES_MEMORY:  # accumulate, select and zero in the method's own kernel
            sents = c.select_many_into(keys_b, list(rs), flats, srcs, wire=c.sparse_wire_dtype())
            for i, sent in zip(batch, self.settle_fused_many(keys_b, rs, sents)):
                out[i] = sent
            return out
        if hasattr(c, "select_tail"):  # DGC: the pass that accumulates also samples, and selects (dgc_in_scan)
            sts, ks, plans = tail_plans(c, keys_b, flats)
            settle = (1 | (8 if c.sparse_wire_dtype() == torch.bfloat16 else 0)) if c.value_dtype is None else 0
            tails = tails_many(list(rs), flats, sts, ks, c.WANT, samples=plans, srcs=srcs,
                               dgc=settle if c.SELECTS_IN_PASS else None)  # (8: the bf16 cast taken there too)
            with self.casts_for_group():
                for i, f, r, tail in zip(batch, flats, rs, tails):
                    out[i] = self._send(keys[i], f, r, acc_finite=tail.finite, tail=tail)
            return out
        # r += g in one pass per tensor that also finds non-finite entries (an overflow of the memory)
        for i, f, r, scan in zip(batch, flats, rs, kernels.scan_many(list(rs), flats, srcs=srcs or ())):
            out[i] = self._send(keys[i], f, r, acc_finite=scan.top < kernels.INF_BITS)
        return out

    def _residual_for(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        r = self.held(self.residual, key, flat)
        return torch.zeros_like(flat) if r is None else r

    def _fused(self, key: str, grad: torch.Tensor, check_finite: bool, owners: P.Partition | None) -> P.Payload:
        """The compressor accumulates, selects and zeroes in its own passes (:mod:`gradsift.kernels`)."""
        c = self.compressor
        check_input(c.name, key, grad)
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        r = self._residual_for(key, flat)
        sent = c.select_into(key, r, flat)  # r += g; selected entries zeroed: r is the residual
        return self.settle_fused(key, r, sent, check_finite, owners)

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        r = self.held(self.residual, key, flat)
        if r is None:
            return flat.to(P.accumulate_dtype(flat.dtype), copy=True)
        # the residual buffer becomes the accumulator (no new allocation), unless it is narrow
        if self.store_dtype is None:
            return r.add_(flat)
        return self.residual_in(key, flat.to(P.accumulate_dtype(flat.dtype), copy=False)).add_(flat)

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        if sent.settled:  # zeroed by the pass that selected it (DGC's); what the wire's cast rounds off stays
            self.cast_settled(acc, sent)
            self.keep_residual(key, acc)
            return
        if sent.kind == P.DENSE and sent.values.dtype == acc.dtype:
            for store in self.stores().values():  # everything went, exactly: no memory left (values may be acc)
                store.pop(key, None)
            return
        self.keep_residual(key, subtract_sent(acc, sent))
