"""The hook's own cost where the network is free: ``gradsift bench hook`` (:mod:`gradsift.experiments.hook_bench`),
kept under this name for the commands in docs/results.md. Same options (``--model``, ``--methods``, ``--steps``,
``--warm``, ``--profile``, ``--device``); the table goes to stdout, the files to a temporary folder.

    OMP_NUM_THREADS=1 python benchmarks/hook_cost.py --model mlp --steps 30
"""

import sys
import tempfile

from gradsift.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "hook", *sys.argv[1:], "--out", tempfile.mkdtemp(prefix="hook-cost-")]))
