"""A process that ran gloo collectives ends with its own exit status, without the user calling anything.

With gloo, a rank that lets Python shut down right after a collective can die of SIGABRT instead of exiting with
its code: a gloo worker thread drops its last reference to the finished collective's tensors a moment after the
caller saw it complete, and if the interpreter is finalizing by then, taking the GIL to free them unwinds that
thread through C++ ("terminate called without an active exception"). On a busy machine the thread can stay
descheduled long enough for a short script to reach its end first.

:func:`settle_at_exit` (called once a rank is built on a process group) registers an exit handler that runs before
the interpreter starts finalizing and waits, at most ``limit_s``, until no other thread of the process is
running: gloo's workers then sit idle on their queues, holding nothing, and the interpreter's shutdown frees
the tensors itself. The exit status is the script's own (an exception's 1, ``sys.exit``'s code), because nothing
is skipped. ``gradsift.ddp.finish()`` stays for scripts that want ``os._exit`` regardless.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

_registered = False


def settle_at_exit() -> None:
    """Register, once per process, the exit handler that lets gloo's worker threads go idle (module docstring)."""
    global _registered
    if not _registered:
        atexit.register(settle)
        _registered = True


def running_threads() -> int | None:
    """How many of this process's other threads are running or runnable now (Linux's /proc); None where the
    system does not say."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = 0
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] == "R":  # the state follows the parenthesised thread name
            running += 1
    return running


def settle(limit_s: float = 2.0, quiet_polls: int = 3, poll_s: float = 0.005) -> float:
    """Wait until no other thread runs for ``quiet_polls`` polls in a row, or ``limit_s``; sleeping releases the
    GIL, so a worker thread waiting for it to free a tensor gets it. Returns the seconds waited. Where the thread
    states cannot be read, waits a fixed 0.2 s."""
    start = time.monotonic()
    quiet = 0
    while time.monotonic() - start < limit_s:
        running = running_threads()
        if running is None:
            time.sleep(0.2)
            break
        quiet = quiet + 1 if running == 0 else 0
        if quiet >= quiet_polls:
            break
        time.sleep(poll_s)
    return time.monotonic() - start
