"""Momentum correction with momentum factor masking (DGC), and its one hand-off with the optimizer.

:class:`MomentumCorrection` is a memory (:mod:`gradsift.memory.feedback`) any sparsifier may use; :func:`take_over_momentum`
gives it the optimizer's momentum so that momentum is applied once.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import payload as P
from ..compressors.base import Compressor, check_input, restore
from ..options import Option
from ..compressors.tails import tail_plans, tails_many
from ..kernels.buffers import reuse_spare
from ..kernels.scatter import momentum_whole, zero_at_many
from ..kernels.many import batchable
from ..kernels import compiled_lib
from .wirecast import cut_to_capacity
from ..errors import ConfigError
from .feedback import Memory, subtract_sent


class MomentumCorrection(Memory):
    """Momentum correction with momentum factor masking (DGC, Lin et al. 2018, Sec. 3.2), for any sparsifier.

    Per tensor, with momentum m::

        u <- m u + g                  (Nesterov: u <- (u + g) m)        [velocity, :meth:`_advance`]
        v <- v + u                    (Nesterov: v <- v + u + g)        [the step momentum SGD takes]
        send select(v); v <- v - sent; u <- 0 where sent (masking)

    The optimizer must then apply no momentum itself (:func:`gradsift.memory.momentum.take_over_momentum`). Tensors sent whole (the
    method's or the wire plan's choice) keep plain momentum: ``v = u`` is sent and ``u`` is not masked; by
    linearity, once every worker holds the same ``u``, that equals momentum on the mean gradient
    (:meth:`step_from_mean`, the route when DDP's own all-reduce takes the steps). Nothing is lost: the sum of
    everything sent plus ``v`` equals the sum of the momentum-corrected updates. ``clip`` > 0 scales each worker's
    gradient to norm at most ``clip / sqrt(N)`` first (DGC's local clipping; per tensor here, where DGC clips the
    whole gradient).

    A checkpoint (the rollback of a skipped step) holds ``u`` and ``v`` themselves, not copies: the compiled pass
    then reads them where they are and writes the step's into two other tensors (those the key's last such step
    replaced), and a path that updates in place copies them first (:mod:`gradsift.memory.kept`'s rule for error
    feedback's residual). A clean step copies nothing.
    """

    memory_name = "momentum"
    TITLE = "momentum correction"
    STORES = ("u", "v")
    UNSENT = "v"
    OPTIONS = {
        "momentum": Option.number(0.9, lo=0.0, hi=1.0, doc="the velocity's momentum (the optimizer's, once handed "
                                                           "over)"),
        "nesterov": Option.flag(False, doc="the Nesterov form (the optimizer's, once handed over)"),
        "masking": Option.flag(True, doc="zero the momentum where an entry was sent (momentum factor masking)"),
        "clip": Option.number(0.0, lo=0.0, doc="DGC's local clipping: each worker's gradient to norm clip/sqrt(N), "
                                                "per tensor (0: off)"),
    }
    applies_momentum = True

    def __init__(self, compressor: Compressor, **options: Any):
        super().__init__(compressor, **options)
        # a momentum given with the method (spec or keyword) is the user's: an optimizer's may not replace it
        self.explicit_momentum = bool({"momentum", "nesterov"} & set(options))
        self._kept: set[tuple[str, str]] = set()  # (store, key) an open checkpoint holds as it is
        self._spare: dict[tuple[str, str], torch.Tensor] = {}  # per (store, key), the u or v a step replaced

    def checkpoint(self, keys, deep: bool = False) -> dict[str, Any]:
        """The velocities themselves, not copies (class docstring); ``deep``: copied."""
        if deep:
            return super().checkpoint(keys, deep)
        keys = list(keys)
        kept = {name: {k: store.get(k) for k in keys} for name, store in self.stores().items()}
        self._kept.update((name, k) for name, held in kept.items() for k, t in held.items() if t is not None)
        return {"inner": self.compressor.checkpoint(keys, deep), "kept": kept}

    def rollback(self, token: dict[str, Any]) -> None:
        if "kept" not in token:
            return super().rollback(token)
        self.compressor.rollback(token["inner"])
        for name, saved in token["kept"].items():
            restore(getattr(self, name), saved)
            self._kept.update((name, k) for k, t in saved.items() if t is not None)  # (others may hold them)

    def _writable(self, name: str, key: str) -> torch.Tensor:
        """``name``'s tensor of ``key``, copied first where an open checkpoint holds it (a write in place follows)."""
        store = getattr(self, name)
        if (name, key) in self._kept:
            self._kept.discard((name, key))
            store[key] = store[key].clone()
        return store[key]

    def _velocities_out(self, key: str, g: torch.Tensor):
        """(u, v, u's source, v's source) for the compiled pass: the velocities themselves (sources None), or, where
        a checkpoint holds them, two other tensors that take their place, the held ones read (class docstring)."""
        if self.held(self.u, key, g) is None:
            self.u[key], self.v[key] = torch.zeros_like(g), torch.zeros_like(g)
        u, v = self.u[key], self.v[key]
        if ("u", key) not in self._kept or ("v", key) not in self._kept:
            return (*self._velocities(key, g), None, None)
        self._kept -= {("u", key), ("v", key)}
        u_out, v_out = reuse_spare(self._spare, ("u", key), u), reuse_spare(self._spare, ("v", key), v)
        self.u[key], self.v[key] = u_out, v_out
        self._spare[("u", key)], self._spare[("v", key)] = u, v
        return u_out, v_out, u, v

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The velocity not yet sent (the analogue of the error-feedback residual)."""
        return self.v

    def holds_back(self, keys) -> bool:
        """Whether any of ``keys`` has velocity not yet sent (``u`` itself is not held back: it is the momentum)."""
        return any(k in self.v and bool(self.v[k].any()) for k in keys)

    def continues_from_mean(self, keys) -> bool:
        """Momentum on the mean gradient (:meth:`step_from_mean`) continues this memory when every tensor has its
        velocity, none is held back, and no worker clips its own gradient (DGC's local clipping has no mean)."""
        return (self.memory_options["clip"] == 0 and all(k in self.u for k in keys)
                and not self.holds_back(keys))

    def compress_many(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of a group; for methods that select from a tail (DGC), the velocity's update and the
        candidates come from one compiled pass per tensor (:func:`gradsift.compressors.tails.tails_many`); top-k's
        group goes through its own fused call (:meth:`_compress_fused`)."""
        c, o = self.compressor, self.memory_options
        if not hasattr(c, "select_tail") or o["clip"] > 0:
            if o["clip"] == 0 and c.FUSES_MEMORY and c.EXACT_K and c.SELECTS_LARGEST and len(grads) > 1 and \
                    all(batchable(g) for g in grads) and compiled_lib(grads[0]) is not None:
                return self._compress_fused(keys, grads)
            return super().compress_many(keys, grads)
        out: list[P.Payload | None] = [None] * len(keys)
        batch = []
        for i, (key, grad) in enumerate(zip(keys, grads)):
            if batchable(grad):
                check_input(c.name, key, grad)
                batch.append(i)
            else:
                out[i] = self.compress(key, grad, check_finite=False, dense=False)
        if batch:
            flats = P.flat_views([grads[i] for i in batch])
            us, vs, u_srcs, v_srcs = zip(*[self._velocities_out(keys[i], f) for i, f in zip(batch, flats)])
            sts, ks, plans = tail_plans(c, [keys[i] for i in batch], flats)
            # a method that selects in the pass settles there too unless value_dtype casts; the sparse wire's bf16
            # cast taken there as well (8: what it rounds off stays in v)
            settle = (2 if o["masking"] else 1) if c.value_dtype is None else 0
            if settle and c.sparse_wire_dtype() == torch.bfloat16:
                settle |= 8
            tails = tails_many(list(vs), flats, sts, ks, c.WANT,
                               momentum=(list(us), o["momentum"], o["nesterov"], list(u_srcs)), samples=plans,
                               dgc=settle if getattr(c, "SELECTS_IN_PASS", False) else None, srcs=list(v_srcs))
            with self.casts_for_group():  # (those selected and settled by the pass: payloads made for the group)
                picked = c.select_tails([keys[i] for i in batch], tails) if hasattr(c, "select_tails") else \
                    [None] * len(batch)
                for i, f, v, tail, sent in zip(batch, flats, vs, tails, picked):
                    out[i] = self._settle_sent(keys[i], f, v, sent, acc_finite=True) if sent is not None else \
                        self._send(keys[i], f, v, acc_finite=tail.finite, tail=tail)
        return out

    def _compress_fused(self, keys, grads) -> list[P.Payload]:
        """:meth:`compress` of a group for a method that accumulates, selects and zeroes in its own group call
        (``select_many_into``): the velocities advanced in two foreach calls (:meth:`_advance`'s operations), then the
        method's call takes ``v + u`` as its accumulation (Nesterov: ``v + u`` by foreach, then ``+ g`` in its
        pass: the per-tensor order of the additions, so the same bits), the sent positions masked in ``u`` in one
        sweep, the casts of the group at once -- where :meth:`compress` took some twenty torch calls a tensor. Where
        a checkpoint holds a velocity the step's is written into another tensor (:meth:`_velocities_out`), as the
        compiled pass does for DGC. Top-k's: a method that selects exactly k and always the largest. A threshold
        method's cut to its wire capacity comes after the wire's cast one tensor at a time, on rounded magnitudes,
        where the group's cut reads them unrounded (where they tie at the cut the two keep different entries); and a
        method that may miss the largest (REGTOP-k, rTop-k, random-k) checks the accumulation before it selects,
        so an overflowed tensor's state does not advance, where the group's call has selected it already."""
        c, o = self.compressor, self.memory_options
        for key, grad in zip(keys, grads):
            check_input(c.name, key, grad)
        flats = P.flat_views(grads)
        us, vs, u_srcs, v_srcs = (list(t) for t in zip(*[self._velocities_out(k, f) for k, f in zip(keys, flats)]))
        held = [i for i, t in enumerate(u_srcs) if t is not None]
        if held:  # (the held velocities read, the step's written into the others)
            torch._foreach_copy_([us[i] for i in held], [u_srcs[i] for i in held])
        self._advance_many(us, flats)
        if o["nesterov"]:  # v + u, then + g in the pass
            if held:
                torch._foreach_copy_([vs[i] for i in held], [v_srcs[i] for i in held])
            torch._foreach_add_(vs, us)
            adds, srcs = flats, None
        else:  # v + u in the pass (from the held v where there is one)
            adds, srcs = us, (v_srcs if held else None)
        with self.casts_for_group():
            sents = c.select_many_into(list(keys), vs, adds, srcs, wire=c.sparse_wire_dtype())
            cut_to_capacity(c, vs, sents)
            # the accumulation's finiteness: the pass's, else what is left in v and what was taken out of it, read
            unknown = [j for j, s in enumerate(sents) if not s.finite]
            bad = set() if not unknown or P.all_finite([vs[j] for j in unknown] + [sents[j].values for j in unknown]) \
                else {j for j in unknown if not (P.is_finite(vs[j]) and P.is_finite(sents[j].values))}
            # overflowed (non-finite values sent, as :meth:`_settle_sent` finds): the memory dropped, nothing masked
            drop = {j for j in bad if not P.is_finite(sents[j].values)}
            if o["masking"]:
                masked = [j for j, s in enumerate(sents) if s.kind == P.SPARSE and s.count and j not in drop]
                zero_at_many([us[j] for j in masked], [sents[j].indices for j in masked])
            out = []
            for j, (key, f, v, sent) in enumerate(zip(keys, flats, vs, sents)):
                sent.settled = True  # (v zeroed where sent by the method's call, u masked above)
                out.append(self._settle_sent(key, f, v, sent, acc_finite=j not in bad))
        return out

    def send_whole_many(self, keys, grads, natives) -> list[P.Payload]:
        """:meth:`compress` of a group's tensors the route sends whole (``natives[i]``: in the gradient's own dtype):
        the velocities advanced, added, copied out and settled in one compiled call
        (:func:`gradsift.kernels.scatter.momentum_whole`; elsewhere in ``torch._foreach_*`` calls: the same arithmetic
        as tensor by tensor) -- where a ResNet-50's 107 biases and norms took ten torch calls each, then six foreach
        calls. Clipping, a gradient other than float32 or a method that casts a whole tensor goes tensor by tensor."""
        c, o = self.compressor, self.memory_options
        flats = P.flat_views(grads)
        if o["clip"] > 0 or c.value_dtype is not None or any(f.dtype != torch.float32 for f in flats) or not flats:
            return [self.compress(k, g, check_finite=False, dense=True, native=n)
                    for k, g, n in zip(keys, grads, natives)]
        for key, grad in zip(keys, grads):
            check_input(c.name, key, grad)
        us, vs = zip(*[self._velocities(k, f) for k, f in zip(keys, flats)])
        done = momentum_whole(us, vs, flats, o["momentum"], o["nesterov"])  # (one compiled call, the same bits)
        if done is not None:
            joined, finite = done
            sents = [P.dense(values, f.dtype) for values, f in zip(joined.split([f.numel() for f in flats]), flats)]
            for key, sent, ok in zip(keys, sents, finite):
                if not ok:
                    self.overflowed(key, sent, False)
            return sents
        self._advance_many(list(us), flats)
        torch._foreach_add_(list(vs), list(us))
        if o["nesterov"]:
            torch._foreach_add_(list(vs), flats)
        joined = torch.cat(vs)  # what is sent (the velocities are settled below)
        sents = [P.dense(values, f.dtype) for values, f in zip(joined.split([f.numel() for f in flats]), flats)]
        if P.is_finite(joined):
            torch._foreach_sub_(list(vs), [sent.values for sent in sents])  # (subtract_sent's arithmetic)
            return sents
        for key, v, sent in zip(keys, vs, sents):
            if P.is_finite(sent.values):
                v.sub_(sent.values)
            else:
                self.overflowed(key, sent, False)
        return sents

    def _advance_many(self, us: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
        """:meth:`_advance` of many velocities, in ``torch._foreach_*`` calls."""
        m = self.memory_options["momentum"]
        if self.memory_options["nesterov"]:
            torch._foreach_add_(us, gs)
            torch._foreach_mul_(us, m)
        else:
            torch._foreach_mul_(us, m)
            torch._foreach_add_(us, gs)

    def _advance(self, u: torch.Tensor, g: torch.Tensor) -> None:
        """The velocity's update, in place: ``u <- m u + g`` (Nesterov: ``u <- (u + g) m``)."""
        m = self.memory_options["momentum"]
        if self.memory_options["nesterov"]:
            u.add_(g).mul_(m)
        else:
            u.mul_(m).add_(g)

    def accumulate(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        o = self.memory_options
        g = flat.to(P.accumulate_dtype(flat.dtype))
        if o["clip"] > 0:
            limit = o["clip"] / (self.compressor.world_size ** 0.5)
            norm = float(torch.linalg.vector_norm(g))
            if norm > limit:
                g = g * (limit / norm)
        u, v = self._velocities(key, g)
        self._advance(u, g)
        v.add_(u)
        if o["nesterov"]:
            v.add_(g)
        return v

    def _velocities(self, key: str, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, v) of ``key`` to update in place (copied first where a checkpoint holds them), zeros (in ``g``'s
        dtype) the first time."""
        if self.held(self.u, key, g) is None:
            self.u[key], self.v[key] = torch.zeros_like(g), torch.zeros_like(g)
        return self._writable("u", key), self._writable("v", key)

    def step_from_mean(self, key: str, mean: torch.Tensor) -> None:
        """A tensor sent whole whose mean gradient arrived by another route (DDP's own all-reduce): the velocity
        advances from the mean (:meth:`_advance`) and ``mean`` becomes the step the hook would have sent, ``u``
        (Nesterov: ``u + g``). Needs the same ``u`` on every worker and nothing held back in ``v``. Nothing to do
        at momentum 0: the mean already is that step."""
        if self.memory_options["momentum"] == 0:
            return
        u = self._writable("u", key).view_as(mean)
        self._advance(u, mean)
        if self.memory_options["nesterov"]:
            mean.add_(u)
        else:
            mean.copy_(u)

    def settle(self, key: str, acc: torch.Tensor, sent: P.Payload) -> None:
        if sent.settled:  # zeroed (and masked) by the pass that selected it; what the bf16 values round off stays
            self.cast_settled(acc, sent)
            self.v[key] = acc
            return
        masking = sent.kind != P.DENSE and self.memory_options["masking"]
        self.v[key] = subtract_sent(acc, sent, self.u[key] if masking else None)


def take_over_momentum(memory, optimizer: torch.optim.Optimizer) -> float | None:
    """The one hand-off between momentum correction and the optimizer: momentum is applied once.

    ``memory`` is a compressor in its memory (:func:`gradsift.memory.factory.make_compressor`; for several workers, call
    once per worker's compressor before the optimizer's momentum is zeroed -- or pass them as a list). With momentum
    correction (``dgc``, ``memory=momentum``) the optimizer's momentum and Nesterov flag become the memory's and the
    optimizer's are set to 0 -- unless the method was given a momentum of its own (then the optimizer must have
    none). Refused in one line: an optimizer other than SGD, parameter groups with different momenta, two momenta.
    Returns the momentum taken over (None when there was nothing to do). ``gradsift train``'s ``--optimizer sgd``
    hands over momentum 0, ``momentum``/``nesterov`` theirs."""
    memories = list(memory) if isinstance(memory, (list, tuple)) else [memory]
    ours = [c for c in memories if c.applies_momentum]
    if not ours:
        return None
    name = ours[0].name
    if not isinstance(optimizer, torch.optim.SGD):
        raise ConfigError(f"{name} applies momentum correction, which is defined for SGD (--optimizer sgd, momentum "
                          f"or nesterov); the optimizer is {type(optimizer).__name__}: with Adam-family optimizers use "
                          f"error feedback (topk, or {name}:memory=ef), which leaves the moments to the optimizer")
    groups = optimizer.param_groups
    m, nesterov = groups[0].get("momentum", 0.0), bool(groups[0].get("nesterov", False))
    if any(g.get("momentum", 0.0) != m or bool(g.get("nesterov", False)) != nesterov for g in groups):
        raise ConfigError(f"{name}: the optimizer's parameter groups use different momentum; momentum correction "
                          "applies one momentum to every tensor")
    if any(c.explicit_momentum for c in ours):
        if m:
            raise ConfigError(f"{name} sets its own momentum and the optimizer adds momentum={m:g}: use an "
                              "optimizer without momentum (--optimizer sgd), or drop momentum from the method's options")
        return None
    for c in ours:
        c.memory_options.update(momentum=float(m), nesterov=nesterov)
    for g in groups:
        g["momentum"], g["nesterov"] = 0.0, False
    return float(m)
