"""What a bucket pays for two collectives against one, on namespace hosts with shaped links (root): a small all-reduce
of W bytes beside an all-gather of G bytes a rank, both in flight at once (a bucket's whole tensors and its sparse
segments as two collectives), against one all-gather of G + W bytes a rank (the whole tensors riding the gather),
and each alone. Median of 20 timed repetitions after 5, twice each, rank 0's times in ms.

    .venv/bin/python benchmarks/merged_collectives.py [--hosts 4] [--rate 100mbit] [--gather 19000] \
        [--whole 4000 20000 60000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def ranks() -> None:
    """One rank's part (under torchrun): prints rank 0's medians as one line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    w, g = int(os.environ["GS_WHOLE"]), int(os.environ["GS_GATHER"])
    small, mine = torch.randn(w // 4), torch.zeros(g, dtype=torch.uint8)

    def gather(nbytes):
        out = torch.empty(nbytes * n, dtype=torch.uint8)
        return dist.all_gather_into_tensor(out, torch.zeros(nbytes, dtype=torch.uint8), async_op=True)

    cases = {"two collectives": lambda: [dist.all_reduce(small, async_op=True), gather(g)],
             "one all-gather": lambda: [gather(g + w)], "all-gather alone": lambda: [gather(g)],
             "all-reduce alone": lambda: [dist.all_reduce(small, async_op=True)]}
    got: dict[str, list[float]] = {}
    for name, start in list(cases.items()) * 2:
        ts = []
        for _ in range(25):
            dist.barrier()
            t0 = time.perf_counter()
            for work in start():
                work.wait()
            ts.append(time.perf_counter() - t0)
        got.setdefault(name, []).append(statistics.median(ts[5:]) * 1e3)
    if dist.get_rank() == 0:
        print(" | ".join(f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in got.items()), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--gather", type=int, default=19000, help="all-gather bytes a rank")
    ap.add_argument("--whole", type=int, nargs="+", default=[4000, 20000, 60000], help="all-reduce bytes")
    a = ap.parse_args()
    from gradsift.cluster.hosts import Cluster, Link, TearDown, run_on_cluster

    cluster = Cluster(hosts=a.hosts, name="mrg", links=[Link(rate=a.rate) for _ in range(a.hosts)])
    print(f"{a.hosts} hosts at {a.rate}, all-gather {a.gather} bytes a rank; ms, two runs each")
    with TearDown(cluster) as c:
        for w in a.whole:
            os.environ.update(GS_WHOLE=str(w), GS_GATHER=str(a.gather))
            res = run_on_cluster(c, [os.path.abspath(__file__), "--ranks"], module=False)
            if res[0][0]:
                print(res[0][2][-2000:], file=sys.stderr)
                return 1
            print(f"all-reduce of {w} bytes | {res[0][1].strip()}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--ranks"]:
        ranks()
    else:
        sys.exit(main())
