"""DGC's selection inside the pass that updates its velocity (``select.c``: ``dgc_in_scan``): the sampled threshold,
its lowering, the counts on the candidates (under the floor with few of them, on the tensor), and the exact top-k
past 1.3k, in the same operations as ``DGC.select_tail`` -- so the compiled and eager backends send the same entries
and keep the same state. What would outrun the candidates' room (more candidates than the cap, or more entries
reaching a threshold under the floor) is left to ``select_tail``."""

from __future__ import annotations

import pytest
import torch

from gradsift import kernels, make_compressor
from gradsift.kernels.guess import Guess

SHAPES = [(64, 3, 3, 3), (256, 64, 1, 1), (1000, 20), (4096, 8), (3, 3, 64, 64), (70_000, 2), (512, 600)]
STEPS = 30

pytestmark = pytest.mark.skipif(kernels.backend() != "compiled", reason="compares the compiled pass with the eager")


def _run(spec: str, ratio: float, backend: str) -> tuple[list, dict]:
    keys = [f"t{i}" for i in range(len(SHAPES))]
    g = torch.Generator().manual_seed(0)
    with kernels.using(backend):
        comp = make_compressor(spec, ratio)
        out = []
        for step in range(STEPS):
            grads = [torch.randn(s, generator=g) * (30.0 if step == 12 else 1.0) for s in SHAPES]
            out.append([(p.indices.clone(), p.values.clone()) for p in comp.compress_many(keys, grads)])
    memory = {f"{name}/{k}": t.clone() for name in ("u", "v") for k, t in getattr(comp, name).items()}
    return out, {k: dict(v) for k, v in comp.inner.tensors.items()}, memory


def _tails(monkeypatch) -> list:
    """Every tail the pass gives momentum correction, in order."""
    import gradsift.memory.momentum as momentum

    got = []
    real = momentum.tails_many
    monkeypatch.setattr(momentum, "tails_many", lambda *a, **kw: got.extend(out := real(*a, **kw)) or out)
    return got


def _same(a, b) -> None:
    for x, y in zip(a[0], b[0]):
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(x, y))
    assert a[1] == b[1]  # floors, slack, steps: the same state
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])  # u and v, settled


def _floors_four_times_too_high(monkeypatch, room_all: bool) -> None:
    """Every guessed floor four times what it would be; the candidates' room the whole tensor (``room_all``) or as
    guessed."""
    real = Guess.floors

    def high(states, ns, ks, want=2.0, grow_range=(0.5, 2.0), every=0):
        got = real(states, ns, ks, want, grow_range, every)
        return [None if g is None else (g[0] * 4.0, n if room_all else g[1]) for g, n in zip(got, ns)]

    monkeypatch.setattr(Guess, "floors", staticmethod(high))


@pytest.mark.parametrize("spec, ratio", [("dgc", 0.01), ("dgc", 0.001), ("dgc:nesterov=true,sample_ratio=0.05", 0.01),
                                         ("dgc:masking=false", 0.01), ("dgc:value_dtype=fp16", 0.01)])
def test_the_compiled_selection_is_the_python_one(monkeypatch, spec, ratio):
    got = _tails(monkeypatch)
    compiled = _run(spec, ratio, "compiled")
    late = got[-10 * len(SHAPES):]  # (the velocity's first steps outgrow every floor)
    picked = [t for t in late if t.picked is not None]
    trimmed = [t for t in got if t.picked is not None and t.picked[1] > t.picked[2].numel()]
    under = [t for t in got if t.picked is not None and t.floor is not None and t.picked[0] < t.floor]
    got.clear()
    _same(compiled, _run(spec, ratio, "eager"))
    assert not any(t.picked is not None for t in got)  # the eager backend selects in Python
    assert len(picked) >= 0.4 * len(late) and trimmed  # many selected there, some past 1.3k
    assert under  # some under the floor, past 1.3k candidates: the exact top k among them, the count read off x
    # settled there unless cast for the wire; the sparse wire's bf16 cast taken there too (8), as the eager backend
    # casts (the sends and memories compared above, bit for bit)
    assert all(bool(t.picked[4]) == (":value_dtype" not in spec) for t in picked)
    assert all(t.picked[4] & 8 == (8 if ":value_dtype" not in spec else 0) for t in picked)


