"""Top-k's candidate target per tensor (kernels/guess.py: topk_want, stepping between 1.3 and 2 candidates per
target entry) against a fixed 2, timed against each other in one process: top-k (error feedback, the default wire)
over ResNet-50's layer shapes, one call per 25 MiB bucket, each step divided by one read pass over the same tensors
taken in the same round; ``iid``: fresh normal gradients each step, ``drift``: a heavy-tailed gradient whose scale
drifts, plus noise. Also counts the passes whose floor missed (the histogram path, two passes of the tensor).

    .venv/bin/python benchmarks/topk_want.py iid|drift
"""
import sys, time, torch, statistics as st
torch.set_num_threads(1)
import gradsift.kernels.many as M
import gradsift.kernels.guess as G
from gradsift.experiments.model_bench import resnet50_shapes, buckets, _step
from gradsift.memory.factory import make_compressor
drift = sys.argv[1] == "drift"
gen = torch.Generator().manual_seed(0)
shapes = resnet50_shapes()
base = [torch.randn(s, generator=gen) * torch.rand(s, generator=gen).pow(2) for _, s in shapes]
def pool(i):
    if not drift:
        return buckets([(n, torch.randn(s, generator=gen)) for n, s in shapes])
    scale = 1.0 + 0.3 * torch.sin(torch.tensor(i / 7.0)).item()
    return buckets([(n, (b * scale + 0.3 * torch.randn(b.shape, generator=gen))) for (n, _), b in zip(shapes, base)])
pools = [pool(i) for i in range(6)]
real_learn = M.learn_want
fixed = lambda st, missed: 2.0
ca, cb = make_compressor("topk", 0.01), make_compressor("topk", 0.01)
miss = {"a": 0, "b": 0}; cur = ["a"]
orig = M.topk
def counting(*a, **k):
    miss[cur[0]] += 1; return orig(*a, **k)
M.topk = counting
def run(c, which, p):
    cur[0] = which
    M.learn_want = fixed if which == "a" else real_learn
    t0 = time.perf_counter(); _step(c, p); return time.perf_counter() - t0
for i in range(20):
    run(ca, "a", pools[i % 6]); run(cb, "b", pools[i % 6])
miss = {"a": 0, "b": 0}
A, B, R = [], [], []
for i in range(48):
    p = pools[i % 6]
    t0 = time.perf_counter()
    for gr in p:
        for _, g in gr: g.sum()
    R.append(time.perf_counter() - t0)
    A.append(run(ca, "a", p)); B.append(run(cb, "b", p))
print(f"{sys.argv[1]}: fixed 2.0: {st.median([a/r for a, r in zip(A, R)]):.2f} passes, misses/step {miss['a']/48:.2f}; "
      f"adaptive: {st.median([b/r for b, r in zip(B, R)]):.2f}, misses/step {miss['b']/48:.2f}; "
      f"median saved {1e3*st.median([a-b for a, b in zip(A, B)]):.2f} ms")
