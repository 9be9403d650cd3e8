"""Bytes a sparse entry costs on the wire, by density, on real models' layer shapes -- and what coding costs in time.

    .venv/bin/python benchmarks/wire_bytes.py --data ../shared/data/tinyshakespeare.txt [--value-dtype int2]

Per model and ratio, every tensor sends its k = ratio x numel (at least 1) largest entries, as top-k does per tensor.
Columns: bytes an entry before the coding (an int32 index and an fp32 value: 8), the payload now (bf16 values and
coded indices, :mod:`gradsift.payload.indexcode`; ``--value-dtype int4``/``int2``: the values' codes and block
scales, :mod:`gradsift.payload.lowbits`), and the wire segment (the payload plus its 16-byte header and
8-byte padding, what the all-gather moves); which codes the tensors got. The size of a code depends only on the
tensor's size and the slot count, so these figures hold whatever the gradient.

Timing (one process, one thread, ratios only): packing and unpacking every tensor's segment, against torch.topk
over the same tensors and against one read pass over them (``x.abs().max()``) -- the coding's cost per step next to
the selection it follows.
"""

from __future__ import annotations

import argparse
import time

import torch

from gradsift.compressors.base import target_count
from gradsift.payload import lowbits
from gradsift import payload as P
from gradsift.payload.indexcode import layout
from gradsift.experiments.model_bench import MODELS
from gradsift.tasks import make_task
from gradsift.transport.gather import pack_gather, unpack_gather
from gradsift.transport.wire import gather_segment_bytes


def task_shapes(name: str, data: str | None) -> list[tuple[str, tuple[int, ...]]]:
    task = make_task(name, 1, data=data if name in ("wordlm", "charlm", "gptlm") else None)
    return [(n, tuple(p.shape)) for n, p in task.build_model().named_parameters()]


def payloads(shapes, ratio: float, g: torch.Generator, bits: int = 0) -> list[P.Payload]:
    out = []
    for _, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        k = target_count(ratio, n)
        idx = torch.randperm(n, generator=g)[:k]
        if bits:  # values on their levels, in index order (as the road hands them over)
            idx = idx.sort().values
            p = P.sparse(lowbits.round_values(torch.randn(k, generator=g), [k], bits), idx, n, torch.float32, k)
            p.value_bits = bits
        else:
            p = P.sparse(torch.randn(k, generator=g).to(torch.bfloat16), idx, n, torch.float32, k)
        p.capacity = k
        out.append(p)
    return out


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None, help="text file for the language-model tasks")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.01, 0.001])
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--value-dtype", choices=("bf16", *P.VALUE_BITS), default="bf16",
                    help="the sparse values' wire format (default bf16)")
    a = ap.parse_args()
    bits = P.VALUE_BITS.get(a.value_dtype, 0)
    torch.set_num_threads(1)
    models = {t: task_shapes(t, a.data) for t in (["wordlm", "charlm", "gptlm"] if a.data else []) + ["mnist1d-cnn"]}
    models.update({m: MODELS[m]() for m in ("resnet50", "gpt2-small")})
    print("| model | parameters | ratio | entries | before (int32 + fp32) | payload now | wire segment now | codes |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, shapes in models.items():
        for ratio in a.ratios:
            ps = payloads(shapes, ratio, g, bits)
            entries = sum(p.count for p in ps)
            numel = sum(p.numel for p in ps)
            codes: dict[str, int] = {}
            for p in ps:
                c = layout(p.numel, p.count, 4)[0]
                codes[c] = codes.get(c, 0) + 1
            payload = sum(p.nbytes for p in ps) / entries
            wire = sum(gather_segment_bytes(p) for p in ps) / entries
            said = ", ".join(f"{c} {n}" for c, n in sorted(codes.items()))
            print(f"| {name} | {numel / 1e6:.2f}M | {ratio:g} | {entries} | 8 | {payload:.2f} | {wire:.2f} | {said} |")
    if a.no_timing:
        return
    print()
    print("| model | ratio | pack + unpack / torch.topk | pack + unpack / one read pass |")
    print("|---|---|---|---|")
    for name in ("gpt2-small", "resnet50"):
        tensors = [torch.randn(*s, generator=g).reshape(-1) for _, s in models[name]]
        for ratio in a.ratios:
            ps = payloads(models[name], ratio, g, bits)
            ks = [p.count for p in ps]
            coding = best_of(lambda: unpack_gather(pack_gather(ps, 0, "cpu"), ps))
            topk = best_of(lambda: [torch.topk(t.abs(), k, sorted=False) for t, k in zip(tensors, ks)])
            read = best_of(lambda: [t.abs().max() for t in tensors])
            print(f"| {name} | {ratio:g} | {coding / topk:.3f} | {coding / read:.2f} |")


if __name__ == "__main__":
    main()
