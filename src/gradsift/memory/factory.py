"""Build a compressor from a spec string and compose its memory around it.

A spec is ``"name"`` or ``"name:key=value,key=value"`` (values parse as int,
float, ``true``/``false``, else string; see :func:`gradsift.compressors.parse_spec`).
Keys every compressor accepts:

``ratio``        the fraction sent, in (0, 1] (or the ``ratio`` argument)
``memory``       ``ef`` (error feedback), ``momentum`` (DGC's momentum correction, for any
                 sparsifier), ``adam`` (each worker's Adam direction with error feedback), ``none``;
                 default per method (``ef``; ``momentum`` for DGC; ``none`` for the sampling methods,
                 as their paper; an optimizer handed over may change it: its recipe)
``feedback``     ``true``/``false``: the method's memory on, or none
``value_dtype``  ``fp32``/``fp16``/``bf16``/``fp64`` on the wire for every payload (default: a sparse
                 payload's fp32 values in bf16 when the method has a memory, which keeps what the
                 rounding drops -- 2 bytes an entry instead of 4; everything else in the gradient's
                 dtype; fp16 for GSB)
``warmup``       steps of DGC's exponential density warm-up

With ``memory=momentum`` also ``momentum`` (0.9), ``nesterov``, ``masking`` (true) and ``clip`` (0); with
``memory=adam``, ``beta1``, ``beta2``, ``eps`` (the optimizer's, once handed over), ``scale`` (``mean``),
``nesterov`` (true), ``masking`` (false) and ``clip`` (0); with
``memory=ef``, ``residual_dtype`` (``fp32``, ``bf16``, ``fp16``, ``fp8``: the residual stored narrower; also
under ``memory=adam``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compressors import compressor_class, parse_spec
from ..compressors.base import Compressor, OptionError
from .feedback import ErrorFeedback, Memory
from .momentum import MomentumCorrection
from .adam import AdamDirection
from .. import payload as P
from .wirecast import cast_below_16_bits


SPARSE_VALUE_DTYPE = torch.bfloat16  # fp32's range: no scaling, and error feedback keeps the 2**-9 it rounds off
MEMORIES: dict[str, type[Memory] | None] = {"ef": ErrorFeedback, "momentum": MomentumCorrection,
                                             "adam": AdamDirection, "none": None}


def resolve_memory(name: str, opts: dict[str, Any]) -> str:
    """The memory a spec asks for (``ef``, ``momentum`` or ``none``), taking ``memory``/``feedback`` out of ``opts``."""
    cls = compressor_class(name)
    memory = opts.pop("memory", None)
    feedback = opts.pop("feedback", None)
    if memory is not None and feedback is not None:
        raise OptionError(f"{name}: give memory or feedback, not both")
    if feedback is not None:
        if not isinstance(feedback, bool):
            raise OptionError(f"feedback must be true or false, got {feedback!r}")
        memory = (cls.MEMORY if cls.MEMORY != "none" else "ef") if feedback else "none"
    memory = cls.MEMORY if memory is None else memory
    if memory not in MEMORIES:
        raise OptionError(f"memory must be one of {', '.join(MEMORIES)}, got {memory!r}")
    return memory


def memory_of(spec: str) -> str:
    """The memory a spec resolves to, without building it."""
    name, opts = parse_spec(spec)
    return resolve_memory(name, dict(opts))




def with_memory(compressor: Compressor, memory: str, **options: Any):
    """``compressor`` inside the named memory (``ef``, ``momentum`` or ``none``)."""
    if memory not in MEMORIES:
        raise OptionError(f"memory must be one of {', '.join(MEMORIES)}, got {memory!r}")
    cls = MEMORIES[memory]
    if cls is None:
        if options:
            raise OptionError(f"{compressor.name}: option {sorted(options)[0]!r} needs memory=momentum")
        return compressor
    return cls(compressor, **options)


def make_compressor(spec: str, ratio: float | None = None, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                    weight: float | None = None, **options: Any):
    """Build a compressor from a spec string, wrapped in its memory.

    ``ratio`` may also come from the spec (``topk:ratio=0.01``); it is required
    for every method but ``dense``. ``seed``, ``rank``, ``world_size`` and
    ``weight`` (this worker's weight in the mean, default 1/world_size) place the
    compressor in its run: shared-index methods draw from ``seed`` only,
    everything else from ``(seed, rank)``. Options given both in the spec and as
    keywords are an error.
    """
    name, spec_opts = parse_spec(spec)
    cls = compressor_class(name)
    both = set(spec_opts) & set(options)
    if both:
        raise OptionError(f"option {sorted(both)[0]!r} given both in the spec {spec!r} and as a keyword")
    opts = {**spec_opts, **options}
    placed = sorted(set(opts) & {"seed", "rank", "world_size", "weight"})
    if placed:  # the run places the compressor; a spec cannot
        raise OptionError(f"{name}: {placed[0]!r} is not a compressor option: the run sets it (--seed, the worker's "
                          "rank and count; make_compressor(..., seed=, rank=, world_size=, weight=) in Python)")
    if "ratio" in opts:
        if ratio is not None:
            raise OptionError("ratio given both in the spec and as an argument")
        ratio = opts.pop("ratio")
    if ratio is None:
        if cls.RATIO_REQUIRED:
            raise OptionError(f"{name}: ratio is required (a number in (0, 1], e.g. 0.01)")
        ratio = 1.0
    memory = resolve_memory(name, opts)
    mem_cls = MEMORIES[memory]
    mem_opts = {k: opts.pop(k) for k in list(opts) if k not in cls.OPTIONS and k != "residual_dtype" and (
        k in MomentumCorrection.OPTIONS or k in AdamDirection.OPTIONS)}
    foreign = sorted(k for k in mem_opts if mem_cls is None or k not in mem_cls.OPTIONS)
    if foreign:
        owner = "momentum correction (memory=momentum)" if foreign[0] in MomentumCorrection.OPTIONS else \
            "Adam's direction (memory=adam)"
        raise OptionError(f"{name}: option {foreign[0]!r} belongs to {owner}; this compressor's memory is {memory}")
    if "residual_dtype" in opts:
        if memory not in ("ef", "adam"):
            raise OptionError(f"{name}: residual_dtype is an option of error feedback's residual (memory=ef or "
                              f"adam); this compressor's memory is {memory}")
        mem_opts["residual_dtype"] = opts.pop("residual_dtype")
    value_dtype = opts.pop("value_dtype", None)
    comp = cls(ratio, seed=seed, rank=rank, world_size=world_size, weight=weight, value_dtype=value_dtype, **opts)
    comp.check_memory(memory)
    if comp.value_bits:
        check_below_16_bits(comp, memory, mem_opts.get("residual_dtype", "fp32"))
    if value_dtype is None and cls.VALUE_DTYPE is None and memory != "none":
        comp.sparse_dtype = SPARSE_VALUE_DTYPE  # the memory keeps what the rounding drops
    return with_memory(comp, memory, **mem_opts)


def check_below_16_bits(comp, memory: str, residual_dtype: str) -> None:
    """``value_dtype=int4``/``int2`` needs a sparse payload (every worker its own indices: codes cannot be summed
    by an all-reduce) and a float32 memory that keeps what the rounding drops."""
    vd = comp.value_dtype_name
    if comp.payload_kind() != P.SPARSE or comp.ROUNDS > 1:
        raise OptionError(f"{comp.name}: value_dtype={vd} codes the values of sparse payloads (each worker its own "
                          f"indices); {comp.name} sends values every worker sums in place: use bf16 or fp16")
    if memory == "none":
        raise OptionError(f"{comp.name}: value_dtype={vd} rounds every value to {comp.value_bits} bits and only a "
                          "memory keeps what that drops: use memory=ef (the default), momentum or adam")
    if residual_dtype != "fp32":
        raise OptionError(f"{comp.name}: value_dtype={vd} puts what its rounding drops back into the residual, which "
                          f"must then be fp32 (residual_dtype={residual_dtype} given)")


def sparsify(spec: str, tensor: torch.Tensor, ratio: float | None = None, **options: Any):
    """Run a fresh compressor once on one tensor; return ``(values, indices)``: the values as the receivers decode
    them, in the tensor's dtype (rounded to bf16 on the wire by default: ``value_dtype=fp32`` keeps them).

    Indices are int64 positions in the flattened tensor (for a dense payload,
    every position).
    """
    comp = make_compressor(spec, ratio, **options)
    p = comp.compress("tensor", tensor)
    if comp.inner.value_bits:  # (the road's cast: values below 16 bits on their levels, in index order)
        cast_below_16_bits(comp, ["tensor"], [p])
    values = p.values.to(tensor.dtype)  # what the receivers decode (bf16 on the wire by default: value_dtype)
    if p.indices is None:
        return values, torch.arange(p.numel, device=p.values.device)
    return values, p.indices
