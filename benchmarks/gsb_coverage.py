"""Coverage and energy of the sampling methods on a fixed heavy-tailed gradient, both readings of GSB's eq. 13
(docs/methods/gsb.md): d = 1e5, ratio 0.01, Student-t(2) entries, the refresh at step 0 (tau = 1000), then 100
sampling steps. Prints, per method, the share of coordinates sampled at least once and the mean share of the
gradient's energy (sum of squares) a step's sample holds.

    .venv/bin/python benchmarks/gsb_coverage.py
"""

from __future__ import annotations

import torch

from gradsift import make_compressor

D, RATIO, STEPS = 100_000, 0.01, 100
SPECS = [("RS", "rsb:alpha=1"), ("GS", "gs"), ("RSB", "rsb"), ("GSB", "gsb"),
         ("RSB, decay=visited", "rsb:decay=visited"), ("GSB, decay=visited", "gsb:decay=visited")]


def main() -> None:
    torch.manual_seed(0)
    grad = torch.distributions.StudentT(torch.tensor(2.0)).sample((D,))
    energy_all = float(grad.square().sum())
    print("| method | coverage after %d steps | gradient energy per step |\n|---|---|---|" % STEPS)
    for label, spec in SPECS:
        comp = make_compressor(spec + ("," if ":" in spec else ":") + "tau=1000", RATIO)
        comp.observe("w", comp.compress("w", grad), grad)  # step 0: the refresh gives the global distribution
        seen = torch.zeros(D, dtype=torch.bool)
        energy = 0.0
        for _ in range(STEPS):
            p = comp.compress("w", grad)
            seen[p.indices] = True
            energy += float(grad[p.indices].square().sum()) / energy_all
        print(f"| {label} | {seen.float().mean():.3f} | {energy / STEPS:.3f} |")


if __name__ == "__main__":
    main()
