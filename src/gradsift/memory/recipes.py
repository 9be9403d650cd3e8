"""gradsift's recipes for the optimizer handed over: the memory a spec that names none gets (:func:`recipe_spec`)
and the Nesterov flag of momentum SGD (:func:`momentum_recipe`). Each returns a new :class:`Spec` or changes the
optimizer, with the one line that says so; each was measured (docs/recipes.md)."""

from __future__ import annotations

import torch

from ..compressors import compressor_class
from ..errors import ConfigError
from .adam_step import adam_family, coupled_adam
from .spec import Spec

# a spec that gives one of these keeps DGC's momentum correction under momentum SGD
MOMENTUM_CORRECTION_KEYS = ("momentum", "nesterov", "masking")


def adam_recipe_spec(spec: "str | Spec", optimizer: torch.optim.Optimizer | None) -> Spec | None:
    """The spec with ``memory=adam`` when gradsift's Adam recipe applies: an Adam-family optimizer
    (:class:`torch.optim.AdamW`, or :class:`torch.optim.Adam` without weight decay), a method whose memory is
    error feedback (or DGC's momentum correction, which is defined for SGD) and a spec that names no memory.
    None when it does not apply."""
    if not adam_family(optimizer):
        return None
    s = Spec.parse(spec)
    if compressor_class(s.method).MEMORY not in ("ef", "momentum") or s.names_memory:
        return None
    return s.replace(memory="adam")


def recipe_spec(spec: "str | Spec", optimizer: torch.optim.Optimizer | None, *,
                adam: bool = True) -> tuple["str | Spec", str | None]:
    """gradsift's recipe for the memory, when an optimizer is handed over and the spec names no memory:

    - Adam-family optimizers (AdamW; Adam without weight decay): every sparsifier with memory sends each worker's
      Adam direction with error feedback (``memory=adam``, :class:`gradsift.memory.adam.AdamDirection`). Measured on
      gptlm at 8 workers and ratio 0.01 (docs/recipes.md): validation loss after 300 steps 3.01 compressing the
      gradient, 2.14 compressing the direction, dense AdamW 2.07.
    - momentum SGD: a method whose default memory is momentum correction (DGC) sends with error feedback
      (``memory=ef``). Measured on mnist1d-cnn at 8 workers and ratio 0.01, steps to dense's final accuracy minus a
      point (3 seeds; dense's budget 600): DGC with momentum correction (Nesterov) 1033, with error feedback
      (Nesterov) 683 (docs/results.md, "DGC's and GaussianK's defaults"). ``dgc:memory=momentum`` keeps DGC's
      momentum correction.

    Plain SGD (no momentum) is left alone: there momentum correction is error feedback. ``adam=False`` (FSDP: the
    workers' moments would be whole, unsharded copies of the model on every rank) leaves Adam's recipe out.
    Returns (the spec to build -- ``spec`` itself when nothing changed -- and the line that says what changed, or
    None). A spec that does not parse comes back as it is: it is refused, in one line, where the settings are
    checked."""
    if optimizer is None:
        return spec, None
    try:
        s = Spec.parse(spec)
    except ValueError:
        return spec, None
    name, cls = s.method, compressor_class(s.method)
    if adam and coupled_adam(optimizer) and cls.MEMORY in ("ef", "momentum") and not s.names_memory:
        raise ConfigError(f"{name} under torch.optim.Adam with weight_decay: the decay is part of the gradient, so "
                          "gradsift's Adam recipe (each worker's Adam direction with error feedback) does not apply, "
                          "and compressing the gradient under Adam trains markedly worse; use AdamW (decoupled "
                          f"weight decay) or weight_decay=0, or say {name}:memory=ef (or recipe=False) to compress the "
                          "gradient anyway")
    new = adam_recipe_spec(s, optimizer) if adam else None
    if new is not None:
        return new, (f"gradsift: {name} sends each worker's Adam direction with error feedback under "
                     f"{type(optimizer).__name__} ({new}: its recipe, measured in docs/recipes.md); the optimizer "
                     f"applies the averaged direction in p.grad (a clip_grad_norm_ after backward() is undone and moves "
                     f"to each rank's gradient as {name}:clip=C; any other change to p.grad stops the script); "
                     f"{name}:memory=ef, or recipe=False, compresses the gradient")
    if cls.MEMORY != "momentum" or s.memory is not None or any(k in s.memory_options for k in MOMENTUM_CORRECTION_KEYS):
        return spec, None
    if isinstance(optimizer, torch.optim.SGD) and not any(g.get("momentum", 0.0) > 0 for g in optimizer.param_groups):
        return spec, None
    new = s.replace(memory="ef")
    return new, (f"gradsift: {name} sends with error feedback under {type(optimizer).__name__} ({new}: its recipe, "
                 f"measured in docs/recipes.md; {name}:memory=momentum, or recipe=False, keeps DGC's momentum correction)")


def momentum_recipe(spec: "str | Spec", optimizer: torch.optim.Optimizer | None) -> str | None:
    """gradsift's recipe for momentum SGD: a sparsifier with memory (error feedback: top-k, random-k, REGTOP-k,
    SIDCo, RedSync, GaussianK, DGC -- error feedback by :func:`recipe_spec`, or momentum correction where named)
    trains with Nesterov momentum -- the optimizer's ``nesterov`` flag is set (momentum correction takes the
    Nesterov form from it). Measured on mnist1d-cnn at 8 workers and ratio 0.01, steps to dense's final accuracy
    minus a point (3 seeds; dense 517): top-k 967 with plain momentum and error feedback, 650 with Nesterov; DGC's
    momentum correction 1033 and 817 (docs/results.md, the race). rTop-k keeps its own rule (plain SGD, the
    momentum folded into the step: ``Compressor.PLAIN_SGD``); Adam-family optimizers and SGD without momentum are
    left as they are. Returns the line that says what changed, or None."""
    name = Spec.parse(spec).method
    cls = compressor_class(name)
    if cls.MEMORY not in ("ef", "momentum") or cls.PLAIN_SGD or not isinstance(optimizer, torch.optim.SGD):
        return None
    groups = optimizer.param_groups
    if not all(g.get("momentum", 0.0) > 0 and not g.get("dampening", 0.0) for g in groups):
        return None
    if all(g.get("nesterov", False) for g in groups):
        return None
    for g in groups:
        g["nesterov"] = True
    return (f"gradsift: {name} trains with Nesterov momentum (the optimizer's nesterov flag is now on: gradsift's recipe "
            "for momentum SGD with a sparsifier; recipe=False keeps the optimizer as given)")
