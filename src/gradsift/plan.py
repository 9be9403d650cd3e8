"""The wire plan: per tensor, compress it, send it whole, or compress it and all-reduce the densified sum.

A sparsifier pays off only where the bytes it saves cost more than what it
spends. From the alpha-beta model of the link (configured, or calibrated on a
real one) the plan decides, per tensor and identically on every worker:

* ``dense`` -- the tensor is sent whole, uncompressed, in the group's all-reduce
  (no error, no memory): when the method itself says so (DGC's 1-D tensors);
  when its whole transfer costs no more than one message latency
  (``numel <= min_numel``, by default ``alpha * beta / value bytes``): compressing
  it saves nothing worth its error (LAGS-SGD Sec. 5 merges such tensors too); or
  when sending it whole takes no longer than selecting and sending its
  payload -- selection modelled as the method's ``SELECT_PASSES`` read passes
  at a nominal ``select_gbps`` (2.5 GB/s, one CPU thread), a fixed model so that
  every worker decides alike (on a fast link a slow selector does not pay);
* ``densify`` -- the tensor is compressed as configured (same selection, same
  memory, the same mean), but the workers' payloads are summed by an
  all-reduce of their dense scatter, because the all-gather of N sparse payloads
  would take longer than that all-reduce (high ratios, many workers, LAGS's
  planned densities);
* ``scatter`` -- the payload goes to the owners of its entries' regions in one
  all-to-all, each owner sums and keeps its share of the k largest, and one
  all-gather brings every owner's keep to everyone (:mod:`gradsift.owners`):
  about 2.25k entries received per worker at any N against (N-1)k, for two
  collectives' latency; chosen where the model says it is the fastest sparse
  collective. Not for methods that read the round's mean at the entries they
  sent (REGTOP-k: an owner's deferral would read as cancellation), nor for
  tensors of 2**31 entries or more;
* ``sparse`` -- everything else: the payload goes by all-gather.

``sparse_collective`` sets the collective of sparse payloads: ``auto`` (the
model's choice; all-gather when the plan is off), ``gather`` or ``scatter``
(where the method allows it, whether or not the plan is on).

``enabled=False`` keeps only the method's own rule (the papers' exact setting,
used by the reproductions). The plan decides per tensor, from the configuration
alone; how a whole *step* travels (measuring, every tensor whole, DDP's own
all-reduce) is the route owner's (:mod:`gradsift.routing`), which reads these
decisions and reports them with their reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import payload as P
from .errors import ConfigError
from .netmodel import NetworkModel
from .transport.wire import DENSIFY, GATHER, HEADER_BYTES, POSITION_DTYPE, SCATTER, pad

SELECT_GBPS = 2.5  # nominal bytes per second (x1e9) one thread reads in a selection pass on a CPU
SPARSE_ROUTE = "sparse"
SCATTER_ROUTE = "scatter"
DENSE_ROUTE = "dense"
SPARSE_COLLECTIVES = ("auto", "gather", "scatter")
DENSIFY_ROUTE = "densify"


@dataclass(frozen=True)
class Decision:
    route: str  # sparse | dense | densify
    reason: str = ""
    native: bool = False  # (dense) values in the gradient's own dtype, not the method's wire dtype
    by_plan: bool = False  # the plan's (or the route owner's) decision, not the method's own rule

    @property
    def dense(self) -> bool:
        return self.route == DENSE_ROUTE

    @property
    def wire_route(self) -> str | None:
        """The transport route to force for a sparse payload (None: the payload's own)."""
        return {DENSIFY_ROUTE: DENSIFY, SPARSE_ROUTE: GATHER, SCATTER_ROUTE: SCATTER}.get(self.route)


def check_collective(compressor, sparse_collective: str, scatter_keep: float = 1.0) -> None:
    """Refuse, in one line, a forced scatter for a method that cannot take it, and a bad keep factor."""
    if sparse_collective not in SPARSE_COLLECTIVES:
        raise ConfigError(f"sparse_collective must be one of {', '.join(SPARSE_COLLECTIVES)}, got {sparse_collective!r}")
    if isinstance(scatter_keep, bool) or not isinstance(scatter_keep, (int, float)) or not 1 <= scatter_keep <= 1e6:
        raise ConfigError(f"scatter_keep is how many times k the owners keep of the sum, a number >= 1, got "
                          f"{scatter_keep!r}")
    c = compressor.inner
    if sparse_collective == "scatter" and c.OBSERVES:
        raise ConfigError(f"{c.name} reads the round's mean at the entries it sent, and the owners' scatter keeps "
                          "only the sum's largest (the rest a step later), which it would read as cancellation: use "
                          "sparse_collective 'gather' or 'auto' (--sparse-collective)")


def check_sharded(compressor) -> None:
    """Refuse, in one line, a method the sharded exchange (FSDP) cannot carry: an owner holds only its shard of
    the mean, and the exchange is one all-to-all of sparse entries or dense rows."""
    c = compressor.inner
    if c.OBSERVES or compressor.ROUNDS > 1:
        raise ConfigError(f"{c.name} reads the round's whole mean or runs several rounds; under FSDP a rank holds only "
                          "its shard of the mean: use a method that selects alone (topk, rtopk, sidco, dgc, ...)")
    if c.payload_kind() == P.SHARED:
        raise ConfigError(f"{c.name} sends shared indices, which the sharded exchange does not route yet: use a sparse "
                          "method (topk, rtopk, sidco, dgc, randomk, ...)")


@dataclass
class WirePlan:
    """Per-tensor routes for one run (see the module docstring)."""

    net: NetworkModel = field(default_factory=NetworkModel)
    world_size: int = 1
    enabled: bool = True
    min_numel: int | None = None
    select_gbps: float = SELECT_GBPS
    sparse_collective: str = "auto"
    scatter_keep: float = 1.0  # the owners keep this times k of the sum (owners.py)
    sharded: bool = False  # (FSDP) every tensor travels to its shards' owners (transport/shard.py)
    _cache: dict = field(default_factory=dict, repr=False)

    def small_limit(self, value_bytes: int) -> int:
        """Tensors up to this many elements are sent whole."""
        if self.min_numel is not None:
            return int(self.min_numel)
        return int(self.net.alpha * self.net.beta / max(value_bytes, 1))

    def decide(self, compressor, key: str, shape, dtype=None) -> Decision:
        """The route of tensor ``key`` (of ``shape`` and ``dtype``) under ``compressor``'s configuration."""
        numel = 1
        for s in shape:
            numel *= int(s)
        inner = compressor.inner
        k = inner.k_for(key, numel)
        item = dtype.itemsize if dtype is not None else 4
        ck = (key, tuple(shape), k, item, inner.name)
        hit = self._cache.get(ck)
        if hit is None:
            hit = self._decide(inner, key, tuple(shape), numel, k, item)
            self._cache[ck] = hit
        return hit

    def _decide(self, c, key: str, shape: tuple, numel: int, k: int, item: int) -> Decision:
        kind = c.payload_kind()
        if c.ROUNDS > 1:
            return Decision(SPARSE_ROUTE)  # its own rule decides (PowerSGD's min_compression_rate)
        if kind == P.DENSE:
            return Decision(DENSE_ROUTE, "uncompressed method")
        if c.sends_dense(key, shape):
            return Decision(DENSE_ROUTE, "the method sends this tensor whole")
        if numel == 0:
            return Decision(DENSE_ROUTE, "empty")
        n = self.world_size
        scatter_ok = kind == P.SPARSE and n > 1 and not c.OBSERVES and numel < 2**31
        if not self.enabled or n <= 1:
            forced = self.sparse_collective == "scatter" and scatter_ok
            return Decision(SCATTER_ROUTE, "--sparse-collective scatter", by_plan=True) if forced else \
                Decision(SPARSE_ROUTE)
        vb = c.value_dtype.itemsize if c.value_dtype is not None else item
        small = self.small_limit(vb)
        if numel <= small:
            return Decision(DENSE_ROUTE, f"small: {numel} elements, one message latency carries {small}", by_plan=True)
        sparse_route = SPARSE_ROUTE
        if kind == P.SPARSE:
            cap = c.capacity_for(k, numel)
            ib = P.index_dtype_for(numel).itemsize
            t = {SPARSE_ROUTE: self.net.allgather_s(HEADER_BYTES + pad(cap * ib) + pad(cap * vb), n)}
            if scatter_ok and self.sparse_collective != "gather":
                sizes = P.Partition(key, numel, n, 1, 0, 1, self.scatter_keep)
                ds, os_ = sizes.dest_slots(cap), sizes.own_slots(k)
                block = HEADER_BYTES + pad(ds * POSITION_DTYPE.itemsize) + pad(ds * vb)
                owned = HEADER_BYTES + pad(os_ * POSITION_DTYPE.itemsize) + pad(os_ * vb)
                t[SCATTER_ROUTE] = self.net.alltoall_s(block, n) + self.net.allgather_s(owned, n)
            if self.sparse_collective == "scatter" and SCATTER_ROUTE in t:
                sparse_route = SCATTER_ROUTE
            elif self.sparse_collective == "auto":
                sparse_route = min(t, key=t.get)
            acc = max(item, 4)  # densified sums travel in at least fp32
            t_reduce = self.net.allreduce_s((numel + 1) * acc, n)
            if t_reduce < t[sparse_route]:  # the wire is the problem: keep the method, change the collective
                return Decision(DENSIFY_ROUTE, f"{sparse_route if sparse_route == SCATTER_ROUTE else 'all-gather'} of "
                                               f"{1e3 * t[sparse_route]:.3g} ms is slower than an all-reduce of "
                                               f"{acc * numel} B ({1e3 * t_reduce:.3g} ms)", by_plan=True)
        # merged into the group's collectives, a tensor adds bytes, not messages: compare bandwidth terms
        t_whole = self.net.allreduce_s(numel * item, n) - self.net.allreduce_s(0.0, n)
        t_select = c.SELECT_PASSES * numel * 4 / (self.select_gbps * 1e9)
        if sparse_route == SCATTER_ROUTE:
            t_sent = t[SCATTER_ROUTE] - self.net.alltoall_s(0.0, n) - self.net.allgather_s(0.0, n)
        elif kind == P.SPARSE:
            t_sent = self.net.allgather_s(k * (vb + P.index_dtype_for(numel).itemsize), n) - self.net.allgather_s(0.0, n)
        else:
            t_sent = self.net.allreduce_s(k * vb, n) - self.net.allreduce_s(0.0, n)
        if t_whole <= t_select + t_sent:  # the selection costs more than the bytes it saves
            return Decision(DENSE_ROUTE, f"compressing costs ~{1e3 * (t_select + t_sent):.3g} ms (selection "
                                         f"~{1e3 * t_select:.3g} ms), sending it whole {1e3 * t_whole:.3g} ms",
                            by_plan=True)
        if sparse_route == SCATTER_ROUTE:
            return Decision(SCATTER_ROUTE, f"owners' all-to-all and all-gather {1e3 * t[SCATTER_ROUTE]:.3g} ms, "
                                           f"all-gather {1e3 * t[SPARSE_ROUTE]:.3g} ms", by_plan=True)
        return Decision(SPARSE_ROUTE)

    def decisions(self) -> dict[str, Decision]:
        """The latest decision taken for every tensor key (a key's k may change: LAGS, warm-up)."""
        return {key: d for (key, *_), d in self._cache.items()}
