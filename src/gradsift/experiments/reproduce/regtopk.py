"""REGTOP-k's experiments: the toy example (Fig. 1), linear regression (Fig. 2), a CNN at 0.1% (Fig. 3)."""

from __future__ import annotations

import math
import statistics

from ...runtime.runconfig import RunConfig
from .common import Ctx, Section, md_table, outcome, plt, run, save, series, spread


# ------------------------------------------------------------------ 1. REGTOP-k toy
def exp_regtopk_toy(ctx: Ctx) -> Section:
    name = "regtopk-toy"
    curves = {}
    for spec in ("dense", "topk", "regtopk"):
        recs, _ = run(ctx, name, spec, RunConfig(task="logistic-toy", compressor=spec, ratio=0.5, workers=2, steps=100))
        curves[spec] = [r["loss"] for r in recs]
    init = math.log1p(math.exp(-1))  # log(1 + e^-1): the loss at w0
    stall = next((i for i, v in enumerate(curves["topk"]) if abs(v - init) > 1e-12), len(curves["topk"]))
    p = plt()
    fig, ax = p.subplots(figsize=(6, 4))
    for spec, label in (("dense", "uncompressed"), ("topk", "TOP-1"), ("regtopk", "REGTOP-1")):
        ax.plot(range(1, len(curves[spec]) + 1), curves[spec], label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig_path = save(fig, ctx, name, "toy.png")
    reg50, reg100 = curves["regtopk"][49], curves["regtopk"][99]
    den50, den100 = curves["dense"][49], curves["dense"][99]
    ok = stall >= 90 and reg50 < 0.05 and reg100 < 2 * den100
    table = md_table(["method", "loss @1", "loss @50", "loss @100", "first update that moves"],
                     [["uncompressed", f"{curves['dense'][0]:.4f}", f"{den50:.4f}", f"{den100:.4f}", "1"],
                      ["TOP-1", f"{curves['topk'][0]:.4f}", f"{curves['topk'][49]:.4f}", f"{curves['topk'][99]:.4f}",
                       str(stall + 1) if stall < 100 else "> 100"],
                      ["REGTOP-1", f"{curves['regtopk'][0]:.4f}", f"{reg50:.4f}", f"{reg100:.4f}", "2"]])
    return Section(
        name, "REGTOP-k: the toy example (Fig. 1)",
        "\"TOP-1 is not able to reduce the empirical risk even after 100 iterations ... REGTOP-1 tracks "
        "non-sparsified training consistently\" (Sec. 1.2, Fig. 1).",
        "`logistic-toy`: 2 workers, x1 = [100, 1], x2 = [-100, 1], w0 = [0, 1], lr 0.9, float64, k = 1 "
        "(ratio 0.5 of 2 entries), error feedback; 100 updates.",
        f"TOP-1 keeps the loss at {init:.4f} until update {stall + 1}; REGTOP-1 reaches {reg50:.4f} at update 50 "
        f"and {reg100:.4f} at 100, uncompressed GD {den50:.4f} and {den100:.4f}.",
        "reproduced" if ok else "not",
        "The first entries cancel in the aggregate; REGTOP-k's posterior distortion damps them after one "
        "round, TOP-k keeps resending them until the second entry's accumulated error overtakes." if ok else
        "The stall or the escape did not appear as the paper describes.",
        f"TOP-1 stalls {stall} updates; REGTOP-1 {reg100:.3f} vs dense {den100:.3f} at 100",
        tables=[table], figures=[fig_path], data={"stall": stall, "reg50": reg50, "reg100": reg100, "dense100": den100})


# ------------------------------------------------------------------ 2. REGTOP-k linear regression
def exp_regtopk_linreg(ctx: Ctx) -> Section:
    name = "regtopk-linreg"
    s_values = [0.6] if ctx.quick else [0.4, 0.5, 0.6]
    seeds = [0] if ctx.quick else [0, 1, 2]
    # the paper's budget, which --scale leaves; --quick stops at half of it, where top-k's stall and REGTOP-k's fall
    # to under 1e-4 are both plain (gaps 0.0156 against 9.5e-6 at step 1500, 0.0161 against 2.4e-11 at 3000)
    steps = 1500 if ctx.quick else 3000
    gaps: dict[tuple[float, str, int], list[tuple[int, float]]] = {}
    for s in s_values:
        for seed in seeds:
            for spec in ("dense", "topk", "regtopk"):
                cfg = RunConfig(task="linreg", compressor=spec, ratio=s, workers=20, steps=steps, lr=0.01, seed=seed,
                                eval_every=10)
                recs, _ = run(ctx, name, f"S{s}-{spec}-seed{seed}", cfg)
                gaps[(s, spec, seed)] = list(zip(*series(recs, "opt_gap")))
    p = plt()
    fig, axes = p.subplots(1, len(s_values), figsize=(5 * len(s_values), 4), squeeze=False)
    rows = []
    for j, s in enumerate(s_values):
        ax = axes[0][j]
        for spec, label, color in (("dense", "uncompressed GD", "C0"), ("topk", "TOP-k", "C1"), ("regtopk", "REGTOP-k", "C2")):
            for seed in seeds:
                pts = gaps[(s, spec, seed)]
                ax.plot([a for a, _ in pts], [b for _, b in pts], color=color, alpha=0.9 if seed == seeds[0] else 0.35,
                        label=label if seed == seeds[0] else None)
            rows.append([f"S = {s}", label, spread([gaps[(s, spec, sd)][-1][1] for sd in seeds])])
        ax.set_yscale("log")
        ax.set_title(f"S = {s}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("optimality gap ||w - w*||")
        ax.grid(alpha=0.3)
        ax.legend()
    fig_path = save(fig, ctx, name, "linreg.png")
    s6 = 0.6
    top6 = [gaps[(s6, "topk", sd)][-1][1] for sd in seeds]
    reg6 = [gaps[(s6, "regtopk", sd)][-1][1] for sd in seeds]
    # Algorithm 1's Delta as printed (form=paper) over a sweep of mu, at S = 0.6
    mus = [4.0] if ctx.quick else [1.0, 4.0, 16.0]
    printed: dict[float, list[float]] = {}
    fig2, ax2 = p.subplots(figsize=(6, 4))
    for spec, label, color in (("dense", "uncompressed GD", "C0"), ("topk", "TOP-k", "C1")):
        pts = gaps[(s6, spec, seeds[0])]
        ax2.plot([a for a, _ in pts], [b for _, b in pts], color=color, label=label)
    for i, mu in enumerate(mus):
        printed[mu] = []
        for seed in seeds:
            cfg = RunConfig(task="linreg", compressor=f"regtopk:form=paper,mu={mu:g}", ratio=s6, workers=20,
                            steps=steps, lr=0.01, seed=seed, eval_every=10)
            recs, _ = run(ctx, name, f"S{s6}-paper-mu{mu:g}-seed{seed}", cfg)
            pts = list(zip(*series(recs, "opt_gap")))
            printed[mu].append(pts[-1][1])
            if seed == seeds[0]:
                ax2.plot([a for a, _ in pts], [b for _, b in pts], color=f"C{i + 3}",
                         label=f"REGTOP-k as printed, mu = {mu:g}")
        rows.append([f"S = {s6}", f"REGTOP-k as printed (form=paper), mu = {mu:g}", spread(printed[mu])])
    ax2.set_yscale("log")
    ax2.set_title(f"S = {s6}: Delta as printed (seed {seeds[0]})")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("optimality gap ||w - w*||")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig2_path = save(fig2, ctx, name, "linreg-printed.png")
    good = [r < 1e-4 and r * 100 <= t for r, t in zip(reg6, top6)]
    code_ok = all(good)
    # the printed form separates from TOP-k where every seed ends at least 100x under TOP-k's gap at some mu
    printed_ok = [mu for mu in mus if all(r * 100 <= t for r, t in zip(printed[mu], top6))]
    verdict = "reproduced" if code_ok and printed_ok else ("partly" if any(good) or printed_ok else "not")
    best_mu = min(mus, key=lambda m: statistics.mean(printed[m]))
    return Section(
        name, "REGTOP-k: distributed linear regression (Fig. 2)",
        "\"REGTOP-k starts to track the (non-sparsified) distributed SGD at S = 0.6 while TOP-k remains at a "
        "certain distance from the optimal solution\" (Sec. 4.1, Fig. 2).",
        f"`linreg` (the paper's generator: 20 workers x 500 points x dim 100, U = 0, sigma^2 = 5, h^2 = 1, "
        f"epsilon = 0.5), full-batch GD, lr 0.01, {steps} iterations, float64, error feedback; "
        f"S in {s_values}, data seeds {seeds}. Two forms of REGTOP-k's Delta: the authors' code (`form=code`, the "
        "default: Delta divided by the value sent last round), mu = 4; and Algorithm 1 as printed (`form=paper`), "
        f"at S = {s6} over mu in {[f'{m:g}' for m in mus]}.",
        f"Final gap at S = 0.6: REGTOP-k (code form) {spread(reg6)}, TOP-k {spread(top6)}; as printed "
        + ", ".join(f"mu = {m:g} {spread(printed[m])}" for m in mus) + " (mean [min, max] over seeds).",
        verdict,
        ("With the authors' code form, at S = 0.6 REGTOP-k follows uncompressed GD far below TOP-k's plateau, as "
         "in Fig. 2" if code_ok else "With the authors' code form, REGTOP-k did not reach the paper's separation "
         "on every data seed") + "; "
        + (f"Algorithm 1's Delta as printed separates as well (mu {', '.join(f'{m:g}' for m in printed_ok)})."
           if printed_ok else
           f"Algorithm 1's Delta as printed does not: at every mu tried it ends at TOP-k's plateau (best mu = "
           f"{best_mu:g}: {spread(printed[best_mu])} against TOP-k's {spread(top6)}), so the claim rests on the "
           "code's form, which gradsift makes the default.")
        + " At S = 0.4-0.5 both sparsifiers sit far above GD at this budget (see the table).",
        f"S = 0.6: REGTOP-k {spread(reg6)} (code form; as printed, best mu {best_mu:g}: "
        f"{spread(printed[best_mu])}) vs TOP-k {spread(top6)}",
        tables=[md_table(["sparsity", "method", "final optimality gap (mean [min, max])"], rows)],
        figures=[fig_path, fig2_path], data={"top6": top6, "reg6": reg6, "printed": {f"{m:g}": v for m, v in
                                                                                    printed.items()}})


# ------------------------------------------------------------------ 3. REGTOP-k CNN
# The paper's ResNet-18 has 11M parameters: at 0.1% of the whole model each worker sends about 11k entries. A
# CNN whose head is one wide fully connected layer (as VGG's, where most parameters sit) reaches that size at a
# cost these CPUs can train: 128 channels, hidden 16384, 10.6M parameters, k = 10.6k.
BIG_CNN = {"channels": 128, "hidden": 16384}


def exp_regtopk_cnn(ctx: Ctx) -> Section:
    name = "regtopk-cnn"
    task = "digits-cnn" if ctx.quick else "mnist1d-cnn"
    options = {} if ctx.quick else dict(BIG_CNN)
    seeds = [0] if ctx.quick else [0, 1, 2]
    steps = ctx.steps(60, 1000)
    every = 20 if ctx.quick else 100
    # The paper's optimizer is plain SGD at lr 0.01 for ResNet-18; on these CNNs at 0.1% it hardly moves within
    # the budget (mnist1d-cnn stayed below 0.4 accuracy after 1500 steps), so the full size trains with the
    # task's momentum SGD (0.9, lr 0.05), the same for both methods; --quick keeps the paper's.
    olabel, opt, lr = ("paper: SGD lr 0.01", "sgd", 0.01) if ctx.quick else ("momentum 0.9, lr 0.05", "momentum", 0.05)
    methods = (("topk", "TOP-k", "C1"), ("regtopk:mu=5", "REGTOP-k", "C2"))
    p = plt()
    fig, ax = p.subplots(figsize=(7, 4.5))
    res: dict[tuple[str, int], tuple[list[dict], dict]] = {}
    for seed in seeds:
        for spec, _, _ in methods:
            cfg = RunConfig(task=task, compressor=spec, ratio=0.001, workers=8, batch_size=20, lr=lr,
                            optimizer=opt, steps=steps, seed=seed, eval_every=every, granularity="model",
                            task_options=options)
            res[(spec, seed)] = run(ctx, name, f"{task}-{opt}-{lr:g}-model-{spec}-seed{seed}", cfg)
    rows, finals, at = [], {}, {}
    for spec, label, color in methods:
        curves = [series(res[(spec, sd)][0], "accuracy") for sd in seeds]
        xs = curves[0][0]
        ax.plot(xs, [statistics.mean(c[1][n] for c in curves) for n in range(len(xs))], color=color, label=label)
        if len(seeds) > 1:
            ax.fill_between(xs, [min(c[1][n] for c in curves) for n in range(len(xs))],
                            [max(c[1][n] for c in curves) for n in range(len(xs))], color=color, alpha=0.2)
        finals[spec] = [outcome(*res[(spec, sd)], "accuracy") for sd in seeds]
        # the paper's first mark: where REGTOP-k starts to lead (600 iterations)
        mark = min(xs, key=lambda x: abs(x - min(600, steps)))
        at[spec] = [c[1][c[0].index(mark)] if mark in c[0] else float("nan") for c in curves]
        rows.append([label, spread(at[spec]), spread(finals[spec])])
    diffs = [r - t for r, t in zip(finals["regtopk:mu=5"], finals["topk"])]
    early = [r - t for r, t in zip(at["regtopk:mu=5"], at["topk"])]
    rows.append(["REGTOP-k - TOP-k", spread(early), spread(diffs)])
    ax.set_title(f"{task}, whole model at 0.1%, {olabel}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig_path = save(fig, ctx, name, "cnn.png")
    # reproduced: REGTOP-k ahead in every seed and by more than 2 points on average; partly: by more than 1 point
    ok = [d for d in diffs if math.isfinite(d)]
    gain = statistics.mean(ok) if ok else float("nan")
    verdict = ("reproduced" if len(ok) == len(diffs) and all(d > 0 for d in ok) and gain > 0.02 else
               ("partly" if gain > 0.01 else "not"))
    params = next((v[0][0] for v in ctx.sizes.get(name, {}).values()), float("nan"))
    k = max(1, round(0.001 * params)) if math.isfinite(params) else float("nan")
    return Section(
        name, "REGTOP-k: CNN at 0.1% density (Fig. 3, scaled)",
        "\"after the first 600 iterations ... REGTOP-k starts to give strictly higher accuracy ... As the number "
        "of iterations surpasses 1500, the difference between the accuracy values exceeds 8%\" (ResNet-18 on "
        "CIFAR-10, 8 workers, batch 20, lr 0.01, S = 0.001; Sec. 4.2, Fig. 3).",
        f"`{task}`" + (f" with options {options} (three convolutions, then a fully connected layer of "
                       f"{options['hidden']:,} units before the classifier)" if options else "")
        + f"; 8 workers, batch 20 each, ratio 0.001 of the whole model ranked as one vector (granularity `model`, "
        f"as the paper's S), k = {k:,} entries per worker per step; {steps} iterations, error feedback; optimizer "
        f"{olabel}, the same for both methods"
        + ("" if ctx.quick else " (the paper's plain SGD at lr 0.01 hardly moves these CNNs at 0.1% within the "
                                "budget)") + "; REGTOP-k with mu = 5 as the paper used for its CNN; identical "
        f"initialization and batch order for both methods; seeds {seeds}.",
        "; ".join(f"{r[0]}: {r[1]} at iteration {min(600, steps)}, {r[2]} final" for r in rows),
        verdict,
        f"REGTOP-k's final accuracy minus TOP-k's, per seed: {', '.join(f'{d:+.4f}' for d in diffs)} "
        "(reproduced: ahead in every seed and by more than 2 accuracy points on average; partly: by more than 1 "
        f"point on average). The regime: a {params:,.0f}-parameter CNN (the paper's ResNet-18: 11.2M), the whole "
        f"model at 0.1%, so each worker sends {k:,} entries a step (the paper's about 11k)"
        + ("; most of our parameters sit in one fully connected layer where ResNet-18's sit in convolutions, the "
           "data is MNIST-1D rather than CIFAR-10" if options else "") + f", and the optimizer is {olabel}.",
        f"{task}: {verdict}",
        tables=[md_table(["method", f"test accuracy at iteration {min(600, steps)} (mean [min, max])",
                          "final test accuracy (mean [min, max])"], rows)],
        figures=[fig_path]).judged_against_chance([a for v in finals.values() for a in v if math.isfinite(a)])
