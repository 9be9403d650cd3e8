"""Fingerprints of what the documented numbers rest on: an investigation under docs/results/ or a section of
docs/reproductions.md is stale when what its runs compute changed, not when a file it names changed.

    .venv/bin/python benchmarks/fingerprints.py [NAME ...]        # print each fingerprint
    PYTHONPATH=/old/checkout/src .venv/bin/python benchmarks/fingerprints.py NAME   # the same run on older code

A fingerprint is a short deterministic run of the code path a section measures -- its methods, task and runtime
(the simulator; the real runtimes do the same arithmetic, which the parity tests hold bit for bit) at a tiny scale,
a few steps -- hashed over every record it writes: losses, metrics, densities, bytes, overflow (each number to 6
significant digits; never a time). A change that moves what a method selects, sends or learns moves its
fingerprint; a change that makes the same numbers faster or slower does not (a speed section is rerun by hand
when its hot path changes: the command is in the section).

Each section says ``Fingerprints: `name` abc123def456, ...`` -- the fingerprints of the code its numbers came
from. ``tests/test_docs.py`` recomputes them: a section whose fingerprint changed must say "(stale)" in its
heading, one whose fingerprints all hold must not. ``benchmarks/docs_numbers.sh`` has the commands that refresh
the numbers; a refreshed section takes the fingerprints printed here.

The runs are single-threaded with ATen's portable kernels, MKL's reproducible mode and oneDNN's kernels at most
AVX2 (set before torch loads: the script starts itself again with them), so that another x86 machine computes the
same digits. (oneDNN's AVX-512 kernels round differently: on a machine that shows AVX-512, left to itself, it
changed the fingerprints of the transformer runs, `gptlm-adam` and `local`.)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
       "ONEDNN_MAX_CPU_ISA": "AVX2"}

_W = ["--workers", "4", "--steps", "3", "--quiet"]
# name -> the gradsift command line (without --out); what each stands for is in the README of the section using it
RUNS: dict[str, list[str]] = {
    "mnist1d-sampling": ["compare", "--task", "mnist1d-cnn", "--ratio", "0.01", *_W, "--compressors", "dense", "topk",
                         "randomk", "randomk:shared=true", "rtopk", "regtopk", "gs", "rsb", "gsb"],
    "mnist1d-thresholds": ["compare", "--task", "mnist1d-cnn", "--ratio", "0.01", *_W, "--compressors", "sidco",
                           "sidco:dist=gp", "sidco:dist=gamma", "dgc", "dgc:memory=momentum", "redsync", "gaussiank"],
    "gptlm-adam": ["compare", "--task", "gptlm", "--data", DATA, "--ratio", "0.01", *_W, "--compressors", "dense",
                   "topk", "sidco"],
    "charlm": ["compare", "--task", "charlm", "--data", DATA, "--ratio", "0.01", "--workers", "2", "--steps", "2",
               "--quiet", "--compressors", "topk", "rtopk"],
    "wordlm": ["train", "--task", "wordlm", "--data", DATA, "--ratio", "0.01", "--workers", "2", "--steps", "2",
               "--quiet", "--compressor", "topk"],
    "wire-plan": ["compare", "--task", "digits-cnn", "--ratio", "0.05", *_W, "--wire-plan", "auto", "--compressors",
                  "topk", "sidco", "dgc"],
    "scatter": ["train", "--task", "digits-cnn", "--ratio", "0.05", *_W, "--wire-plan", "auto",
                "--sparse-collective", "scatter", "--compressor", "topk"],
    "fsdp": ["train", "--task", "digits-mlp", "--ratio", "0.05", *_W, "--fsdp", "--compressor", "topk"],
    "hsdp": ["train", "--task", "digits-mlp", "--ratio", "0.05", *_W, "--fsdp", "--replicas", "2", "--compressor",
             "topk"],
    "lags": ["train", "--task", "digits-cnn", "--ratio", "0.05", *_W, "--lags", "--compressor", "topk"],
    "local": ["compare", "--task", "mnist1d-cnn", "--ratio", "0.01", "--workers", "4", "--steps", "5", "--quiet",
              "--compressors", "local:period=2", "local:period=2,outer=nesterov", "local:period=2,compressor=topk",
              "local:period=2,outer=ef,compressor=topk"],
    "lowbits": ["compare", "--task", "digits-cnn", "--ratio", "0.05", *_W, "--compressors", "topk:value_dtype=int2",
                "dgc:value_dtype=int4", "local:period=2,compressor=topk,value_dtype=int2"],
    "linreg": ["compare", "--task", "linreg", "--ratio", "0.1", *_W, "--compressors", "topk", "regtopk"],
    "logistic-toy": ["compare", "--task", "logistic-toy", "--ratio", "0.5", "--workers", "2", "--steps", "3", "--quiet", "--compressors", "topk", "regtopk"],
}


# what a record says of the training and of what was sent (times, and fields added for bookkeeping, left out: a new
# telemetry field does not make every section stale)
KEYS = ("file", "step", "loss", "batch_loss", "accuracy", "test_loss", "perplexity", "valid_loss", "density", "k_ratio",
        "bytes_per_worker", "wire_bytes_per_worker", "overflow")


def digest(records: list[dict]) -> str:
    """12 hex digits of every record's :data:`KEYS` (numbers to 6 significant digits)."""
    def norm(v):
        if isinstance(v, float):
            return v if not math.isfinite(v) else float(f"{v:.6g}")
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    kept = [{k: norm(r[k]) for k in KEYS if k in r} for r in records]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:12]


def records_under(out: Path) -> list[dict]:
    """Every record of every metrics.jsonl under ``out``, the files in path order."""
    rows = []
    for f in sorted(out.rglob("metrics.jsonl")):
        rows.append({"file": str(f.relative_to(out))})
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def fingerprint(name: str) -> str:
    """The fingerprint of run ``name`` on the gradsift this process imports ("unavailable": it does not run)."""
    import contextlib
    import io

    import torch

    from gradsift.cli import main

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                rc = main([*RUNS[name], "--out", str(out)])
        except SystemExit as e:
            rc = e.code
        rows = records_under(out) if out.exists() else []
        if rc not in (0, None) or not rows:
            return "unavailable"
        return digest(rows)


def main(argv: list[str]) -> int:
    if any(os.environ.get(k) != v for k, v in ENV.items()):  # (before torch loads: start again with them)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ENV})
    names = argv or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"fingerprints: no run {unknown[0]!r}; the runs: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    for n in names:
        print(n, fingerprint(n), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
