"""Momentum correction when the hook stands aside (:meth:`gradsift.ddp.state.GradsiftState.stand_aside`).

DGC's memory (``feedback.MomentumCorrection``) sends a tensor that goes whole
with plain momentum: each rank keeps a velocity ``u <- m u + g`` (Nesterov:
``u <- (u + g) m``, sent ``u + g``) and the ranks' velocities are averaged. By
linearity that is momentum on the mean gradient once every rank holds the mean
velocity, so after DDP's own all-reduce has averaged the gradients the velocity
can be advanced here, the same on every rank, and the compressor's state stays
what the hook would hold (a resumed run that goes through the hook again
continues from it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def momentum_whole(state) -> bool:
    """Momentum correction whose every tensor goes whole with nothing held back (its velocity sent in full), no
    local clipping, the gradient's own dtype on the wire, one round."""
    c = state.road.compressor
    if not getattr(c, "applies_momentum", False) or c.memory_options.get("clip", 0.0) > 0:
        return False
    if c.inner.value_dtype is not None or c.inner.ROUNDS != 1:
        return False
    named = state.named
    shapes = ([("model", (sum(p.numel() for _, p in named),), named[0][1].dtype)]
              if state.granularity == "model" else [(n, tuple(p.shape), p.dtype) for n, p in named])
    if not all(state.road.plan.decide(c, key, shape, dtype).dense for key, shape, dtype in shapes):
        return False
    return all(key in c.u and not bool(c.v[key].any()) for key, _, _ in shapes)


def average_velocity(state) -> None:
    """Every rank's velocity becomes the ranks' mean (one all-reduce): from now on each adds the mean gradient."""
    c = state.road.compressor
    keys = sorted(c.u)
    flat = torch.cat([c.u[k].reshape(-1) for k in keys])
    dist.all_reduce(flat, group=state.group)
    flat.div_(state.world_size)
    off = 0
    for k in keys:
        n = c.u[k].numel()
        c.u[k].copy_(flat[off:off + n].view_as(c.u[k]))
        off += n


def momentum_step(state) -> None:
    """Each parameter's ``.grad`` (the mean gradient) becomes what the hook would have sent: ``u <- m u + g``,
    sent ``u`` (Nesterov: ``u <- (u + g) m``, sent ``u + g``). Nothing for a method without momentum correction,
    nor for momentum 0 (``--optimizer sgd`` hands DGC momentum 0): ~1 ms a step on charlm's two ranks."""
    c = state.road.compressor
    if not getattr(c, "applies_momentum", False):
        return
    m, nesterov = c.memory_options["momentum"], c.memory_options["nesterov"]
    if m == 0:  # u <- g, sent g: the mean gradient already is what would be sent (and a hooked step sets u <- g)
        return
    if state.granularity == "model":
        u, off, views = c.u["model"], 0, []
        for _, p in state.named:
            views.append(u[off:off + p.numel()].view_as(p))
            off += p.numel()
    else:
        views = [c.u[n].view_as(p) for n, p in state.named]
    for (_, p), u in zip(state.named, views):
        if p.grad is None:
            continue
        g = p.grad
        if nesterov:
            u.add_(g).mul_(m)
            g.add_(u)
        else:
            u.mul_(m).add_(g)
            g.copy_(u)
