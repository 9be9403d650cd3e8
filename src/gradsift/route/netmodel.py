"""Alpha-beta cost of the collectives gradsift issues, and step-time estimates.

Ring collectives on N workers, a latency alpha per message and a bandwidth
beta (bytes/s) per link (Thakur et al. 2005; Patarasuk & Yuan 2009):

* all-reduce of S bytes: ``2(N-1) alpha + 2(N-1)/N * S / beta``
* all-gather of S bytes from each worker: ``(N-1) alpha + (N-1) S / beta``
* all-to-all of S bytes to each other worker: ``(N-1) alpha + (N-1) S / beta`` (pairwise)

A group (a DDP bucket; one tensor in the simulator) costs its all-reduce and
its all-gather (:mod:`gradsift.transport.wire`): fixed-size buffers, no count
exchange.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from ..transport.base import GroupTraffic


@dataclass(frozen=True)
class NetworkModel:
    """Links of ``bandwidth_gbps`` Gbit/s and ``latency_us`` microseconds per message."""

    bandwidth_gbps: float = 1.0
    latency_us: float = 50.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbps > 0):
            raise ValueError(f"bandwidth must be > 0 Gbit/s, got {self.bandwidth_gbps}")
        if not (self.latency_us >= 0):
            raise ValueError(f"latency must be >= 0 us, got {self.latency_us}")

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Bytes per second per link."""
        return self.bandwidth_gbps * 1e9 / 8.0

    def allreduce_s(self, nbytes: float, world_size: int) -> float:
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        n = world_size
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes / self.beta

    def allgather_s(self, nbytes_each: float, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        n = world_size
        return (n - 1) * self.alpha + (n - 1) * nbytes_each / self.beta

    def alltoall_s(self, nbytes_each: float, world_size: int) -> float:
        """An all-to-all of ``nbytes_each`` to every other worker: pairwise exchanges, one link, N-1 messages."""
        if world_size <= 1:
            return 0.0
        n = world_size
        return (n - 1) * self.alpha + (n - 1) * nbytes_each / self.beta

    def group_s(self, traffic: GroupTraffic) -> float:
        """Time to aggregate one group: its collectives one after the other (the scatter route's two stages
        depend on each other)."""
        n = traffic.world_size
        return (self.allreduce_s(traffic.allreduce_bytes, n) + sum(
            self.allgather_s(b, n) for b in (traffic.allgather_bytes, traffic.gathered_sums, traffic.owner_bytes) if b)
                + (self.alltoall_s(traffic.alltoall_bytes, n) if traffic.alltoall_bytes else 0.0))

    def as_dict(self) -> dict:
        return asdict(self)


def serial_step_s(compute_s: float, select_s: float, comm_s: float) -> float:
    """Step time when communication starts after backprop (SLGS-SGD, Fig. 1b of LAGS)."""
    return compute_s + select_s + comm_s
