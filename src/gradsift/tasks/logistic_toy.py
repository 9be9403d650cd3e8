"""``logistic-toy``: the motivating example of REGTOP-k Sec. 1.2.

Two workers, one point each: x1 = [100, 1], x2 = [-100, 1], both labelled 1;
weights w = [theta1, theta2], zero bias, w0 = [0, 1]; worker loss
``log(1 + exp(-<w, x_n>))``; lr 0.9; float64. The first gradient entries
cancel after averaging, so TOP-1 with error feedback sends only them and stays
at w0 until the second entry's accumulated error overtakes (about update 100).
The metric is the loss itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .base import Task, TaskError


class LogisticToy(Task):
    name = "logistic-toy"
    metric = "loss"
    higher_is_better = False
    defaults = {"lr": 0.9, "batch_size": 1, "steps": 100, "optimizer": "sgd", "eval_every": 1}
    SUMMARY = "REGTOP-k Sec. 1.2 two-point logistic regression (2 workers); metric: the loss"
    dtype = torch.float64

    def setup(self) -> None:
        if self.workers != 2:
            raise TaskError(f"logistic-toy is defined for exactly 2 workers, got {self.workers}")
        self.x = torch.tensor([[100.0, 1.0], [-100.0, 1.0]], dtype=torch.float64)

    def make_model(self) -> nn.Module:
        m = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.tensor([[0.0, 1.0]]))
        return m

    def batch(self, worker: int, step: int):
        return self.x[worker:worker + 1]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.softplus(-model(batch)).mean()

    def probe_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, self.beside(model, self.x)))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": self.probe_loss(model)}
