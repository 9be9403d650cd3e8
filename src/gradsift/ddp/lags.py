"""LAGS-SGD in DDP: profile a few steps of a real model, plan per-layer ratios on every rank alike, apply them.

Timing comes from the model itself, so it works in any training script: a
forward pre-hook and hook on the wrapped module time the forward pass, a
post-accumulate-grad hook per parameter times when each gradient is ready, and
:meth:`GradsiftState.end_step` hands each profiled step to the schedule. The
profile is averaged over ranks (one all-reduce, outside the hook), the plan
(:class:`gradsift.route.layerwise.LagsSchedule`) is applied to the compressor, the
configuration check runs again, and rank 0 prints the plan.
"""

from __future__ import annotations

import time

import torch

from ..messages import say
from ..errors import ConfigError
from ..memory.factory import make_compressor
from ..route.layerwise import LagsSchedule, ReadyClock, c_upper, measure_selection
from ..runtime.consensus import average_over_ranks


class DdpLags:
    """The DDP runtime's LAGS controller (owned by its :class:`~gradsift.ddp.state.GradsiftState`)."""

    def __init__(self, state, module: torch.nn.Module, *, profile_steps: int = 3, skip_steps: int = 2, log=True):
        if state.granularity != "layer":
            raise ConfigError("LAGS compresses layer by layer: use granularity 'layer'")
        self.state = state
        self.log = log
        numels = {n: p.numel() for n, p in state.named}
        self.schedule = LagsSchedule([n for n, _ in state.named], numels, state.net, state.world_size,
                                     c_upper(state.settings.ratio), profile_steps=profile_steps, skip_steps=skip_steps)
        self.clock = ReadyClock(state.named)
        self.it = 0
        self._t0 = 0.0
        self._forward_s = 0.0
        self._handles = [module.register_forward_pre_hook(self._before_forward),
                         module.register_forward_hook(self._after_forward)]

    @property
    def ratios(self) -> dict[str, float] | None:
        return self.schedule.ratios

    def _before_forward(self, _module, _args) -> None:
        if self.schedule.wants(self.it):
            self._t0 = time.perf_counter()

    def _after_forward(self, _module, _args, _out) -> None:
        if self.schedule.wants(self.it):
            now = time.perf_counter()
            self._forward_s = now - self._t0
            self.clock.start(now)

    def after_step(self) -> None:
        it, self.it = self.it, self.it + 1
        if not self.schedule.wants(it) or not self.clock.active:
            return
        ready, _ = self.clock.stop()
        backward = max(ready.values(), default=0.0)  # computation ends when the last gradient is ready
        if self.schedule.add(self._forward_s, backward, ready):
            self.plan()

    def plan(self) -> None:
        st = self.state
        keys = self.schedule.keys
        select = measure_selection(lambda: make_compressor(st.settings.compressor, st.settings.ratio, feedback=False),
                                   [self.schedule.numels[k] for k in keys])
        ratios = self.schedule.plan(dict(zip(keys, select)), average=lambda v: average_over_ranks(v, st.group))
        for k, r in ratios.items():
            st.compressor.inner.set_layer_ratio(k, r)
        st.verify()
        self.stop()
        if self.log and st.rank == 0:
            say(self.schedule.describe())

    def reapply(self) -> None:
        """After a resume the plan comes back with the compressor state; stop profiling."""
        ratios = dict(self.state.compressor.inner.layer_ratios)
        if ratios:
            self.schedule.ratios = ratios
            self.stop()

    def stop(self) -> None:
        self.clock.remove()
        for h in self._handles:
            h.remove()
        self._handles = []

    def report(self) -> dict:
        return self.schedule.report()
