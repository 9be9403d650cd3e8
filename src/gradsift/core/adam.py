"""Adam's update compressed, not the gradient: gradsift's recipe for Adam-family optimizers, and its hand-off.

:class:`AdamDirection` is a memory (:mod:`gradsift.core.feedback`) any sparsifier may use (``memory=adam``);
:func:`take_over_adam` gives it the optimizer's moments so that Adam is applied once, by the workers, before the
exchange, and the optimizer only takes the averaged step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import payload as P
from ..compressors.base import Compressor, OptionError, as_bool, as_number, check_input
from ..errors import ConfigError
from .feedback import Memory, subtract_sent
from .narrow import NarrowResidual


class AdamDirection(NarrowResidual, Memory):
    """Each worker's Adam direction, sent with error feedback (``memory=adam``).

    Why: a sparsified gradient reaches Adam as spikes -- an entry sent once in T steps carries T steps of gradient
    -- and top-k picks entries by the gradient's scale, where Adam weighs every coordinate alike (measured on
    gptlm, 8 workers, ratio 0.01: validation loss 3.01 after 300 steps against dense AdamW's 2.07, and 3.11 even with
    the second moment of the true mean gradient; docs/recipes.md). Compressing the update instead, as 1-bit Adam and
    DeMo do in their ways, selects in Adam's own scale and keeps error feedback's sum exact. Per tensor, on each
    worker, with the optimizer's betas and eps (Kingma and Ba 2015, Algorithm 1)::

        g <- g min(1, clip / (sqrt(T) ||g||))                             [clip: the worker's gradient, per tensor]
        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2 ;  t <- t + 1
        m^ = m / (1 - b1^t) ;  v^ = v / (1 - b2^t)
        d  = n / (sqrt(s) + eps)                                          [the worker's Adam direction]
        e <- e + d ;  send select(e) ;  e <- e - sent                      [error feedback on the direction]

    and the optimizer applies ``p <- p (1 - lr wd) - lr (mean of what was sent)`` (:func:`take_over_adam`; AdamW's
    decoupled decay). Two deviations from Adam on the mean gradient, each measured (docs/recipes.md):

    - ``scale="mean"`` (default): ``s`` estimates the second moment of the *mean* gradient of the N workers from
      this worker's own: a worker's ``v^`` holds its batch's noise N times over. With ``w`` the running mean (b2) of
      ``m^ ** 2`` and ``r = (1 - b1) / (1 + b1)`` (the share of the noise a b1-average keeps): noise
      ``q = max(v^ - w^, 0) / (1 - r)``, ``s = max(w^ + (1/N - r) q, 0)``. Uncompressed (ratio 1), 8 workers train
      as dense AdamW does (2.065 against 2.074 after 300 steps); ``scale="worker"`` (``s = v^``) 2.251.
      With one worker ``s = max(v^, w^)``.
    - ``nesterov=true`` (default): ``n = b1 m^ + (1 - b1) g / (1 - b1^t)``, Adam's step with Nesterov's look-ahead
      (Dozat 2016, NAdam's form) -- as the momentum-SGD recipe, the look-ahead shortens the delay error feedback adds
      (2.14 against 2.21 after 300 steps); ``false``: ``n = m^``.

    ``clip`` > 0 bounds the worker's whole gradient norm by clipping each of its T tensors at ``clip / sqrt(T)``
    (T set by the runtime; a DDP hook sees one bucket at a time, so no rank knows its whole norm before sending):
    a script's ``clip_grad_norm_`` after backward would clip the averaged direction instead, which the optimizer
    applies as it is -- so under a DDP hook gradsift undoes that factor at the optimizer's step and sets ``clip`` to
    the script's max_norm from the next step (:mod:`gradsift.runtime.gradwatch`). ``masking`` zeroes ``m`` where an entry was sent (DGC's momentum factor masking; no gain
    measured). Tensors sent whole carry their direction and any residual exactly. Nothing is lost: everything sent
    plus ``e`` equals the sum of the directions.
    """

    memory_name = "adam"
    STORES = ("m", "v", "w", "residual", "t")
    UNSENT = "residual"
    OPTIONS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "scale": "mean", "nesterov": True, "masking": False,
               "clip": 0.0, "residual_dtype": "fp32"}
    applies_adam = True

    def __init__(self, compressor: Compressor, **options: Any):
        super().__init__(compressor, **options)
        o = self.memory_options
        try:
            for name in ("beta1", "beta2"):
                o[name] = float(as_number(name, o[name], lo=0.0, hi=1.0))
                if o[name] >= 1.0:
                    raise OptionError(f"{name} must be in [0, 1), got {o[name]!r}")
            o["eps"] = float(as_number("eps", o["eps"], lo=0.0))
            o["clip"] = float(as_number("clip", o["clip"], lo=0.0))
            as_bool("nesterov", o["nesterov"])
            as_bool("masking", o["masking"])
            if o["scale"] not in ("mean", "worker"):
                raise OptionError(f"scale must be mean or worker, got {o['scale']!r}")
            self.init_residual(o["residual_dtype"])
        except OptionError as e:
            raise OptionError(f"{compressor.name}: {e}") from None
        self.tensor_count = 1  # T of the clip: the runtime sets it (take_over_adam)

    def holds_back(self, keys) -> bool:
        return any(k in self.residual and bool(self.residual[k].any()) for k in keys)

    def continues_from_mean(self, keys) -> bool:
        """Never: each worker's direction comes from its own moments, which the mean gradient cannot continue."""
        return False

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        return self.accumulate_many([key], [flat])[0]

    def compress_many(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of a group: every tensor's moments and direction in a fixed number of
        ``torch._foreach_*`` operations (:meth:`accumulate_many`), then each tensor's selection."""
        c = self.compressor
        for key, grad in zip(keys, grads):
            check_input(c.name, key, grad)
        flats = [g.reshape(-1) for g in grads]
        accs = self.accumulate_many(keys, flats)
        return [self._send(k, f, a, False, False, None, False) for k, f, a in zip(keys, flats, accs)]

    def accumulate_many(self, keys, flats) -> list[torch.Tensor]:
        """The class docstring's update for every tensor of a group: each line one foreach operation over a chunk of
        the group's tensors (elementwise, so each tensor's numbers are exactly what one tensor at a time gives).
        Chunks hold about ``CHUNK`` entries, so the update's ten or so arrays stay in a core's cache between its
        operations: the operations grow with the group's bytes, not with its tensor count."""
        out: list[torch.Tensor] = []
        start, size = 0, 0
        for i, f in enumerate(flats):
            size += f.numel()
            if size >= self.CHUNK or i == len(flats) - 1:
                out += self._accumulate_chunk(keys[start:i + 1], flats[start:i + 1])
                start, size = i + 1, 0
        return out

    CHUNK = 1 << 15  # entries a chunk (:meth:`accumulate_many`): 10 fp32 arrays of it fit a 1 MiB cache

    def _accumulate_chunk(self, keys, flats) -> list[torch.Tensor]:
        o = self.memory_options
        gs = [f.to(P.accumulate_dtype(f.dtype)) for f in flats]
        if o["clip"] > 0:
            limit = o["clip"] / self.tensor_count ** 0.5
            norms = torch.stack(torch._foreach_norm(gs)).tolist()  # (one host sync for the group)
            gs = [g * (limit / n) if n > limit else g for g, n in zip(gs, norms)]
        for key, g in zip(keys, gs):
            if self.held(self.m, key, g) is None:
                self.m[key], self.v[key] = (torch.zeros_like(g) for _ in range(2))
                self.t[key] = torch.zeros((), dtype=torch.int64)
                if o["scale"] == "mean":
                    self.w[key] = torch.zeros_like(g)
            self.t[key] = self.t[key] + 1
        ms, vs = [self.m[k] for k in keys], [self.v[k] for k in keys]
        es = [self.residual_in(k, g) for k, g in zip(keys, gs)]
        ts = [int(self.t[k]) for k in keys]
        b1, b2 = o["beta1"], o["beta2"]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        c1s, c2s = [1 - b1 ** t for t in ts], [1 - b2 ** t for t in ts]
        mhs = torch._foreach_div(ms, c1s)
        if o["nesterov"]:
            ns = torch._foreach_mul(ms, b1)
            torch._foreach_add_(ns, gs, alpha=1 - b1)
            torch._foreach_div_(ns, c1s)
        else:
            ns = mhs
        ss = torch._foreach_div(vs, c2s)
        if o["scale"] == "mean":
            ws = [self.w[k] for k in keys]
            torch._foreach_mul_(ws, b2)
            torch._foreach_addcmul_(ws, mhs, mhs, value=1 - b2)
            whs = torch._foreach_div(ws, c2s)
            r = (1 - b1) / (1 + b1)
            torch._foreach_sub_(ss, whs)  # the noise: max(v^ - w^, 0) / (1 - r)
            torch._foreach_clamp_min_(ss, 0)
            torch._foreach_div_(ss, 1 - r)
            torch._foreach_add_(whs, ss, alpha=1 / self.compressor.world_size - r)
            torch._foreach_clamp_min_(whs, 0)
            ss = whs
        torch._foreach_sqrt_(ss)
        torch._foreach_add_(ss, o["eps"])
        torch._foreach_addcdiv_(es, ns, ss)
        return es

    def _accumulate_one(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """:meth:`accumulate_many`'s update for one tensor, written out (the reference the tests compare with)."""
        o = self.memory_options
        g = flat.to(P.accumulate_dtype(flat.dtype))
        if o["clip"] > 0:
            limit = o["clip"] / self.tensor_count ** 0.5
            norm = float(torch.linalg.vector_norm(g))
            if norm > limit:
                g = g * (limit / norm)
        if self.held(self.m, key, g) is None:
            self.m[key], self.v[key] = (torch.zeros_like(g) for _ in range(2))
            self.t[key] = torch.zeros((), dtype=torch.int64)
            if o["scale"] == "mean":
                self.w[key] = torch.zeros_like(g)
        m, v, e = self.m[key], self.v[key], self.residual_in(key, g)
        self.t[key] = self.t[key] + 1
        t = int(self.t[key])
        b1, b2 = o["beta1"], o["beta2"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        mh = m / c1
        n = (m * b1).add_(g, alpha=1 - b1).div_(c1) if o["nesterov"] else mh
        s = v / c2
        if o["scale"] == "mean":
            w = self.w[key]
            w.mul_(b2).addcmul_(mh, mh, value=1 - b2)
            wh = w / c2
            r = (1 - b1) / (1 + b1)
            noise = s.sub_(wh).clamp_(min=0).div_(1 - r)
            s = wh.add_(noise, alpha=1 / self.compressor.world_size - r).clamp_(min=0)
        return e.addcdiv_(n, s.sqrt_().add_(o["eps"]))

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        masking = sent.kind != P.DENSE and self.memory_options["masking"]
        self.keep_residual(key, subtract_sent(acc, sent, self.m[key] if masking else None))


def adam_recipe_spec(spec: str, optimizer: torch.optim.Optimizer | None, cls) -> str | None:
    """The spec with ``memory=adam`` when gradsift's Adam recipe applies: an Adam-family optimizer
    (:class:`torch.optim.AdamW`, or :class:`torch.optim.Adam` without weight decay), a method whose memory is
    error feedback (or DGC's momentum correction, which is defined for SGD) and a spec that names no memory.
    None when it does not apply."""
    from ..compressors import parse_spec
    if not adam_family(optimizer):
        return None
    _, opts = parse_spec(spec)
    if cls.MEMORY not in ("ef", "momentum") or "memory" in opts or "feedback" in opts:
        return None
    if "momentum" in opts:  # momentum correction's
        return None
    return spec + (",memory=adam" if ":" in spec else ":memory=adam")


def adam_family(optimizer) -> bool:
    """AdamW, or Adam without (L2-coupled) weight decay: the optimizers whose step the recipe reproduces."""
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    return isinstance(optimizer, torch.optim.Adam) and not any(g.get("weight_decay", 0.0) for g in optimizer.param_groups)


def take_over_adam(memory, optimizer: torch.optim.Optimizer, *, tensors: int = 1, clip: float | None = None) -> bool:
    """The one hand-off between :class:`AdamDirection` and the optimizer: Adam is applied once.

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
            for p in g["params"]:
                if p.grad is None:
                    continue
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(p.grad.to(p.dtype), alpha=-lr)
                p.grad = None

    optimizer.register_step_pre_hook(apply_direction)
    _TAKEN_OVER.add(optimizer)
    return True


def hand_clip_over(state, optimizer, clip: float | None) -> bool:
    """A framework's gradient clipping (``gradsift train --clip-norm``, the Trainer's ``max_grad_norm``, Lightning's
    ``gradient_clip_val``) handed to the workers when ``state`` (a registered rank) sends Adam's direction: they clip
    their own gradients (:class:`AdamDirection`'s ``clip``), and the caller must then stop clipping the averaged
    direction. Returns whether it was handed over (nothing to do otherwise)."""
    comp = getattr(state, "compressor", None)
    if comp is None or not comp.applies_adam or not clip or clip <= 0 or optimizer is None:
        return False
    take_over_adam(comp, optimizer, tensors=len(state.tensors), clip=float(clip))
    return True


_TAKEN_OVER: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose step applies directions
