"""Several "hosts" on one machine: network namespaces on a bridge, with shaped links.

``gradsift cluster up|run|down|calibrate`` builds N host namespaces
(``<name>-h0 ...``) and one bridge namespace (``<name>-br``), joins each host to
the bridge with a veth pair (``eth0`` in the host, address ``<subnet>.<i+1>/24``),
and shapes each host's uplink with ``tc tbf`` for the rate. Training runs
``torchrun`` in every host namespace (multi-node rendezvous over the bridge,
``GLOO_SOCKET_IFNAME=eth0``, one thread per rank).

Delay and loss: the kernel here has no ``sch_netem`` (``tc qdisc add ... netem``
answers "Specified qdisc kind is unknown"), so a link with delay or loss is routed
through a small userspace link emulator instead (:mod:`gradsift.cluster.relay`): the host's veth
peer is not attached to the bridge; a process in the bridge namespace moves
Ethernet frames between it and a second veth pair that is, holding each frame
for the delay and dropping the given share at random. Offloads (TSO/GSO/GRO, TX
checksum) are turned off on those interfaces with ``ethtool`` so frames are
whole and checksummed. Where ``netem`` exists it is used instead.

Everything is torn down on exit, on failure and on Ctrl-C (namespaces deleted,
relays killed). Without root or ``ip netns`` every command refuses with one line.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

STATE_DIR = Path("/run/gradsift-cluster") if os.path.isdir("/run") else Path("/tmp/gradsift-cluster")


class ClusterError(RuntimeError):
    """Cluster set-up or run failed; the message is one line, ``outputs`` holds what the hosts printed."""

    def __init__(self, message: str, outputs: list[tuple[int, str, str]] | None = None):
        super().__init__(message)
        self.outputs = outputs or []


def _run(cmd: Sequence[str] | str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    shell = isinstance(cmd, str)
    r = subprocess.run(cmd, shell=shell, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        what = cmd if shell else " ".join(cmd)
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ClusterError(f"`{what}` failed: {msg[0] if msg else r.returncode}")
    return r


def check_environment() -> None:
    """Refuse, in one line, where namespaces cannot be made."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise ClusterError("gradsift cluster needs root (network namespaces and tc); run it as root")
    if not shutil.which("ip") or not shutil.which("tc"):
        raise ClusterError("gradsift cluster needs iproute2 (`ip` and `tc`) on PATH")
    probe = f"gsprobe{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        raise ClusterError(f"cannot create network namespaces here: {(r.stderr or '').strip()[:160]}")
    _run(["ip", "netns", "del", probe], check=False)


def netem_available() -> bool:
    probe = f"gsnetem{os.getpid()}"
    _run(["ip", "netns", "add", probe], check=False)
    try:
        _run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"], check=False)
        r = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                 check=False)
        return r.returncode == 0
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def parse_rate(rate: str) -> float:
    """'100mbit' / '1gbit' / '500kbit' -> bits per second."""
    r = rate.strip().lower()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(unit):
            try:
                return float(r[: -len(unit)]) * mult
            except ValueError:
                break
    raise ClusterError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


