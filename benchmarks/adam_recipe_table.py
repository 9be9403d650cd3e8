"""The Adam recipe's evidence: what trains gptlm at 8 workers and ratio 0.01 with AdamW (docs/recipes.md).

    OMP_NUM_THREADS=1 python benchmarks/adam_recipe_table.py [--steps 300] [--data PATH]

Each row is one simulated run (seed 0, the task's AdamW, warm-up and cosine decay over the steps, clipping at 1,
the wire plan on); prints a markdown table of the validation loss every 100 steps and the bytes a worker sends.
"""

import argparse
import time

from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator

ROWS = [
    ("dense", 1.0, "dense AdamW"),
    ("topk:memory=ef", 0.01, "the gradient compressed (error feedback), AdamW's moments of the mean"),
    ("topk:memory=adam,scale=worker,nesterov=false", 1.0, "every worker's Adam, uncompressed"),
    ("topk:memory=adam,nesterov=false", 1.0, "every worker's Adam, the mean's second moment estimated, uncompressed"),
    ("topk:memory=adam,scale=worker,nesterov=false", 0.01, "every worker's Adam direction, error feedback"),
    ("topk:memory=adam,nesterov=false", 0.01, "... with the mean's second moment estimated"),
    ("topk:memory=adam,masking=true", 0.01, "... and Nesterov, and momentum factor masking"),
    ("topk", 0.01, "the recipe: topk:memory=adam (mean second moment, Nesterov)"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--data", default="../shared/data/tinyshakespeare.txt")
    a = ap.parse_args()
    print(f"| spec | ratio | what | validation loss at {', '.join(str(s) for s in range(100, a.steps + 1, 100))} "
          "| KiB/worker/step |")
    print("|---|---|---|---|---|")
    for spec, ratio, what in ROWS:
        t0 = time.time()
        sim = Simulator(RunConfig(task="gptlm", data=a.data, compressor=spec, ratio=ratio, workers=8, steps=a.steps,
                                  seed=0, wire_plan="auto", eval_every=100))
        recs = sim.run()
        losses = ", ".join(f"{r['valid_loss']:.3f}" for r in recs if r.get("valid_loss") is not None)
        kib = sum(r["bytes_per_worker"] for r in recs) / len(recs) / 1024
        print(f"| `{sim.cfg.compressor}` | {ratio:g} | {what} | {losses} | {kib:.1f} |  ({time.time() - t0:.0f}s)",
              flush=True)


if __name__ == "__main__":
    main()
