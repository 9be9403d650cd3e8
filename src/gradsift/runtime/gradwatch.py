"""What a training script did to ``p.grad`` between the hook and the optimizer's step, where it matters.

Under the Adam recipe (``memory=adam``) the hook writes the averaged Adam *direction* into ``p.grad`` (entries
near +-1), and the optimizer applies it as it is. A script written for plain DDP changes ``p.grad`` after
``backward()``: ``clip_grad_norm_(params, 1.0)`` scales every gradient by one factor, which on the direction shrinks
the step by about the square root of the parameter count -- the model never trains, and nothing says so.

:class:`WrittenGrads` records two figures of every tensor the hook wrote (its L2 norm and its largest entry: on a CPU
one compiled read of each tensor, elsewhere one ``torch._foreach_*`` reduction each a bucket) and compares them at
the optimizer's pre-step (:meth:`WrittenGrads.check`):

- **unchanged** (every ratio 1): nothing to do;
- **one factor c on every tensor** (``clip_grad_norm_``, a loss scaler's ``unscale_``, a script's own rescaling):
  Adam's step does not depend on its gradient's scale, so the factor is undone (``p.grad /= c``) and the optimizer
  applies the direction the workers computed. Where c < 1 and is not a power of two, it is read as
  ``clip_grad_norm_``'s: ``c = max_norm / (||d|| + 1e-6)`` gives the script's ``max_norm`` (L2 norm), and each
  worker's gradient is clipped before its Adam instead, from the next step (:func:`gradsift.memory.adam_step.hand_clip_over`)
  -- where the clip belongs (its effect on Adam is through the moments). Said once on rank 0;
- **anything else** (``clip_grad_value_``, a subset of tensors changed, a second ``backward()`` adding into the
  gradients, gradient surgery): :class:`~gradsift.errors.ConfigError` on every rank (each rank reads the same mean),
  one line naming what changed and the ways out.

Where ``p.grad`` is a mean gradient (error feedback, momentum correction) nothing is watched: a script may change
it as it would without gradsift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels.figures import figures_many
from ..messages import say, warn
from ..memory.adam_step import hand_clip_over
from ..errors import ConfigError
from .consensus import max_over_ranks

TOLERANCE = 1e-4  # relative: two reductions of the same numbers in another order, or one rounding of a product


class WrittenGrads:
    """Per-tensor figures of the gradients the hook wrote this step, keyed by parameter name; ``params`` maps each
    name to its parameter (whose ``.grad`` the optimizer reads)."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params
        self._records: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []

    def record(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """The tensors ``grads`` (in ``names``' order) as the hook left them: two foreach reductions, two stacks.
        Buckets finish on several of the backend's threads at once: each record is one append (atomic)."""
        if grads:
            self._records.append((list(names), *_figures(grads)))

    def clear(self) -> None:
        self._records = []

    def check(self) -> "Rescaled | None":
        """Compare ``p.grad`` with what was recorded, then forget the record. Returns None when nothing changed, or
        the common factor by which every gradient was scaled (already undone: ``p.grad`` holds the written values
        again). Raises :class:`ConfigError` for any other change."""
        records = self._records
        self.clear()
        if not records:
            return None
        names = [n for r in records for n in r[0]]
        l2, top = [r[1] for r in records], [r[2] for r in records]
        grads = [self.params[n].grad for n in names]
        kept = [i for i, g in enumerate(grads) if g is not None]  # a gradient set to None is not applied: allowed
        if not kept:
            return None
        grads = [grads[i] for i in kept]
        at = torch.tensor(kept)
        was_l2, was_top = torch.cat(l2)[at], torch.cat(top)[at]
        now_l2, now_top = _figures(grads)
        nonzero = was_l2 > 0
        if bool((now_l2[~nonzero] != 0).any()):
            raise ConfigError(_changed_line(f"{int((now_l2[~nonzero] != 0).sum())} tensor(s) the hook left at zero "
                                            "hold a gradient at the optimizer's step"))
        if not bool(nonzero.any()):
            return None
        topped = was_top != 0
        ratios = torch.cat([now_l2[nonzero] / was_l2[nonzero], now_top[topped] / was_top[topped]])
        c = float(ratios.median())
        tol = max(TOLERANCE, 8 * max(torch.finfo(g.dtype).eps for g in grads))  # (bf16 gradients round c * g)
        if not (c > 0 and math.isfinite(c)) or not bool(((ratios - c).abs() <= tol * c).all()):
            spread = f"{float(ratios.min()):.4g} to {float(ratios.max()):.4g}"
            raise ConfigError(_changed_line(f"the gradients changed by different factors, {spread} of what the hook "
                                            "wrote (clip_grad_value_, a change to some tensors, a second backward?)"))
        if c == 1.0 or (abs(c - 1.0) <= tol and bool((ratios == 1.0).any())):
            return None  # (the same numbers, reduced in another order)
        torch._foreach_div_(grads, c)
        return Rescaled(c, float(was_l2.square().sum().sqrt()))


@dataclass(frozen=True)
class Rescaled:
    """Every gradient the hook wrote was scaled by ``factor`` (now undone); ``written_norm``: their L2 norm as
    written (``clip_grad_norm_``'s total norm)."""

    factor: float
    written_norm: float

    @property
    def clip(self) -> float | None:
        """The ``max_norm`` of a ``clip_grad_norm_`` that applied this factor (L2; ``factor = max_norm / (norm +
        1e-6)``), to 4 significant digits; None where the factor is no clip's (1 or more, or a power of two: a loss
        scaler's ``unscale_``)."""
        e = math.log2(self.factor)
        if self.factor >= 1.0 or abs(e - round(e)) < 1e-6:
            return None
        return float(f"{self.factor * (self.written_norm + 1e-6):.4g}")


def undo_rescaling(rank, optimizer) -> None:
    """At the optimizer's pre-step, under the Adam recipe (``rank.watch`` set): a factor the script applied to every
    gradient after ``backward()`` is undone, and a ``clip_grad_norm_``'s max_norm clips each rank's own gradient
    from the next step (:func:`gradsift.memory.adam_step.hand_clip_over`; one value on every rank), said once on rank 0;
    any other change stops the script in one line (:meth:`WrittenGrads.check`)."""
    scaled = rank.watch.check()
    if scaled is None:
        return
    comp = rank.road.compressor
    clip, own = scaled.clip, comp.memory_options["clip"]
    if clip is not None and not own:
        if rank.world_size > 1:  # each rank read it off its own sums: one value for all
            clip = max_over_ranks([clip], getattr(rank.transport, "group", None))[0]
        hand_clip_over(rank, optimizer, clip)
        if rank.global_rank == 0:
            say(f"gradsift: clip_grad_norm_ after backward() scaled the averaged Adam direction in p.grad by "
                f"{scaled.factor:.3g} (max_norm={clip:g}), which would stall training: gradsift undoes that factor "
                f"at every step and clips each rank's own gradient before its Adam instead, from step "
                f"{rank.step + 1} on ({comp.name}:clip={clip:g}; give that to register and drop the call to "
                "silence this)")
        rank.rescaling_said = True
    elif not getattr(rank, "rescaling_said", False):
        rank.rescaling_said = True
        if rank.global_rank == 0:
            why = (f"the ranks clip as {comp.name}:clip={own:g} says" if own
                   else "Adam's step does not depend on its gradient's scale")
            warn(f"gradsift: p.grad was scaled by {scaled.factor:.3g} after backward() (clip_grad_norm_, a loss "
                 f"scaler's unscale_?); under the Adam recipe it holds the averaged Adam direction: gradsift undoes "
                 f"the factor at every step ({why})")


def _figures(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's L2 norm and its largest entry (a factor c > 0 scales both by c; a clamp or a change to some
    entries does not), as two fp64 CPU vectors. Float32 CPU gradients: both in one compiled read of each
    (:func:`gradsift.kernels.figures.figures_many`; the record and the check read the same way, so unchanged
    gradients give the same bits). Elsewhere: the norm summed in fp32 (fp64 where a gradient is fp64), one foreach
    reduction each and a stack. (The largest entry, not the largest magnitude: the infinity norm's foreach runs
    tensor by tensor on a CPU, 9 ms for 150 tensors against about 1 ms.) An empty tensor's largest entry is taken
    as 0."""
    got = figures_many(grads)
    if got is not None:
        return got
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    with torch.no_grad():
        l2 = torch.stack(torch._foreach_norm(grads, 2, dtype=wide)).double().cpu()
        if all(g.numel() for g in grads) and len({g.dtype for g in grads}) == 1:
            top = torch.stack(torch._foreach_max(grads)).double().cpu()
        else:  # (tensor by tensor)
            top = torch.tensor([float(g.max()) if g.numel() else 0.0 for g in grads], dtype=torch.float64)
    return l2, top


def _changed_line(what: str) -> str:
    return ("gradsift: p.grad changed between backward() and optimizer.step(): " + what + "; under the Adam recipe "
            "p.grad holds the averaged Adam direction, which the optimizer applies as it is, so gradsift stops "
            "rather than apply it changed: clip with clip_grad_norm_ (gradsift moves it to the workers) or the "
            "method's clip=C option, make other changes to the loss or before backward, or compress the gradient "
            "itself with memory=ef (or recipe=False), where p.grad is the mean gradient a script may change")
