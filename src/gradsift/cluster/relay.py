"""The userspace link emulator: delay and loss where the kernel has no ``sch_netem``.

``python -m gradsift.cluster.relay DEV_A DEV_B DELAY_S LOSS SEED`` (started by
:meth:`gradsift.cluster.hosts.Cluster.start_relay` in the bridge namespace) moves
Ethernet frames between two interfaces over raw ``AF_PACKET`` sockets, holding
each frame for the delay and dropping the given share at random.
"""

from __future__ import annotations

import random
import select
import socket
import sys
import time
from typing import Any

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def relay(dev_a: str, dev_b: str, delay_s: float, loss: float, seed: int) -> None:
    """Move Ethernet frames between two interfaces, delayed by ``delay_s``, dropping a share ``loss``."""
    import heapq

    rng = random.Random(seed)
    socks = {}
    for dev in (dev_a, dev_b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((dev, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 2**20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)
        s.setblocking(False)
        socks[dev] = s
    other = {socks[dev_a].fileno(): socks[dev_b], socks[dev_b].fileno(): socks[dev_a]}
    queue: list[tuple[float, int, Any, bytes]] = []
    seq = 0
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, dst, frame = heapq.heappop(queue)
            try:
                dst.send(frame)
            except OSError:
                pass
        timeout = max(0.0, queue[0][0] - now) if queue else 1.0
        ready, _, _ = select.select(list(socks.values()), [], [], timeout)
        for s in ready:
            for _ in range(256):
                try:
                    frame, addr = s.recvfrom(65535)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue
                if loss and rng.random() < loss:
                    continue
                seq += 1
                heapq.heappush(queue, (time.monotonic() + delay_s, seq, other[s.fileno()], frame))


if __name__ == "__main__":
    _, a, b, d, l, sd = sys.argv
    relay(a, b, float(d), float(l), int(sd))
