"""Which parameters a DDP step used, for the rule of :mod:`gradsift.runtime.unused` (a parameter no rank used keeps its
memory).

Only for a DDP model built with ``find_unused_parameters=True`` or ``static_graph=True`` -- without either, DDP
needs every parameter used in every step. Two facts, neither costing a collective:

* **this rank's use**, while the hook runs: a post-accumulate-grad hook on every parameter marks it when its
  gradient is accumulated. Autograd calls it from the accumulation itself, before DDP's own hook on the same
  parameter, so when a bucket reaches gradsift's hook every used parameter of it is marked (``no_sync()``
  micro-steps mark too: a parameter used in any of them is used, as DDP counts it);
* **every rank's use**, after ``backward()``: DDP all-reduces its used map at the end of the backward pass and
  waits for it before the pass returns; ``reducer._get_local_used_map()`` then holds, per parameter in the
  reducer's order, how many ranks used it. It is read only when this rank left a parameter unused (one used
  everywhere is used here too, so only then can one be unused everywhere).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch


class Usage:
    """Marks of this rank's use per step, and DDP's count of every rank's (module docstring)."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], ddp):
        self.ddp = ddp
        ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        # the reducer's parameters: the module's, in named_parameters order, trainable when DDP was built
        self.order = [n for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignore]
        self.name_of = {id(p): n for n, p in named}
        self.used: set[int] = set()
        self._warned = False
        self.handles = [p.register_post_accumulate_grad_hook(self._mark) for _, p in named]

    def _mark(self, p: torch.Tensor) -> None:
        self.used.add(id(p))

    def unused_in(self, params: Sequence[torch.nn.Parameter]) -> list[str]:
        """The names of ``params`` (a bucket's) that this rank did not use in the step so far."""
        return [self.name_of[id(p)] for p in params if id(p) not in self.used and id(p) in self.name_of]

    def unused_everywhere(self) -> set[str]:
        """The parameters no rank used in the step just finished (after ``backward()``)."""
        counts = self.ddp.reducer._get_local_used_map()
        if counts.numel() != len(self.order):
            if not self._warned:
                self._warned = True
                warnings.warn(f"gradsift: DDP's used-parameter map has {counts.numel()} entries, the model "
                              f"{len(self.order)} trainable parameters: parameters no rank used cannot be told, so "
                              "their memory is not kept back", RuntimeWarning, stacklevel=3)
            return set()
        return {n for n, c in zip(self.order, counts.tolist()) if c == 0}

    def close(self, road) -> list[str]:
        """The step's end: the parameters no rank used get their memory back; the marks start afresh."""
        back = road.unused.restore(self.unused_everywhere()) if road.unused.pending else []
        self.used.clear()  # (the road drops what it saved when it closes the step)
        return back

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