def test_a_threshold_under_the_floor_with_few_candidates_is_taken_off_the_tensor(monkeypatch):
    """A floor guessed far too high: the sampled threshold lies under it with few candidates above it. The compiled
    pass counts over the tensor as ``select_tail`` would and takes what reaches the threshold off the tensor, into
    the candidates' room -- more entries than it had candidates -- and sends what the eager backend sends; what
    would outrun that room is left to ``select_tail``."""
    _floors_four_times_too_high(monkeypatch, room_all=True)
    got = _tails(monkeypatch)
    compiled = _run("dgc", 0.01, "compiled")
    off_x = [t for t in got if t.picked is not None and t.picked[0] < t.floor and t.picked[2].numel() > t.count]
    assert len(off_x) >= len(got) // 2
    _same(compiled, _run("dgc", 0.01, "eager"))


def test_what_outruns_the_candidates_room_is_left_to_the_caller(monkeypatch):
    """Under a floor guessed too high, every magnitude tied (the same gradient of +-1 each step: the velocities grow
    alike): the sampled threshold is that magnitude, which every entry not sent reaches -- more than the
    candidates' room. The pass leaves those tensors to ``select_tail`` (the exact top k, ties to the lowest
    index); the same sends as the eager backend."""
    _floors_four_times_too_high(monkeypatch, room_all=False)
    got = _tails(monkeypatch)
    keys = [f"t{i}" for i in range(len(SHAPES))]
    sends = {}
    for backend in ("compiled", "eager"):
        g = torch.Generator().manual_seed(1)
        grads = [torch.sign(torch.randn(s, generator=g)) for s in SHAPES]
        with kernels.using(backend):
            comp = make_compressor("dgc", 0.01)
            sends[backend] = [[(p.indices.clone(), p.values.clone())
                               for p in comp.compress_many(keys, [x.clone() for x in grads])] for _ in range(6)]
        if backend == "compiled":
            left = [t for t in got if t.picked is None and t.floor is not None]
    assert left
    for a, b in zip(sends["compiled"], sends["eager"]):
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.parametrize("spec", ["dgc:memory=ef", "dgc:memory=ef,value_dtype=fp16", "dgc:memory=adam"])
@pytest.mark.parametrize("backend", ["compiled", "eager"])
def test_with_error_feedback_a_groups_selection_is_each_tensors_own(spec, backend):
    """DGC with error feedback (its memory under the momentum-SGD recipe; on Adam's direction under AdamW's): the
    group's pass accumulates the residual (Adam: reads the residual plus the direction), samples and selects
    (settling the residual there unless the values are cast for the wire) -- the same sends, residuals and state as
    tensor by tensor through the whole-tensor selection, ties at the threshold included (Adam's first directions
    tie in magnitude by the hundred)."""
    keys = [f"t{i}" for i in range(len(SHAPES))]
    g = torch.Generator().manual_seed(0)
    with kernels.using(backend):
        group, alone = (make_compressor(spec, 0.01) for _ in range(2))
        for step in range(12):
            grads = [torch.randn(s, generator=g) * (30.0 if step == 6 else 1.0) for s in SHAPES]
            a = group.compress_many(keys, [x.clone() for x in grads])
            b = [alone.compress(k, x.clone(), check_finite=False, dense=False) for k, x in zip(keys, grads)]
            assert all(torch.equal(p.indices, q.indices) and torch.equal(p.values, q.values) for p, q in zip(a, b))
    assert all(torch.equal(group.residual[k], alone.residual[k]) for k in keys)
    for k in keys:  # the same state, the group's guess of where the candidates start besides
        mine, its = group.inner.tensors[k], alone.inner.tensors[k]
        assert {name: mine[name] for name in its} == its
