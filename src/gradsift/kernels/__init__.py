"""Selection at memory speed: exact top-k and thresholds from one histogram pass and one compaction pass.

Every top-k method (``topk``, ``regtopk``, ``rtopk``, DGC's last step) and SIDCo
select through this module. For a float32 vector of n entries:

1. **histogram** -- one pass counts the *keys* of the magnitudes: the top 16 bits
   of ``|x|``'s bit pattern, which order like the values (65,536 buckets, each
   2^-7 = 0.78% wide). With error feedback the pass first adds the gradient into
   the residual (``a = r + g``, in place): memory and selection share the pass.
2. the bucket holding the k-th largest magnitude (or a threshold's bucket) is
   read off the counts;
3. **compaction** -- a second pass writes, in index order, every entry of a
   higher bucket (index and value; with error feedback it zeroes them, which is
   ``residual = a - sent`` for those entries) and the indices of the boundary
   bucket's entries (the candidates);
4. an exact second level over the candidates' low 15 bits finishes: all
   entries above the k-th magnitude, then ties at it in index order.

The result is the exact top-k (the same set as ``torch.topk`` up to ties, which
go to the lowest indices), in a deterministic order. Two backends give
identical results: ``compiled`` (``select.c``, built with the machine's C
compiler on first use, POSIX threads, :mod:`gradsift.kernels.native`) and
``eager`` (the same steps in torch operations; also the path on GPUs, where
exact top-k instead finishes ``torch.topk``'s radix select: see ``_topk_gpu``).
``GRADSIFT_KERNELS=auto`` (default) uses ``compiled`` where it builds and
otherwise warns once and runs ``eager``; ``compiled`` or ``eager`` forces one.
Vectors under 65,536 entries, and dtypes other than float32, use ``torch.topk``
on both backends.

:mod:`gradsift.kernels.many` selects many tensors at once, most in one pass each
(a floor guessed from the previous call; this module's two passes when it misses).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from dataclasses import dataclass

import torch

from .native import KernelUnavailable, load

NB = 1 << 16
SHIFT = 15
LOW = (1 << SHIFT) - 1
SMALL = 1 << 16
FEW_CANDIDATES = 4096  # below this many candidates in the threshold bucket, sort them instead of counting
BACKENDS = ("auto", "compiled", "eager")

_state: dict = {"name": None, "lib": None, "reason": None}


def _resolve(want: str) -> None:
    if want not in BACKENDS:
        raise ValueError(f"GRADSIFT_KERNELS must be one of {', '.join(BACKENDS)}, got {want!r}")
    _state.update(name="eager", lib=None, reason=None)
    if want == "eager":
        return
    try:
        _state.update(name="compiled", lib=load())
    except KernelUnavailable as e:
        if want == "compiled":
            raise
        _state["reason"] = str(e)
        warnings.warn(f"gradsift: the compiled selection kernels are unavailable ({e}); using the eager path "
                      "(identical results, slower)", RuntimeWarning, stacklevel=3)


def backend() -> str:
    """``"compiled"`` or ``"eager"``: the backend selection runs on (resolved on first use)."""
    if _state["name"] is None:
        _resolve(os.environ.get("GRADSIFT_KERNELS", "auto"))
    return _state["name"]


@contextlib.contextmanager
def using(name: str):
    """Run a block on one backend (tests, benchmarks): ``with kernels.using("eager"): ...``."""
    old = dict(_state)
    _resolve(name)
    try:
        yield
    finally:
        _state.clear()
        _state.update(old)


def _ptr(t: torch.Tensor | None):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _compiled(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and backend() == "compiled"


def compiled_lib(x: torch.Tensor):
    """The compiled kernels' library where ``x`` lives on the CPU and the compiled backend is in use, else None."""
    return _state["lib"] if _compiled(x) else None


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), n >> 20, 64))


@dataclass
class AbsHistogram:
    """Counts of the magnitude keys: ``per_chunk[t, key]`` for each of the compaction's chunks."""

    per_chunk: torch.Tensor
    n: int
    keys: torch.Tensor | None = None  # eager: the keys, kept for the compaction

    @property
    def counts(self) -> torch.Tensor:
        return self.per_chunk[0] if self.per_chunk.shape[0] == 1 else self.per_chunk.sum(0)


