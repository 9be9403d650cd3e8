"""Today's compiled kernels against another revision's, timed in one process, alternating per round: a method's 1%
selection (default top-k; error feedback or the method's own memory, the default wire) over a model's layer shapes,
one call per 25 MiB bucket (every compiled function both revisions have taken from the other revision's), and the coding of the MLP's 82 top-k segments into one gather buffer (``gs_pack_segments``, the
same bytes checked). The revision's ``select.c`` is compiled into a temporary library as gradsift compiles its own;
each selection step is also divided by one read pass over the same tensors taken in the same round.
(``benchmarks/gather_decode.py`` times the decoding.)

    .venv/bin/python benchmarks/kernel_pair.py [--rev HEAD~1] [--model resnet50] [--rounds 40] [--method topk]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gradsift import kernels
from gradsift.experiments.model_bench import compress_step, model_shapes, random_buckets
from gradsift.kernels import native
from gradsift.memory.factory import make_compressor
from gradsift.transport import gather

MLP = [("bag", (1000, 256))] + [(f"layers.{i}.weight", (256, 256)) for i in range(80)] + [("head", (10, 256))]


class Mixed:
    """Today's library with the named functions taken from another."""

    def __init__(self, base, other, names):
        self.base, self.other, self.names = base, other, set(names)

    def __getattr__(self, name):
        return getattr(self.other if name in self.names else self.base, name)


def compile_rev(rev: str, out: Path, flags=()) -> ctypes.CDLL:
    src = Path(native.__file__).with_name("select.c")
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=src.parent, text=True).strip())
    rel = src.relative_to(root)
    for name in ("select.c", "spec.h"):
        text = subprocess.check_output(["git", "show", f"{rev}:{rel.with_name(name)}"], cwd=root, text=True)
        (out / name).write_text(text)
    lib = out / "select.so"
    subprocess.check_call([native.compiler(), "-O3", "-march=native", *flags, "-ffp-contract=off", "-fPIC", "-shared",
                           "-pthread", "-o", str(lib), str(out / "select.c"), "-lm"])
    return ctypes.CDLL(str(lib))


def timed(pairs, rounds: int, read=None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name, _ in pairs}
    times["read"] = []
    for i in range(rounds):
        if read is not None:
            t0 = time.perf_counter()
            read(i)
            times["read"].append(time.perf_counter() - t0)
        for name, fn in (pairs if i % 2 else pairs[::-1]):  # (each first in every other round: no place favoured)
            t0 = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD~1")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--method", default="topk", help="the selection timed (a compressor spec)")
    ap.add_argument("--flags", nargs="*", default=[], help="more compiler flags for both builds (-mno-avx512f: "
                                                           "the AVX2 bodies on a machine with AVX-512)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    today = kernels.compiled_lib(torch.empty(0))
    if today is None:
        raise SystemExit("kernel_pair: the compiled kernels are not available here")
    med = statistics.median
    with tempfile.TemporaryDirectory() as d:
        other = compile_rev(a.rev, Path(d), a.flags)
        if a.flags:  # (today's built with them too, not the cached build)
            today = native.build_with(["-O3", "-march=native", *a.flags], Path(d) / "today.so")
            kernels._state["lib"] = today
        both = [name for name in vars(today) if name.startswith("gs_") and hasattr(other, name)]  # (those load() typed)
        for name in both:
            getattr(other, name).argtypes = getattr(today, name).argtypes
            getattr(other, name).restype = getattr(today, name).restype
        label, shapes = model_shapes(a.model, None)
        pools = random_buckets(shapes)
        # two compressors (their memories), each stepping with both libraries in turn: which memory a library
        # works on changes every two rounds, so neither gains from where its memory lies (both libraries compute
        # the same bits: the two memories stay alike)
        comps = [make_compressor(a.method, 0.01), make_compressor(a.method, 0.01)]
        libs = {"today": today, a.rev: Mixed(today, other, both)}

        def step(name):
            def run(i):
                kernels._state["lib"] = libs[name]
                try:
                    compress_step(comps[(list(libs).index(name) + i // 2) % 2], pools[i % 2])
                finally:
                    kernels._state["lib"] = today
            return run

        for i in range(20):  # (the guesses settle)
            for name in libs:
                step(name)(i)
        t = timed([(name, step(name)) for name in libs], a.rounds,
                  read=lambda i: [g.sum() for group in pools[i % 2] for _, g in group])
        passes = {k: med(x / r for x, r in zip(t[k], t["read"])) for k in libs}
        saved = med(o - n for n, o in zip(t["today"], t[a.rev]))
        print(f"selection, {a.method} 1% over {label}'s {len(shapes)} tensors: today {passes['today']:.2f} read passes, "
              f"{a.rev} {passes[a.rev]:.2f}; {1e3 * saved:.2f} ms a step less today (median of {a.rounds} pairs)")

        keys = [k for k, _ in MLP]
        gen = torch.Generator().manual_seed(0)
        mine = make_compressor("topk", 0.01).compress_many(keys, [torch.randn(s, generator=gen) for _, s in MLP])
        packs = {"today": today, a.rev: Mixed(today, other, ["gs_pack_segments"])}

        def pack(name):
            def run(i):
                kernels._state["lib"] = packs[name]
                try:
                    return gather.pack_gather(mine, 0, "cpu")
                finally:
                    kernels._state["lib"] = today
            return run

        if not torch.equal(pack("today")(0), pack(a.rev)(0)):
            raise SystemExit("kernel_pair: the two packings wrote different bytes")
        t = timed([(name, pack(name)) for name in packs], a.rounds)
        print(f"coding, the MLP's 82 top-k segments ({sum(p.count for p in mine)} entries): today "
              f"{1e3 * med(t['today']):.2f} ms, {a.rev} {1e3 * med(t[a.rev]):.2f} ms (pack_gather, median of "
              f"{a.rounds})")


if __name__ == "__main__":
    main()
