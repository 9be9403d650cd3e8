"""What a training task gives the simulator and the DDP runtime.

A task owns its data and model definition. Everything it hands out is a
function of ``(seed, worker, step)``, so a run is reproducible and a resumed
run continues with the same batches (the data position is the step).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn


class TaskError(ValueError):
    """Bad task name, option or data; the message is one line."""


class Task:
    """Base class. Subclasses set the class attributes and implement the methods.

    ``metric``        name of the task metric in ``metrics.jsonl``
    ``higher_is_better``
    ``defaults``      default lr, batch_size, steps, optimizer, eval_every
    ``OPTIONS``       task options (``--task-option key=value``) and defaults
    """

    name: ClassVar[str] = ""
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = {}
    OPTIONS: ClassVar[dict[str, Any]] = {}
    SUMMARY: ClassVar[str] = ""
    dtype: torch.dtype = torch.float32

    def __init__(self, workers: int, seed: int = 0, batch_size: int | None = None,
                 data: str | None = None, **options: Any):
        if workers < 1:
            raise TaskError(f"workers must be >= 1, got {workers}")
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            allowed = ", ".join(self.OPTIONS) or "none"
            raise TaskError(f"{self.name}: unknown task option {sorted(unknown)[0]!r}; allowed: {allowed}")
        self.options = {**self.OPTIONS, **options}
        self.workers = workers
        self.seed = int(seed)
        self.batch_size = int(batch_size or self.defaults.get("batch_size", 32))
        if self.batch_size < 1:
            raise TaskError(f"batch size must be >= 1, got {self.batch_size}")
        self.data_path = data
        self.setup()

    # --------------------------------------------------------------- overrides
    def setup(self) -> None:
        """Load or generate data (called once from __init__)."""

    def make_model(self) -> nn.Module:
        raise NotImplementedError

    def batch(self, worker: int, step: int) -> Any:
        """Worker ``worker``'s batch for optimizer step ``step`` (0-based)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def probe_loss(self, model: nn.Module) -> float:
        """Training loss on a fixed probe set (all data for full-batch tasks)."""
        raise NotImplementedError

    def all_gradients(self, model: nn.Module, step: int) -> tuple[list[list[torch.Tensor]], list[float]] | None:
        """Optional fast path: every worker's gradients (in parameter order) and batch losses at once.

        Tasks with closed-form gradients (linreg) batch the workers into one
        tensor operation; the simulator then reports the batched time / N as each
        worker's compute time. ``None`` (the default) means: use autograd per worker.
        """
        return None

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """The task metric (and anything else worth logging) on held-out data."""
        raise NotImplementedError

    # ----------------------------------------------------------------- helpers
    def beside(self, model: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """``t`` on ``model``'s device (a GPU under NCCL). The task's fixed tensors (probe and held-out sets) are
        moved once per device and kept; tensors made per call are moved each time."""
        dev = next(model.parameters()).device
        if t.device == dev:
            return t
        cache = self.__dict__.setdefault("_beside", {})
        key = (id(t), dev)
        hit = cache.get(key)
        if hit is None or hit[0] is not t:
            hit = cache[key] = (t, t.to(dev))
        return hit[1]

    def build_model(self) -> nn.Module:
        """The model, initialized from the task seed without touching the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.make_model()
        return model.to(self.dtype)

    def describe(self) -> dict[str, Any]:
        return {"task": self.name, "workers": self.workers, "seed": self.seed,
                "batch_size": self.batch_size, "options": self.options, "data": self.data_path}


class ShardedData:
    """A training set split into one shard per worker, read in seeded epochs.

    The training set is permuted once (from the seed) and cut into ``workers``
    equal contiguous shards (the remainder is dropped). Worker w reads its shard
    in epochs; each epoch is a fresh permutation drawn from ``(seed, w, epoch)``.
    The batch of step s is positions ``[s*B, (s+1)*B)`` of that endless stream.
    """

    def __init__(self, n: int, workers: int, batch_size: int, seed: int):
        rng = np.random.default_rng([seed, 7919])
        order = rng.permutation(n)
        per = n // workers
        if per < 1:
            raise TaskError(f"{n} training examples cannot be split over {workers} workers")
        self.shards = [order[w * per:(w + 1) * per] for w in range(workers)]
        self.per = per
        self.batch_size = batch_size
        self.seed = seed
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _epoch(self, worker: int, epoch: int) -> np.ndarray:
        key = (worker, epoch)
        perm = self._perm_cache.get(key)
        if perm is None:
            if len(self._perm_cache) > 64:
                self._perm_cache.clear()
            perm = np.random.default_rng([self.seed, worker, epoch]).permutation(self.per)
            self._perm_cache[key] = perm
        return perm

    def indices(self, worker: int, step: int) -> np.ndarray:
        start = step * self.batch_size
        out = []
        pos = start
        end = start + self.batch_size
        while pos < end:
            epoch, off = divmod(pos, self.per)
            take = min(end - pos, self.per - off)
            out.append(self.shards[worker][self._epoch(worker, epoch)[off:off + take]])
            pos += take
        return np.concatenate(out)

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.per


def probe_indices(n: int, size: int, seed: int) -> np.ndarray:
    """A fixed subset of the training set for the per-step loss."""
    rng = np.random.default_rng([seed, 104729])
    return np.sort(rng.choice(n, size=min(n, size), replace=False))


def log_or_nan(x: float) -> float:
    return math.log(x) if x > 0 else float("nan")
