"""Nothing silently wrong, nothing lost: self-verifying checkpoints, output folders that cannot mix, rank-bound
state, edge inputs, dying peers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradsift import make_compressor
from gradsift.compressors import InputError, OptionError
from gradsift.launch.checkpoint import CheckpointError, load_verified, save_verified
from gradsift.runtime.records import MetricsWriter, OutputDir, OutputError, read_metrics
import procs
from helpers import all_specs
from test_launch import TORCHRUN, env, free_port

TRAIN = [sys.executable, "-m", "gradsift", "train"]


def torchrun(nproc: int, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    port = free_port()
    return procs.run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", "-m", "gradsift", "train",
                      "--runtime", "ddp", *args], env=env(), timeout=timeout)


def ours(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if l.startswith("gradsift: error:")]


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_file_verifies_itself(tmp_path):
    good = tmp_path / "good.pt"
    save_verified({"w": torch.arange(1000.0)}, good)
    assert torch.equal(load_verified(good)["w"], torch.arange(1000.0))
    raw = good.read_bytes()
    cases = {
        "flipped": raw[: len(raw) // 2] + bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 16])
        + raw[len(raw) // 2 + 16:],
        "truncated": raw[: len(raw) - 100],
        "empty": b"",
        "garbage": os.urandom(5000),
        "plain torch.save": b"PK\x03\x04" + raw[200:],
    }
    expect = {"flipped": "corrupted", "truncated": "truncated", "empty": "empty", "garbage": "not a gradsift",
              "plain torch.save": "not a gradsift"}
    for name, data in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.pt"
        bad.write_bytes(data)
        with pytest.raises(CheckpointError) as e:
            load_verified(bad)
        msg = str(e.value)
        assert "\n" not in msg and str(bad) in msg and expect[name] in msg, (name, msg)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_verified(tmp_path / "missing.pt")


class _Payload:
    """Unpickling this runs code: it touches ``marker`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_crafted_checkpoint_with_a_valid_checksum_runs_no_code(tmp_path):
    """The header's SHA-256 proves the file whole, not who wrote it: a file with gradsift's header and a valid
    checksum whose content names a callable is refused unread, and the callable never runs."""
    import hashlib
    import io
    import pickle

    from gradsift.launch.checkpoint import MAGIC

    marker = tmp_path / "ran"
    for name, content in {"pickle": pickle.dumps({"model": _Payload(str(marker))}, protocol=2),
                          "torch.save": None}.items():
        if content is None:
            buf = io.BytesIO()
            torch.save({"model": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, buf)
            content = buf.getvalue()
        header = json.dumps({"version": "0", "length": len(content), "sha256": hashlib.sha256(content).hexdigest()})
        crafted = tmp_path / f"crafted-{name.replace('.', '_')}.pt"
        crafted.write_bytes(MAGIC + header.encode() + b"\n" + content)
        with pytest.raises(CheckpointError) as e:
            load_verified(crafted)
        assert not marker.exists(), f"loading a crafted checkpoint ({name}) ran its code"
        assert "\n" not in str(e.value) and str(crafted) in str(e.value), str(e.value)
    # a real checkpoint's content (RNG streams included) still loads
    from gradsift.launch.checkpoint import rng_state, set_rng_state

    good = tmp_path / "good.pt"
    state = rng_state()
    save_verified({"rng": state}, good)
    import random

    import numpy as np

    expect = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_verified(good)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expect[0], again[0]) and np.array_equal(expect[1], again[1]) and expect[2] == again[2]


def test_resume_from_a_bad_checkpoint_stops_every_rank_with_one_line(tmp_path):
    """A damaged checkpoint, or one of another configuration, stops every rank with one line naming it; refused
    in the completed run's own folder, it leaves that run's summary as it was (not 'failed', not 0 steps)."""
    common = ["--task", "digits-mlp", "--compressor", "topk", "--ratio", "0.05", "--eval-every", "1000", "--quiet",
              "--timeout", "60"]
    r = torchrun(2, [*common, "--steps", "4", "--checkpoint-every", "2", "--out", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr[-2000:]
    before = (tmp_path / "a" / "summary.json").read_text()
    ck = tmp_path / "a" / "checkpoints" / "ckpt-00000004.pt"
    raw = ck.read_bytes()
    flipped = tmp_path / "flipped.pt"
    mid = len(raw) // 2
    flipped.write_bytes(raw[:mid] + b"\x7f" * 16 + raw[mid + 16:])  # 16 bytes overwritten, as the issue measured
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(raw[: mid])
    cases = [(2, flipped, common, "corrupted"), (2, truncated, common, "truncated"),
             (2, ck, [*common[:5], "0.02", *common[6:]], "another configuration: ratio"),
             (2, ck, [*common[:3], "randomk", *common[4:]], "another configuration: compressor")]
    for i, (nproc, path, args, needle) in enumerate(cases):
        out = tmp_path / ("a" if i == len(cases) - 1 else f"r{i}")  # (the last in the completed run's folder)
        r = torchrun(nproc, [*args, "--steps", "6", "--resume", str(path), "--out", str(out)])
        lines = ours(r.stderr)
        assert r.returncode != 0 and len(lines) == nproc, (needle, r.stderr[-2000:])  # one line on every rank
        assert all(needle in l and str(path) in l for l in lines), (needle, lines)
        # no traceback through gradsift's own code (torchrun prints its own; the checkout may be named gradsift)
        assert not re.search(r'File "[^"]*/(src|site-packages)/gradsift/', r.stderr), r.stderr[-2000:]
        # every rank exits 2 (none aborts in gloo's teardown: gradsift.launch.exit_process)
        assert r.stderr.count("exitcode  : 2") == nproc and "SIGABRT" not in r.stderr, r.stderr[-1500:]
    assert (tmp_path / "a" / "summary.json").read_text() == before


# ---------------------------------------------------------------- output folders
def test_two_runs_into_one_folder_refuse_and_overwrite_clears(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--task", "linreg", "--compressor", "topk", "--ratio", "0.1", "--workers", "2", "--steps", "3",
            "--quiet", "--out", str(out)]
    assert procs.cli(args).returncode == 0
    r = procs.cli(args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--overwrite" in r.stderr
    (out / "stale.txt").write_text("x")
    r = procs.cli([*args, "--overwrite"])
    assert r.returncode == 0, r.stderr
    assert not (out / "stale.txt").exists() and len(read_metrics(out / "metrics.jsonl")) == 3
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    # a folder of someone else's files is never cleared
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    r = procs.cli([*args[:-1], str(other), "--overwrite"])
    assert r.returncode == 2 and (other / "thesis.tex").exists() and "not a gradsift" in r.stderr


def test_a_folder_in_use_refuses_a_second_run(tmp_path):
    with OutputDir(tmp_path / "busy"):
        with pytest.raises(OutputError, match="in use by another gradsift run"):
            OutputDir(tmp_path / "busy", overwrite=True).open()
        r = procs.cli(["train", "--task", "linreg", "--compressor", "topk", "--steps", "2", "--quiet", "--overwrite",
                       "--out", str(tmp_path / "busy")])
        assert r.returncode == 2 and "in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # a lock left by a process that died is taken over
    (tmp_path / "dead").mkdir()
    (tmp_path / "dead" / ".gradsift.lock").write_text(f"999999999 {os.uname().nodename}\n")
    with OutputDir(tmp_path / "dead", reuse=True):
        pass


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; /proc covers the unwritable case below")
def test_read_only_folder_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = subprocess.run([*TRAIN, "--task", "linreg", "--compressor", "topk", "--steps", "2", "--out", str(ro / "x")], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot create" in r.stderr
    finally:
        ro.chmod(0o700)


def test_unwritable_folder_is_one_line(tmp_path):
    for where in ("/proc/gradsift-out", "/proc/self/status/x"):
        r = procs.cli(["train", "--task", "linreg", "--compressor", "topk", "--steps", "2", "--out", where])
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and where in r.stderr


def test_concurrent_writers_never_tear_a_record(tmp_path):
    path = tmp_path / "m.jsonl"
    code = ("import sys; from gradsift.runtime.records import MetricsWriter\n"
            "w = MetricsWriter(sys.argv[1], append=True)\n"
            "for i in range(400): w.write({'step': i, 'who': sys.argv[2], 'pad': 'x' * 3000})\n")
    writers = [subprocess.Popen([sys.executable, "-c", code, str(path), str(n)]) for n in range(3)]
    assert all(p.wait(timeout=120) == 0 for p in writers)
    lines = path.read_text().splitlines()
    assert len(lines) == 1200 and all(json.loads(l)["pad"] == "x" * 3000 for l in lines)
    w = MetricsWriter(tmp_path / "nan.jsonl")
    w.write({"step": 1, "loss": float("nan"), "t": torch.tensor(2.0)})
    w.close()
    assert read_metrics(tmp_path / "nan.jsonl") == [{"step": 1, "loss": None, "t": 2.0}]


def test_interrupted_run_says_so(tmp_path):
    out = tmp_path / "run"
    # (Ctrl-C as a user's shell delivers it: the run starts with SIGINT at its default, whatever this process has)
    p = subprocess.Popen([*TRAIN, "--task", "digits-cnn", "--compressor", "topk", "--workers", "2", "--steps",
                          "100000", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 90
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "interrupted", s["status"]
    assert "Traceback" not in err


# ---------------------------------------------------------------- rank-bound state
def test_state_of_another_rank_refuses_unless_reset():
    a = make_compressor("topk", 0.1, rank=0, world_size=2)
    b = make_compressor("topk", 0.1, rank=1, world_size=2)
    a.compress("w", torch.randn(100))
    sd = a.state_dict()
    assert sd["rank"] == 0 and sd["world_size"] == 2
    with pytest.raises(ValueError, match="rank 0") as e:
        b.load_state_dict(sd)
    assert "reset_memory" in str(e.value) and "\n" not in str(e.value)
    b.load_state_dict(sd, reset_memory=True)
    assert all(not store for store in b.stores().values())  # reset: no residual carried over
    c = make_compressor("topk", 0.1, rank=0, world_size=2)
    c.load_state_dict(sd)  # its own rank: restored exactly
    assert torch.equal(c.compress("w", torch.ones(100)).values, a.compress("w", torch.ones(100)).values)


# ---------------------------------------------------------------- edge inputs, every compressor
@pytest.mark.parametrize("spec", all_specs())
def test_every_compressor_defines_its_edge_inputs(spec):
    comp = make_compressor(spec, 0.1)
    p = comp.compress("empty", torch.empty(0))
    assert p.count == 0 and p.values.numel() == 0
    big = torch.full((257,), 3.4e38)
    big[::2] *= -1
    p = comp.compress("big", big)  # finite: the finiteness check must not overflow
    assert bool(torch.isfinite(p.values).all())
    for dtype in (torch.int64, torch.bool):
        with pytest.raises(InputError, match="floating"):
            comp.compress("int", torch.ones(10, dtype=dtype))
    with pytest.raises(InputError, match="meta"):
        comp.compress("meta", torch.empty(10, device="meta"))
    with pytest.raises(OptionError, match="ratio"):
        make_compressor(spec, True)


# ---------------------------------------------------------------- a peer that dies
def _rank_pids(parent: int) -> dict[int, int]:
    out = {}
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            envs = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for e in envs:
            if e.startswith(b"RANK="):
                out[int(e[5:])] = int(child)
    return out


def test_a_killed_peer_leaves_one_line_and_a_failed_summary(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    p = procs.start([TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", "-m", "gradsift", "train",
                     "--runtime", "ddp", "--task", "digits-mlp", "--compressor", "topk", "--steps", "100000",
                     "--eval-every", "100000", "--quiet", "--timeout", "60", "--out", str(out)], env=env())
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not ((out / "metrics.jsonl").exists()
                                              and len(read_metrics(out / "metrics.jsonl")) >= 5):
            time.sleep(0.2)
        pids = _rank_pids(p.pid)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGKILL)
        ((_, _, err),) = procs.finish([p], 90)
    finally:
        procs.kill_tagged(procs.TAG, p.gradsift_tag)
    lines = ours(err)
    assert p.returncode != 0
    assert len(lines) == 1 and "rank 1" in lines[0], err[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"].startswith("failed") and "rank 1" in s["status"], s["status"]


def test_exit_process_is_a_plain_exit_until_a_group_was_joined():
    from gradsift.launch import exit_process

    with pytest.raises(SystemExit) as e:
        exit_process(3)  # no process group in this process: the interpreter shuts down normally (pytest survives)
    assert e.value.code == 3


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("spec", ["redsync", "gaussiank", "sidco", "sidco:dist=gp", "sidco:dist=gamma"])
def test_threshold_methods_send_from_a_constant_tensor(spec, backend):
    """Every magnitude tied: a threshold from their mean and spread lands on them and once selected nothing for 50
    steps while the residual grew 50-fold. Now the largest go (ties included, capped by the method's capacity):
    at least k a step, a 1-element tensor every step, and nothing lost (sent + residual = every gradient added)."""
    import gradsift
    from gradsift import kernels

    with kernels.using(backend):
        for n in (1, 1000, 200_000):
            c = gradsift.make_compressor(spec, 0.01)
            k = max(1, round(0.01 * n))
            sent, total = torch.zeros(n, dtype=torch.float64), 0
            for _ in range(20):
                p = c.compress("w", torch.full((n,), 0.5))
                sent.index_add_(0, p.indices, p.values.double())
                total += p.count
            assert total >= 20 * k, (spec, n, total)
            if n == 1:
                assert total == 20
            assert torch.allclose(sent + c.residual["w"].double(), torch.full((n,), 10.0, dtype=torch.float64))


# ---------------------------------------------------------------- restarts and refused resumes
def test_a_kill_before_the_first_checkpoint_restarts_from_the_start(tmp_path):
    """torchrun --max-restarts 1 --resume auto, a rank SIGKILLed before any checkpoint: the restarted ranks start
    over in the job's own folder (they refused it as 'not empty' before) and the run completes with every step."""
    import time as _time

    out = tmp_path / "run"
    port = free_port()
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--max-restarts", "1", "-m", "gradsift", "train", "--runtime", "ddp", "--task",
           "digits-mlp", "--compressor", "topk", "--ratio", "0.05", "--steps", "1500", "--eval-every", "1000",
           "--resume", "auto", "--timeout", "60", "--quiet", "--out", str(out)]
    # without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: on one node gradsift joins each attempt under its own prefix
    p = procs.start(cmd, env={k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})
    deadline = _time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while _time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 20):
        _time.sleep(0.05)
    victims = set(procs.tagged(procs.TAG, p.gradsift_tag)) & set(procs.tagged("LOCAL_RANK", "1"))
    assert victims, "no rank 1 to kill"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    (code, _, err), = procs.finish([p], timeout=240)
    assert code == 0, err[-3000:]
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps == list(range(1, 1501))
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def test_a_planted_symlink_is_refused_never_followed(tmp_path):
    """A symbolic link where gradsift writes (metrics.jsonl in a resumed --out, the temporary name of an atomic
    write) is refused in one line or removed; the file outside keeps its bytes."""
    from gradsift.runtime.records import MetricsWriter, OutputError, write_json

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(outside)
    with pytest.raises(OutputError, match="symbolic link"):
        MetricsWriter(link)
    planted = tmp_path / f".summary.json.tmp-{os.getpid()}"
    planted.symlink_to(outside)
    write_json(tmp_path / "summary.json", {"status": "completed"})
    assert outside.read_text() == "precious\n" and not (tmp_path / "summary.json").is_symlink()
    # end to end: a resumed run whose metrics.jsonl was replaced by a link
    out = tmp_path / "run"
    common = ["--task", "digits-mlp", "--compressor", "topk", "--ratio", "0.05", "--checkpoint-every", "3",
              "--quiet", "--out", str(out)]
    assert torchrun(2, ["--steps", "3", *common]).returncode == 0
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(outside)
    r = torchrun(2, ["--steps", "6", "--resume", str(out / "checkpoints"), *common])
    assert r.returncode != 0 and any("symbolic link" in line for line in ours(r.stderr)), r.stderr[-2000:]
    assert outside.read_text() == "precious\n"


def test_a_torn_last_record_is_dropped_on_resume_and_other_garbage_refused(tmp_path):
    """A full disk or a crash can tear metrics.jsonl's last line: the resume keeps the whole records before it
    (a JSONDecodeError traceback before); a bad line in the middle is refused in one line."""
    from gradsift.runtime.records import OutputError, read_resumed_metrics

    good = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    p = tmp_path / "metrics.jsonl"
    p.write_text(good + '{"step": 3, "lo')
    assert [r["step"] for r in read_resumed_metrics(p)] == [1, 2]
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(OutputError, match="line 2 is not a JSON record"):
        read_resumed_metrics(p)


def test_a_full_disk_keeps_whole_records_and_says_so_in_one_line(tmp_path, monkeypatch):
    """ENOSPC mid-record: metrics.jsonl is cut back to its last whole record (it ended mid-record, 8192 bytes);
    an atomic write leaves the old file and no temporary one; both errors are one line."""
    import errno

    from gradsift.runtime import records
    from gradsift.runtime.records import MetricsWriter, OutputError, write_json

    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"step": 1, "loss": 1.0})
    real_write = os.write
    calls = [0]

    def full(fd, data):  # the first chunk goes, then the disk is full
        calls[0] += 1
        if calls[0] == 1:
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records.os, "write", full)
    with pytest.raises(OutputError, match="No space left") as e:
        w.write({"step": 2, "loss": 0.5, "pad": "x" * 100})
    assert "\n" not in str(e.value)
    monkeypatch.setattr(records.os, "write", real_write)
    w.close()
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    write_json(tmp_path / "summary.json", {"status": "completed"})

    def no_fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records.os, "fsync", no_fsync)
    with pytest.raises(OutputError, match="unchanged"):
        write_json(tmp_path / "summary.json", {"status": "failed"})
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
