"""``powersgd``: PowerSGD, as PyTorch's ``powerSGD_hook`` runs it, for the simulator.

Vogels, Karimireddy, Jaggi. "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization." NeurIPS 2019; the steps and defaults of
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (torch 2.13),
read, not copied, so that a simulated run can be compared with a PyTorch user's
real one. Per tensor ``T`` (viewed as ``M = T.view(n, -1)``, n x m) and step:

* steps before ``start`` (PyTorch's ``start_powerSGD_iter``): plain all-reduce;
* then, with error feedback ``M <- M + e`` (the previous step's local error):
  tensors where ``(n + m) r * min_compression_rate >= n m`` are all-reduced
  whole; the others are compressed in two rounds:
  round 1 sends ``P = M Q`` (n x r), ``Q`` being the previous step's
  orthogonalized ``Q`` (warm start) or a fresh standard normal matrix the first
  time, orthogonalized; round 2 sends ``Q = M^T orth(mean P)`` (m x r); the
  result is ``orth(mean P) (mean Q)^T`` and the local error
  ``e = M - result`` (for whole tensors ``e = M - mean``, as PyTorch computes it
  over the bucket).

Options: ``approx_rank`` (PyTorch's ``matrix_approximation_rank``, 1), ``start``
(1000), ``min_compression_rate`` (2), ``warm_start`` (true), ``epsilon`` (0),
``error_feedback`` (true).

The random ``Q``: a ``numpy.random.RandomState(seed)`` per compressor gives one
``randint(1e9)`` per tensor at its first compressed step, the torch seed of its
``Q``. PyTorch draws one per *bucket* and then fills its tensors' ``Q`` from
that seed in order, so the two agree where a bucket holds one compressed
tensor (the test compares them so). Orthogonalization is Gram-Schmidt for
rank <= 2 (``epsilon`` guards zero columns), QR above, as in the hook.

Two dependent all-reduces per step: the simulator runs both rounds
(:meth:`gradsift.runtime.road.Road.advance`); in DDP a second collective would have to
start in a future callback, which hangs on gloo with several buckets, so DDP
runs use PyTorch's own hook (``--torch-hook powersgd``) instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import payload as P
from .base import Compressor
from .registry import register
from ..options import Option


def orthogonalize(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormal columns of ``m`` (n x r), in place for r <= 2 (Gram-Schmidt), QR above."""
    r = m.shape[1]
    if r > 2 and m.dtype not in (torch.float16, torch.bfloat16):
        m.copy_(torch.linalg.qr(m).Q)
        return m
    for i in range(r):
        col = m[:, i:i + 1]
        norm = torch.norm(col)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < r:
            rest = m[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
    return m


def beside_others(steps: int | None) -> dict[str, int]:
    """PowerSGD's options where it runs beside other methods (``gradsift train --compressor powersgd``, a race, the
    ``--torch-hook powersgd`` baseline), unless given: rank 2, and plain all-reduce for the first tenth of the
    ``steps`` (at least 2 steps: warm start and error feedback start from a plain one; 100 steps when unknown)."""
    return {"approx_rank": 2, "start": max(2, (steps or 100) // 10)}


@register
class PowerSGD(Compressor):
    SELECT_PASSES = 0.0  # read passes per selection (gradsift bench select; the wire plan's model)
    name = "powersgd"
    OPTIONS = {
        "approx_rank": Option.integer(1, lo=1, doc="the factors' rank (PyTorch's matrix_approximation_rank)"),
        "start": Option.integer(1000, lo=0, doc="plain all-reduce before this step (start_powerSGD_iter)"),
        "min_compression_rate": Option.number(2.0, lo=0.0, doc="all-reduce a matrix whole unless the factors are "
                                                               "this many times smaller"),
        "warm_start": Option.flag(True, doc="start each step's Q from the last one's"),
        "epsilon": Option.number(0.0, lo=0.0, doc="added to a column's norm when orthogonalizing"),
        "error_feedback": Option.flag(True, doc="keep what the factors miss for the next step"),
    }
    MEMORY = "none"  # its error feedback is PyTorch's, computed after the second round (``error_feedback``)
    EXACT_K = True
    ROUNDS = 2
    RATIO_REQUIRED = False
    SUMMARY = "PowerSGD (rank-r factors, two all-reduces), as PyTorch's powerSGD_hook; simulator only"

    def validate(self) -> None:
        self._seeds = np.random.RandomState(self.seed)

    def payload_kind(self) -> str:
        return P.DENSE

    def init_state(self, key: str, numel: int, device) -> dict[str, Any]:
        return {"error": None, "q": None, "phase": "plain"}

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        """Round 1: the plain tensor, or its P factor (its own rule decides: the wire plan never sends a
        multi-round method whole, so ``dense`` and ``native`` do not apply)."""
        flat = super().compress(key, grad, check_finite=check_finite, dense=True).values
        st = self.state(key, flat)
        step, st["step"] = st["step"], st["step"] + 1
        if step < self.options["start"] or flat.numel() == 0:
            st["phase"] = "plain"
            return P.dense(flat, flat.dtype)
        n = grad.shape[0] if grad.dim() else 1
        m = flat.numel() // n
        acc = flat.to(torch.float32) if st["error"] is None or not self.options["error_feedback"] else \
            flat.to(torch.float32) + st["error"]
        st["acc"] = acc
        r = min(n, m, self.options["approx_rank"])
        if (n + m) * r * self.options["min_compression_rate"] >= n * m:
            st["phase"] = "whole"
            return P.dense(acc, flat.dtype)
        if st["q"] is None or not self.options["warm_start"]:
            g = torch.Generator().manual_seed(int(self._seeds.randint(1_000_000_000)))
            st["q"] = torch.randn(m, r, generator=g).to(acc.device)
        q = orthogonalize(st["q"], self.options["epsilon"])
        st["phase"] = "p"
        p = acc.view(n, m) @ q
        return P.Payload(P.DENSE, p.reshape(-1), None, p.numel(), flat.dtype, p.numel())

    def next_round(self, key: str, sent: P.Payload, mean: torch.Tensor) -> P.Payload | None:
        """Round 2: Q = M^T orth(mean P); None when the tensor is done after round 1."""
        st = self.tensors[key]
        if st["phase"] != "p":
            return None
        m = st["q"].shape[0]
        n = st["acc"].numel() // m
        p = orthogonalize(mean.to(torch.float32).view(n, -1).clone(), self.options["epsilon"])
        st["p"], st["phase"] = p, "q"
        q = st["acc"].view(n, m).t() @ p
        return P.Payload(P.DENSE, q.reshape(-1), None, q.numel(), sent.grad_dtype, q.numel())

    def decode(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        """The tensor's mean gradient after the last round; the local error for the next step."""
        st = self.tensors[key]
        phase = st["phase"]
        if phase == "plain":
            return mean
        if phase == "q":
            q = mean.to(torch.float32).view(st["q"].shape).clone()
            st["q"] = q  # warm start: the next step's Q
            out = (st["p"] @ q.t()).reshape(-1)
        else:
            out = mean.to(torch.float32)
        if self.options["error_feedback"]:
            st["error"] = st["acc"] - out
        for k in ("acc", "p"):
            st.pop(k, None)
        return out.to(mean.dtype)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["seeds"] = self._seeds.get_state()
        return sd

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        super().load_state_dict(sd, reset_memory=reset_memory)
        self._seeds.set_state(sd["seeds"])

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        return {"tensors": super().checkpoint(keys, deep), "seeds": self._seeds.get_state()}

    def rollback(self, token: dict[str, Any]) -> None:
        super().rollback(token["tensors"])
        self._seeds.set_state(token["seeds"])
