"""The floor of a tensor's next pass (:class:`Guess`): where the candidates of the one-pass selections
(:mod:`gradsift.kernels.many`) start, learned from the tensor's last call and kept in its compressor state."""

from __future__ import annotations

import math
from typing import Any

from . import SMALL

SLACK = 0.9  # a first floor: 0.9 of the last threshold
SLACK_RANGE = (0.1, 10.0)
TOPK_WANT = 2.0  # top-k's candidates aimed at per target entry (at most twice that, plus CAP_EXTRA, are kept)
CAP_EXTRA = 64
EVERY_ENTRY = 1024  # top-k takes every entry of a tensor this small as a candidate: a guess missed there (k of 1-10)
MOVE_RANGE = (0.5, 2.0)  # how far one call's threshold move is believed (Guess.update's grow)


class Guess:
    """The floor of one tensor's next pass, kept in its compressor state as plain numbers: ``kth`` (the last
    threshold: top-k's k-th magnitude, a threshold method's final one), ``grow`` (how much it moved in the last call:
    error feedback's and momentum's accumulations grow for a while) and ``slack`` (the floor over the threshold
    expected, placed where the method wants its candidates)."""

    @staticmethod
    def floor(st: dict[str, Any], n: int, k: int, want: float = TOPK_WANT,
              grow_range: tuple[float, float] = MOVE_RANGE) -> tuple[float, int] | None:
        """(floor, candidate cap: twice ``want * k``) for this call, or None: no guess for a large tensor.
        ``grow_range`` bounds how much of the last move carries over: a threshold that jumps up and down (DGC's
        sampled one, RedSync's coarse search) must neither lift the floor over the next one nor carry a drop
        into a floor far below it (on ResNet-50's shapes a carried drop made 12% of DGC's passes overflow)."""
        return Guess.floors((st,), (n,), (k,), want, grow_range)[0]

    @staticmethod
    def floors(states, ns, ks, want: float = TOPK_WANT, grow_range: tuple[float, float] = MOVE_RANGE,
               every: int = 0) -> list[tuple[float, int] | None]:
        """:meth:`floor` of many tensors, in one loop; a tensor of at most ``every`` entries takes every entry as a
        candidate, guess or not (top-k's rule, :data:`EVERY_ENTRY`)."""
        lo, hi = grow_range
        out: list[tuple[float, int] | None] = []
        for st, n, k in zip(states, ns, ks):
            kth = st.get("kth")
            if k >= n or n <= every:
                out.append((0.0, n))
            elif not kth:  # no guess yet, or zeros at the threshold: every entry of a small tensor
                out.append((0.0, n) if n <= SMALL else None)
            else:
                grow = st.get("grow", 1.0)
                grow = lo if grow < lo else (hi if grow > hi else grow)
                out.append((kth * grow * st.get("slack", SLACK), min(n, int(2 * want * k) + CAP_EXTRA)))
        return out

    @staticmethod
    def cap(st: dict[str, Any], n: int, k: int, want: float = TOPK_WANT) -> int | None:
        """:meth:`floor`'s candidate cap alone: every entry when ``k >= n`` or, for a small tensor, without a guess
        yet (its floor is then 0); None for a large tensor without one."""
        if k >= n:
            return n
        if not st.get("kth"):  # no guess yet, or zeros at the threshold: every entry
            return n if n <= SMALL else None
        return min(n, int(2 * want * k) + CAP_EXTRA)

    @staticmethod
    def update(st: dict[str, Any], kth: float, at: int, want: float, floor: float | None = None,
               count: int | None = None) -> None:
        """Learn from this call: ``at`` entries lay above its threshold ``kth`` and (when a pass ran) ``count``
        reached ``floor``. The count is taken as log-linear in magnitude through those two points; the next floor
        is where ``want`` entries would lie."""
        Guess.update_many((st,), (kth,), (at,), (want,), (floor,), (count,))

    @staticmethod
    def update_many(states, kths, ats, wants, floors, counts) -> None:
        """:meth:`update` of many tensors' states, in one loop."""
        lo, hi = MOVE_RANGE
        slo, shi = SLACK_RANGE
        log, inf = math.log, math.inf
        for st, kth, at, want, floor, count in zip(states, kths, ats, wants, floors, counts):
            if not (0.0 <= kth < inf):  # an overflowed tensor: no guess
                st.pop("kth", None)
                continue
            old = st.get("kth")
            if old and kth:
                g = kth / old
                st["grow"] = lo if g < lo else (hi if g > hi else g)
            if floor is not None and count is not None and kth > 0 and count != at and floor != kth:
                a = at if at > 0.5 else 0.5
                slope = log((count if count > 0.5 else 0.5) / a) / (floor - kth)
                if slope < 0:
                    slack = 1.0 + log(want / a) / slope / kth
                    st["slack"] = slo if slack < slo else (shi if slack > shi else slack)
            st["kth"] = float(kth)
