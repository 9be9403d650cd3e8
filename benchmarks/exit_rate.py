"""How often a 2-rank gloo script exits 0: `examples/ddp_train.py` as shipped (ending with gradsift.ddp.finish())
against the same script ending with the interpreter's normal shutdown (its last line removed).

    .venv/bin/python benchmarks/exit_rate.py --runs 20

Each run is `torchrun --standalone --nproc-per-node 2 SCRIPT --steps 20`; a run counts as clean when torchrun
exits 0. Prints the counts and the failures' last stderr line (docs/ddp-reference.md, "Ending the process").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def run_many(script: Path, runs: int) -> tuple[int, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    clean, failures = 0, []
    for i in range(runs):
        r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), "--steps", "20"],
                           capture_output=True, text=True, env=env, timeout=300)
        if r.returncode == 0:
            clean += 1
        else:
            lines = [l for l in r.stderr.splitlines() if "Signal" in l or "terminate" in l or "Error" in l]
            failures.append(f"exit {r.returncode}: {lines[-1] if lines else r.stderr.strip()[-200:]}")
        print(f"  {script.name} run {i + 1}/{runs}: exit {r.returncode}", file=sys.stderr, flush=True)
    return clean, failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    shipped = ROOT / "examples" / "ddp_train.py"
    text = shipped.read_text()
    last = "    gradsift.ddp.finish()"
    if last not in text:
        sys.exit(f"error: {shipped} no longer ends with {last.strip()!r}: update this benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "ddp_train_plain_exit.py"
        plain.write_text("\n".join(l for l in text.splitlines() if not l.startswith(last)) + "\n")
        rows = [("interpreter shutdown (finish() removed)", *run_many(plain, args.runs)),
                ("gradsift.ddp.finish() (as shipped)", *run_many(shipped, args.runs))]
    print("| script ends with | runs | exit 0 |")
    print("|---|---|---|")
    for label, clean, _ in rows:
        print(f"| {label} | {args.runs} | {clean} |")
    for label, _, failures in rows:
        for f in failures:
            print(f"- {label}: {f}")


if __name__ == "__main__":
    main()
