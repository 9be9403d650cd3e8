"""SIDCo: estimation quality, selection speed, and time to target (Figs. 1, 6, 9)."""

from __future__ import annotations

import statistics

from ...runtime.runconfig import RunConfig
from ..compare import line_styles
from .common import Ctx, Section, final, md_table, net_note, plt, run, save, spread


# ------------------------------------------------------------------ 6. SIDCo
# the three forms of SIDCo's estimate: Algorithm 1 as printed, gradsift's estimate alone (stage count chosen inside
# each call, no count correction), and gradsift's default (with the correction)
PRINTED, ESTIMATE, CORRECTED = "sidco:paper=true", "sidco:correct=false", "sidco"
FORMS = [PRINTED, ESTIMATE, CORRECTED]
SIDCO_ESTIMATORS = ["sidco", "sidco:dist=gp", "sidco:dist=gamma", "dgc", "redsync", "gaussiank"]
QUALITY = FORMS + ["sidco:dist=gp", "sidco:dist=gamma", "dgc", "redsync", "gaussiank"]
TRAINED = ["dense", "topk", "dgc", CORRECTED, PRINTED]


def target_of(runs: dict, metric: str) -> float:
    """90% of dense's final accuracy (110% of its final perplexity)."""
    dense = final(runs["dense"], metric)
    return dense * 0.9 if metric == "accuracy" else dense * 1.1


