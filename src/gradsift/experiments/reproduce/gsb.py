"""GSB: sampling quality (phi, tau; Fig. 3) and accuracy against GS, RS and RSB (Table 1)."""

from __future__ import annotations

import statistics

from ...runtime.runconfig import RunConfig
from .common import (Ctx, Section, all_above, diverged, finite_mean, md_table, outcome, plt, run, save, series,
                     spread)


# ------------------------------------------------------------------ 5. GSB
def _phi_tau(ctx: Ctx, spec: str, steps: int) -> tuple[list[float], list[float]]:
    """Share of the sampled entries among the k largest of the round's global (mean) gradient (phi), and share of
    coordinates sampled at least once (tau), for the largest layer over ``steps`` iterations."""
    import torch

    from ...runtime.simulate import Simulator

    cfg = RunConfig(task="mnist1d-cnn", compressor=spec, ratio=0.01, workers=8, steps=steps, seed=0, eval_every=10**6,
                    wire_plan=False, task_options=ctx.cnn())
    sim = Simulator(cfg)
    i = max(range(len(sim.params)), key=lambda j: sim.params[j].numel())
    d = sim.params[i].numel()
    k = max(1, round(0.01 * d))
    seen = torch.zeros(d, dtype=torch.bool)
    phi, tau = [], []
    with ctx.progress.task(f"gsb: phi/tau {spec}", steps) as advance:
        for _ in range(steps):
            sim.step()
            pl = sim.last_payloads[0][i]
            if pl.kind == "dense":
                advance(1)
                continue
            full = torch.stack([g[i].reshape(-1) for g in sim.last_grads]).mean(0)  # the round's global gradient
            top = torch.topk(full.abs(), k).indices
            hit = torch.isin(pl.indices, top).sum().item()
            phi.append(hit / max(pl.count, 1))
            seen[pl.indices] = True
            tau.append(seen.float().mean().item())
            advance(1)
    return phi, tau


