"""The suite's own guards against hangs (tests/procs.py, the per-test limit in conftest.py): a stuck process costs one
failed test, never the CI run's whole time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs

HERE = Path(__file__).resolve().parent
# a parent that starts a child in a session of its own (as torchrun does its workers), writes its pid, then waits
PARENT = ("import subprocess, sys, time\n"
          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
          "open(sys.argv[1], 'w').write(str(c.pid))\n"
          "time.sleep(300)\n")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(path: Path, limit_s: float = 60.0) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_a_timeout_kills_what_the_process_started_in_other_sessions(tmp_path):
    pidfile = tmp_path / "child.pid"
    p = procs.start([sys.executable, "-c", PARENT, str(pidfile)])
    child = wait_for(pidfile)
    with pytest.raises(AssertionError, match="did not finish within 1 s"):
        procs.finish([p], timeout=1)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child) and p.poll() is not None


def test_a_test_past_its_limit_fails_alone_and_its_processes_go(tmp_path):
    for f in ("conftest.py", "procs.py"):
        shutil.copy(HERE / f, tmp_path / f)
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_stuck.py").write_text(
        "import subprocess, sys\n"
        f"PARENT = {PARENT!r}\n"
        "def test_stuck():\n"
        f"    subprocess.Popen([sys.executable, '-c', PARENT, {str(pidfile)!r}]).wait()\n"
        "def test_next():\n"
        "    pass\n")
    env = {k: v for k, v in os.environ.items() if k != procs.SESSION}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       capture_output=True, text=True, env={**env, "GRADSIFT_TEST_LIMIT_S": "5"}, cwd=tmp_path,
                       timeout=240)
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-2000:]
    assert "ran past 5 s" in r.stdout
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
