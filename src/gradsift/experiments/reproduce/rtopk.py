"""rTop-k against top-k and random-k (Tables I and IV)."""

from __future__ import annotations

import statistics

from ...runconfig import RunConfig
from .common import Ctx, Section, final, md_table, plt, run, save, series, spread


# ------------------------------------------------------------------ 4. rTop-k
def exp_rtopk(ctx: Ctx) -> Section:
    name = "rtopk"
    ratios = [0.01] if ctx.quick else [0.01, 0.001]
    seeds = [0] if ctx.quick else [0, 1, 2]
    jobs = [("mnist1d-cnn", ctx.steps(60, 600), "momentum", 0.05, seeds, ctx.cnn())]
    if not ctx.quick and ctx.data is not None:
        jobs.append(("charlm", ctx.steps(60, 200), "sgd", 1.0, [0], {"hidden": 128, "seq_len": 32}))
    rows, blowups = [], []
    verdict_bits = []
    p = plt()
    fig, axes = p.subplots(1, len(jobs), figsize=(6 * len(jobs), 4), squeeze=False)
    for j, (task, steps, opt, lr, sds, topts) in enumerate(jobs):
        metric = "accuracy" if task != "charlm" else "perplexity"
        warm = steps // 10
        finals: dict[tuple[str, float], list[float]] = {}
        specs = [("dense", 1.0)] + [(m, r) for r in ratios for m in ("topk", "randomk", "rtopk")]
        for spec, r in specs:
            for seed in sds:
                # the stable regime: momentum correction (DGC's memory: the velocity accumulates before the
                # sparsifier) for every compressed method, the optimizer's momentum handed over; dense runs the
                # same momentum SGD. Error feedback under a momentum optimizer blew up 14 runs of an earlier report.
                if spec == "dense":
                    full = spec
                else:
                    full = f"{spec}:warmup={warm}" + (",memory=momentum" if opt == "momentum" else "")
                cfg = RunConfig(task=task, compressor=full, ratio=r, workers=5, steps=steps, seed=seed, optimizer=opt,
                                lr=lr, eval_every=max(steps // 6, 1), data=str(ctx.data) if task == "charlm" else None,
                                task_options=topts, clip_norm=0.25 if task == "charlm" else None)
                recs, summ = run(ctx, name, f"{task}-{spec}-{r}-seed{seed}", cfg)
                v = float("nan") if summ.get("status") == "diverged" else final(recs, metric)
                finals.setdefault((spec, r), []).append(v)
                losses = [x["loss"] for x in recs if x.get("loss") is not None]
                if spec != "dense" and losses and max(losses) > 1.1 * losses[0]:
                    blowups.append(f"{task} {spec} {(1 - r) * 100:g}% seed {seed} (loss {losses[0]:.3g} -> peak "
                                   f"{max(losses):.3g} at step {1 + losses.index(max(losses))})")
                if seed == sds[0]:
                    xs, ys = series(recs, metric)
                    axes[0][j].plot(xs, ys, label=f"{spec} {'' if spec == 'dense' else f'{(1 - r) * 100:g}%'}")
        for (spec, r), v in finals.items():
            rows.append([task, spec, "-" if spec == "dense" else f"{(1 - r) * 100:g}%", spread(v)])
        better = (lambda a, b: a > b) if metric == "accuracy" else (lambda a, b: a < b)
        for r in ratios:
            rt, tk, rk = (statistics.mean(finals[(m, r)]) for m in ("rtopk", "topk", "randomk"))
            verdict_bits.append((task, r, better(rt, tk), better(rt, rk)))
        axes[0][j].set_title(f"{task} (5 workers)")
        axes[0][j].set_xlabel("iteration")
        axes[0][j].set_ylabel(metric)
        if metric == "perplexity":
            axes[0][j].set_yscale("log")
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    fig_path = save(fig, ctx, name, "rtopk.png")
    # The claim is "better than top-k AND random-k": beating random-k alone is what any top-based method does, so
    # it does not make a partial reproduction; rTop-k must beat top-k somewhere for "partly".
    wins = sum(1 for b in verdict_bits if b[2])
    both = sum(1 for b in verdict_bits if b[2] and b[3])
    verdict = "reproduced" if both == len(verdict_bits) else ("partly" if wins else "not")
    return Section(
        name, "rTop-k against top-k and random-k (Tables I and IV)",
        "Table I (ResNet-18, CIFAR-10, distributed): rTop-k 93.25% vs top-k 92.46% at 99% compression, 89.34% vs "
        "86.12% at 99.9%, random-k 66.81% at 99%. Table IV (LSTM, PTB): rTop-k 82.49 perplexity at 99.9% vs top-k "
        "91.84; random-k 281.61 at 99%. \"rTop-k strategy has substantially better performance compared to top-k "
        "and random-k strategies under the same compression ratio.\"",
        f"5 workers; compression 99% and 99.9% (ratio 0.01 / 0.001{'; quick: 0.01 only' if ctx.quick else ''}); "
        "on mnist1d-cnn momentum correction (DGC's memory, momentum 0.9 accumulated before selection, the optimizer "
        "plain SGD) for every compressed method and momentum SGD for dense -- the same momentum everywhere; on "
        "charlm plain SGD with error feedback; DGC-style warm-up over the first 10% of steps for every compressed method "
        "(the paper warmed up for 5 epochs); r = 5k (k/r = 1/n as in the paper). "
        + "; ".join(f"`{t}`{' (' + ', '.join(f'{k}={v}' for k, v in to.items()) + ')' if to else ''}: {s} steps, "
                    f"{o} lr {l}, seeds {sd}" for t, s, o, l, sd, to in jobs)
        + ("; charlm with hidden 128, sequence 32, gradient clipping 0.25" if len(jobs) > 1 else "") + ".",
        "; ".join(f"{t} at {(1 - r) * 100:g}%: rTop-k {'beats' if w else 'does not beat'} top-k"
                  for t, r, w, _ in verdict_bits) + ".",
        verdict,
        "Orderings by mean over seeds (table). "
        + ("" if verdict == "reproduced" else
           f"rTop-k beats random-k in {sum(1 for b in verdict_bits if b[3])}/{len(verdict_bits)} settings and "
           f"top-k in {wins}/{len(verdict_bits)}; the paper's contribution is the gain over top-k, which "
           + ("holds only in some settings." if wins else "does not appear here."))
        + (f" Training loss rose more than 10% above its start in {len(blowups)} compressed run(s) ("
           + ", ".join(f"{m} {sum(1 for b in blowups if f' {m} ' in b)}" for m in ("topk", "randomk", "rtopk"))
           + "), e.g. " + "; ".join(blowups[:3]) + ": reported, not hidden; the regime is the same for every "
           "method."
           if blowups else ""),
        f"rTop-k beats top-k in {wins}/{len(verdict_bits)} settings",
        tables=[md_table(["task", "method", "compression", "final metric (mean [min, max])"], rows)],
        figures=[fig_path])