def exp_gsb(ctx: Ctx) -> Section:
    name = "gsb"
    seeds = [0] if ctx.quick else [0, 1, 2]
    steps = ctx.steps(40, 600)
    methods = [("RS", "rsb:alpha=1.0"), ("GS", "gs"), ("RSB", "rsb"), ("GSB", "gsb")]
    literal = [("RSB eq.13 literal", "rsb:decay=visited"), ("GSB eq.13 literal", "gsb:decay=visited")]
    finals: dict[str, list[float]] = {}
    curves: dict[str, tuple] = {}
    for label, spec in methods + literal:
        for seed in seeds:
            cfg = RunConfig(task="mnist1d-cnn", compressor=spec, ratio=0.01, workers=8, steps=steps, seed=seed,
                            eval_every=max(steps // 6, 1), task_options=ctx.cnn())
            recs, summ = run(ctx, name, f"{label.replace(' ', '-')}-seed{seed}", cfg)
            finals.setdefault(label, []).append(outcome(recs, summ, "accuracy"))
            if seed == seeds[0]:
                curves[label] = series(recs, "accuracy")
    # the regime where random sampling is near dense: unsent values kept (error feedback) until sampled or refreshed
    ef_seeds = seeds[:2]
    ef: dict[str, list[float]] = {}
    for label, spec in [("dense", "dense")] + [(m, f"{s}{',' if ':' in s else ':'}memory=ef") for m, s in methods]:
        for seed in ef_seeds:
            cfg = RunConfig(task="mnist1d-cnn", compressor=spec, ratio=0.01 if spec != "dense" else 1.0, workers=8,
                            steps=steps, seed=seed, eval_every=max(steps // 6, 1), task_options=ctx.cnn())
            recs, summ = run(ctx, name, f"ef-{label}-seed{seed}", cfg)
            ef.setdefault(label, []).append(outcome(recs, summ, "accuracy"))
    alphas = [] if ctx.quick else [0.6, 0.7, 0.8, 0.9, 0.95, 0.99]
    sweep, sweep_lit = {}, {}
    for a in alphas:
        for decay, into, reading in (("sampled", sweep, alphas), ("visited", sweep_lit, (0.6, 0.9, 0.99))):
            if a not in reading:
                continue
            vals = []
            for seed in seeds[:2]:
                cfg = RunConfig(task="mnist1d-cnn", compressor=f"gsb:alpha={a}" + (",decay=visited" if decay ==
                                "visited" else ""), ratio=0.01, workers=8, steps=steps, seed=seed, eval_every=steps,
                                task_options=ctx.cnn())
                recs, summ = run(ctx, name, f"alpha{a}-{decay}-seed{seed}" if decay == "visited" else
                                 f"alpha{a}-seed{seed}", cfg)
                vals.append(outcome(recs, summ, "accuracy"))
            into[a] = vals
    it = 30 if ctx.quick else 100
    ptau = {label: _phi_tau(ctx, spec, it + 1) for label, spec in methods + literal}
    p = plt()
    fig, axes = p.subplots(1, 3, figsize=(16, 4))
    for label, (xs, ys) in curves.items():
        axes[0].plot(xs, ys, label=label)
    axes[0].set_title("test accuracy (seed 0)")
    axes[0].set_xlabel("iteration")
    for label in ptau:
        axes[1].plot(range(1, len(ptau[label][0]) + 1), [100 * v for v in ptau[label][0]], label=label)
        axes[2].plot(range(1, len(ptau[label][1]) + 1), [100 * v for v in ptau[label][1]], label=label)
    axes[1].set_title("phi: % of sampled entries among the k largest")
    axes[2].set_title("tau: % of coordinates sampled so far")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_xlabel("iteration")
    fig_path = save(fig, ctx, name, "gsb.png")
    phi_mean = {k: statistics.mean(v[0]) if v[0] else float("nan") for k, v in ptau.items()}
    tau_end = {k: v[1][-1] if v[1] else float("nan") for k, v in ptau.items()}
    means = {k: finite_mean(v) for k, v in finals.items()}
    lost = {k: diverged(v) for k, v in list(finals.items()) + [(f"{k} (error feedback)", v) for k, v in ef.items()]
            + [(f"GSB alpha {a:g}", v) for a, v in sweep.items()] if diverged(v)}
    # a method with a diverged seed cannot head the ordering; the others compare on the seeds that finished
    order_ok = not lost.get("GSB") and means["GSB"] >= max(means["GS"], means["RSB"], means["RS"])
    phi_ok = phi_mean["GS"] > 3 * phi_mean["RS"]
    tau_ok = tau_end["RSB"] > tau_end["RS"] and tau_end["GSB"] > tau_end["GS"]
    n_ok = sum([order_ok, phi_ok, tau_ok])
    verdict = "reproduced" if n_ok == 3 else ("partly" if n_ok else "not")
    best = max((k for k in means if k in dict(methods) and means[k] == means[k]), key=means.get, default="GSB")
    if max(means.values()) < 0.15:  # ten classes: chance is 0.1
        acc_note = (f"Every method ends near chance (at most {max(means.values()):.3f}): the accuracy ordering is "
                    "inconclusive at this scale.")
    elif best == "GSB":
        acc_note = "GSB has the highest mean final accuracy."
    else:
        apart = all_above(finals[best], finals["GSB"])
        acc_note = (f"{best} has the highest mean final accuracy ({means[best]:.3f} vs GSB {means['GSB']:.3f}); "
                    + ("one seed: within noise at this scale." if len(seeds) == 1 else
                       "every seed of it is above every seed of GSB." if apart else
                       "their seed ranges overlap, so that order is within noise."))
    rows = [[k, spread(v)] for k, v in finals.items()]
    tables = [md_table(["method", "final accuracy (mean [min, max])"], rows),
              md_table(["method", f"phi, mean over {it} iterations", f"tau after {it} iterations"],
                       [[k, f"{100 * phi_mean[k]:.1f}%", f"{100 * tau_end[k]:.1f}%"] for k in ptau])]
    if sweep:
        tables.append(md_table(["alpha"] + [str(a) for a in alphas],
                               [["GSB accuracy (prior x alpha per sampling)"] + [spread(sweep[a]) for a in alphas],
                                ["GSB accuracy (eq. 13 literal)"] + [spread(sweep_lit[a]) if a in sweep_lit else "-"
                                                                     for a in alphas]]))
    tables.append(md_table(["method (error feedback: unsent values kept)", "final accuracy (mean [min, max])"],
                           [[k, spread(v)] for k, v in ef.items()]))
    ef_means = {k: finite_mean(v) for k, v in ef.items()}
    ef_order = ef_means["RS"] < ef_means["RSB"] and ef_means["GS"] < ef_means["GSB"]
    ef_near = ef_means["RS"] >= ef_means["dense"] - 0.05  # "near dense": within 5 points
    trend = ""
    if len(sweep) > 1:
        ms = [finite_mean(sweep[a]) for a in alphas]
        rising = all(b >= a - 0.005 for a, b in zip(ms, ms[1:])) and ms[-1] > ms[0] + 0.01
        trend = (f" GSB's accuracy against alpha ({', '.join(f'{a:g}: {m:.3f}' for a, m in zip(alphas, ms))}) "
                 + ("rises with alpha: the weaker the prior, the better in this regime (the paper: flat for "
                    "0.8-0.95)." if rising else "shows no steady trend (the paper: flat for 0.8-0.95)."))
    return Section(
        name, "GSB: gradient sampling with a Bayes prior (Tables 1-2, Fig. 3)",
        "Table 1 (ResNet-50, ImageNet): RS 75.65, GS 76.13, RSB 75.97, GSB 76.41. Table 2: accuracy flat for alpha in "
        "0.8-0.95 (76.41-76.39). Fig. 3: \"phi_GS is about 8 times higher than that of phi_RS\"; \"tau_RSB are "
        "increasingly larger than tau_RS as iteration goes\".",
        f"`mnist1d-cnn` ({'128 channels' if ctx.cnn() else '32 channels'}), 8 workers, ratio 0.01 of the sampled "
        "part, refresh every tau = 100 steps with the Bayes prior restarting at each refresh, FP16 values, "
        f"no error feedback (the paper's scheme), {steps} steps, seeds {seeds}. RS is `rsb:alpha=1.0` (uniform "
        f"Bernoulli sampling in the same pipeline); alpha sweep {alphas or 'skipped in --quick'} (2 seeds each; "
        "eq. 13 read literally at 0.6, 0.9, 0.99); the same four with error feedback (`memory=ef`: unsent values "
        "kept until sampled or refreshed) beside dense, 2 seeds. "
        f"Fig. 3's phi and tau on the largest layer ({it} iterations, seed 0).",
        "Final accuracy: " + ", ".join(f"{k} {spread(v)}" for k, v in finals.items())
        + f". phi: GS {100 * phi_mean['GS']:.1f}% vs RS {100 * phi_mean['RS']:.1f}%; tau after {it}: RS "
          f"{100 * tau_end['RS']:.1f}%, RSB {100 * tau_end['RSB']:.1f}%, GS {100 * tau_end['GS']:.1f}%, GSB "
          f"{100 * tau_end['GSB']:.1f}%.",
        verdict,
        f"Accuracy ordering GSB best: {'yes' if order_ok else 'no'}; GS captures many more of the largest "
        f"entries than RS: {'yes' if phi_ok else 'no'}; the prior widens coverage: {'yes' if tau_ok else 'no'}. "
        "The sampling mechanics (phi, tau) are properties of the method" + (" and reproduce. " if phi_ok and tau_ok
                                                                           else ". ") + acc_note
        + " The paper's four accuracies lie within 0.8 points of each other (Table 1). The regime is not the "
        f"paper's: without error feedback RS reaches {means['RS']:.3f} here where the paper's RS is within a point "
        "of SGD, so a sampler that sends the largest entries (GS) wins by construction. "
        + (f"With unsent values kept (error feedback, {len(ef_seeds)} seeds) RS nears dense ({ef_means['RS']:.3f} "
           f"against {ef_means['dense']:.3f}), and there the paper's orderings RS < RSB and GS < GSB "
           + ("hold." if ef_order else "do not both hold") if ef_near else
           f"No regime where RS nears dense was found: with unsent values kept (error feedback, {len(ef_seeds)} "
           + (f"seeds) RS diverged on every seed (dense {ef_means['dense']:.3f}; RS without it {means['RS']:.3f})"
              if ef_means["RS"] != ef_means["RS"] else
              f"seeds) RS reaches {ef_means['RS']:.3f} against dense {ef_means['dense']:.3f}, below its "
              f"{means['RS']:.3f} without")
           + " -- a coordinate sampled with probability about 1% waits about 100 steps in "
           "memory and the task's momentum replays the burst, rTop-k's failure mode (docs/methods/rtopk.md; plain "
           "SGD was not tried here). The orderings there")
        + f" (RS {_acc(ef_means['RS'])}, RSB {_acc(ef_means['RSB'])}, GS {_acc(ef_means['GS'])}, GSB "
          f"{_acc(ef_means['GSB'])}: RS < RSB {_less(ef_means['RS'], ef_means['RSB'])}, GS < GSB "
          f"{_less(ef_means['GS'], ef_means['GSB'])})."
        + (f" Eq. 13 read literally (every visited coordinate decays every step; `decay=visited`): coverage after "
           f"{it} iterations RSB {100 * tau_end['RSB eq.13 literal']:.1f}%, GSB {100 * tau_end['GSB eq.13 literal']:.1f}% "
           f"(the default reading: {100 * tau_end['RSB']:.1f}%, {100 * tau_end['GSB']:.1f}%), accuracy RSB "
           f"{spread(finals['RSB eq.13 literal'])}, GSB {spread(finals['GSB eq.13 literal'])}. The default counts "
           "samplings, as the paper's example (\"being sampled three times in succession ... 0.8^3\") does.")
        + trend
        + (" Diverged (left out of the means above, and no method with a diverged seed heads the ordering): "
           + ", ".join(f"{k} {n} of {len(seeds) if k in finals else 2} seeds" for k, n in lost.items()) + "."
           if lost else " No run diverged."),
        f"phi GS/RS {phi_mean['GS'] / max(phi_mean['RS'], 1e-9):.1f}x; accuracy order {'as paper' if order_ok else 'differs'}",
        tables=tables, figures=[fig_path]).judged_against_chance([a for v in finals.values() for a in v])


def _acc(mean: float) -> str:
    """A mean accuracy for the verdict; NaN (every seed diverged) says so."""
    return "diverged" if mean != mean else f"{mean:.3f}"


def _less(a: float, b: float) -> str:
    """Whether ``a < b``, for the verdict; with a side that diverged on every seed the order is not decided."""
    return "n/a (diverged)" if a != a or b != b else ("yes" if a < b else "no")
