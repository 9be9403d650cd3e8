"""Which Adam recipe trains with error-fed top-k? A probe on gptlm (8 simulated workers, ratio 0.01), not a
method of gradsift's: three ways to combine AdamW with sparsified exchange, against dense AdamW.

    OMP_NUM_THREADS=1 python benchmarks/adam_sparse_probe.py MODE SPEC STEPS [--data PATH]

MODE ``grad``: what gradsift does today -- the gradient is compressed with error feedback, the optimizer (AdamW)
keeps its moments of the mean it receives. ``update``: every worker keeps AdamW moments of its own (clipped)
gradient and compresses its update direction m/(sqrt(v)+eps) with error feedback; the mean direction is applied
by SGD with the same decay groups and learning rate (compressing the update, as 1-bit Adam and DeMo do in their
ways). ``frozen``: the second moment is measured on the true mean gradient for the first 60 steps (a dense
warm-up's, as 1-bit Adam freezes it) and frozen; the compressed mean gradient then drives the first moment, so
the step is linear in the gradient and error feedback's sum is exact. ``oracle``: the compressed mean gradient
drives the first moment, the second moment is AdamW's of the true mean gradient at every step (a diagnosis, not
a method: it needs the dense mean). Prints the validation loss every 50 steps. gradsift's Adam recipe
(``memory=adam``, gradsift.memory.adam) grew out of ``update``; benchmarks/adam_recipe_table.py measures it.
"""

import argparse
import time

import torch

from gradsift.runtime.runconfig import RunConfig, make_optimizer
from gradsift.runtime.simulate import Simulator

B1, B2, EPS, WARM = 0.9, 0.999, 1e-8, 60


def update_mode(sim, cfg):
    ms = [[torch.zeros_like(p) for p in sim.params] for _ in range(sim.n)]
    vs = [[torch.zeros_like(p) for p in sim.params] for _ in range(sim.n)]
    t = [0]
    measured = sim.gradients

    def gradients(s):
        grads, losses, compute = measured(s)
        t[0] += 1
        c1, c2 = 1 - B1 ** t[0], 1 - B2 ** t[0]
        out = []
        for w, gs in enumerate(grads):
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])))
            f = min(1.0, cfg.clip_norm / (norm + 1e-6)) if cfg.clip_norm else 1.0
            d = []
            for g, m, v in zip(gs, ms[w], vs[w]):
                m.mul_(B1).add_(g * f, alpha=1 - B1)
                v.mul_(B2).addcmul_(g * f, g * f, value=1 - B2)
                d.append((m / c1) / ((v / c2).sqrt() + EPS))
            out.append(d)
        return out, losses, compute

    sim.gradients = gradients
    sim.optimizer = make_optimizer(cfg, sim.named, name="sgd", decays=getattr(sim.task, "decays", None))
    cfg.clip_norm = None


def true_second_moment_mode(sim, cfg, measure_steps: int | None):
    """The compressed mean gradient drives Adam's first moment; the second moment is measured on the true mean
    gradient for ``measure_steps`` steps and then frozen (``frozen``), or at every step (``oracle``: None)."""
    v = [torch.zeros_like(p) for p in sim.params]
    m = [torch.zeros_like(p) for p in sim.params]
    t = [0, 0]  # steps the second moment measured, optimizer steps
    measured = sim.gradients

    def gradients(s):
        grads, losses, compute = measured(s)
        if measure_steps is None or t[0] < measure_steps:
            t[0] += 1
            for i, vi in enumerate(v):
                g = sum(gs[i] for gs in grads) / len(grads)
                vi.mul_(B2).addcmul_(g, g, value=1 - B2)
        return grads, losses, compute

    base = make_optimizer(cfg, sim.named, name="sgd", decays=getattr(sim.task, "decays", None))
    index = {id(p): i for i, p in enumerate(sim.params)}

    class TrueSecondMoment:
        param_groups = base.param_groups

        def zero_grad(self, set_to_none=True):
            base.zero_grad(set_to_none=True)

        @torch.no_grad()
        def step(self):
            t[1] += 1
            c1, c2 = 1 - B1 ** t[1], 1 - B2 ** t[0]
            for g in base.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        i = index[id(p)]
                        m[i].mul_(B1).add_(p.grad, alpha=1 - B1)
                        p.mul_(1 - g["lr"] * g["weight_decay"])
                        p.sub_(g["lr"] * (m[i] / c1) / ((v[i] / c2).sqrt() + EPS))

    sim.gradients = gradients
    sim.optimizer = TrueSecondMoment()
    cfg.clip_norm = None


MODES = {"grad": lambda sim, cfg: None, "update": update_mode,
         "frozen": lambda sim, cfg: true_second_moment_mode(sim, cfg, WARM),
         "oracle": lambda sim, cfg: true_second_moment_mode(sim, cfg, None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=tuple(MODES))
    ap.add_argument("spec")
    ap.add_argument("steps", type=int)
    ap.add_argument("--data", default="../shared/data/tinyshakespeare.txt")
    a = ap.parse_args()
    # recipe=False: the spec's own memory (error feedback on what each mode hands it), not the Adam recipe
    sim = Simulator(RunConfig(task="gptlm", data=a.data, compressor=a.spec, ratio=0.01, workers=8, steps=a.steps,
                              seed=0, wire_plan="auto", recipe=False))
    MODES[a.mode](sim, sim.cfg)
    t0 = time.time()
    recs = sim.run()
    print(a.mode, a.spec, [(r["step"], round(r["valid_loss"], 3)) for r in recs if r.get("valid_loss") is not None],
          f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
