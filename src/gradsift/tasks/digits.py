"""``digits-mlp`` and ``digits-cnn``: scikit-learn's bundled 8x8 digits (1797 images).

Fixed split: 20% test, stratified, ``random_state=0`` (independent of the run
seed, so every run is scored on the same 360 images). Pixels are scaled to
[0, 1]. Metric: accuracy on the test split.
"""

from __future__ import annotations

import functools

import numpy as np
from torch import nn

from .base import TaskError
from .classify import InMemoryClassification


@functools.lru_cache(maxsize=1)
def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=0, stratify=d.target)
    for a in (xtr, ytr, xte, yte):
        a.setflags(write=False)  # cached: shared by every task instance
    return xtr, ytr, xte, yte


class DigitsMLP(InMemoryClassification):
    name = "digits-mlp"
    defaults = {"lr": 0.1, "batch_size": 32, "steps": 300, "optimizer": "sgd", "eval_every": 25}
    OPTIONS = {"hidden": 64, "dtype": "float32"}
    SUMMARY = "sklearn 8x8 digits, MLP 64-hidden-10 (no batch statistics); metric accuracy"

    def setup(self) -> None:
        dt = self.options["dtype"]
        if dt not in ("float32", "float64"):
            raise TaskError(f"dtype must be float32 or float64, got {dt!r}")
        import torch

        self.dtype = torch.float64 if dt == "float64" else torch.float32
        super().setup()

    def load(self):
        return load_digits_split()

    def make_model(self) -> nn.Module:
        h = int(self.options["hidden"])
        return nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))


class DigitsCNN(InMemoryClassification):
    name = "digits-cnn"
    defaults = {"lr": 0.05, "batch_size": 32, "steps": 300, "optimizer": "momentum", "eval_every": 25}
    SUMMARY = "sklearn 8x8 digits, 2-conv CNN (~38k parameters); metric accuracy"

    def load(self):
        xtr, ytr, xte, yte = load_digits_split()
        return xtr.reshape(-1, 1, 8, 8), ytr, xte.reshape(-1, 1, 8, 8), yte

    def make_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )
