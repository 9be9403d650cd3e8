"""Shared machinery of the in-memory classification tasks (digits, MNIST-1D)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import ShardedData, Task, probe_indices


class InMemoryClassification(Task):
    """Train/test tensors in memory, sharded over workers; metric ``accuracy``."""

    metric = "accuracy"
    higher_is_better = True
    probe_size = 256

    def load(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, y_train, x_test, y_test) as numpy arrays."""
        raise NotImplementedError

    def setup(self) -> None:
        xtr, ytr, xte, yte = self.load()
        self.x_train = torch.tensor(xtr, dtype=self.dtype)
        self.y_train = torch.tensor(ytr, dtype=torch.long)
        self.x_test = torch.tensor(xte, dtype=self.dtype)
        self.y_test = torch.tensor(yte, dtype=torch.long)
        self.shards = ShardedData(len(self.x_train), self.workers, self.batch_size, self.seed)
        self.probe = torch.as_tensor(probe_indices(len(self.x_train), self.probe_size, self.seed))

    def batch(self, worker: int, step: int):
        idx = torch.as_tensor(self.shards.indices(worker, step))
        return self.x_train[idx], self.y_train[idx]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def probe_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            x, y = self.beside(model, self.x_train), self.beside(model, self.y_train)
            probe = self.beside(model, self.probe)
            return float(self.loss(model, (x[probe], y[probe])))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        with torch.no_grad():
            y_test = self.beside(model, self.y_test)
            logits = model(self.beside(model, self.x_test))
            acc = (logits.argmax(1) == y_test).double().mean().item()
            test_loss = F.cross_entropy(logits, y_test).item()
        model.train(was)
        return {"accuracy": acc, "test_loss": test_loss}
