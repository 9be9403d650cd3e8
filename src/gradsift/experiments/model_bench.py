"""``gradsift bench select --model NAME``: selection over a whole model's layers, as a DDP hook meets it.

A hook at layer granularity compresses every parameter tensor once per step, so what selection costs is the sum
over the model's tensors, per-call fixed costs included -- one long vector hides those. Here every method, built as
a user builds it (``make_compressor(spec, ratio)``, its default memory), compresses every tensor of a model's
parameter shapes once per step, the tensors of each 25 MiB bucket (DDP's grouping) in one ``compress_many`` call as
the road makes it (``observe`` too for the methods that read the round's mean, the input standing in
for it); a step's time is divided by one read pass over the same tensors (``x.sum()`` on each, the cheapest read:
at one thread about 5x faster than ``vector_norm(x, 1)``, the single-vector bench's yardstick) taken in the same
round, so load that comes and goes hits both alike.

Shapes are built in code from the published architectures (no downloads): ``resnet50`` (He et al. 2016, torchvision's
layout: 161 tensors, 25.6M parameters), ``bert-base`` (Devlin et al. 2019, uncased vocabulary: 199 tensors, 109M),
``gpt2-small`` (Radford et al. 2019: 148 tensors, 124M), ``vit-b16`` (Dosovitskiy et al. 2021, ViT-B/16 at 224 x 224,
torchvision's layout: 152 tensors, 86.6M); or ``--shapes FILE``, a JSON list of shapes (or of
``[name, shape]`` pairs).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import kernels
from ..memory.factory import make_compressor
from ..runtime.road import whole_together


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)),
                                              ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            out += [(f"{p}.conv1.weight", (planes, inplanes, 1, 1)), (f"{p}.bn1.weight", (planes,)),
                    (f"{p}.bn1.bias", (planes,)), (f"{p}.conv2.weight", (planes, planes, 3, 3)),
                    (f"{p}.bn2.weight", (planes,)), (f"{p}.bn2.bias", (planes,)),
                    (f"{p}.conv3.weight", (planes * 4, planes, 1, 1)), (f"{p}.bn3.weight", (planes * 4,)),
                    (f"{p}.bn3.bias", (planes * 4,))]
            if b == 0:
                out += [(f"{p}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (f"{p}.downsample.1.weight", (planes * 4,)), (f"{p}.downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def bert_base_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, f = 768, 3072
    out: list[tuple[str, tuple[int, ...]]] = [
        ("embeddings.word_embeddings.weight", (30522, h)), ("embeddings.position_embeddings.weight", (512, h)),
        ("embeddings.token_type_embeddings.weight", (2, h)), ("embeddings.LayerNorm.weight", (h,)),
        ("embeddings.LayerNorm.bias", (h,))]
    for i in range(12):
        p = f"encoder.layer.{i}"
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out += [(f"{p}.{m}.weight", (h, h)), (f"{p}.{m}.bias", (h,))]
        out += [(f"{p}.attention.output.LayerNorm.weight", (h,)), (f"{p}.attention.output.LayerNorm.bias", (h,)),
                (f"{p}.intermediate.dense.weight", (f, h)), (f"{p}.intermediate.dense.bias", (f,)),
                (f"{p}.output.dense.weight", (h, f)), (f"{p}.output.dense.bias", (h,)),
                (f"{p}.output.LayerNorm.weight", (h,)), (f"{p}.output.LayerNorm.bias", (h,))]
    return out + [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]


def gpt2_small_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h = 768
    out: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (50257, h)), ("wpe.weight", (1024, h))]
    for i in range(12):
        p = f"h.{i}"
        out += [(f"{p}.ln_1.weight", (h,)), (f"{p}.ln_1.bias", (h,)), (f"{p}.attn.c_attn.weight", (h, 3 * h)),
                (f"{p}.attn.c_attn.bias", (3 * h,)), (f"{p}.attn.c_proj.weight", (h, h)), (f"{p}.attn.c_proj.bias", (h,)),
                (f"{p}.ln_2.weight", (h,)), (f"{p}.ln_2.bias", (h,)), (f"{p}.mlp.c_fc.weight", (h, 4 * h)),
                (f"{p}.mlp.c_fc.bias", (4 * h,)), (f"{p}.mlp.c_proj.weight", (4 * h, h)), (f"{p}.mlp.c_proj.bias", (h,))]
    return out + [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


def vit_b16_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, f, tokens = 768, 3072, 197  # 224 x 224 images in 16 x 16 patches: 196 and the class token
    out: list[tuple[str, tuple[int, ...]]] = [("conv_proj.weight", (h, 3, 16, 16)), ("conv_proj.bias", (h,)),
                                              ("class_token", (1, 1, h)), ("encoder.pos_embedding", (1, tokens, h))]
    for i in range(12):
        p = f"encoder.layers.encoder_layer_{i}"
        out += [(f"{p}.ln_1.weight", (h,)), (f"{p}.ln_1.bias", (h,)),
                (f"{p}.self_attention.in_proj_weight", (3 * h, h)), (f"{p}.self_attention.in_proj_bias", (3 * h,)),
                (f"{p}.self_attention.out_proj.weight", (h, h)), (f"{p}.self_attention.out_proj.bias", (h,)),
                (f"{p}.ln_2.weight", (h,)), (f"{p}.ln_2.bias", (h,)), (f"{p}.mlp.0.weight", (f, h)),
                (f"{p}.mlp.0.bias", (f,)), (f"{p}.mlp.3.weight", (h, f)), (f"{p}.mlp.3.bias", (h,))]
    return out + [("encoder.ln.weight", (h,)), ("encoder.ln.bias", (h,)), ("heads.head.weight", (1000, h)),
                  ("heads.head.bias", (1000,))]


MODELS = {"resnet50": resnet50_shapes, "bert-base": bert_base_shapes, "gpt2-small": gpt2_small_shapes,
          "vit-b16": vit_b16_shapes}


class ModelBenchError(ValueError):
    """Bad model-bench input; one line."""


def model_shapes(model: str | None, shapes_file: str | None) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    """(label, [(name, shape)]) of a known model or of a JSON file."""
    if model is not None:
        if model not in MODELS:
            raise ModelBenchError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
        return model, MODELS[model]()
    try:
        raw = json.loads(Path(str(shapes_file)).read_text())
        named = [(str(s[0]), tuple(int(d) for d in s[1])) if isinstance(s, list) and len(s) == 2 and
                 isinstance(s[1], list) else (f"t{i}", tuple(int(d) for d in s)) for i, s in enumerate(raw)]
    except (OSError, ValueError, TypeError, IndexError) as e:
        raise ModelBenchError(f"--shapes {shapes_file!r}: expected a JSON list of shapes or [name, shape] pairs "
                              f"({type(e).__name__})") from None
    if not named or any(not s or any(d < 1 for d in s) for _, s in named):
        raise ModelBenchError(f"--shapes {shapes_file!r}: every shape needs positive sizes")
    return Path(str(shapes_file)).stem, named


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
WARMUP = 30  # untimed rounds: allocations, first-use kernels, error feedback's residual and DGC's velocity building
# up from zero (their magnitudes grow for some 10-20 steps, and the floors guessed from the previous call trail them:
# with 5 untimed rounds DGC's timed steps were twice its steady state). A training run takes thousands of steps.


def buckets(named: Sequence[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors grouped as DDP's reducer first buckets them: in reverse order, up to 25 MiB a bucket."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, g in reversed(named):
        nbytes = g.numel() * g.element_size()
        if out[-1] and size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append((name, g))
        size += nbytes
    return out


def random_buckets(shapes: Sequence[tuple[str, tuple[int, ...]]], copies: int = 2,
                   seed: int = 0) -> list[list[list[tuple[str, torch.Tensor]]]]:
    """``copies`` sets of normal gradients of ``shapes`` (seeded), each grouped as DDP's buckets (:func:`buckets`):
    steps alternate between them, so no step finds the last one's tensors in the caches."""
    gen = torch.Generator().manual_seed(seed)
    return [buckets([(n, torch.randn(s, generator=gen)) for n, s in shapes]) for _ in range(copies)]