def supported(x: torch.Tensor) -> bool:
    """Whether the histogram path applies: a contiguous float32 vector of at least 65,536 entries."""
    return x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous() and x.numel() >= SMALL


def abs_histogram(x: torch.Tensor, add: torch.Tensor | None = None) -> AbsHistogram:
    """One pass: the key histogram of ``|x|``; with ``add``, ``x += add`` first (in place, same pass)."""
    n = x.numel()
    if add is not None and (add.dtype != x.dtype or not add.is_contiguous() or add.numel() != n
                            or add.device != x.device):
        raise ValueError(f"abs_histogram: add must be a contiguous tensor of x's dtype, size and device; got "
                         f"{add.dtype} {tuple(add.shape)} on {add.device} for {x.dtype} ({n},) on {x.device}")
    if _compiled(x):
        nt = _threads(n)
        per = torch.zeros(nt, NB, dtype=torch.int64)
        if _state["lib"].gs_hist16(_ptr(x), _ptr(add), n, nt, _ptr(per)) < 0:
            raise MemoryError("gradsift selection kernel: out of memory for its histogram")
        return AbsHistogram(per, n)
    if add is not None:
        x.add_(add)
    keys = (x.view(torch.int32) & 0x7FFFFFFF) >> SHIFT
    counts = torch.bincount(keys.reshape(-1), minlength=NB).to(device="cpu", dtype=torch.int64)
    return AbsHistogram(counts[None], n, keys)


def accumulate(acc: torch.Tensor, grad: torch.Tensor) -> AbsHistogram | None:
    """``acc += grad`` for an exact :func:`topk` of ``acc`` next: fused with the histogram pass where that path
    uses one (the histogram, to pass on as ``hist``), a plain add where it does not (small or non-float32 vectors,
    and GPUs, where top-k finishes ``torch.topk``'s radix select) -- None then."""
    if supported(acc) and not acc.is_cuda:
        return abs_histogram(acc, add=grad)
    acc.add_(grad)
    return None


