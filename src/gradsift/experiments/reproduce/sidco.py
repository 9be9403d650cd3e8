"""SIDCo: estimation quality, selection speed, and time to target (Figs. 1, 6, 9)."""

from __future__ import annotations

import statistics

from ...runtime.runconfig import RunConfig
from ..compare import line_styles
from .common import Ctx, Section, final, md_table, net_note, plt, run, save


# ------------------------------------------------------------------ 6. SIDCo
SIDCO_ESTIMATORS = ["sidco", "sidco:dist=gp", "sidco:dist=gamma", "dgc", "redsync", "gaussiank"]
# the statistical estimate alone: gradsift's count correction off, and the stage count fixed as well
RAW = ["sidco:correct=false", "sidco:correct=false,adapt=false"]


def target_of(runs: dict, metric: str) -> float:
    """90% of dense's final accuracy (110% of its final perplexity)."""
    dense = final(runs["dense"], metric)
    return dense * 0.9 if metric == "accuracy" else dense * 1.1


def _attribution(task: str, times: dict, finals: dict, steps: int) -> str:
    """Why SIDCo's time to target compares as it does on ``task``: a method that never reached the target in
    ``steps`` did not converge far enough (not a matter of communication); between methods that did, the model's
    communication/computation ratio decides."""
    missed = [s for s, t in times.items() if not t]
    text = ""
    if missed:
        text = (f"On {task}, " + ", ".join(f"{s} (final {finals[s][0]:.3g} against the target {finals[s][1]:.3g})"
                                          for s in missed)
                + f" did not reach the target within {steps} steps: a convergence shortfall at this ratio, which "
                "no link speed changes.")
    if times.get("sidco"):
        text += (f" {'Where' if missed else f'On {task}'} the methods reached it, the speed-ups depend on the "
                 "model's communication/computation ratio: our models are 8k-400k parameters (LSTM-PTB has ~66M), so "
                 "at 10 Gbit/s communication is a small part of a step and the paper's 41.7x cannot appear.")
    return text.strip()


