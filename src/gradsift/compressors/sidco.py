"""``sidco``: threshold sparsification from fitted sparsity-inducing distributions.

Abdelmoniem, Elzanaty, Alouini, Canini. "An Efficient Statistical-based Gradient
Compression Technique for Distributed Training Systems." MLSys 2021
(sidco-sparsity-inducing-distributions.md).

Instead of sorting, fit a distribution to |g| and send the entries above the
quantile that leaves a fraction ``ratio`` (Lemma 1, eq. (4):
``eta = F^{-1}_{|G|}(1 - delta)``). Three fits (``dist``):

``exp``    double exponential: ``eta = mean(|g|) * log(1/delta)`` (Corollary 1.1,
           eq. (6)); later stages fit the exceedances shifted by the previous
           threshold with the same law (Corollary 2.1, eqs. (10)-(11)).
``gp``     generalized Pareto by moment matching: with m, v the mean and
           (unbiased) variance of the shifted data, shape
           ``xi = (1 - m^2/v) / 2``, scale ``beta = m (m^2/v + 1) / 2``, and
           ``eta = beta / xi * (delta^-xi - 1) + eta_prev`` (Lemma 2, eqs. (7)-(9);
           Corollary 1.3, eqs. (28)-(29)).
``gamma``  double gamma for the first stage (Corollary 1.2, eq. (16): Minka's
           closed-form shape ``alpha = (3 - s + sqrt((s-3)^2 + 24 s)) / (12 s)``,
           ``s = log mean - mean log``, ``beta = mean / alpha``), generalized Pareto
           after it (Sec. 2.4: "gamma-GP").

Multi-stage (Sec. 2.4): stage 1 keeps ``first_ratio`` (0.25) of the entries;
each later stage fits the exceedances of the previous threshold and keeps a
fraction of them, the remaining ratio split evenly in log space, so the product
is the target. The last threshold selects from the whole tensor, strictly
(``|g| > eta``), and the original values are sent.

How it is computed. **One pass** per tensor once a tensor has been seen
(:func:`gradsift.kernels.many.scan_many`, the tensors of a group in one call): with
error feedback it adds the gradient into the residual, records the entries above a
*floor* guessed from the last call's threshold (about 2k candidates), and gathers
the count and sums (and squares, for ``gp``) of the magnitudes above a few
*levels*: zero, and one just under each stage threshold of the last call's chain
(:class:`gradsift.kernels.moments.Levels`; exact integer sums of the magnitudes
rounded to 2^-18 of the largest, the same on both kernel backends). A stage's
statistics then come from the candidates at or above the floor
(:class:`gradsift.compressors.histstats.ScanStats`), and from the highest level at
or below its threshold under it; the selection is taken from the candidates. On
the compiled backend the pass itself works out the floor and the levels from the
tensor's state, then finds the threshold, selects, zeroes and learns the next state,
right after each tensor (``sd_in_scan`` in ``select.c``: the same float64 operations
as :meth:`SIDCo.threshold` and :class:`~gradsift.kernels.guess.Guess`, which the eager
backend runs: both send the same and keep the same state); no Python runs per tensor
but the state's copy in and out.
**Two passes** on a tensor's first call, for the gamma fit (its sum of logs) and on
GPUs: a histogram of the magnitudes (65,536 buckets of relative width 2^-7; the same
pass accumulates), every stage's statistics read off it (bucket midpoints), then a
pass that selects. No sort either way.

**Algorithm 1 as printed** (``paper=true``): the per-stage ratios fixed (``first_ratio``, then the rest of the
target split evenly in log space), every stage fitted on the actual exceedances of the previous threshold (one
filtering pass each, over what the last one kept), the stage count ``M`` adapted once per window of ``window``
(Q = 5) calls from the mean count selected over it, every entry with ``|g| >= eta_M`` sent, no correction and no
exclusion of exact zeros; gamma by eq. (15)'s closed form, as the algorithm prints it. Costs 2 + M read passes. The
options ``dist``, ``stages`` (the starting M), ``first_ratio``, ``adapt``, ``eps_h``, ``eps_l`` mean the same;
``correct`` does not apply. Its count is unbounded until the window adapts: the wire has room for 4k (what a
threshold selects beyond it returns to error feedback, counted as ``overflow``).

The default (``paper=false``) deviates from the printed algorithm, each for a measured reason:

* **Exact zeros are not fitted.** The fits model ``|g|`` of a continuous
  gradient; whole-model vectors of real models hold many exact zeros (an
  embedding's untouched rows: most of its entries), which drag every fitted
  quantile towards zero. Stage 1 fits the non-zero entries and aims at ``k``
  of them.
* **Each stage aims at the count actually left.** The paper's schedule assumes
  every stage keeps exactly its share; when a fit misses (mixed layer scales in a
  whole-model vector), every later stage inherits the miss and the product is
  off by it (we measured 0.06-0.67 of the target on real whole-model gradients).
  Here stage i's ratio is ``(k / n_i)^(1/(stages left))`` with ``n_i`` the count
  above the previous threshold, read from the histogram: later stages correct
  earlier misses.
* **Stage adaptation inside the call.** Algorithm 1 adapts the stage count over
  windows of Q calls because each stage costs a pass over the data. Here every
  stage count's final count is known from the histogram before selecting, so
  the call tries stage counts outward from the previous call's (within
  ``[1, ceil(log(ratio)/log(0.5))]``) and takes the first whose count lies in
  ``[1 - eps_l, 1 + eps_h] k``, else the closest; the next call starts from it.
  Estimation is therefore right from the first call (the window version needed
  several windows on mixed-scale vectors). ``adapt=false`` keeps ``stages`` fixed.
* **A correction when every fit misses.** On wordlm's whole-model gradient
  (45% exact zeros, a bulk near 2e-6, dense layers 100x larger) every chain, any
  stage count, selected about half of k at ratio 0.1 (stages only raise the
  threshold, and the first overshoots). Then the threshold moves between the
  closest thresholds seen on either side of k -- the exponential tail through
  the two bracketing counts, alternating with their geometric midpoint, each
  count read off the histogram -- until the count is within half the band
  (:meth:`SIDCo.correct`). ``correct=false`` keeps the fitted estimate.
* Gamma threshold: the exact quantile ``beta * P^{-1}(alpha, 1 - delta)``
  (eq. (14)), by Newton's method on the regularized incomplete gamma function
  -- not eq. (15)'s closed form, which needs ``alpha <= 1`` while Gaussian input
  gives about 1.36. The authors' code mixes the two.
* Statistics come from bucket midpoints: each magnitude is represented to within
  0.4%, so means and variances are too; the count above a threshold is exact up
  to the one bucket it falls in.
* **In one pass, a stage under the floor fits from a level** (the highest at or
  below the previous stage's threshold, 2% under where the last call's chain put
  it), not from that threshold itself: the pass cannot know this call's thresholds
  before it ends. The location of a peaks-over-threshold fit is free in the paper's
  own argument (Lemma 2: any high enough threshold); each stage still aims at the
  count left above its location, and the last stages, above the floor, fit from
  their thresholds exactly. On ResNet-50's shapes (Gaussian gradients, error
  feedback, ratio 0.01, steps 10-40) the one pass sent 0.95 of the target (``gp``:
  0.92; the histogram path 0.98 and 0.94), 96% of the calls of tensors with k >= 1000
  within the band (``gp`` and the histogram: 100%); ``tests/test_sidco_scan.py``.
* The authors normalize |g| by its L2 norm first; every fit here is scale
  equivariant, so the threshold is the same and we save that pass.
* State (the stage count) is per tensor; their code keeps it in a class-level
  global shared by all tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import kernels
from .. import payload as P
from ..kernels import many
from ..kernels.guess import MOVE_RANGE, SLACK, SLACK_RANGE
from ..kernels.many import INF_BITS, Guess, _magnitude, batchable
from ..kernels.moments import MAX_LEVELS, SD_HEAD, Levels
from .base import Compressor, fill_from
from .histstats import ScanStats, TailStats
from .registry import register
from ..options import Option
from .sidcoprinted import PAPER_CAPACITY, PrintedAlgorithm
from .sidcofits import (  # noqa: F401 (the fits, importable from here)
    Estimator, exp_threshold, gamma_shape, gamma_threshold, gamma_threshold_approx, gamma_upper_quantile, gp_threshold,
    max_stages, path_room,
)
from .tails import GROW, largest_instead, nonfinite

DISTS = ("exp", "gp", "gamma")
WANT = 2  # candidates aimed at per target entry: the fits' last stages and the correction count among them
LADDER = 0.98  # levels sit this far under where the last call's stage thresholds are expected


@register
class SIDCo(PrintedAlgorithm, Estimator, Compressor):
    SELECT_PASSES = 2.5  # read passes per selection (gradsift bench select; the wire plan's model)
    name = "sidco"
    OPTIONS = {
        "dist": Option.choice("exp", DISTS, doc="the fitted law: double exponential, generalized Pareto or gamma "
                                                "(Sec. 2.3)"),
        "stages": Option.integer(3, lo=1, doc="the stage count M to start from (Sec. 2.4)"),
        "first_ratio": Option.number(0.25, lo=0.0, hi=1.0, lo_open=True, doc="the share stage 1 keeps"),
        "adapt": Option.flag(True, doc="adapt the stage count to the count selected"),
        "eps_h": Option.number(0.2, lo=0.0, doc="the count's band above k before the stages adapt"),
        "eps_l": Option.number(0.2, lo=0.0, hi=1.0, doc="the count's band below k before the stages adapt"),
        "correct": Option.flag(True, doc="correct the threshold when every fit misses the band"),
        "paper": Option.flag(False, doc="Algorithm 1 as printed: fixed stage ratios, stages adapted per window"),
        "window": Option.integer(5, lo=1, doc="calls per window of the printed algorithm's adaptation (Q)"),
    }
    SUMMARY = "SIDCo: multi-stage threshold from fitted exp/gp/gamma distributions, adaptive stages, no sort"
    FUSES_MEMORY = True

    def capacity_for(self, target: int, numel: int) -> int:
        """As printed (``paper=true``) nothing bounds the count a threshold selects until the window adapts the
        stages: room for :data:`PAPER_CAPACITY` times the target; what a threshold selects beyond it returns to
        error feedback (counted as ``overflow``). Otherwise the acceptance band, as every estimator."""
        if self.options["paper"]:
            return min(numel, max(target, math.ceil(PAPER_CAPACITY * target - 1e-9)))
        return super().capacity_for(target, numel)

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """The per-tensor state of ``keys`` for :meth:`rollback`, copied as dicts: its one list (the ladder) a step
        replaces and never writes, so it is shared (a deep copy of it cost 2 ms a step on 163 tensors)."""
        if deep:
            return super().checkpoint(keys, deep)
        return {k: dict(self.tensors[k]) if k in self.tensors else None for k in keys}

    def init_state(self, key: str, numel: int, device) -> dict[str, Any]:
        if self.options["paper"]:  # the stage count M, and the window's count and sum of selected entries
            return {"stages": self.options["stages"], "calls": 0, "selected": 0}
        return {"stages": self.options["stages"]}

    # ------------------------------------------------------------ selection
    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        return self._select_many([key], [x], None)[0]

    def select_into(self, key: str, acc: torch.Tensor, grad: torch.Tensor) -> P.Payload:
        """Error feedback fused into the pass: ``acc += grad``, select, zero what was selected in ``acc``
        (float32 values as accumulated; the memory casts them for the wire)."""
        return self._select_many([key], [acc], [grad])[0]

    def select_many(self, keys, xs) -> list[P.Payload]:
        """:meth:`select` of a group's tensors in one call (``Compressor.compress_many``)."""
        return self._select_many(keys, xs, None)

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        return self._select_many(keys, accs, grads, srcs)

    def _select_many(self, keys, xs, adds, srcs=None) -> list[P.Payload]:
        """Tensors with a floor guessed from their last call take one pass (:meth:`_on_scans`); the others (first
        calls of large tensors, the gamma fit, GPUs and other dtypes) the histogram's two (:meth:`_on_histogram`)."""
        begun = self.begin_many(keys, xs)
        adds = adds or [None] * len(xs)
        srcs = srcs or [None] * len(xs)
        if self.options["paper"]:
            fill_from(xs, srcs)  # (this path accumulates in place)
            srcs = [None] * len(xs)
        if self.options["paper"]:  # Algorithm 1 as printed (sidcoprinted.py)
            return [self.printed(x, add, st, k) for x, add, (st, k, _) in zip(xs, adds, begun)]
        out: list[P.Payload | None] = [None] * len(xs)
        scan, caps = [], []
        fits = self.options["dist"] != "gamma"
        for i, (x, (st, k, _)) in enumerate(zip(xs, begun)):
            cap = Guess.cap(st, x.numel(), k, WANT) if fits and batchable(x) else None
            if cap is None:
                fill_from([x], [srcs[i]])
                out[i] = self._on_histogram(x, adds[i], st, k)
            else:
                scan.append(i)
                caps.append(cap)
        if scan:
            for i, p in zip(scan, self._on_scans([xs[i] for i in scan], [adds[i] for i in scan],
                                                 [begun[i] for i in scan], caps, [srcs[i] for i in scan])):
                out[i] = p
        return out  # type: ignore[return-value]

    def _levels(self, st: dict[str, Any], floor: float) -> Levels:
        """The non-zero entries, and a level just under each stage threshold of the last call's chain (where this
        call's stages will land again as long as the tensor's scale holds) that lies under the floor."""
        path = st.get("ladder", ())
        if path:
            grow = LADDER * min(max(st.get("grow", 1.0), GROW[0]), GROW[1])
            path = sorted({grow * p for p in path if 0.0 < grow * p < floor})[:MAX_LEVELS - 1]
        return Levels((0.0, *path), Levels.scale_for(st.get("top", 0.0)), self.options["dist"] != "exp")

    def _rows(self, xs, begun, zero: bool) -> list[tuple[list[int], list[float], int]]:
        """Each tensor's options and state for the compiled pass (``sd_in_scan`` in ``select.c``, which works out
        the floor (:meth:`Guess.floor`), the levels (:meth:`_levels`), the threshold and the next state (``Guess.
        update``) from them in the same float64 operations): ints k, gp, adapt, correct, stages, zero, the ladder's
        length; doubles the options and this module's and ``guess.py``'s constants, then kth, grow, slack (NaN: not
        set), top, the ladder; the room its out row needs for the chain's path."""
        o = self.options
        flags = [int(o["dist"] == "gp"), int(bool(o["adapt"])), int(bool(o["correct"]))]
        consts = [o["first_ratio"], o["eps_l"], o["eps_h"], *GROW, SLACK, LADDER, WANT, *SLACK_RANGE, *MOVE_RANGE]
        nan = math.nan
        return [([k, *flags, st["stages"], int(zero), len(lad := st.get("ladder", ()))],
                 [*consts, st.get("kth") or 0.0, st.get("grow", nan), st.get("slack", nan), st.get("top", 0.0), *lad],
                 path_room(k, x.numel())) for x, (st, k, _) in zip(xs, begun)]

    def _on_scans(self, xs, adds, begun, caps, srcs=()) -> list[P.Payload]:
        """One pass per tensor; on the compiled backend the pass also finds the threshold, selects, zeroes and
        learns the next floor and levels (:meth:`_rows`); on the eager one, :meth:`_threshold_of` from its moments."""
        zero = adds[0] is not None
        adapt = self.options["adapt"]
        if kernels.backend() == "compiled":
            floors, levels = None, None
            scans = many.scan_many(xs, adds, (), caps, sidco=self._rows(xs, begun, zero), srcs=srcs)
        else:
            floors = [Guess.floor(st, x.numel(), k, WANT, grow_range=GROW)[0] for x, (st, k, _) in zip(xs, begun)]
            levels = [self._levels(st, f) for (st, _, _), f in zip(begun, floors)]
            scans = many.scan_many(xs, adds, floors, caps, levels=levels, srcs=srcs)
        out = []
        for j, (x, (st, k, _), sc) in enumerate(zip(xs, begun, scans)):
            if sc.top >= INF_BITS:  # NaN or Inf: sent as they are (the memory sees the overflow)
                idx, vals = nonfinite(x)
                if zero:
                    x.index_fill_(0, idx, 0.0)
                out.append(P.sparse(vals if zero else self.wire(vals), idx, x.numel(), x.dtype, k))
                continue
            sd = sc.sidco
            if sd is not None and sd[4]:  # selected, zeroed and learned by the compiled pass
                st["kth"], st["top"], st["ladder"] = sd[0], sd[8], sd[SD_HEAD:SD_HEAD + int(sd[2])]
                if sd[5] == sd[5]:
                    st["grow"] = sd[5]
                if sd[6] == sd[6]:
                    st["slack"] = sd[6]
                if adapt:
                    st["stages"] = int(sd[1])
                idx, vals = sc.result
                out.append(P.sparse(vals if zero else self.wire(vals), idx, x.numel(), x.dtype, k, zero))
                continue
            if sd is not None:
                floor, t, stages, path = sd[7], sd[0], int(sd[1]), sd[SD_HEAD:SD_HEAD + int(sd[2])]
            else:
                floor = floors[j]
                t, stages, path = self._threshold_of(x, sc, levels[j], floor, k, st["stages"])
            if sd is not None and sd[3] >= 0:  # (selected and zeroed there)
                idx, vals = sc.idx, sc.vals
            else:
                idx, vals = many.take_above(sc.vals, sc.idx, t) if sc.idx is not None and t >= floor else \
                    many.take_above(x, None, t)
                if zero:
                    x.index_fill_(0, idx, 0.0)
            top = _magnitude(sc.top)
            if not idx.numel() and top > 0.0:  # nothing above t: t is at or above the largest
                idx, vals = largest_instead(x, top, zero)
            Guess.update(st, t, idx.numel(), WANT * k, floor, sc.count)
            st["top"], st["ladder"] = top, path
            if adapt:
                st["stages"] = stages
            out.append(P.sparse(vals if zero else self.wire(vals), idx, x.numel(), x.dtype, k, zero))
        return out

    def _threshold_of(self, x, sc, lv: Levels, floor: float, k: int, stages: int):
        """(threshold, stage count, path) from a scan's statistics in Python: the reference the compiled pass
        repeats, and the eager backend's path."""
        moments, top = sc.moments, _magnitude(sc.top)
        if not lv.fits(sc.top):  # the magnitudes outgrew the scale: the moments again, at a scale that fits
            lv = Levels(lv.levels, Levels.scale_for(top), lv.squares)
            moments = many.scan_many([x], [None], [None], [0], levels=[lv])[0].moments
        cand = TailStats.of_tensor(sc.vals) if sc.idx is not None else None
        stats = ScanStats(x, ScanStats.level_rows(lv, moments), cand, floor, sc.count, top)
        st = {"stages": stages}
        t, path = self.threshold(stats, k, st, k / x.numel())
        return t, st["stages"], path

    def _on_histogram(self, x: torch.Tensor, add: torch.Tensor | None, st: dict[str, Any], k: int) -> P.Payload:
        d = x.numel()
        hist = None
        f32 = x.dtype == torch.float32 and x.is_contiguous()
        if f32 and (x.is_cuda or kernels.supported(x)):
            hist = kernels.abs_histogram(x, add=add)  # with error feedback: the same pass accumulates
            stats = TailStats.of_histogram(hist.counts)
        elif x.is_cuda:  # other dtypes on a GPU: the histogram of a float32 copy
            stats = TailStats.of_histogram(kernels.abs_histogram(x.to(torch.float32).contiguous()).counts)
        else:  # small tensors and other dtypes: the keys of x (or of a float32 copy) counted directly
            if add is not None:
                x.add_(add)
            stats = TailStats.of_tensor((x if f32 else x.to(torch.float32).contiguous()).reshape(-1))
        t, path = self.threshold(stats, k, st, k / d)
        idx, vals = kernels.select_above(x, t, hist=hist, zero=add is not None)
        if not idx.numel() and (top := float(x.abs().max())) > 0.0:  # (a NaN fit too)
            idx, vals = largest_instead(x, top, add is not None)
        Guess.update(st, t, idx.numel(), WANT * k)
        st["top"], st["ladder"] = stats.largest(), path
        return P.sparse(vals if add is not None else self.wire(vals), idx, d, x.dtype, k)  # fused: the memory casts

    def telemetry(self, workers) -> dict[str, float]:
        """Mean stage count over tensors and workers (``sidco_stages``)."""
        vals = [st["stages"] for w in workers for st in w.inner.tensors.values()]
        return {"sidco_stages": sum(vals) / len(vals)} if vals else {}
