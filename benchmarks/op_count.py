"""Operations a bucket costs: the aten operations one worker's road dispatches for one group (selection, memory,
the value cast, coding, the exchange's local part, decoding, the sum), for a group of 10 tensors and one of 100
tensors of the same total size -- every method with its default memory, and the optimizer recipes (``RECIPES``), world
size 2, in process.

An operation the hook dispatches per tensor shows as growth from 10 to 100 tensors; on a GPU each is a kernel launch
(about 5-10 us), on a CPU a trip through the dispatcher. Work the compiled kernels do inside one call (``ctypes``)
dispatches nothing, so the count is of torch operations only.

    .venv/bin/python benchmarks/op_count.py
    .venv/bin/python benchmarks/op_count.py --methods topk sidco --entries 400000
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsift import available, make_compressor
from gradsift.runtime.road import Group, Road
from gradsift.transport.local import LocalGroup

METHODS = [m for m in available() if m != "powersgd"]  # (PowerSGD's two rounds: the simulator's road only)
# the recipes a runtime picks for an optimizer (register(..., optimizer=opt)): Adam's direction under AdamW, momentum
# correction under momentum SGD
RECIPES = ["topk:memory=adam", "sidco:memory=adam", "topk:memory=momentum"]


class Counter(TorchDispatchMode):
    """Counts every aten operation dispatched inside it (``views=False``: but views, which only describe memory:
    no kernel on a GPU, no pass over data)."""

    def __init__(self, views: bool = True):
        super().__init__()
        self.ops = 0
        self.views = views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += self.views or not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_group(spec: str, tensors: int, entries: int, ratio: float = 0.01, steps: int = 8,
                  whole: bool = False, views: bool = True) -> int:
    """The operations worker 0's road dispatches for one group of ``tensors`` equal tensors (``entries`` in all) at
    the last of ``steps`` steps (the first ones fill the memory and the guesses: at the third, top-k's floors still
    missed on most tensors of 2,000 entries, 7 operations a tensor; settled by the eighth). ``whole``: the group
    lives in one buffer, as a DDP bucket does, and goes whole (the route's ``whole`` mode, which a plan picks where
    whole steps are faster). ``views=False`` leaves views out of the count."""
    world = 2
    roads = [Road(make_compressor(spec, ratio, rank=r, world_size=world, seed=1)) for r in range(world)]
    for road in roads:
        road.routing.mode = "whole" if whole else road.routing.mode
    keys = [f"t{i}" for i in range(tensors)]
    n = entries // tensors
    link = LocalGroup(world)
    gen = torch.Generator().manual_seed(0)
    count = 0
    for step in range(steps):
        buffers = [torch.randn(n * tensors, generator=gen) for _ in range(world)]
        grads = [list(b.split(n)) for b in buffers]
        groups = [Group(list(keys), [g.shape for g in gs], torch.float32, lambda gs=gs: list(gs),
                        b if whole else None, gs if whole else None) for gs, b in zip(grads, buffers)]
        counter = Counter(views)
        with counter:
            t0 = roads[0].start(groups[0], link.endpoint(0))
        t1 = roads[1].start(groups[1], link.endpoint(1))
        with counter:
            roads[0].finish(t0, t0.pending.wait())
            roads[0].close_step()
        roads[1].finish(t1, t1.pending.wait())
        roads[1].close_step()
        count = counter.ops
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=METHODS + RECIPES)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--ratio", type=float, default=0.01)
    args = ap.parse_args()
    print(f"aten operations for one group of {args.entries:,} entries, ratio {args.ratio}, world size 2")
    print("| method | 10 tensors | 100 tensors | per added tensor |")
    print("|---|---|---|---|")
    for m in args.methods:
        a, b = ops_per_group(m, 10, args.entries, args.ratio), ops_per_group(m, 100, args.entries, args.ratio)
        print(f"| {m} | {a} | {b} | {(b - a) / 90:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