def _tail_mean(q: list[float]) -> float:
    """Mean achieved/target count after the first third of training (the adaptation's start left out)."""
    return statistics.mean(q[len(q) // 3:] or q)


def _faster_than_dgc(bench: list[dict]) -> tuple[list[str], list[str]]:
    """The bench's (size, ratio) cells where SIDCo's default selects faster than DGC's, and where it does not."""
    by = {(r["compressor"], r["size"], r["ratio"]): r["vs_topk"] for r in bench}
    won, lost = [], []
    for (c, size, ratio), t in by.items():
        if c == "sidco" and ("dgc", size, ratio) in by:
            (won if t < by[("dgc", size, ratio)] else lost).append(f"{size:,} entries at ratio {ratio:g}")
    return won, lost


def exp_sidco(ctx: Ctx) -> Section:
    from ..bench import run_select_bench

    name = "sidco"
    d = ctx.dir(name)
    sizes = [262144] if ctx.quick else [262144, 2621440, 26214400]
    bench = run_select_bench(["topk"] + SIDCO_ESTIMATORS + [PRINTED], sizes, [0.1, 0.01, 0.001], "gaussian",
                             6 if ctx.quick else 10, d / "bench", progress=ctx.progress)
    speed_rows = []
    for r in bench:
        if r["compressor"] != "topk":
            speed_rows.append([r["compressor"], r["size"], r["ratio"], f"{1 / r['vs_topk']:.2f}x",
                               f"{r['read_passes']:.1f}", f"{r['k_ratio']:.2f}"])
    won, lost = _faster_than_dgc(bench)
    # estimation quality over training: the three forms and DGC on 3 seeds, the other estimators on one
    ratios = [0.01] if ctx.quick else [0.1, 0.01, 0.001]
    seeds = [0] if ctx.quick else [0, 1, 2]
    steps = ctx.steps(30, 300)
    quality: dict[tuple[str, float, int], list[float]] = {}
    for ratio in ratios:
        for spec in QUALITY:
            for seed in (seeds if spec in FORMS + ["dgc"] else seeds[:1]):
                cfg = RunConfig(task="mnist1d-cnn", compressor=spec, ratio=ratio, workers=8, steps=steps, seed=seed,
                                eval_every=steps, granularity="model", task_options=ctx.cnn())
                recs, _ = run(ctx, name, f"quality-{spec}-{ratio}" + (f"-seed{seed}" if seed else ""), cfg)
                quality[(spec, ratio, seed)] = [r["k_ratio"] for r in recs]

    def per_seed(spec: str, ratio: float) -> list[float]:
        return [_tail_mean(quality[(spec, ratio, sd)]) for sd in seeds if (spec, ratio, sd) in quality]

    p = plt()
    fig, axes = p.subplots(1, len(ratios), figsize=(5 * len(ratios), 4), squeeze=False)
    q_rows = []
    for j, ratio in enumerate(ratios):
        for spec, style in zip(QUALITY, line_styles(len(QUALITY))):
            q = quality[(spec, ratio, seeds[0])]
            axes[0][j].plot(range(1, len(q) + 1), q, label=spec, **style)
            pooled = sorted(v for sd in seeds if (spec, ratio, sd) in quality
                            for v in quality[(spec, ratio, sd)][len(quality[(spec, ratio, sd)]) // 3:])
            q_rows.append([ratio, spec, spread(per_seed(spec, ratio)),
                           f"[{pooled[int(0.05 * (len(pooled) - 1))]:.3f}, {pooled[int(0.95 * (len(pooled) - 1))]:.3f}]"])
        axes[0][j].set_yscale("log")
        axes[0][j].axhline(1.0, color="k", lw=0.8)
        axes[0][j].set_title(f"achieved / target count, ratio {ratio}")
        axes[0][j].set_xlabel("iteration")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    figs = [save(fig, ctx, name, "quality.png")]
    # training and time to target on the network model: gradsift's training recipe (momentum SGD: Nesterov
    # momentum for the sparsifiers), so that top-k reaches the target the others race to
    bw, lat = 10.0, 50.0
    train_jobs = [("mnist1d-cnn", ctx.steps(60, 600), "momentum", 0.05, ctx.cnn(), None, seeds)]
    if not ctx.quick and ctx.data is not None:
        train_jobs.append(("charlm", ctx.steps(60, 200), "sgd", 1.0, {"hidden": 128, "seq_len": 32}, 0.25, seeds))
    t_rows, speed_sections, notes = [], [], []
    fig, axes = p.subplots(1, len(train_jobs), figsize=(6 * len(train_jobs), 4), squeeze=False)
    for j, (task, tsteps, opt, lr, topts, clip, tseeds) in enumerate(train_jobs):
        metric = "perplexity" if task == "charlm" else "accuracy"
        higher = metric == "accuracy"
        runs: dict[tuple[str, int], list[dict]] = {}
        for spec in TRAINED:
            for seed in tseeds:
                cfg = RunConfig(task=task, compressor=spec, ratio=0.001, workers=8, steps=tsteps, seed=seed,
                                optimizer=opt, lr=lr, eval_every=max(tsteps // 10, 1), bandwidth_gbps=bw,
                                latency_us=lat, data=str(ctx.data) if task == "charlm" else None, task_options=topts,
                                clip_norm=clip, granularity="model")
                runs[(spec, seed)], _ = run(ctx, name, f"train-{task}-{spec}" + (f"-seed{seed}" if seed else ""),
                                            cfg, recipe=True)
        dense_final = statistics.mean(final(runs[("dense", sd)], metric) for sd in tseeds)
        target = dense_final * 0.9 if higher else dense_final * 1.1
        times: dict[str, list] = {}
        for spec in TRAINED:
            times[spec] = []
            for seed in tseeds:
                recs, t, hit, xs, ys = runs[(spec, seed)], 0.0, None, [], []
                for r in recs:
                    t += r["est_step_s"]
                    v = r.get(metric)
                    if v is None:
                        continue
                    xs.append(t)
                    ys.append(v)
                    if hit is None and ((v >= target) if higher else (v <= target)):
                        hit = t
                times[spec].append(hit)
                axes[0][j].plot(xs, ys, label=spec if seed == tseeds[0] else None,
                                color=f"C{TRAINED.index(spec)}", alpha=0.9 if seed == tseeds[0] else 0.35)
            hits = [h for h in times[spec] if h]
            t_rows.append([task, f"{metric} {'>=' if higher else '<='} {target:.4g}", spec,
                           f"{len(hits)}/{len(tseeds)}", spread(hits) if hits else "not reached",
                           spread([final(runs[(spec, sd)], metric) for sd in tseeds])])
        axes[0][j].axhline(target, color="k", lw=0.8, ls=":")
        axes[0][j].set_xlabel(f"estimated time (s) at {bw:g} Gbit/s")
        axes[0][j].set_ylabel(metric)
        axes[0][j].set_title(f"{task}, 8 workers, ratio 0.001")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend()
        speed_sections.append((task, times, len(tseeds)))
    figs.append(save(fig, ctx, name, "train.png"))

    printed = {r: per_seed(PRINTED, r) for r in ratios}
    estimate = {r: per_seed(ESTIMATE, r) for r in ratios}
    corrected = {r: per_seed(CORRECTED, r) for r in ratios}
    sid_quality = [statistics.mean(per_seed(s, r)) for s in ("sidco", "sidco:dist=gp", "sidco:dist=gamma")
                   for r in ratios]
    q_ok = all(0.8 <= q <= 1.25 for r in ratios for q in printed[r])  # the paper's claim, of Algorithm 1
    sid_speed = [float(r[3][:-1]) for r in speed_rows if r[0] == "sidco" and r[3].endswith("x")]
    s_ok = bool(sid_speed) and min(sid_speed) > 1.0

    def all_reached(spec: str) -> bool:
        return all(all(tm.get(spec) or [None]) for _, tm, _ in speed_sections)

    def median_time(task_times: dict, spec: str) -> float | None:
        hits = task_times.get(spec) or []
        return statistics.median(hits) if hits and all(hits) else None

    cnn_times = speed_sections[0][1]
    t_ok = all_reached(CORRECTED) and all(
        (median_time(cnn_times, CORRECTED) or 1e9) <= (median_time(cnn_times, b) or 1e9) for b in ("topk", "dgc"))
    verdict = "reproduced" if q_ok and s_ok and t_ok else ("partly" if q_ok or s_ok or t_ok else "not")

    def fmt(vals: dict) -> str:
        return ", ".join(f"{r:g}: {spread(v)}" for r, v in vals.items())

    def race_text(task: str, tm: dict, n: int) -> str:
        return f"{task} ({'3 seeds' if n == 3 else 'one seed'}): " + ", ".join(
            f"{s} {sum(1 for h in v if h)}/{n}" + (f" in {statistics.median([h for h in v if h]):.2f} s (median)"
                                                   if any(v) else "") for s, v in tm.items())

    sid_t, dgc_t, top_t = (median_time(cnn_times, s) for s in (CORRECTED, "dgc", "topk"))
    if sid_t and dgc_t and top_t:
        dgc_line = (f"To the mnist1d-cnn target SIDCo's default took {sid_t:.2f} s (median of the seeds) against DGC's "
                    f"{dgc_t:.2f} s and top-k's {top_t:.2f} s: " + (
                        "faster than both, as the paper claims. " if sid_t < min(dgc_t, top_t) else
                        "the paper's \"faster than top-k and DGC\" does not reproduce here, where selection is a "
                        "small part of a step and SIDCo sends a little less than k per step. "))
    else:  # (the methods that missed it are named below)
        dgc_line = ""
    unreached = [(t, [s for s, v in tm.items() if not all(v)]) for t, tm, _ in speed_sections]
    unreached = [(t, m) for t, m in unreached if m]
    miss_line = " ".join(
        f"On {t}, {', '.join(m)} did not reach the target on every seed in its budget"
        + (" -- top-k included, so at ratio 0.001 the budget is too short for any sparsifier here, not a matter "
           "of link speed." if "topk" in m else ".") for t, m in unreached)
    where = (f"in {len(won)} of {len(won) + len(lost)} (size, ratio) cells"
             + (f" and fails at {', '.join(lost)}" if lost else ""))
    return Section(
        name, "SIDCo: threshold quality, selection speed, and time to target (Figs. 1, 3-6, 9)",
        "SIDCo estimates the target ratio with high quality (\"on average k_hat/k ~ 1\") where RedSync and "
        "GaussianKSGD are off by up to ~60x (Fig. 9); it is faster than top-k on CPU and GPU (Figs. 1, 16); on "
        "LSTM-PTB it reaches the target \"~41.7x\" faster than no compression and up to \"~7.6x\" and \"~1.9x\" "
        "faster than top-k and DGC (8 nodes, 10 Gbit/s).",
        f"Three forms of SIDCo's estimate: **printed** (`{PRINTED}`: Algorithm 1 as the paper prints it -- fixed "
        "per-stage ratios, the stage count adapted once per window of Q = 5 calls, `|g| >= eta_M` sent, no "
        f"correction), **estimate alone** (`{ESTIMATE}`: gradsift's chain with the stage count chosen inside each "
        f"call from exact counts, no correction) and **corrected** (`{CORRECTED}`, the default: the same plus a "
        "count correction from the candidates), all SIDCo-E (exp) unless named. Selection bench on Gaussian "
        f"vectors of sizes {sizes} at ratios 0.1/0.01/0.001 (this CPU, torch threads as set). Estimation quality: "
        f"`mnist1d-cnn`, 8 workers, whole-model compression, error feedback, {steps} steps, ratios {ratios}; the "
        f"three forms and DGC on seeds {seeds}, the other estimators on seed 0. Time to target: "
        + "; ".join(f"`{t}` {s} steps ({'seeds ' + str(sd) if len(sd) > 1 else 'one seed'}, {o} lr {lr:g})"
                    for t, s, o, lr, _, _, sd in train_jobs)
        + f", ratio 0.001, whole-model, {net_note(bw, lat)}; target = 90% of dense's final accuracy (110% of "
          "its final perplexity), dense's mean over seeds; gradsift's training recipe on for every method "
          "(momentum SGD: Nesterov momentum for the sparsifiers, docs/recipes.md), so that top-k reaches the "
          "target -- the paper's own runs use momentum with error feedback; charlm trains with plain SGD, where "
          "the recipe changes nothing.",
        f"Mean achieved/target count after the first third of training, per seed (mean [min, max]): printed "
        f"{fmt(printed)}; estimate alone {fmt(estimate)}; corrected {fmt(corrected)}. Selection speed-up over "
        f"torch.topk {min(sid_speed or [0]):.2f}-{max(sid_speed or [0]):.2f}x; faster than DGC at "
        f"{len(won)} of {len(won) + len(lost)} (size, ratio) cells" + (f", slower at {', '.join(lost)}" if lost
                                                                       else "") + ". Time to target: "
        + "; ".join(race_text(t, tm, n) for t, tm, n in speed_sections) + ".",
        verdict,
        "The quality verdict is the printed algorithm's (`paper=true`), as the paper's claim is"
        + (": its window adaptation holds the count within [0.8, 1.25] of k on every seed and ratio. " if q_ok else
           ": it leaves the count outside [0.8, 1.25] of k on some seed or ratio (see the rows), where the "
           "estimate-alone and corrected forms keep it closer. ")
        + "Selection speed-up over sorting reproduces on this CPU for the default form; against DGC's sampled "
        "threshold, selection alone, the claim holds " + where
        + (" (at ratio 0.1 SIDCo's one pass records about 2k candidates, 5M entries at 26M, where DGC reads a "
           "sample)" if any("ratio 0.1" in c for c in lost) else "") + ". "
        + dgc_line + miss_line
        + " Our models are 100k-250k parameters (LSTM-PTB has ~66M): at 10 Gbit/s communication is a small part of "
        "a step and the paper's 41.7x over dense cannot appear.",
        f"printed estimate {min(min(v) for v in printed.values()):.2f}-{max(max(v) for v in printed.values()):.2f} "
        f"of k (estimate alone {min(min(v) for v in estimate.values()):.2f}-"
        f"{max(max(v) for v in estimate.values()):.2f}, corrected {min(min(v) for v in corrected.values()):.2f}-"
        f"{max(max(v) for v in corrected.values()):.2f}); selection {min(sid_speed or [0]):.1f}-"
        f"{max(sid_speed or [0]):.1f}x faster than top-k, faster than DGC in {len(won)}/{len(won) + len(lost)} cells",
        tables=[md_table(["compressor", "size", "ratio", "speed-up over torch.topk", "read passes", "k_ratio"], speed_rows),
                md_table(["ratio", "estimator", "mean achieved/target per seed (mean [min, max])",
                          "5-95% range, all seeds"], q_rows),
                md_table(["task", "target", "method", "seeds reaching it", "time to target (s, mean [min, max])",
                          "final"], t_rows)],
        figures=figs, data={"sid_quality": sid_quality, "sid_speed": sid_speed,
                            "raw_quality": {PRINTED: [statistics.mean(v) for v in printed.values()],
                                            ESTIMATE: [statistics.mean(v) for v in estimate.values()]},
                            "faster_than_dgc": won, "slower_than_dgc": lost})
