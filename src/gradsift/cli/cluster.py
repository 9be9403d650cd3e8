"""``gradsift cluster up|run|down|calibrate|bench``: hosts in network namespaces on shaped links (root)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .options import UsageError


def cmd_cluster(a: argparse.Namespace) -> int:
    from ..cluster import Cluster, ClusterError, Link, TearDown, check_environment, run_on_cluster

    try:
        if a.action == "down":
            Cluster(hosts=1, name=a.name).down()
            print(f"cluster {a.name!r} is down")
            return 0
        check_environment()
        if a.action == "bench":
            from ..cluster.bench import check_options, run_cluster_bench

            try:  # bad options: exit 2 before the output folder is made
                check_options(a.repeats, a.tasks, a.host_counts, a.steps, a.paired)
            except ClusterError as e:
                raise UsageError(f"gradsift {e}") from None
            from ..experiments.runner import Progress

            from ..runtime.records import OutputDir

            with OutputDir(a.out, overwrite=a.overwrite):
                report = run_cluster_bench(Path(a.out), quick=a.quick, data=a.data, progress=Progress(not a.quiet),
                                           faults=not a.no_faults, rates=a.sweep_rates, only=a.methods,
                                           repeats=a.repeats, tasks=a.tasks, host_counts=a.host_counts,
                                           target=not a.no_target, steps=a.steps, paired=a.paired)
            print(f"report: {report}")
            return 0
        if a.action == "race":
            from ..cluster.race import race_on_cluster, write_race
            from ..cluster.runs import SHAKESPEARE, Bench
            from ..runtime.records import OutputDir
            from ..experiments.runner import Progress

            if a.factor < 1 or not 2 <= a.hosts <= 8:
                raise UsageError(f"gradsift cluster race: --factor must be >= 1 and --hosts 2 to 8, got {a.factor} "
                                 f"and {a.hosts}")
            data = Path(a.data) if a.data else SHAKESPEARE
            task = (a.tasks or ["charlm"])[0]
            with OutputDir(a.out, overwrite=a.overwrite):
                bench = Bench(Path(a.out), data, False, Progress(not a.quiet))
                res = race_on_cluster(bench, task=task, hosts=a.hosts, rate=a.rate, steps=a.steps or 300,
                                      factor=a.factor, only=a.methods)
                report = write_race(Path(a.out), res, "gradsift cluster " + shlex.join(sys.argv[2:]))
            print(f"report: {report}")
            return 0
        links = [Link(rate=a.rate) for _ in range(a.hosts)]
        if a.delay_ms or a.loss_pct:
            if not 0 <= a.impair_host < a.hosts:
                raise UsageError(f"gradsift cluster: --impair-host must be in [0, {a.hosts}), got {a.impair_host}")
            links[a.impair_host] = Link(rate=a.rate, delay_ms=a.delay_ms, loss_pct=a.loss_pct)
        if a.action == "up":
            c = Cluster(hosts=a.hosts, name=a.name, links=links).up()
            print(f"cluster {a.name!r} is up: hosts {', '.join(c.host_ns(i) for i in range(c.hosts))} at "
                  f"{', '.join(c.ip(i) for i in range(c.hosts))}; `gradsift cluster down` removes it")
            return 0
        if a.action in ("run", "calibrate"):
            attached = Cluster.load_state(a.name) is not None
            cluster = Cluster.attach(a.name) if attached else Cluster(hosts=a.hosts, name=a.name, links=links)
            ctx = _NullCtx(cluster) if attached else TearDown(cluster)
            with ctx as c:
                if a.action == "calibrate":
                    from ..cluster.bench import calibrate

                    cal = calibrate(c, Path(a.out))
                    print(f"latency {cal['fit']['latency_us']:.1f} us, bandwidth {cal['fit']['bandwidth_gbps']:.4f} "
                          f"Gbit/s ({c.hosts} hosts); samples in {a.out}")
                    return 0
                args = list(a.train_args)
                res = run_on_cluster(c, ["gradsift", "train", "--runtime", "ddp", *args], nproc=a.nproc_per_host,
                                     max_restarts=a.max_restarts)
                for i, (rc, out, err) in enumerate(res):
                    for line in err.splitlines():
                        if line.startswith("gradsift: error:"):
                            print(f"host {i}: {line}", file=sys.stderr)
                    sys.stdout.write(out)
                bad = [rc for rc, _, _ in res if rc]
                return 1 if bad else 0
    except ClusterError as e:
        print(f"gradsift: error: {e}", file=sys.stderr)
        return 1
    raise UsageError(f"gradsift cluster: unknown action {a.action!r}")  # pragma: no cover


class _NullCtx:
    def __init__(self, c):
        self.c = c

    def __enter__(self):
        return self.c

    def __exit__(self, *exc):
        return None
