"""How often a 2-rank gloo script exits 0 when it ends at the interpreter's own shutdown (gradsift lets gloo's
threads go idle first: gradsift.runtime.settle), against the same script ending with gradsift.ddp.finish().

    .venv/bin/python benchmarks/exit_rate.py --runs 20 [--busy]

The scripts: `examples/ddp_train.py` as shipped (no gradsift call after `register`), the same with
`gradsift.ddp.finish()` as its last line, and `tests/minimal_ddp_run.py` (only `register(..., optimizer=)`, a NaN
gradient on rank 1 at step 5, skipped on every rank). Each run is `torchrun --standalone --nproc-per-node 2 SCRIPT`;
a run counts as clean when torchrun exits 0. `--busy` keeps one core busy with a spinning process meanwhile.
Prints the counts and the failures' last stderr line (docs/ddp-reference.md, "Ending the process").
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


def run_many(script: Path, args: list[str], runs: int) -> tuple[int, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    clean, failures = 0, []
    for i in range(runs):
        r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), *args],
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
    ap.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    args = ap.parse_args()
    shipped = ROOT / "examples" / "ddp_train.py"
    text = shipped.read_text()
    if "finish(" in text:
        sys.exit(f"error: {shipped} calls finish(): this benchmark compares it with and without")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            finished = Path(tmp) / "ddp_train_finish.py"
            finished.write_text(text + "    gradsift.ddp.finish()\n")
            rows = [("interpreter shutdown (`examples/ddp_train.py` as shipped)", *run_many(shipped, ["--steps", "20"], args.runs)),
                    ("`gradsift.ddp.finish()` as its last line", *run_many(finished, ["--steps", "20"], args.runs)),
                    ("interpreter shutdown, only `register(..., optimizer=)`, a NaN step skipped "
                     "(`tests/minimal_ddp_run.py`)",
                     *run_many(ROOT / "tests" / "minimal_ddp_run.py", ["--steps", "20", "--nan-step", "5"], args.runs))]
    finally:
        if spin is not None:
            spin.kill()
    print("| script ends with | runs | exit 0 |")
    print("|---|---|---|")
    for label, clean, _ in rows:
        print(f"| {label} | {args.runs} | {clean} |")
    for label, _, failures in rows:
        for f in failures:
            print(f"- {label}: {f}")


if __name__ == "__main__":
    main()