def compress_step(comp, groups: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> None:
    """One step as the road takes it (:meth:`gradsift.runtime.road.Road.start`): each bucket's tensors compressed in
    one call, those the method sends whole in another where the road joins them (else one by one), then observed."""
    for group in groups:
        whole = [comp.sends_dense(n, g.shape) for n, g in group]  # the method's own rule (DGC: 1-D tensors)
        alike = [(n, g) for (n, g), w in zip(group, whole) if not w]
        got = iter(comp.compress_many([n for n, _ in alike], [g for _, g in alike]))
        dense = [(n, g) for (n, g), w in zip(group, whole) if w]
        if dense and whole_together(comp, [n for n, _ in dense]):
            sent = iter(comp.send_whole_many([n for n, _ in dense], [g for _, g in dense], [False] * len(dense)))
        else:
            sent = iter([comp.compress(n, g, check_finite=False) for n, g in dense])
        payloads = [next(sent) if w else next(got) for w in whole]
        if comp.OBSERVES:
            comp.observe_many([n for n, _ in group], payloads, [g.reshape(-1) for _, g in group])


def time_steps(comps: dict[str, Any], pools, steps: int, advance) -> dict[str, list[float]]:
    """Every method's step and one read pass, ``steps`` rounds after ``WARMUP`` untimed ones: {name: [seconds]}."""
    specs = list(comps)
    times: dict[str, list[float]] = {name: [] for name in ["read", *specs]}
    for i in range(steps + WARMUP):
        named = pools[i % len(pools)]
        for name in times:
            t0 = time.perf_counter()
            if name == "read":
                for group in named:
                    for _, g in group:
                        g.sum()
            else:
                compress_step(comps[name], named)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
        advance(1, f"round {i + 1}")
    return times


def run_model_bench(specs: Sequence[str], label: str, shapes: Sequence[tuple[str, tuple[int, ...]]],
                    ratios: Sequence[float], steps: int, out: Path, threads: int | None = None,
                    progress=None) -> list[dict[str, Any]]:
    """Every method's step over every tensor, in rounds against one read pass; ``bench.md`` and ``bench.json``."""
    for spec in specs:
        make_compressor(spec, ratios[0])  # a bad spec fails before anything is timed
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    pools = random_buckets(shapes)
    numel = sum(g.numel() for group in pools[0] for _, g in group)
    from .runner import Progress

    progress = progress or Progress(False)
    records = []
    med = statistics.median
    try:
        with progress.task(f"bench select --model {label} ({torch.get_num_threads()} threads)",
                           len(ratios) * (steps + WARMUP)) as advance:
            for ratio in ratios:
                comps = {spec: make_compressor(spec, ratio) for spec in specs}
                times = time_steps(comps, pools, steps, advance)
                for spec in specs:
                    passes = [t / r for t, r in zip(times[spec], times["read"])]
                    records.append({"model": label, "tensors": len(shapes), "numel": numel, "compressor": spec,
                                    "ratio": ratio, "memory": comps[spec].memory_name,
                                    "threads": torch.get_num_threads(), "backend": kernels.backend(),
                                    "median_ms": 1e3 * med(times[spec]), "read_passes": med(passes),
                                    "read_passes_range": [min(passes), max(passes)],
                                    "read_pass_ms": 1e3 * med(times["read"])})
    finally:
        torch.set_num_threads(before)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(records, indent=2) + "\n")
    r0 = records[0]
    lines = [f"# Selection over {label}'s layers", "",
             f"{r0['tensors']} tensors, {r0['numel'] / 1e6:.1f}M parameters; every method with its default memory "
             f"compresses every tensor once per step, one call per 25 MiB bucket as the DDP hook does ({steps} steps "
             f"after {WARMUP} untimed, timed in rounds in one process, "
             f"{r0['threads']} torch threads, `{r0['backend']}` kernels). `read passes` = the step's time / one read "
             f"pass (`sum`) over every tensor in the same round ({r0['read_pass_ms']:.2f} ms), median [min, max].", "",
             "| ratio | compressor | memory | ms per step | read passes of the model [min, max] |",
             "|---|---|---|---|---|"]
    for r in records:
        lo, hi = r["read_passes_range"]
        lines.append(f"| {r['ratio']} | `{r['compressor']}` | {r['memory']} | {r['median_ms']:.1f} | "
                     f"{r['read_passes']:.1f} [{lo:.1f}, {hi:.1f}] |")
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    return records
