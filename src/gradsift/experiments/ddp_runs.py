"""``gradsift train --runtime ddp`` with the benchmark tools plugged in: a PyTorch baseline instead of gradsift's
hook (``--torch-hook``, :mod:`gradsift.experiments.baselines`), and gradsift timed against DDP's own all-reduce in
the same processes (``--paired-ddp``, :mod:`gradsift.experiments.pairing`). The training loop itself
(:func:`gradsift.launch.train_ddp`) is the library's and knows neither."""

from __future__ import annotations

from typing import Any

from ..launch import train_ddp
from ..runtime.runconfig import RunConfig
from .baselines import Baseline
from .pairing import Pairing


def train(cfg: RunConfig, out=None, **kwargs: Any) -> dict[str, Any]:
    """:func:`gradsift.launch.train_ddp` for ``cfg``, its ``torch_hook`` and ``paired_ddp`` resolved."""
    baseline = Baseline(cfg.torch_hook, cfg.steps) if cfg.torch_hook is not None else None
    pairing = (lambda state, ddp: Pairing(cfg.paired_ddp, state, ddp)) if cfg.paired_ddp is not None else None
    return train_ddp(cfg, out, baseline=baseline, pairing=pairing, **kwargs)
