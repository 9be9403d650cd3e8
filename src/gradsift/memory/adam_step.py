"""The hand-off between :class:`gradsift.memory.adam.AdamDirection` and the optimizer: when the recipe applies
(:func:`gradsift.memory.recipes.adam_recipe_spec`), the optimizer's betas and eps given to the workers and its step reduced to applying the
averaged direction (:func:`take_over_adam`), and a framework's gradient clipping moved to the workers
(:func:`hand_clip_over`)."""

from __future__ import annotations

import weakref

import torch

from ..errors import ConfigError


def coupled_adam(optimizer) -> bool:
    """:class:`torch.optim.Adam` (not AdamW) with weight decay in some group: L2 decay added to the gradient."""
    return type(optimizer) is torch.optim.Adam and any(g.get("weight_decay", 0.0) for g in optimizer.param_groups)


def adam_family(optimizer) -> bool:
    """AdamW, or Adam without (L2-coupled) weight decay: the optimizers whose step the recipe reproduces."""
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    return isinstance(optimizer, torch.optim.Adam) and not any(g.get("weight_decay", 0.0) for g in optimizer.param_groups)


def take_over_adam(memory, optimizer: torch.optim.Optimizer, *, tensors: int = 1, clip: float | None = None) -> bool:
    """The one hand-off between :class:`~gradsift.memory.adam.AdamDirection` and the optimizer: Adam is applied once.

    ``memory``: a compressor in its memory, or a list (one per simulated worker). With ``memory=adam`` the
    optimizer's betas and eps become the memory's (the same in every parameter group, else refused in one line),
    and the optimizer's own step is replaced, through a step pre-hook, by ``p <- p (1 - lr wd) - lr d`` with the
    group's current ``lr`` and ``weight_decay`` (AdamW's decoupled decay; a learning-rate scheduler keeps working)
    and ``d`` the mean direction in ``p.grad``; the optimizer then finds no gradients and leaves its own state
    empty. ``tensors``: how many tensors each worker sends (the clip's T); ``clip``: the run's gradient clipping
    (``gradsift train --clip-norm``, a task's), which becomes the memory's unless its spec named one -- the run must
    then not clip the averaged direction. Refused: an optimizer other than Adam/AdamW, Adam with weight decay (its
    decay is part of the gradient), ``amsgrad``. Returns whether anything was taken over."""
    memories = list(memory) if isinstance(memory, (list, tuple)) else [memory]
    ours = [c for c in memories if getattr(c, "applies_adam", False)]
    if not ours:
        return False
    name = ours[0].name
    if not adam_family(optimizer):
        what = type(optimizer).__name__ + (" with weight decay" if isinstance(optimizer, torch.optim.Adam) else "")
        raise ConfigError(f"{name}:memory=adam compresses Adam's direction, for AdamW (or Adam without weight "
                          f"decay); the optimizer is {what}: use error feedback (memory=ef)")
    groups = optimizer.param_groups
    first = groups[0]
    if any(tuple(g["betas"]) != tuple(first["betas"]) or g["eps"] != first["eps"] for g in groups):
        raise ConfigError(f"{name}:memory=adam: the optimizer's parameter groups use different betas or eps; the "
                          "workers' Adam applies one to every tensor")
    if any(g.get("amsgrad", False) for g in groups):
        raise ConfigError(f"{name}:memory=adam reproduces Adam without amsgrad; the optimizer has amsgrad=True")
    b1, b2 = (float(b) for b in first["betas"])
    for c in ours:
        c.memory_options.update(beta1=b1, beta2=b2, eps=float(first["eps"]))
        c.tensor_count = max(1, int(tensors))
        if clip and not c.memory_options["clip"]:
            c.memory_options["clip"] = float(clip)
    if optimizer in _TAKEN_OVER:
        return True
    decoupled = isinstance(optimizer, torch.optim.AdamW)

    @torch.no_grad()
    def apply_direction(opt, args, kwargs) -> None:
        for g in opt.param_groups:
            lr = float(g["lr"])
            wd = float(g.get("weight_decay", 0.0)) if decoupled else 0.0
            ps = [p for p in g["params"] if p.grad is not None]
            for _, same in _by_kind(ps):  # (foreach operations take one dtype and device at a time)
                if wd:
                    torch._foreach_mul_(same, 1 - lr * wd)
                torch._foreach_add_(same, [p.grad.to(p.dtype) for p in same], alpha=-lr)
            for p in ps:
                p.grad = None

    optimizer.register_step_pre_hook(apply_direction)
    _TAKEN_OVER.add(optimizer)
    return True


def _by_kind(ps) -> list[tuple[tuple, list]]:
    """Parameters grouped by (dtype, device), in first-seen order."""
    kinds: dict[tuple, list] = {}
    for p in ps:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.items())


def hand_clip_over(state, optimizer, clip: float | None) -> bool:
    """A framework's gradient clipping (``gradsift train --clip-norm``, the Trainer's ``max_grad_norm``, Lightning's
    ``gradient_clip_val``) handed to the workers when ``state`` (a registered rank) sends Adam's direction: they clip
    their own gradients (:class:`~gradsift.memory.adam.AdamDirection`'s ``clip``), and the caller must then stop clipping the averaged
    direction. Returns whether it was handed over (nothing to do otherwise)."""
    comp = getattr(state, "compressor", None)
    if comp is None or not comp.applies_adam or not clip or clip <= 0 or optimizer is None:
        return False
    take_over_adam(comp, optimizer, tensors=len(state.tensors), clip=float(clip))
    return True


_TAKEN_OVER: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose step applies directions
