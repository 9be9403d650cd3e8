"""Subprocesses from tests that cannot outlive their test: every process a test starts, and every process those start
(torchrun puts its workers in sessions of their own, so a process group does not hold them), carries a tag in its
environment; a timeout kills everything with the tag and fails the test with the processes' last words, instead of
waiting on a pipe a stray worker still holds."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Sequence

TAG = "GRADSIFT_TEST_TAG"
SESSION = "GRADSIFT_TEST_SESSION"  # set once by conftest.py: every process of this pytest run carries it


def tagged(name: str, value: str) -> list[int]:
    """The pids (other than this process) whose environment holds ``name=value``."""
    want = f"{name}={value}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if want in env.split(b"\0"):
            out.append(int(d.name))
    return out


def kill_tagged(name: str, value: str) -> list[int]:
    """SIGKILL every process tagged ``name=value``; the pids it killed."""
    pids = tagged(name, value)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def start(cmd: Sequence[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Popen with stdout and stderr captured as text, tagged so :func:`finish` can kill it and all it started."""
    tag = uuid.uuid4().hex
    p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**(os.environ if env is None else env), TAG: tag}, **kw)
    p.gradsift_tag = tag
    return p


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process, all within ``timeout`` seconds together; past it every process
    they started is killed and the test fails with their stderr tails."""
    import time

    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tagged(TAG, q.gradsift_tag)
            tails = [q.communicate()[1][-1500:] for q in procs]
            raise AssertionError(f"{len(procs)} process(es) did not finish within {timeout:g} s (a hang: all killed); "
                                 f"stderr tails: {tails}") from None
        outs.append((p.returncode, o, e))
    return outs


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that kills what ``cmd`` started on a timeout."""
    p = start(cmd, env=env, **kw)
    ((rc, o, e),) = finish([p], timeout)
    return subprocess.CompletedProcess(p.args, rc, o, e)


def restarted_job(cmd: Sequence[str], out: Path, env: dict[str, str] | None, kill_local_rank: str | None,
                  timeout: float = 300) -> tuple[dict, str]:
    """Run a ``torchrun --max-restarts ... gradsift train --out OUT --checkpoint-every ...`` job to its end; with
    ``kill_local_rank``, SIGKILL that local rank once the first checkpoint exists (torchrun then restarts the job).
    It must exit 0; returns (the final model's state dict, stderr)."""
    import time

    import torch

    p = start(cmd, env=env)
    if kill_local_rank is not None:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not latest.exists():
            time.sleep(0.05)
        victims = set(tagged(TAG, p.gradsift_tag)) & set(tagged("LOCAL_RANK", kill_local_rank))
        assert victims and latest.exists(), f"no checkpoint, or no rank {kill_local_rank} to kill"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
    (code, _, err), = finish([p], timeout=timeout)
    assert code == 0, err[-3000:]
    return torch.load(out / "final_model.pt"), err


# Processes that run gradsift's command line without starting an interpreter: forked from one server per pytest
# worker that has torch, torch._dynamo (the first optimizer imports it: 2-3 s a process here) and gradsift imported.
# The process is still a process of its own (its exit code, its stdout and stderr, os._exit), with the server's
# environment: tests that pass an environment, or test the interpreter's own start (``python -m gradsift``), use
# :func:`run`.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.multiprocessing", "gradsift", "gradsift.cli",
           "gradsift.ddp", "gradsift.fsdp", "procs", "ddp_helpers"]


def forkserver():
    """The multiprocessing context whose processes fork from the preloaded server."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def write_output_to(stdout: str, stderr: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at these files: a forked process would
    otherwise write to the server's, whatever they were when it started."""
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)


def _cli_child(args: list[str], out: str, err: str, cwd: str | None) -> None:
    import sys
    import traceback

    write_output_to(out, err)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["gradsift", *args]
    code = 1
    try:
        from gradsift.cli import console

        console()  # ends the process itself (gradsift.launch.exit_process)
    except SystemExit as e:  # what the interpreter would make of it
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends an interpreter
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli(args: Sequence[str], timeout: float = 300, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``gradsift ARGS`` in a process of its own, forked from the preloaded server: (returncode, stdout, stderr) as
    text, as :func:`run` gives them; past ``timeout`` the process is killed and the test fails."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gradsift-cli-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = forkserver().Process(target=_cli_child, args=(list(args), out, err, None if cwd is None else str(cwd)))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise AssertionError(f"gradsift {' '.join(map(str, args))} did not finish within {timeout:g} s (killed); "
                                 f"stderr tail: {Path(err).read_text(errors='replace')[-1500:]}")
        return subprocess.CompletedProcess(["gradsift", *args], p.exitcode, Path(out).read_text(errors="replace"),
                                           Path(err).read_text(errors="replace"))