def exp_sidco(ctx: Ctx) -> Section:
    from ..bench import run_select_bench

    name = "sidco"
    d = ctx.dir(name)
    sizes = [262144] if ctx.quick else [262144, 2621440, 26214400]
    bench = run_select_bench(["topk"] + SIDCO_ESTIMATORS, sizes, [0.1, 0.01, 0.001], "gaussian",
                             6 if ctx.quick else 10, d / "bench", progress=ctx.progress)
    speed_rows = []
    for r in bench:
        if r["compressor"] != "topk":
            speed_rows.append([r["compressor"], r["size"], r["ratio"], f"{1 / r['vs_topk']:.2f}x",
                               f"{r['read_passes']:.1f}", f"{r['k_ratio']:.2f}"])
    # estimation quality over training
    ratios = [0.01] if ctx.quick else [0.1, 0.01, 0.001]
    steps = ctx.steps(30, 300)
    quality: dict[tuple[str, float], list[float]] = {}
    for ratio in ratios:
        for spec in SIDCO_ESTIMATORS + RAW:
            cfg = RunConfig(task="mnist1d-cnn", compressor=spec, ratio=ratio, workers=8, steps=steps, seed=0,
                            eval_every=steps, granularity="model", task_options=ctx.cnn())
            recs, _ = run(ctx, name, f"quality-{spec}-{ratio}", cfg)
            quality[(spec, ratio)] = [r["k_ratio"] for r in recs]
    p = plt()
    fig, axes = p.subplots(1, len(ratios), figsize=(5 * len(ratios), 4), squeeze=False)
    q_rows = []
    for j, ratio in enumerate(ratios):
        for spec, style in zip(SIDCO_ESTIMATORS + RAW, line_styles(len(SIDCO_ESTIMATORS + RAW))):
            q = quality[(spec, ratio)]
            axes[0][j].plot(range(1, len(q) + 1), q, label=spec, **style)
            tail = q[len(q) // 3:] or q
            q_rows.append([ratio, spec, f"{statistics.mean(tail):.3f}",
                           f"[{sorted(tail)[int(0.05 * (len(tail) - 1))]:.3f}, {sorted(tail)[int(0.95 * (len(tail) - 1))]:.3f}]"])
        axes[0][j].set_yscale("log")
        axes[0][j].axhline(1.0, color="k", lw=0.8)
        axes[0][j].set_title(f"achieved / target count, ratio {ratio}")
        axes[0][j].set_xlabel("iteration")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    figs = [save(fig, ctx, name, "quality.png")]
    # training and time to target on the network model
    bw, lat = 10.0, 50.0
    speed_sections = []
    train_jobs = [("mnist1d-cnn", ctx.steps(60, 600), "momentum", 0.05, ctx.cnn(), None)]
    if not ctx.quick and ctx.data is not None:
        train_jobs.append(("charlm", ctx.steps(60, 200), "sgd", 1.0, {"hidden": 128, "seq_len": 32}, 0.25))
    t_rows, finals = [], []
    fig, axes = p.subplots(1, len(train_jobs), figsize=(6 * len(train_jobs), 4), squeeze=False)
    for j, (task, tsteps, opt, lr, topts, clip) in enumerate(train_jobs):
        metric = "perplexity" if task == "charlm" else "accuracy"
        runs = {}
        for spec in ("dense", "topk", "dgc", "sidco"):
            cfg = RunConfig(task=task, compressor=spec, ratio=0.001, workers=8, steps=tsteps, seed=0, optimizer=opt,
                            lr=lr, eval_every=max(tsteps // 10, 1), bandwidth_gbps=bw, latency_us=lat,
                            data=str(ctx.data) if task == "charlm" else None, task_options=topts, clip_norm=clip,
                            granularity="model")
            recs, _ = run(ctx, name, f"train-{task}-{spec}", cfg)
            runs[spec] = recs
        finals.append(({s: (final(rs, metric), target_of(runs, metric)) for s, rs in runs.items()}, tsteps))
        higher = metric == "accuracy"
        dense_final = final(runs["dense"], metric)
        target = dense_final * 0.9 if higher else dense_final * 1.1
        times = {}
        for spec, recs in runs.items():
            t, hit = 0.0, None
            for r in recs:
                t += r["est_step_s"]
                v = r.get(metric)
                if v is not None and ((v >= target) if higher else (v <= target)):
                    hit = t
                    break
            times[spec] = hit
            xs, ys, acc_t = [], [], 0.0
            for r in recs:
                acc_t += r["est_step_s"]
                if r.get(metric) is not None:
                    xs.append(acc_t)
                    ys.append(r[metric])
            axes[0][j].plot(xs, ys, label=spec)
        axes[0][j].axhline(target, color="k", lw=0.8, ls=":")
        axes[0][j].set_xlabel(f"estimated time (s) at {bw:g} Gbit/s")
        axes[0][j].set_ylabel(metric)
        axes[0][j].set_title(f"{task}, 8 workers, ratio 0.001")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend()
        for base in ("dense", "topk", "dgc"):
            tb, ts = times.get(base), times.get("sidco")
            sp = (f"{tb / ts:.2f}x" if tb and ts else ("SIDCo reached, baseline did not" if ts else "not reached"))
            t_rows.append([task, f"{metric} {'>=' if higher else '<='} {target:.4g}", base, sp])
        speed_sections.append((task, times))
    figs.append(save(fig, ctx, name, "train.png"))
    def mean_tail(spec: str, r: float) -> float:
        q = quality[(spec, r)]
        return statistics.mean(q[len(q) // 3:] or q)

    sid_quality = [mean_tail(s, r) for s in ("sidco", "sidco:dist=gp", "sidco:dist=gamma") for r in ratios]
    raw_quality = {s: [mean_tail(s, r) for r in ratios] for s in RAW}
    q_ok = all(0.8 <= q <= 1.25 for q in raw_quality[RAW[0]])  # the paper's claim is the estimator's, uncorrected
    sid_speed = [float(r[3][:-1]) for r in speed_rows if r[0] == "sidco" and r[3].endswith("x")]
    s_ok = bool(sid_speed) and min(sid_speed) > 1.0
    t_ok = all(tm.get("sidco") for _, tm in speed_sections)  # SIDCo reached the target wherever it trained
    verdict = "reproduced" if q_ok and s_ok and t_ok else ("partly" if q_ok or s_ok or t_ok else "not")
    return Section(
        name, "SIDCo: threshold quality, selection speed, and time to target (Figs. 1, 3-6, 9)",
        "SIDCo estimates the target ratio with high quality (\"on average k_hat/k ~ 1\") where RedSync and "
        "GaussianKSGD are off by up to ~60x (Fig. 9); it is faster than top-k on CPU and GPU (Figs. 1, 16); on "
        "LSTM-PTB it reaches the target \"~41.7x\" faster than no compression and up to \"~7.6x\" and \"~1.9x\" "
        "faster than top-k and DGC (8 nodes, 10 Gbit/s).",
        f"Selection bench on Gaussian vectors of sizes {sizes} at ratios 0.1/0.01/0.001 (this CPU, "
        f"torch threads as set). Estimation quality: `mnist1d-cnn`, 8 workers, whole-model compression, "
        f"error feedback, {steps} steps, ratios {ratios}. Time to target: "
        + "; ".join(f"`{t}` {s} steps" for t, s, *_ in train_jobs)
        + f", ratio 0.001, whole-model, {net_note(bw, lat)}; target = 90% of dense's final accuracy (110% of "
          "its final perplexity); SIDCo-E (exp).",
        f"SIDCo's estimate alone (`correct=false`; mean achieved/target count after the first third of training, "
        f"exp at ratios {ratios}): " + ", ".join(f"{q:.2f}" for q in raw_quality[RAW[0]])
        + "; with the stage count fixed as well (`adapt=false`): " + ", ".join(f"{q:.2f}" for q in raw_quality[RAW[1]])
        + f"; with gradsift's count correction (the default): {min(sid_quality):.2f}-{max(sid_quality):.2f} across "
        f"dists and ratios. Selection speed-up over torch.topk {min(sid_speed or [0]):.2f}-"
        f"{max(sid_speed or [0]):.2f}x. "
        + "; ".join(f"{t}: time to target " + ", ".join(f"{k} {v:.2f}s" if v else f"{k} not reached" for k, v in tm.items())
                    for t, tm in speed_sections),
        verdict,
        "The quality verdict is the statistical estimate's (`correct=false`), as the paper's claim is; the default "
        "adds a correction of the count from the candidates (ours, `docs/methods/sidco.md`), which is what the "
        "corrected rows measure. The speed-up over sorting is the estimator's and reproduces on this CPU. "
        + " ".join(_attribution(t, tm, runs_final, tsteps) for (t, tm), (runs_final, tsteps) in
                   zip(speed_sections, finals)),
        f"estimate alone {min(raw_quality[RAW[0]]):.2f}-{max(raw_quality[RAW[0]]):.2f} (corrected "
        f"{min(sid_quality):.2f}-{max(sid_quality):.2f}); selection {min(sid_speed or [0]):.1f}-"
        f"{max(sid_speed or [0]):.1f}x faster than top-k",
        tables=[md_table(["compressor", "size", "ratio", "speed-up over torch.topk", "read passes", "k_ratio"], speed_rows),
                md_table(["ratio", "estimator", "mean achieved/target", "5-95% range"], q_rows),
                md_table(["task", "target", "SIDCo's speed-up over", "time-to-target ratio"], t_rows)],
        figures=figs, data={"sid_quality": sid_quality, "sid_speed": sid_speed, "raw_quality": raw_quality})
