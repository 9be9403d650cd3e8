"""The compressor interface: select what to send from one flat tensor.

A compressor never communicates. It keeps explicit per-tensor state as plain
data (tensors, numbers), draws randomness only from its own ``torch.Generator``
(re-seeded from ``(seed, rank, tensor key, step)``, so a checkpoint needs only
the step counter and the user's global RNG is never touched), and may look at
the round's aggregated mean afterwards (:meth:`Compressor.observe`).

Every compressor, wrapped in memory or not, offers the same calls:

* ``compress(key, grad) -> Payload`` -- what this worker sends for tensor ``key``;
* ``observe(key, payload, mean)`` -- the round's result for that tensor;
* ``state_dict()`` / ``load_state_dict(sd)`` -- everything needed to continue;
* ``checkpoint(keys)`` / ``rollback(token)`` -- undo one step (a skipped step).

Memory (error feedback, momentum correction) wraps a compressor from outside
(:mod:`gradsift.memory.feedback`, composed by :func:`gradsift.memory.factory.make_compressor`);
this module knows nothing of it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from .. import payload as P
from ..payload import fit_capacity  # noqa: F401 (the memory calls it too)
from ..payload.seeds import derive_seed
from ..kernels.many import batchable
from .state import clone_state, fill_from, move_state, restore  # noqa: F401 (memories, runtimes, methods: from here)
from .wiredtypes import WireDtypes
from ..options import Option, check_options
from .checks import (COMMON_OPTIONS, InputError, NonFiniteGradient, OptionError, check_input,  # noqa: F401
                     check_int, check_ratio, target_count)


is_finite = P.is_finite  # one read pass (min and max); defined with the payloads, which transports may import


class Compressor(WireDtypes):
    """Base class of the selection step. Subclasses implement :meth:`select`.

    Class attributes a subclass sets:

    ``name``           registry name
    ``OPTIONS``        method options (spec keys), each declared once: :class:`gradsift.options.Option`
    ``MEMORY``         default memory: ``"ef"`` (error feedback), ``"momentum"`` or ``"none"``
    ``EXACT_K``        whether exactly k entries are sent every call
    ``CAPACITY``       wire slots per target entry for methods that are not exact (their acceptance band)
    ``OBSERVES``       whether :meth:`observe` does anything (runtimes skip it otherwise)
    ``VALUE_DTYPE``    default wire value dtype: None keeps the gradient's dtype
    ``ROUNDS``         collectives per step that depend on each other (2: PowerSGD's, with
                       ``next_round`` and ``decode``); 1 for every sparsifier
    ``RATIO_REQUIRED`` whether a ratio must be given (not for ``dense`` and ``powersgd``)
    ``SELECT_PASSES``  selection cost in read passes over the tensor (the wire plan's model; measured with
                       ``gradsift bench select``)
    ``SELECTS_LARGEST`` whether the entries of largest magnitude are always among those sent (then an
                       overflow of the memory shows in the payload; others need a check of the whole memory)
    ``PLAIN_SGD``      whether the method's selection holds top entries back for several steps, so that a
                       momentum optimizer compounds the wait into oscillation: runs that take a task's default
                       momentum optimizer step with plain SGD instead, the momentum folded into the step size
                       (:meth:`gradsift.runtime.runconfig.RunConfig.resolved`; rTop-k)
    ``SUMMARY``        one line for ``gradsift list``
    """

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[dict[str, Option]] = {}
    MEMORY: ClassVar[str] = "ef"
    EXACT_K: ClassVar[bool] = False
    CAPACITY: ClassVar[float] = 1.25
    OBSERVES: ClassVar[bool] = False
    VALUE_DTYPE: ClassVar[str | None] = None
    ROUNDS: ClassVar[int] = 1
    RATIO_REQUIRED: ClassVar[bool] = True
    SELECTS_LARGEST: ClassVar[bool] = True
    PLAIN_SGD: ClassVar[bool] = False
    SELECT_PASSES: ClassVar[float] = 2.0
    FUSES_MEMORY: ClassVar[bool] = False  # select_into() accumulates, selects and zeroes in one pass (kernels)
    SUMMARY: ClassVar[str] = ""

    def __init__(self, ratio: float = 0.01, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 weight: float | None = None, value_dtype: str | None = None, warmup: int = 0, **options: Any):
        self.ratio = check_ratio(ratio)
        self.seed = check_int("seed", seed)
        world_size = check_int("world_size", world_size, 1)
        rank = check_int("rank", rank, 0)
        if rank >= world_size:
            raise OptionError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        # this worker's weight omega_n in the aggregated mean (1/N for a plain mean)
        self.weight = 1.0 / self.world_size if weight is None else float(weight)
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise OptionError(f"worker weight must be a finite number > 0, got {weight!r}")
        vd = COMMON_OPTIONS["value_dtype"].check("value_dtype", value_dtype if value_dtype is not None
                                                 else self.VALUE_DTYPE)
        self.value_dtype_name = vd
        self.value_bits = P.VALUE_BITS.get(vd, 0)  # int4/int2: sparse values coded by the road (payload/lowbits.py)
        self.value_dtype = P.VALUE_DTYPES[vd] if vd in P.VALUE_DTYPES else None
        # sparse fp32 values without value_dtype: bf16 where the memory keeps the rounding (make_compressor sets it)
        self.sparse_dtype: torch.dtype | None = None
        try:
            self.warmup = COMMON_OPTIONS["warmup"].check("warmup", warmup)
        except OptionError as e:
            raise OptionError(f"{self.name}: {e}") from None
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            raise OptionError(f"{self.name}: unknown option {sorted(unknown)[0]!r}; allowed: {self.allowed_options()}")
        self.options = check_options(self.OPTIONS, options, self.name)
        self.layer_ratios: dict[str, float] = {}
        self.tensors: dict[str, dict[str, Any]] = {}
        self._generators: dict[str, torch.Generator] = {}
        try:
            self.validate()
        except OptionError as e:
            raise OptionError(f"{self.name}: {e}") from None

    # ------------------------------------------------------------ subclass API
    def validate(self) -> None:
        """What the declarations cannot say (options that depend on each other); raise :class:`OptionError` with
        one line. Each option's type and bounds are checked from ``OPTIONS`` before."""

    def init_state(self, key: str, numel: int, device: torch.device) -> dict[str, Any]:
        """Fresh per-tensor state (plain data). The base keeps a step counter."""
        return {}

    def select(self, key: str, x: torch.Tensor) -> P.Payload:
        """What to send from the flat tensor ``x`` (the accumulated gradient)."""
        raise NotImplementedError

    def observe(self, key: str, sent: P.Payload, mean: torch.Tensor) -> None:
        """See the round's flat mean for ``key``; ``sent`` is this worker's payload."""

    def observe_many(self, keys, sents, means) -> None:
        """:meth:`observe` of a group's tensors (a method may take them at once)."""
        for key, sent, mean in zip(keys, sents, means):
            self.observe(key, sent, mean)

    def check_memory(self, memory: str) -> None:
        """Refuse (OptionError) a memory this method's options cannot work with."""

    def telemetry(self, workers) -> dict[str, Any]:
        """Method-specific fields for the simulator's step record, from every worker's compressor (none here)."""
        return {}

    def payload_kind(self) -> str:
        """The kind of payload :meth:`select` returns (sparse unless a method says otherwise)."""
        return P.SPARSE

    def sends_dense(self, key: str, shape: torch.Size) -> bool:
        """The method's own rule for tensors it never compresses (DGC: 1-D tensors)."""
        return False

    # ---------------------------------------------------------------- helpers
    @classmethod
    def allowed_options(cls) -> str:
        return ", ".join(list(cls.OPTIONS) + ["ratio", "memory", "feedback", "value_dtype", "warmup"])

    def ratio_for(self, key: str) -> float:
        return self.layer_ratios.get(key, self.ratio)

    def set_layer_ratio(self, key: str, ratio: float) -> None:
        """Override the ratio of one tensor (LAGS-SGD's per-layer densities)."""
        self.layer_ratios[key] = check_ratio(ratio)

    def ratio_at(self, key: str, step: int) -> float:
        """The ratio at 0-based ``step``, with DGC's exponential warm-up (Lin et al. 2018).

        During the first ``warmup`` steps the density decays from near 1 to the
        target as ``ratio ** ((step + 1) / (warmup + 1))`` (DGC applies the same
        rule per epoch; rTop-k and SIDCo used it too). After that, the ratio.
        """
        ratio = self.ratio_for(key)
        if self.warmup and step < self.warmup:
            return max(ratio, ratio ** ((step + 1) / (self.warmup + 1)))
        return ratio

    def k_for(self, key: str, numel: int, step: int | None = None) -> int:
        if step is None:
            return target_count(self.ratio_for(key), numel)
        return target_count(self.ratio_at(key, step), numel)

    def capacity_for(self, target: int, numel: int) -> int:
        """Wire slots of a sparse payload aiming at ``target`` entries: the target for exact methods, else the
        method's acceptance band (``CAPACITY`` times the target), never above the tensor size."""
        if self.EXACT_K:
            return target
        return min(numel, max(target, math.ceil(self.CAPACITY * target - 1e-9)))

    def begin(self, key: str, x: torch.Tensor) -> tuple[dict[str, Any], int, int]:
        """(state, k, step) for this call on tensor ``key``; advances the step counter."""
        return self.begin_many((key,), (x,))[0]

    def begin_many(self, keys, xs) -> list[tuple[dict[str, Any], int, int]]:
        """:meth:`begin` of a group's tensors, in one loop (the ratio read once where no warm-up, per-layer ratio
        or method's own k applies)."""
        plain, tensors, ratio, out = not self.warmup and not self.layer_ratios and type(self).k_for is \
            Compressor.k_for, self.tensors, self.ratio, []
        for key, x in zip(keys, xs):
            n = x.numel()
            st = tensors.get(key)
            st = self.state(key, x) if st is None or st["numel"] != n else st
            step, st["step"] = st["step"], st["step"] + 1
            out.append((st, target_count(ratio, n) if plain else self.k_for(key, n, step), step))
        return out

    def state(self, key: str, x: torch.Tensor) -> dict[str, Any]:
        st = self.tensors.get(key)
        if st is None:
            st = {"numel": int(x.numel()), "step": 0}
            st.update(self.init_state(key, int(x.numel()), x.device))
            self.tensors[key] = st
        elif st["numel"] != x.numel():
            raise ValueError(f"tensor {key!r} changed size: {st['numel']} elements before, {x.numel()} now")
        return st

    def rng(self, key: str, step: int, device: torch.device, shared: bool = False,
            fresh: bool = False) -> torch.Generator:
        """This compressor's generator, seeded for (tensor, step); ``shared`` drops the rank; ``fresh``: a new
        generator object (several tensors' streams alive at once), else one reused per device.

        Shared draws are identical on every worker with the same seed, which is
        what lets shared-index payloads travel by all-reduce with no indices.
        """
        dev = torch.device(device)
        g = None if fresh else self._generators.get(str(dev))
        if g is None:
            g = torch.Generator(device=dev)
            if not fresh:
                self._generators[str(dev)] = g
        g.manual_seed(self.draw_seed(key, step, shared))
        return g

    def draw_seed(self, key: str, step: int, shared: bool = False) -> int:
        """The 63-bit seed of (tensor, step) that :meth:`rng` seeds its generator with (``shared``: without the
        rank), for the counter-based draws (:mod:`gradsift.kernels.draw`)."""
        return derive_seed(self.name, self.seed, "shared" if shared else self.rank, key, step)

    def config(self) -> dict[str, Any]:
        """Everything that must agree between workers (checked before distributed training)."""
        return {
            "name": self.name,
            "ratio": self.ratio,
            "seed": self.seed,
            "world_size": self.world_size,
            "value_dtype": self.value_dtype_name,
            "warmup": self.warmup,
            "options": dict(sorted(self.options.items())),
            "layer_ratios": dict(sorted(self.layer_ratios.items())),
        }

    # ----------------------------------------------------------- public calls
    def emit(self, key: str, x: torch.Tensor, owners: P.Partition | None = None,
             tail: Any = None) -> tuple[P.Payload, P.Payload | None]:
        """Select from the flat ``x`` and fit the payload to its wire capacity (per owner, when the payload will be
        scattered among ``owners``): (payload, what did not fit). ``tail``: ``x``'s candidates from the pass that
        accumulated it (:mod:`gradsift.compressors.tails`), for the methods that select from one (``select_tail``)."""
        if x.numel() == 0:
            return P.dense(self.wire(x, sparse=False), x.dtype), None
        p = self.select(key, x) if tail is None else self.select_tail(key, tail)
        if p.kind == P.SPARSE:
            p.capacity = self.capacity_for(p.target, p.numel)
            p.owners = owners
        return p, fit_capacity(p)

    def send_dense(self, key: str, flat: torch.Tensor, native: bool = False) -> P.Payload:
        """The whole tensor, uncompressed (the wire plan's or the method's choice): in the method's wire dtype, or
        with ``native`` in the tensor's own (a route decision, :mod:`gradsift.route.routing`)."""
        return P.dense(flat if native else self.wire(flat, sparse=False), flat.dtype)

    def send_whole_many(self, keys, grads, natives) -> list[P.Payload]:
        """:meth:`compress` of a group's tensors the route sends whole (``natives[i]``: in the gradient's own dtype),
        their casts joined (:meth:`wire_whole`)."""
        for key, grad in zip(keys, grads):
            check_input(self.name, key, grad)
        flats = P.flat_views(grads)
        return [P.dense(v, f.dtype) for v, f in zip(self.wire_whole(flats, list(natives)), flats)]

    def compress(self, key: str, grad: torch.Tensor, *, check_finite: bool = True, dense: bool | None = None,
                 native: bool = False, owners: P.Partition | None = None) -> P.Payload:
        """What this worker sends for ``grad``; ``dense`` forces (True) or forbids (False) sending it whole,
        None follows the method's own rule (:meth:`sends_dense`); ``native`` sends a whole tensor in the
        gradient's own dtype instead of the method's wire dtype; ``owners``: the selection will be scattered
        among owners (:class:`gradsift.payload.Partition`), so its capacity holds per owner."""
        check_input(self.name, key, grad)
        flat = grad.reshape(-1)
        if check_finite and not is_finite(flat):
            raise NonFiniteGradient(f"gradient of {key!r} holds NaN or Inf")
        if dense or (dense is None and self.sends_dense(key, grad.shape)):
            return self.send_dense(key, flat, native)
        return self.emit(key, flat, owners)[0]

    def select_many_into(self, keys, accs, grads, srcs=None, wire=None) -> list[P.Payload]:
        """``select_into`` (``FUSES_MEMORY`` methods: ``acc += grad``, select, zero the selected in ``acc``) for the
        tensors of a group; methods with a batched kernel override it. ``srcs[i]``, where given, holds what
        ``accs[i]`` starts from (``accs[i] = srcs[i] + grads[i]``, ``srcs[i]`` left as it was: the memory a rollback
        keeps without a copy); here it is copied in first, a batched kernel reads it in its pass. ``wire``: the
        dtype the caller casts the values to next (:meth:`sparse_wire_dtype`); a kernel may take that cast itself
        (top-k's, for bf16: values already in it, what it drops left in ``acc``)."""
        fill_from(accs, srcs)
        return [self.select_into(key, acc, grad) for key, acc, grad in zip(keys, accs, grads)]

    def compress_many(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of each tensor of a group, as the road sends what it compresses (no finiteness
        check, never whole). Methods with a batched kernel (``select_many(keys, flats)``) select the group's
        contiguous float32 CPU tensors in one call; memories with fused kernels do the same
        (:mod:`gradsift.memory.feedback`)."""
        many = getattr(self, "select_many", None)
        out: list[P.Payload | None] = [None] * len(keys)
        batch = []
        for i, (key, grad) in enumerate(zip(keys, grads)):
            if many is not None and batchable(grad):
                check_input(self.name, key, grad)
                batch.append(i)
            else:
                out[i] = self.compress(key, grad, check_finite=False, dense=False)
        if batch:
            for i, p in zip(batch, many([keys[i] for i in batch], P.flat_views([grads[i] for i in batch]))):
                if p.kind == P.SPARSE:
                    p.capacity = self.capacity_for(p.target, p.numel)
                    fit_capacity(p)
                out[i] = p
        return out

    # ------------------------------------------------ memory protocol (a compressor without memory)
    memory_name: ClassVar[str] = "none"
    applies_momentum: ClassVar[bool] = False  # momentum correction applies momentum itself (DGC)
    applies_adam: ClassVar[bool] = False  # memory=adam: the workers apply Adam (gradsift.memory.adam)

    @property
    def memory_options(self) -> dict[str, Any]:
        return {}

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """What memory holds back per tensor: nothing, without memory (:mod:`gradsift.memory.feedback`)."""
        return {}

    def stores(self) -> dict[str, dict[str, torch.Tensor]]:
        """Memory's per-tensor stores by name: none, without memory."""
        return {}

    def holds_back(self, keys) -> bool:
        """Whether memory holds something for ``keys`` that sending them whole would have to carry: never
        without memory."""
        return False

    def continues_from_mean(self, keys) -> bool:
        """Whether steps whose mean gradient arrives by another route (DDP's own all-reduce, once the hook stands
        aside) leave this memory as the hook would: yes without memory."""
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config(), "tensors": clone_state(self.tensors), "layer_ratios": dict(self.layer_ratios),
                "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, sd: dict[str, Any], *, reset_memory: bool = False) -> None:
        """Continue from ``sd``. State is bound to the rank that saved it (its memory is that worker's): loading
        another rank's is an error, unless ``reset_memory`` keeps the configuration and starts state afresh."""
        mine = self.config()
        theirs = dict(sd["config"])
        theirs.pop("layer_ratios", None)
        mine.pop("layer_ratios", None)
        if theirs != mine:
            raise ValueError(f"compressor state was saved with a different configuration: {theirs} != {mine}")
        self.layer_ratios = dict(sd.get("layer_ratios", {}))
        if self.rank_mismatch(sd, reset_memory):
            self.tensors = {}
            return
        self.tensors = clone_state(sd["tensors"])

    def rank_mismatch(self, sd: dict[str, Any], reset_memory: bool) -> bool:
        """True if ``sd`` is another rank's and ``reset_memory`` allows dropping it; raises if not allowed."""
        saved = sd.get("rank", self.rank)
        if saved == self.rank:
            return False
        if not reset_memory:
            raise ValueError(f"{self.name}: this state belongs to rank {saved}, this compressor is rank {self.rank}: "
                             "load each rank's own state (save per rank), or pass reset_memory=True to keep the "
                             "configuration and start the memory afresh")
        return True

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """A copy of the per-tensor state of ``keys``, for :meth:`rollback`. Methods whose checkpoint shares tensors
        (a step replaces them, or logs what it writes into them) copy them with ``deep``: a token that stays valid
        after the rollback of another one."""
        return {k: clone_state(self.tensors[k]) if k in self.tensors else None for k in keys}

    def rollback(self, token: dict[str, Any]) -> None:
        restore(self.tensors, token)

    @property
    def inner(self) -> "Compressor":
        """The selection compressor itself (memory wrappers return what they wrap)."""
        return self

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}({opts})" if opts else self.name
