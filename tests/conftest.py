import faulthandler
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# ``make test`` runs the in-process tests on two pytest-xdist workers, one thread each (two workers of two threads
# would ask for four cores of this machine's two); a run without workers keeps two threads.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else max(1, min(2, os.cpu_count() or 1)))

from procs import SESSION, kill_tagged  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# No single test may hold the suite: past this many seconds the test's own processes (every process this pytest run
# started carries SESSION in its environment) are killed and the test fails with every thread's stack, so a hang
# costs one failed test, not the CI run's whole time.
TEST_LIMIT_S = int(os.environ.get("GRADSIFT_TEST_LIMIT_S", "600"))
os.environ.setdefault(SESSION, uuid.uuid4().hex)
if WORKER:  # each worker's own tag: a timeout in one kills what that worker started, never the other's processes
    os.environ[SESSION] = uuid.uuid4().hex


class TestRanPastItsLimit(Exception):
    pass


def _past_limit(signum, frame):
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    killed = kill_tagged(SESSION, os.environ[SESSION])
    raise TestRanPastItsLimit(f"the test ran past {TEST_LIMIT_S} s (GRADSIFT_TEST_LIMIT_S); killed the "
                              f"{len(killed)} process(es) it had started")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not hasattr(signal, "SIGALRM"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _past_limit)
    interrupt = signal.getsignal(signal.SIGINT)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        # what Ctrl-C does is restored after each test: code run in-process (Lightning's Trainer after a
        # KeyboardInterrupt, its process-group teardown) may leave SIGINT ignored or at the C default, and a later
        # test's subprocesses would inherit that (an ignored SIGINT stays ignored across exec)
        if interrupt is not None and signal.getsignal(signal.SIGINT) is not interrupt:
            signal.signal(signal.SIGINT, interrupt)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that reads the shared report (``quick_report``) runs on one pytest-xdist worker, which makes the
    report once (``--dist loadgroup``; the mark is set before xdist reads it)."""
    for item in items:
        if "quick_report" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("quick_report"))


@pytest.fixture
def shared_dir() -> Path:
    return SHARED


@pytest.fixture(scope="session")
def quick_report(tmp_path_factory) -> Path:
    """``gradsift reproduce all --quick``, run once for the session (tests/test_reproduce.py reads its report;
    tests/test_regtopk.py the linear regression's curves)."""
    from gradsift.cli import main

    out = tmp_path_factory.mktemp("reproduce")
    assert main(["reproduce", "all", "--quick", "--quiet", "--out", str(out)]) == 0
    return out