def _exclusive(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def _compact(x: torch.Tensor, hist: AbsHistogram, b: int, zero: bool):
    """(indices and values of keys > b, indices of keys == b), each in index order."""
    if hist.keys is None and _compiled(x):
        per = hist.per_chunk
        above_t, cand_t = per[:, b + 1:].sum(1), per[:, b].clone()
        na, nc = int(above_t.sum()), int(cand_t.sum())
        a_off, c_off = _exclusive(above_t).contiguous(), _exclusive(cand_t).contiguous()
        ai = torch.empty(na, dtype=torch.int64)
        av = torch.empty(na, dtype=torch.float32)
        ci = torch.empty(nc, dtype=torch.int64)
        _state["lib"].gs_compact16(_ptr(x), x.numel(), per.shape[0], b, _ptr(a_off), _ptr(c_off), _ptr(ai), _ptr(av),
                                   _ptr(ci), int(zero))
        return ai, av, ci
    keys = hist.keys if hist.keys is not None else (x.view(torch.int32) & 0x7FFFFFFF) >> SHIFT
    ai = torch.nonzero(keys > b).squeeze(1)
    ci = torch.nonzero(keys == b).squeeze(1)
    av = x[ai]
    if zero:
        x.index_fill_(0, ai, 0.0)
    return ai, av, ci


def _low_bits(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return (x[idx].view(torch.int32) & LOW).long()


def _largest_at_least(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """(the highest bucket b with at least k entries at or above it, the count strictly above it)."""
    top = counts.flip(0).cumsum(0)  # top[j]: entries in the j + 1 highest buckets (non-decreasing)
    j = int(torch.searchsorted(top, torch.tensor([k], dtype=top.dtype)))  # the first j with top[j] >= k
    return counts.numel() - 1 - j, int(top[j - 1]) if j > 0 else 0


def _top_candidates(x: torch.Tensor, cand: torch.Tensor, m: int) -> torch.Tensor:
    """The m candidates of largest magnitude (exact: low bits, then lowest index at ties), in index order."""
    if m >= cand.numel():
        return cand
    low = _low_bits(x, cand)
    if cand.numel() <= FEW_CANDIDATES:  # a stable sort of a few keys beats two passes over 32,768 bins
        first = torch.sort(low, descending=True, stable=True).indices[:m]  # ties: the lower index first
        return cand[torch.sort(first).values]
    b2, above = _largest_at_least(torch.bincount(low, minlength=LOW + 1).cpu(), m)
    eq = low == b2
    keep = (low > b2) | (eq & (torch.cumsum(eq, 0) <= m - above))
    return cand[keep]


def topk(x: torch.Tensor, k: int, *, hist: AbsHistogram | None = None,
         zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude of the flat ``x``: (int64 indices, values).

    ``zero`` zeroes them in ``x`` (error feedback: ``x`` is the accumulated
    gradient and becomes the residual). ``hist`` may come from a fused
    :func:`abs_histogram` pass over the same ``x``.
    """
    n = x.numel()
    if k >= n:
        idx, vals = torch.arange(n, device=x.device), x.clone()
        if zero:
            x.zero_()
        return idx, vals
    if not supported(x):
        idx = torch.topk(x.abs(), k, sorted=False).indices
        vals = x[idx]
        if zero:
            x.index_fill_(0, idx, 0.0)
        return idx, vals
    if x.is_cuda and hist is None:
        return _topk_gpu(x, k, zero)
    hist = hist if hist is not None else abs_histogram(x)
    b, above = _largest_at_least(hist.counts, k)
    ai, av, ci = _compact(x, hist, b, zero)
    chosen = _top_candidates(x, ci, k - above)
    vals = x[chosen]
    if zero:
        x.index_fill_(0, chosen, 0.0)
    return torch.cat([ai, chosen]), torch.cat([av, vals])


def topk_lowest_ties(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of ``mag`` (flat, non-negative), ties at the k-th going to the lowest indices: the
    entries above the k-th magnitude, then the lowest-index entries at it, each in index order -- the histogram
    path's set at any size (:func:`topk` leaves ties to ``torch.topk`` under 65,536 entries, in no set order)."""
    if k >= mag.numel():
        return torch.arange(mag.numel(), device=mag.device)
    idx = torch.topk(mag, k, sorted=False).indices
    kth = mag[idx].min()
    if not bool(torch.isfinite(kth)):  # (NaN or Inf at the k-th: no order among them to keep)
        return idx
    above = torch.nonzero(mag > kth).squeeze(1)
    return torch.cat([above, torch.nonzero(mag == kth).squeeze(1)[:k - above.numel()]])


def _bucket_floor(b: int) -> float:
    """The smallest magnitude whose key is ``b`` (float32 bits ``b << SHIFT``)."""
    return float(torch.tensor([b << SHIFT], dtype=torch.int32).view(torch.float32))


def _topk_gpu(x: torch.Tensor, k: int, zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk`'s result on a GPU, from ``torch.topk``'s radix select (a few passes there, where the eager
    histogram's 65,536-bin ``bincount`` and its compactions cost 25-50; ``gradsift bench select --device cuda``).

    ``torch.topk`` picks the set up to ties at the k-th magnitude, in no set order. Made identical to the CPU
    kernels: when it left out an entry tied at the k-th magnitude, the ties are re-chosen by lowest index
    (one more pass); the order is the histogram path's: entries of keys above the k-th magnitude's key, then
    those of its key, each in index order.
    """
    a = x.abs()
    idx = torch.topk(a, k, sorted=False).indices
    mag = a[idx]
    kth = mag.min()
    # the one host read: ties at the k-th left out by torch, and the k-th magnitude's bits (its key)
    left_out, bits = torch.stack(_tie_read(a, mag, kth)).tolist()
    return _topk_finish(x, k, a, idx, mag, kth, left_out, bits, zero)


def _tie_read(a: torch.Tensor, mag: torch.Tensor, kth: torch.Tensor) -> list[torch.Tensor]:
    return [(a == kth).sum() - (mag == kth).sum(), kth.view(torch.int32).long()]


def _topk_finish(x, k, a, idx, mag, kth, left_out: int, bits: int, zero: bool):
    n = x.numel()
    if left_out:  # the set is torch's only when every tie at the k-th is in it
        over = torch.nonzero(a > kth).squeeze(1)
        ties = torch.nonzero(a == kth).squeeze(1)[:k - over.numel()]
        idx = torch.cat([over, ties])
        mag = a[idx]
    # one sort of k keys: entries of the k-th's key go after those above it, each group in index order
    order = torch.sort(idx + n * (mag < _bucket_floor((bits >> SHIFT) + 1))).values
    idx = order - n * (order >= n)
    vals = x[idx]
    if zero:
        x.index_fill_(0, idx, 0.0)
    return idx, vals


def topk_each(xs, ks, *, zero: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`topk` of each flat ``x`` with its ``k``, for a GPU's group of tensors: :func:`_topk_gpu`'s steps for
    all of them with one host read between (one wait for the GPU per group, not one per tensor; the magnitudes in
    one ``_foreach_abs``). The same results as :func:`topk` one by one (tests/test_kernels.py holds it on the CPU's
    kernels, tests/test_cuda.py on a GPU); at most one extra copy of the group's magnitudes is alive at once."""
    out: list = [None] * len(xs)
    todo = [i for i, (x, k) in enumerate(zip(xs, ks)) if 0 < k < x.numel() and supported(x)]
    for i in set(range(len(xs))) - set(todo):
        out[i] = topk(xs[i], ks[i], zero=zero)
    if not todo:
        return out
    mags = torch._foreach_abs([xs[i] for i in todo])
    picked, reads = [], []
    for i, a in zip(todo, mags):
        idx = torch.topk(a, ks[i], sorted=False).indices
        mag = a[idx]
        kth = mag.min()
        picked.append((idx, mag, kth))
        reads += _tie_read(a, mag, kth)
    found = torch.stack(reads).view(-1, 2).tolist()
    for i, a, (idx, mag, kth), (left_out, bits) in zip(todo, mags, picked, found):
        out[i] = _topk_finish(xs[i], ks[i], a, idx, mag, kth, left_out, bits, zero)
    return out


def select_above(x: torch.Tensor, t: float, *, hist: AbsHistogram | None = None,
                 zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry with ``|x| > t`` (strict): (int64 indices, values); ``zero`` as in :func:`topk`."""
    t = max(float(t), 0.0)
    if not supported(x):
        idx = torch.nonzero(x.abs() > t).squeeze(1)
        vals = x[idx]
        if zero:
            x.index_fill_(0, idx, 0.0)
        return idx, vals
    tb = int(torch.tensor([min(t, 3.4028234663852886e38)], dtype=torch.float32).view(torch.int32))
    b, low_t = tb >> SHIFT, tb & LOW
    hist = hist if hist is not None else abs_histogram(x)
    ai, av, ci = _compact(x, hist, b, zero)
    chosen = ci[_low_bits(x, ci) > low_t]
    vals = x[chosen]
    if zero:
        x.index_fill_(0, chosen, 0.0)
    return torch.cat([ai, chosen]), torch.cat([av, vals])


_BUCKETS: dict[str, torch.Tensor] = {}


def bucket_values() -> torch.Tensor:
    """Each bucket's representative magnitude (float64, the middle of its bit range; 0 for bucket 0)."""
    v = _BUCKETS.get("mid")
    if v is None:
        keys = torch.arange(NB, dtype=torch.int64)
        bits = ((keys << SHIFT) | (1 << (SHIFT - 1))).to(torch.int32)
        v = bits.view(torch.float32).to(torch.float64)
        v[0] = 0.0
        v[keys >= (0x7F800000 >> SHIFT)] = 0.0  # Inf/NaN patterns: never in a finite input
        _BUCKETS["mid"] = v
    return v


__all__ = ["AbsHistogram", "KernelUnavailable", "abs_histogram", "accumulate", "backend", "bucket_values", "select_above",
           "supported", "topk", "using"]
