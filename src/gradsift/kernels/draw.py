"""Counter-based draws: independent Bernoulli draws (:func:`bernoulli`) and random-k's k distinct positions
(:func:`draw_k`).

Bernoulli: ``i`` is kept when ``u_i < p[i]``, ``u_i`` a 24-bit
uniform on [0, 1) that is a function of (seed, i) alone (two rounds of the 32-bit "lowbias32" finalizer, keyed by
the seed's two halves; 32-bit arithmetic, so the compiled draw vectorizes).

The sampling methods (GS, RSB, GSB) draw one uniform per coordinate every step, identical on every worker. Torch's
``torch.rand`` over every entry, then a comparison and a ``nonzero``, took a third of GSB's step on ResNet-50's
shapes; the compiled draw is one read of ``p``. The torch twin computes the same mixing in int64 arithmetic on
32-bit values (products masked to 32 bits: no overflow), so both backends draw the same coordinates."""

from __future__ import annotations

import torch

from . import _compiled, _state

M1, M2 = 0x7FEB352D, 0x846CA68B
LOW32 = 0xFFFFFFFF


def _mix32(z: torch.Tensor) -> torch.Tensor:
    """The lowbias32 finalizer on the low 32 bits of int64 ``z`` (products taken mod 2^32)."""
    z = z ^ (z >> 16)
    z = (z * M1) & LOW32
    z = z ^ (z >> 15)
    z = (z * M2) & LOW32
    return z ^ (z >> 16)


def uniforms(n: int, seed: int, device=None) -> torch.Tensor:
    """The ``n`` uniforms of ``seed`` as float32 (the torch form of the compiled draw's ``u_i``)."""
    s0, s1 = seed & LOW32, (seed >> 32) & LOW32
    z = (torch.arange(n, dtype=torch.int64, device=device) + s0) & LOW32
    z = _mix32(_mix32(z) ^ s1)
    return (z >> 8).to(torch.float32) * 2.0 ** -24


def bernoulli(base: torch.Tensor, seed: int, scale: float = 1.0, expect: float | None = None) -> torch.Tensor:
    """The positions of the flat float32 ``base`` where ``u_i < min(scale * base[i], 1)`` (int64, ascending; the
    product in float32, the scale rounded to float32 as torch multiplies by a number), ``seed`` in [0, 2^63).
    ``expect``: about how many will be kept (the probabilities' sum), to size the output (a count beyond twice it
    draws again with room for all: the same positions)."""
    if base.dtype == torch.float32 and base.is_contiguous() and not base.is_cuda and base.dim() == 1 \
            and _compiled(base):
        n = base.numel()
        room = n if expect is None else min(n, int(2 * expect) + 4096)
        out = torch.empty(room, dtype=torch.int64)
        kept = int(_state["lib"].gs_bernoulli(base.data_ptr(), n, scale, seed, out.data_ptr(), room))
        if kept > room:
            out = torch.empty(kept, dtype=torch.int64)
            _state["lib"].gs_bernoulli(base.data_ptr(), n, scale, seed, out.data_ptr(), kept)
            return out
        return out[:kept].clone() if kept < room // 2 else out[:kept]
    p = base.reshape(-1).to(torch.float32).mul(scale).clamp_(max=1.0)
    return torch.nonzero(uniforms(p.numel(), seed, p.device) < p).squeeze(1)



KEY0, KEY1 = 0x9E3779B9, 0x85EBCA6B  # (select.c's: the keys' seed halves are the draw's, xor these)
MAX_DRAW_N = 1 << 31  # positions are coded in 31 bits of a key


def _hash(i: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    return _mix32(_mix32((i + s0) & LOW32) ^ s1)


def draw_k(n: int, k: int, seed: int, device=None) -> torch.Tensor:
    """k distinct positions of ``range(n)`` (``n < 2^31``), ascending, a function of (``seed``, n, k) alone: every
    worker with the seed draws the same, and the compiled form (``gs_draw_k``, also inside the selection pass)
    computes the same positions. Positions are drawn with replacement from two 32-bit hashes of the draw's count
    (``floor(h n / 2^64)``, h their 64 bits), in rounds of ``(k - d) + (k - d) // 8 + 16`` while fewer than k are
    distinct (d); of more, the k with the smallest keys ``H'(p) 2^31 + p`` stay (``H'`` a hash of the position): a
    uniformly random k-subset up to ties of the 32-bit ``H'`` (the lower position then stays). Where ``4 k > n``
    every position is keyed. The cost grows with k, not n (a ``randperm(n)`` cost 2-7x ``torch.topk`` on 2.6M
    entries)."""
    if not 0 < n < MAX_DRAW_N:
        raise ValueError(f"draw_k: n must be in [1, 2^31), got {n}")
    k = min(int(k), n)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if (device is None or torch.device(device).type == "cpu") and _compiled(torch.empty(0)):
        out = torch.empty(k, dtype=torch.int64)
        if int(_state["lib"].gs_draw_k(n, k, seed, out.data_ptr())) != k:
            raise MemoryError("gradsift draw: out of memory for its keys")
        return out
    s0, s1 = seed & LOW32, (seed >> 32) & LOW32
    if k == n:
        return torch.arange(n, dtype=torch.int64, device=device)
    if 4 * k > n:
        cand = torch.arange(n, dtype=torch.int64, device=device)
    else:
        cand, e = torch.empty(0, dtype=torch.int64, device=device), 0
        while cand.numel() < k:
            b = (k - cand.numel()) + (k - cand.numel()) // 8 + 16
            two_e = 2 * torch.arange(e, e + b, dtype=torch.int64, device=device)
            hi, lo = _hash(two_e, s0, s1), _hash(two_e + 1, s0, s1)
            cand = torch.unique(torch.cat([cand, (hi * n + ((lo * n) >> 32)) >> 32]))
            e += b
    if cand.numel() > k:
        keys = (_hash(cand, s0 ^ KEY0, s1 ^ KEY1) << 31) | cand
        cand = keys.sort().values[:k] & 0x7FFFFFFF
        cand = cand.sort().values
    return cand
