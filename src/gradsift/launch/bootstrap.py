"""Joining the process group torchrun describes, and turning what a failed collective raised into one line."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..compressors.base import NonFiniteGradient
from ..payload.indexcode import CorruptPayload
from ..ddp import ConfigMismatch, finish
from ..runtime.records import process_alive
from ..runtime.runconfig import ConfigError

DEFAULT_TIMEOUT_S = 120.0
_joined = False  # this process joined a process group (its gloo worker threads outlive destroy_process_group)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout, or a peer rank went away."""


def _essence(text: str) -> str:
    """The informative part of a collective's error: without the future-callback wrappers and source tags."""
    text = re.sub(r"(Got the following error when running the callback: )?(RuntimeError|DistBackendError): ", "",
                  text)
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.lstrip().startswith(("Exception raised",
                                                                                               "frame #"))]
    return lines[0][:200] if lines else ""


class Terminated(BaseException):
    """SIGTERM arrived: torchrun stops the other ranks this way when one rank fails (or the job is cancelled)."""


@contextlib.contextmanager
def sigterm_raises():
    """While inside, SIGTERM raises :class:`Terminated` in the main thread, so a stopped rank still reports
    which peer went away and writes its summary (torchrun escalates to SIGKILL only after a grace period)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:  # not when a failing rank has set it aside since
            signal.signal(signal.SIGTERM, old)


def ignore_sigterm() -> None:
    """SIGTERM ignored from now until the process exits: a rank that is already failing prints its own one-line
    error and exits, instead of dying mid-report because torchrun stops every rank once the first one exits."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Peers:
    """Where every rank runs (host, pid), gathered once at start: on a failure, which rank went away."""

    def __init__(self):
        me = (socket.gethostname(), os.getpid())
        self.table: list[tuple[str, int]] = [me] * dist.get_world_size()
        dist.all_gather_object(self.table, me)
        self.rank = dist.get_rank()

    def gone(self, settle_s: float = 0.0) -> list[int]:
        """Ranks on this host whose process no longer exists (or is a zombie its launcher has not reaped yet);
        with ``settle_s``, look again for that long while none is found (a peer's death reaches us first)."""
        host = socket.gethostname()
        deadline = time.monotonic() + settle_s
        while True:
            out = [r for r, (h, pid) in enumerate(self.table) if r != self.rank and h == host and not process_alive(pid)]
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)

    def describe(self, settle_s: float = 0.0) -> str:
        gone = self.gone(settle_s)
        if gone:
            return "rank " + ", ".join(f"{r} (pid {self.table[r][1]} on {self.table[r][0]})" for r in gone) + \
                " went away"
        others = [r for r in range(len(self.table)) if r != self.rank]
        return "a peer rank went away or stopped answering" if others else "the collective failed"


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes in the environment (no-op if already joined)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("--runtime ddp runs under torchrun (RANK and WORLD_SIZE are not set), e.g. "
                          "torchrun --standalone --nproc-per-node 2 -m gradsift train --runtime ddp ...")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("GRADSIFT_DEVICE", "") == "cuda" else "gloo"
    global _joined
    bound = {}
    if backend == "nccl":  # bind this rank's GPU now: NCCL's collectives and barriers then need no guess
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        bound["device_id"] = torch.device("cuda", torch.cuda.current_device())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(timeout)
    if store is None:
        warn_shared_store_restarts()
    else:
        bound.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=timeout, **bound)
    _joined = True


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``. Once it joined a process group, the interpreter's shutdown is skipped
    (``os._exit`` after flushing stdout and stderr): a gloo worker thread drops its last reference to a finished
    collective's tensors a moment after the caller saw the collective complete; when that release needs the GIL
    while Python is finalizing, the thread is unwound through C++ and the whole process aborts with SIGABRT
    ("terminate called without an active exception", seen on about 1 in 12 runs that end right after a
    collective). The group itself is not destroyed first: ``destroy_process_group`` followed by freeing a DDP model
    destroys the gloo group from its Reducer while holding the GIL, which deadlocks when a worker thread waits for
    the GIL (pytorch/pytorch#56297). Nothing of gradsift's is left to finalize: files are closed where written."""
    if _joined:  # (a group joined through gradsift and already left: still no interpreter shutdown)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    finish(code)


def attempt_store(timeout: datetime.timedelta, env: dict[str, str] | None = None):
    """On one node under torchrun's restarts over its shared agent store: that store, under a prefix of its own per
    restart attempt (None otherwise).

    Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every restart round's workers join through the agent's one
    store with no per-round prefix (torch assumes a fresh store per attempt), so a restarted rank can read a peer's
    gloo address left by the dead round ("Connection refused") or wait on it (a hang in ``init_process_group``):
    6 of 10 one-node kill-and-restart runs failed so (``benchmarks/restart_rate.py --shared-store``). On one node
    one agent restarts every worker, so ``TORCHELASTIC_RESTART_COUNT`` is the same on every rank of a round and
    names a fresh key space. On several nodes a node that joins later counts its restarts from 0: there the
    variable is still needed (:func:`warn_shared_store_restarts` says so)."""
    env = os.environ if env is None else env
    if not (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
            and env.get("GROUP_WORLD_SIZE", "1") == "1" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        return None
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"gradsift/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def warn_shared_store_restarts(env: dict[str, str] | None = None) -> str | None:
    """Warn (rank 0) when torchrun may restart workers of several nodes over its shared, unprefixed store.

    Returns the warning text, or None when the set-up is safe (see docs/ddp-reference.md, "Restarts"): a restarted
    rank can read a peer's gloo address left over from the dead round and fail ("Connection refused") or hang. On
    one node :func:`attempt_store` gives each restart attempt its own keys (10 of 10 recovered, 4 of 10 before).
    """
    env = os.environ if env is None else env
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1" and env.get("GROUP_WORLD_SIZE", "1") != "1"):
        text = ("gradsift: warning: torchrun may restart workers of several nodes while they share the agent's "
                "store; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun or a restart can fail or hang in "
                "init_process_group")
        if env.get("RANK", "0") == "0":
            print(text, file=sys.stderr)
        return text
    return None


def device_for_rank() -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def explain(e: BaseException, state, timeout_s: float, peers: Peers | None = None) -> BaseException:
    """Turn what a failed backward/collective raised into gradsift's own one-line errors."""
    if state is not None and getattr(state, "error", None) is not None:
        return state.error
    if isinstance(e, Terminated):
        if peers is not None and peers.gone(settle_s=0.5):
            return CollectiveTimeout(f"{peers.describe()}; the launcher stopped this rank (SIGTERM)")
        return CollectiveTimeout("stopped by SIGTERM (torchrun sends it to every rank when one fails, or the job "
                                 "was cancelled)")
    text = str(e)
    if isinstance(e, (NonFiniteGradient, CorruptPayload, ConfigMismatch, ConfigError, CollectiveTimeout)):
        return e
    if "CorruptPayload" in text:
        line = next(l for l in text.splitlines() if "CorruptPayload" in l)
        return CorruptPayload(line.split("CorruptPayload:")[-1].strip())
    if "NonFiniteGradient" in text or "non-finite gradient" in text:
        line = next((l for l in text.splitlines() if "non-finite gradient" in l), text.splitlines()[0])
        return NonFiniteGradient(line.split("NonFiniteGradient:")[-1].strip())
    low = text.lower()
    first = _essence(text) or type(e).__name__
    if "timed out" in low or "timeout" in low:
        who = f"; {peers.describe()}" if peers is not None and peers.gone() else ""
        return CollectiveTimeout(f"a collective did not complete within the {timeout_s:g} s timeout (a peer is "
                                 f"unreachable or has died{who}): {first}")
    if any(w in low for w in ("connection closed", "connection reset", "broken pipe", "connection refused", "peer")):
        what = peers.describe(settle_s=1.0) if peers is not None else "a peer rank went away"
        return CollectiveTimeout(f"{what}; this rank stops: {first}")
    return e
