"""Spawning process groups from pytest: gloo on CPU (file store, one thread per rank); NCCL on GPUs for the CUDA checks."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import procs

TIMEOUT_S = 60

# Ranks are forked from one server process per pytest worker that has already imported torch, torch.distributed,
# torch._dynamo (which the first optimizer imports: 2-3 s a process on this machine) and gradsift, instead of each
# rank starting a fresh interpreter (the "spawn" method; procs.forkserver). The server starts single-threaded, so
# forking it is safe; a rank still gets a process of its own, its own process group and file store. NCCL ranks keep
# "spawn". A forked rank would write to the server's stdout and stderr (whatever they were when the server started,
# in an earlier test), so each rank writes to files that the test's own process copies to its stdout and stderr when
# the ranks end.
procs.forkserver()


def _entry(rank: int, world: int, store: str, fn, args, errdir: str, backend: str = "gloo") -> None:
    procs.write_output_to(os.path.join(errdir, f"stdout{rank}.txt"), os.path.join(errdir, f"stderr{rank}.txt"))
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    bound = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        bound["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), **bound)
    code = 0
    try:
        fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        Path(errdir, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    # as gradsift's own command does (gradsift.launch.exit_process): the group is never destroyed (freeing a DDP
    # model after destroy_process_group can deadlock in gloo's destructor) and there is no interpreter shutdown, which
    # a gloo worker still releasing a finished collective's tensors would turn into SIGABRT
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(fn, world: int, *args, expect_failure: bool = False, backend: str = "gloo") -> dict[int, str]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks of ``backend`` (NCCL: rank r on GPU r); return
    {rank: error text} of failed ranks."""
    tmp = tempfile.mkdtemp(prefix="gradsift-ddp-")
    errdir = tempfile.mkdtemp(prefix="gradsift-err-")
    try:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args, errdir, backend), nprocs=world,
                           join=True, start_method="spawn" if backend == "nccl" else "forkserver")
    except Exception:  # noqa: BLE001
        _echo(errdir, world)
        if not expect_failure:
            errs = {int(p.stem[4:]): p.read_text() for p in Path(errdir).glob("rank*.err")}
            raise AssertionError(f"ranks failed: {errs}") from None
    else:
        _echo(errdir, world)
    return {int(p.stem[4:]): p.read_text() for p in Path(errdir).glob("rank*.err")}


def _echo(errdir: str, world: int) -> None:
    """What the ranks wrote to stdout and stderr, rank by rank, onto this process's own (a test's capfd sees it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        for rank in range(world):
            path = Path(errdir, f"{name}{rank}.txt")
            if path.exists():
                os.write(fd, path.read_bytes())


def plain_mean_grads(module: torch.nn.Module, x: torch.Tensor, world: int) -> list[torch.Tensor]:
    """The gradients of ``module(x).square().mean()`` averaged over the ranks by hand (a copy of the module, one
    all-reduce per tensor): what DDP's own all-reduce would give, to compare a hook with."""
    import copy

    plain = copy.deepcopy(module)
    plain(x).square().mean().backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(world)
    return grads
