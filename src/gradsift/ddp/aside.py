"""Standing aside: once the route owner says the hook would only repeat DDP's own all-reduce
(:data:`gradsift.route.routing.ASIDE`), DDP's C++ all-reduce takes the steps, for every user of
:func:`gradsift.ddp.register` (plain scripts, the Lightning strategy, ``gradsift train``).

A DDP wrapper's communication hook cannot be removed, so :class:`Aside` builds a hookless *twin*: a second
``DistributedDataParallel`` of the same module with the same settings (no broadcast: the ranks' weights already
agree), and routes the user's wrapper's ``forward`` through it. A wrapper handles the backward pass of its own
forward only, so the hooked reducer stays idle from then on. The twin's buckets are one more gradient-sized
buffer. ``no_sync()`` on the user's wrapper carries over (its flag is read at every forward).

After each such step the hook adapter calls :meth:`Aside.close_step`: the non-finite rule of the road, read off
the averaged gradients (one min/max pass); momentum correction continued from the mean gradient
(:meth:`gradsift.memory.momentum.MomentumCorrection.step_from_mean`, after the ranks' velocities were averaged once on
the way in).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..messages import say
from ..payload import is_finite


def hookless_twin(ddp: DDP) -> DDP:
    """A second ``DistributedDataParallel`` of ``ddp.module`` with ``ddp``'s settings and no hook. A collective
    (the reducers' set-up): every rank builds it at the same step."""
    kw: dict[str, Any] = {"device_ids": ddp.device_ids, "output_device": ddp.output_device, "dim": ddp.dim,
                          "process_group": ddp.process_group,
                          "find_unused_parameters": ddp.find_unused_parameters,
                          "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "static_graph": ddp.static_graph}
    caps = list(getattr(ddp, "bucket_bytes_cap_list", None) or [])
    if caps:
        kw["bucket_cap_mb_list"] = [c / 2**20 for c in caps]
    elif not getattr(ddp, "bucket_bytes_cap_default", False):
        kw["bucket_cap_mb"] = ddp.bucket_bytes_cap / 2**20
    if hasattr(ddp, "forward_sync_buffers"):
        kw["forward_sync_buffers"] = ddp.forward_sync_buffers
    else:  # pragma: no cover - older torch
        kw["broadcast_buffers"] = ddp.broadcast_buffers
    try:
        return DDP(ddp.module, init_sync=False, **kw)
    except TypeError:  # pragma: no cover - a torch without init_sync: parameters are broadcast once (equal anyway)
        return DDP(ddp.module, **kw)


class Aside:
    """DDP's own all-reduce in place of the hook, for one hook state (module docstring)."""

    def __init__(self, state, ddp: DDP):
        self.state = state
        self.ddp = ddp
        c = state.road.compressor
        if c.applies_momentum:
            average_velocity(c, state.group, state.world_size)
        self.twin = hookless_twin(ddp)
        twin = self.twin

        def forward(*args, **kwargs):
            twin.require_backward_grad_sync = ddp.require_backward_grad_sync  # no_sync() on the user's wrapper
            if ddp.require_backward_grad_sync and torch.is_grad_enabled():
                state.core.opened()  # a step DDP's own all-reduce takes: the optimizer's step closes it
            return twin(*args, **kwargs)

        ddp.forward = forward
        if state.rank == 0:
            say(f"gradsift: every tensor goes whole from step {state.road.step + 1} on: DDP's own all-reduce takes "
                "the steps (the hook would only repeat it)")

    def close_step(self, loss: torch.Tensor | None) -> None:
        """The step DDP's own all-reduce took: the road's non-finite rule, then momentum correction's velocity."""
        st = self.state
        if not check_mean(st, loss):
            return
        c = st.road.compressor
        if c.applies_momentum:
            for key, mean, write in _means(st):
                c.step_from_mean(key, mean)
                write(mean)


def check_mean(state, loss: torch.Tensor | None) -> bool:
    """The road's non-finite rule on gradients DDP's own all-reduce averaged (one min/max pass, one host read):
    every rank sees the same sum, so every rank raises, or skips alike (gradients read NaN, as on the hook's
    path: a GradScaler skips the step and lowers its scale). ``loss`` names this
    rank when its own loss was not finite. True when the mean is finite."""
    grads = [p.grad for _, p in state.named if p.grad is not None and p.grad.numel()]
    if not grads or is_finite(torch.cat([torch.stack(torch.aminmax(g.reshape(-1))) for g in grads])):
        return True
    own = loss is not None and not is_finite(loss.detach().reshape(-1))
    state.road.nonfinite(f"rank {state.rank}" if own else "a rank", [n for n, _ in state.named],
                         "; summed by DDP's own all-reduce")
    for g in grads:  # (skip: nothing is applied; error: raised above)
        g.fill_(float("nan"))
    return False


def _means(st):
    """(key, flat mean gradient, write-back) per compression key: each parameter, or the whole model flattened."""
    params = [p for _, p in st.named]
    if st.settings.granularity == "model":
        flat = torch.cat([p.grad.reshape(-1) for p in params])

        def write(m: torch.Tensor) -> None:
            off = 0
            for p in params:
                p.grad.copy_(m[off:off + p.numel()].view_as(p.grad))
                off += p.numel()

        return [("model", flat, write)]
    return [(n, p.grad, lambda m: None) for n, p in st.named if p.grad is not None]  # (in place: u is viewed as it)


def average_velocity(c, group, world_size: int) -> None:
    """Every rank's velocity ``u`` becomes the ranks' mean (one all-reduce): from then on each advances it from
    the same mean gradient, which by linearity is what the hook's whole route computes."""
    keys = sorted(c.u)
    flat = torch.cat([c.u[k].reshape(-1) for k in keys])
    dist.all_reduce(flat, group=group)
    flat.div_(world_size)
    off = 0
    for k in keys:
        n = c.u[k].numel()
        c.u[k].copy_(flat[off:off + n].view_as(c.u[k]))
        off += n
