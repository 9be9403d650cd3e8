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
    """(x_train, y_train, x_test, y_test): the rows of scikit-learn's bundled ``digits.csv.gz`` in the order of
    ``digits_split.txt`` beside this file -- the split ``train_test_split(test_size=0.2, random_state=0,
    stratify=target)`` gives, read without importing scikit-learn (1.3 s of every process's start)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("the digits tasks read scikit-learn's bundled digits: pip install scikit-learn")
    data = np.loadtxt(Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz"), delimiter=",")
    x, y = (data[:, :-1] / 16.0).astype(np.float32), data[:, -1].astype(np.int64)
    rows = dict(line.split(" ", 1) for line in (Path(__file__).with_name("digits_split.txt")).read_text().splitlines()
                if not line.startswith("#"))
    train, test = (np.array(rows[k].split(), dtype=np.int64) for k in ("train", "test"))
    out = x[train], y[train], x[test], y[test]
    for a in out:
        a.setflags(write=False)  # cached: shared by every task instance
    return out


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