@dataclass
class Link:
    """How one host's link behaves: uplink rate (tbf), and delay/loss (netem or the relay)."""

    rate: str | None = "100mbit"
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    @property
    def impaired(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0


@dataclass
class Cluster:
    hosts: int = 4
    name: str = "gs"
    subnet: str = "10.99.0"
    links: list[Link] = field(default_factory=list)
    relays: dict[int, int] = field(default_factory=dict)  # host -> relay pid
    use_netem: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ClusterError(f"hosts must be between 1 and 200, got {self.hosts}")
        if not self.links:
            self.links = [Link() for _ in range(self.hosts)]
        if len(self.links) != self.hosts:
            raise ClusterError("one link description per host")

    # ------------------------------------------------------------- names
    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def host_ns(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    def ns(self, ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", ns, *cmd], check=check)

    # ------------------------------------------------------------- up/down
    def up(self) -> "Cluster":
        check_environment()
        self.down(quiet=True)
        self.use_netem = any(l.impaired for l in self.links) and netem_available()
        try:
            _run(["ip", "netns", "add", self.bridge_ns])
            self.ns(self.bridge_ns, "ip", "link", "set", "lo", "up")
            self.ns(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
            self.ns(self.bridge_ns, "ip", "link", "set", "br0", "up")
            for i in range(self.hosts):
                self._add_host(i)
            self.save()
        except BaseException:
            self.down(quiet=True)
            raise
        return self

    def _add_host(self, i: int) -> None:
        h, br = self.host_ns(i), self.bridge_ns
        a, b = f"{self.name}a{i}", f"{self.name}b{i}"
        _run(["ip", "netns", "add", h])
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        _run(["ip", "link", "set", a, "netns", h])
        _run(["ip", "link", "set", b, "netns", br])
        self.ns(h, "ip", "link", "set", a, "name", "eth0")
        self.ns(h, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
        self.ns(h, "ip", "link", "set", "eth0", "up")
        self.ns(h, "ip", "link", "set", "lo", "up")
        link = self.links[i]
        if link.impaired and not self.use_netem:
            # host eth0 <-> b (bridge ns, unattached) <relay> c (bridge ns) <-> d (on br0)
            c, d = f"{self.name}c{i}", f"{self.name}d{i}"
            self.ns(br, "ip", "link", "add", c, "type", "veth", "peer", "name", d)
            for dev in (c, d, b):
                self.ns(br, "ip", "link", "set", dev, "up")
            self.ns(br, "ip", "link", "set", d, "master", "br0")
            self._no_offload(h, "eth0")
            for dev in (b, c, d):
                self._no_offload(br, dev)
            self.start_relay(i, b, c, link)
        else:
            self.ns(br, "ip", "link", "set", b, "master", "br0")
            self.ns(br, "ip", "link", "set", b, "up")
        self.shape(i)

    def _no_offload(self, ns: str, dev: str) -> None:
        if not shutil.which("ethtool"):
            raise ClusterError("delay or loss without sch_netem needs ethtool (apt-get install ethtool)")
        self.ns(ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off", "rx", "off",
                check=False)

    def shape(self, i: int) -> None:
        """(Re)apply host i's uplink shaping."""
        h = self.host_ns(i)
        link = self.links[i]
        self.ns(h, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        parent = ["root"]
        if self.use_netem and link.impaired:
            net = ["netem"]
            if link.delay_ms:
                net += ["delay", f"{link.delay_ms}ms"]
            if link.loss_pct:
                net += ["loss", f"{link.loss_pct}%"]
            self.ns(h, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", *net)
            parent = ["parent", "1:"]
        if link.rate:
            bps = parse_rate(link.rate)
            burst = max(32 * 1024, int(bps / 8 * 0.002))  # 2 ms worth of bytes, at least 32 KiB
            self.ns(h, "tc", "qdisc", "add", "dev", "eth0", *parent, "handle", "2:", "tbf", "rate", link.rate,
                    "burst", str(burst), "latency", "200ms")

    def start_relay(self, i: int, dev_a: str, dev_b: str, link: Link) -> None:
        cmd = ["ip", "netns", "exec", self.bridge_ns, sys.executable, "-m", "gradsift.cluster.relay", dev_a,
               dev_b, str(link.delay_ms / 1000.0), str(link.loss_pct / 100.0), str(1000 + i)]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.relays[i] = p.pid
        time.sleep(0.3)
        if p.poll() is not None:
            raise ClusterError(f"the link emulator for host {i} did not start (exit {p.returncode})")

    def down(self, quiet: bool = False) -> None:
        """Kill relays and delete every namespace of this cluster (by name prefix)."""
        for pid in list(self.relays.values()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        self.relays = {}
        st = self.load_state(self.name)
        if st:
            for pid in st.get("relays", {}).values():
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        r = _run(["ip", "netns", "list"], check=False)
        for line in r.stdout.splitlines():
            ns = line.split()[0] if line.strip() else ""
            if ns == self.bridge_ns or (ns.startswith(f"{self.name}-h") and ns[len(self.name) + 2:].isdigit()):
                _run(["ip", "netns", "pids", ns], check=False)
                for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                _run(["ip", "netns", "del", ns], check=False)
        try:
            self.state_file.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------- faults
    def cut(self, i: int) -> None:
        self.ns(self.host_ns(i), "ip", "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        self.ns(self.host_ns(i), "ip", "link", "set", "eth0", "up")
        self.shape(i)

    # ------------------------------------------------------------- state
    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        d = asdict(self)
        self.state_file.write_text(json.dumps(d))

    @classmethod
    def load_state(cls, name: str) -> dict | None:
        p = STATE_DIR / f"{name}.json"
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    @classmethod
    def attach(cls, name: str) -> "Cluster":
        st = cls.load_state(name)
        if st is None:
            raise ClusterError(f"no cluster named {name!r} is up (run `gradsift cluster up` first)")
        st["links"] = [Link(**l) for l in st["links"]]
        st["relays"] = {int(k): v for k, v in st["relays"].items()}
        return cls(**st)

    # ------------------------------------------------------------- processes
    def popen(self, i: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.Popen(["ip", "netns", "exec", self.host_ns(i), *cmd], env=full_env,
                                start_new_session=True, **kw)

    def torchrun_cmd(self, i: int, args: Sequence[str], nproc: int = 1, port: int = 29400, max_restarts: int = 0,
                     run_id: str = "gradsift", module: bool = True) -> list[str]:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--nnodes", str(self.hosts), "--nproc-per-node", str(nproc), "--node-rank", str(i),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.ip(0)}:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},join_timeout=900",
                "--local-addr", self.ip(i), "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
                *(["-m"] if module else []), *args]


def torch_env(threads: int = 1) -> dict[str, str]:
    """Environment for torchrun on a namespace host.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default the workers of every restart round reuse the agent's
    rendezvous store without a per-round prefix, so after a restart a fast rank can read a peer's gloo address
    left from the dead round and fail with "Connection refused" (measured: 2 of 3 kill-and-restart runs hung).
    With it, rank 0 of each round opens a fresh store on a fresh port.
    """
    return {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_on_cluster(cluster: Cluster, args: Sequence[str], *, nproc: int = 1, max_restarts: int = 0,
                   timeout_s: float = 1800, module: bool = True, on_start=None, run_id: str | None = None
                   ) -> list[tuple[int, str, str]]:
    """Run ``torchrun ... args`` on every host; return [(returncode, stdout, stderr)] per host.

    ``on_start(procs)`` runs while training is in flight (fault injection).
    Every torchrun is killed if any of them hangs past ``timeout_s``.
    """
    port = 29400 + random.Random(os.getpid() + int(time.time())).randrange(500)
    rid = run_id or f"gs{os.getpid()}{int(time.time() * 1000) % 100000}"
    procs = [cluster.popen(i, cluster.torchrun_cmd(i, args, nproc, port, max_restarts, rid, module),
                           env=torch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(cluster.hosts)]
    results: list[tuple[int, str, str]] = []
    try:
        if on_start is not None:
            on_start(procs)
        deadline = time.time() + timeout_s
        for p in procs:
            left = max(1.0, deadline - time.time())
            try:
                out, err = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                outputs = []
                for q in procs:  # kill everything, keep what each host printed for the diagnosis
                    _kill_group(q)
                    o, e = q.communicate()
                    outputs.append((q.returncode, o or "", e or ""))
                raise ClusterError(f"training on the cluster did not finish within {timeout_s:.0f} s",
                                   outputs) from None
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            _kill_group(p)
            p.wait()
    return results


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL a still-running host command and everything it started (its own session)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass


class TearDown:
    """Context manager: bring a cluster up, and down on exit, error, Ctrl-C or SIGTERM."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Cluster:
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, handler)
        atexit.register(self.cluster.down, True)
        return self.cluster.up()

    def __exit__(self, *exc) -> None:
        try:
            self.cluster.down(quiet=True)
        finally:
            atexit.unregister(self.cluster.down)
            for sig, old in self._old.items():
                signal.signal(sig, old)
