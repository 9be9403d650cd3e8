"""``linreg``: the distributed least-squares problem of REGTOP-k Sec. 4.1.

Worker n holds D points x ~ N(0, I_J) labelled by its own model
``y = x^T t_n + e`` with ``t_n ~ N(u_n, h^2 I)``, ``u_n ~ N(U, sigma^2)`` and
``e ~ N(0, epsilon)``. Training is full-batch gradient descent on half the mean
squared error, so worker n's gradient is ``X_n^T (X_n w - y_n) / D``; the
metric is the optimality gap ``||w - w*||`` against the least-squares solution
of all the data (the minimizer of the equally weighted global loss). Float64,
since the paper's curves go far below float32's floor (~2.5e-5).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .base import Task


class LinReg(Task):
    name = "linreg"
    metric = "opt_gap"
    higher_is_better = False
    defaults = {"lr": 0.01, "batch_size": 500, "steps": 3000, "optimizer": "sgd", "eval_every": 1}
    OPTIONS = {"points": 500, "dim": 100, "U": 0.0, "sigma2": 5.0, "h2": 1.0, "epsilon": 0.5}
    SUMMARY = "REGTOP-k Sec. 4.1 least squares, full-batch GD, float64; metric opt_gap = ||w - w*||"
    dtype = torch.float64

    def setup(self) -> None:
        o = self.options
        d, j = int(o["points"]), int(o["dim"])
        rng = np.random.default_rng([self.seed, 4001])
        xs, ys = [], []
        for _ in range(self.workers):
            u = rng.normal(o["U"], np.sqrt(o["sigma2"]))
            t = rng.normal(u, np.sqrt(o["h2"]), size=j)
            x = rng.normal(0.0, 1.0, size=(d, j))
            y = x @ t + rng.normal(0.0, np.sqrt(o["epsilon"]), size=d)
            xs.append(torch.from_numpy(x))
            ys.append(torch.from_numpy(y))
        self.xs, self.ys = xs, ys
        x_all, y_all = torch.cat(xs), torch.cat(ys)
        self.w_star = torch.linalg.lstsq(x_all, y_all.unsqueeze(1)).solution.squeeze(1)
        self.x_all, self.y_all = x_all, y_all
        # per-worker Gram matrices for the batched fast path: grad_n = (X_n^T X_n w - X_n^T y_n) / D
        self.gram = torch.stack([x.T @ x for x in xs]) / d  # (N, J, J)
        self.xty = torch.stack([x.T @ y for x, y in zip(xs, ys)]) / d  # (N, J)
        self.yy = torch.stack([y @ y for y in ys]) / d  # (N,)

    def make_model(self) -> nn.Module:
        m = nn.Linear(int(self.options["dim"]), 1, bias=False)
        nn.init.zeros_(m.weight)
        return m

    def batch(self, worker: int, step: int):
        return self.xs[worker], self.ys[worker]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()

    def all_gradients(self, model: nn.Module, step: int):
        """``X_n^T (X_n w - y_n) / D`` for every worker at once, from precomputed Gram matrices.

        The same gradient as autograd's, to float64 rounding; batch losses come from
        the same quadratic form (reported only, never used for selection).
        """
        with torch.no_grad():
            w = model.weight.detach().reshape(-1)
            gw = self.gram @ w  # (N, J)
            g = gw - self.xty
            losses = (0.5 * (w @ gw.T - 2 * self.xty @ w + self.yy)).tolist()
        return [[g[n].reshape(1, -1)] for n in range(self.workers)], losses

    def probe_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, (self.beside(model, self.x_all), self.beside(model, self.y_all))))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            w = model.weight.detach().reshape(-1).to(device=self.w_star.device, dtype=self.w_star.dtype)
            return {"opt_gap": float(torch.linalg.vector_norm(w - self.w_star))}
