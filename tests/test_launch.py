"""`gradsift train --runtime ddp` under torchrun: two loopback "nodes", CLI errors."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from procs import finish as procs_finish, run as procs_run, start as procs_start


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def two_nodes(args_per_node, timeout=180):
    port = free_port()
    procs = []
    for node, args in enumerate(args_per_node):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gradsift-test",
               "--max-restarts", "0", "-m", "gradsift", "train", "--runtime", "ddp", *args]
        procs.append(procs_start(cmd, env=env()))
    return procs_finish(procs, timeout)


def test_two_node_loopback_run(tmp_path):
    out = tmp_path / "run"
    common = ["--task", "digits-cnn", "--compressor", "sidco", "--ratio", "0.05", "--steps", "8", "--eval-every", "4",
              "--out", str(out), "--quiet", "--bucket-cap-mb", "0.01", "--timeout", "60"]
    res = two_nodes([common, common])
    for rc, o, e in res:
        assert rc == 0, e[-2000:]
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    for r in recs:
        assert r["comm_s"] > 0 and r["step_s"] >= r["comm_s"] * 0 and r["k_ratio"] > 0
        # the least over both ranks, gathered at the end: rank 0's own time is one of the two
        assert 0 < r["comm_min_s"] <= r["comm_s"]
    s = json.loads((out / "summary.json").read_text())
    assert s["runtime"] == "ddp" and s["world_size"] == 2 and s["config"]["workers"] == 2


def test_two_nodes_with_different_settings_both_exit_1(tmp_path):
    a = ["--task", "digits-cnn", "--compressor", "topk", "--ratio", "0.01", "--steps", "3", "--quiet",
         "--out", str(tmp_path / "a")]
    b = ["--task", "digits-cnn", "--compressor", "topk", "--ratio", "0.02", "--steps", "3", "--quiet",
         "--out", str(tmp_path / "b")]
    res = two_nodes([a, b], timeout=90)
    for rc, o, e in res:
        assert rc != 0
        ours = [l for l in e.splitlines() if l.startswith("gradsift: error:")]
        assert len(ours) == 1 and "different gradsift configurations" in ours[0], e[-1500:]


def test_ddp_runtime_outside_torchrun_and_worker_mismatch(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gradsift", "train", "--runtime", "ddp", "--task", "linreg", "--compressor", "topk",
                        "--steps", "2", "--out", str(tmp_path / "x")], capture_output=True, text=True, env=env(),
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "torchrun" in r.stderr
    port = free_port()
    r = procs_run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", "-m", "gradsift", "train",
                   "--runtime", "ddp", "--task", "linreg", "--compressor", "topk", "--workers", "3", "--steps", "2", "--quiet",
                   "--out", str(tmp_path / "y")], env=env(), timeout=120)
    assert r.returncode != 0
    assert r.stderr.count("gradsift: error: --workers 3 does not match the world size 2") == 2


def test_plain_pytorch_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"
    port = free_port()
    r = procs_run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", str(example),
                   "--compressor", "sidco", "--steps", "21", "--save", str(tmp_path / "ck")], env=env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith("step")]
    assert len(lines) == 3
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[3])
    assert last < first
    # its checkpoint (docs/ddp-reference.md quotes these lines): each rank its own file, the memory restored
    import torch

    saved = [torch.load(tmp_path / f"ck-rank{r}.pt", weights_only=False)["gradsift"] for r in (0, 1)]
    r = procs_run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", str(example),
                   "--compressor", "sidco", "--steps", "1", "--resume", str(tmp_path / "ck")], env=env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert saved[0]["totals"]["steps"] == 21 and saved[0]["rank"] != saved[1]["rank"]


def test_one_call_script_skips_a_nan_step_and_exits_0(tmp_path):
    """A user's script whose only gradsift call is ``register(ddp, "topk", ratio=0.01, optimizer=opt)``: it
    trains, counts its steps, skips rank 1's NaN step on both ranks (the weights stay equal and finite), says so
    in one line, and both ranks exit 0 at the interpreter's own shutdown, run after run
    (benchmarks/exit_rate.py measures 20 of 20 with a core busy)."""
    script = Path(__file__).resolve().parent / "minimal_ddp_run.py"
    for _ in range(2):
        r = procs_run([TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", str(script),
                       "--steps", "12", "--nan-step", "4"], env=env(), timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", r.stdout)]  # (the ranks' lines may interleave)
        assert sorted(o["rank"] for o in out) == [0, 1]
        for o in out:
            assert o["steps"] == 11 and o["skipped"] == 1 and o["finite"] and o["bytes_per_worker"] > 0, o
        assert out[0]["checksum"] == out[1]["checksum"]
        said = [l for l in r.stderr.splitlines() if "skipped on every rank" in l]
        assert len(said) == 1 and said[0].startswith("gradsift: step 5 skipped"), r.stderr[-2000:]
        assert "SIGABRT" not in r.stderr and "terminate called" not in r.stderr


def test_warns_when_restarts_share_the_agent_store(capsys):
    from gradsift.launch import warn_shared_store_restarts

    risky = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2",
             "RANK": "0"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warn_shared_store_restarts(risky)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    assert warn_shared_store_restarts({**risky, "RANK": "1"}) and not capsys.readouterr().err  # rank 0 only
    capsys.readouterr()
    for safe in ({**risky, "TORCHELASTIC_USE_AGENT_STORE": "False"}, {**risky, "TORCHELASTIC_MAX_RESTARTS": "0"},
                 {**risky, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, {},
                 {**risky, "GROUP_WORLD_SIZE": "1"}):  # one node: gradsift's own prefix per attempt (below)
        assert warn_shared_store_restarts(safe) is None


def test_one_node_restarts_get_a_key_space_per_attempt():
    """On one node under torchrun's shared agent store, every restart attempt joins under a prefix of its own, so a
    restarted rank never reads the dead round's gloo addresses (4 of 10 kill-and-restart runs recovered without
    it, 10 of 10 with it: benchmarks/restart_rate.py --shared-store). Several nodes, or the store not shared: none."""
    import datetime

    import torch.distributed as dist

    from gradsift.launch.bootstrap import attempt_store

    timeout = datetime.timedelta(seconds=10)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    one = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "1",
           "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port)}
    store = attempt_store(timeout, one)
    store.set("default_pg/0", "here")
    assert master.get("gradsift/attempt_1/default_pg/0") == b"here"
    assert not master.check(["default_pg/0"])  # nothing where the next attempt would look
    for other in ({**one, "GROUP_WORLD_SIZE": "2"}, {**one, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                  {**one, "TORCHELASTIC_MAX_RESTARTS": "0"}, {**one, "TORCHELASTIC_USE_AGENT_STORE": "False"}):
        assert attempt_store(timeout, other) is None
