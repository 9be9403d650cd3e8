"""gradsift inside ``torch.nn.parallel.DistributedDataParallel``: a communication hook.

One call registers any registered compressor on a DDP model::

    model = DDP(model, bucket_cap_mb=...)
    state = gradsift.ddp.register(model, "topk", ratio=0.01)
    ...
    loss.backward()             # the hook compresses, communicates, and writes the mean gradient
    if state.end_step():        # True when the step must be skipped (--on-nonfinite skip)
        continue
    optimizer.step()

The hook is a thin adapter: compression is the compressor's, communication the
:class:`~gradsift.transport.dist.DistTransport`'s, exactly as the simulator
uses the compressor and the in-process transport. What the adapter does:

* **keys** -- per-layer state is keyed by parameter name (``"layer"``
  granularity), so DDP's bucket rebuild after the first iterations cannot mix it
  up; whole-model compression (``"model"``) flattens the one bucket in
  parameter order under the key ``"model"`` and refuses a model that is not
  bucketed that way, saying how to set ``bucket_cap_mb``;
* **collectives** are all issued in the hook body; the future's callback only
  decodes, observes and writes back (collectives started inside callbacks hang
  on gloo with several buckets);
* **configuration check** at registration: every rank must run the same
  compressor configuration; on a mismatch every rank raises
  :class:`ConfigMismatch` naming the difference (never a hang: it is one
  all-gather, under the process group's timeout);
* **non-finite gradients**: a rank whose bucket holds NaN/Inf compresses zeros
  instead (so every rank issues the same collectives), the flag reaches every
  rank with the counts (or in the all-reduce), and every rank raises
  :class:`gradsift.compressors.base.NonFiniteGradient` (``"error"``) or the step
  is skipped on every rank with the compressor state restored (``"skip"``);
* **checkpoints** -- ``state_dict()`` / ``load_state_dict()`` hold this rank's
  compressor state and no process group;
* ``no_sync()`` accumulation works unchanged (DDP skips the hook), and so do
  fp16/bf16 gradients and GPU tensors (nothing assumes CPU). DDP's own
  ``mixed_precision=`` registers a hook of its own and cannot be combined.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from . import payload as P
from .compressors import make_compressor
from .compressors.base import NonFiniteGradient, is_finite
from .netmodel import NetworkModel
from .runconfig import GRANULARITIES, NONFINITE, ConfigError
from .transport.dist import DistTransport, Header


class ConfigMismatch(RuntimeError):
    """Ranks run different compressor configurations."""


def _describe_config(state: "GradsiftState") -> dict[str, Any]:
    cfg = state.compressor.config()
    return {"compressor": cfg, "granularity": state.granularity, "on_nonfinite": state.on_nonfinite,
            "tensors": [[n, list(p.shape)] for n, p in state.named]}


def control_device(group=None) -> torch.device:
    """Where small control tensors must live for the group's backend (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_strings(text: str, group) -> list[str]:
    dev = control_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    outs = [torch.zeros(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return [bytes(o[: int(s.item())].cpu().tolist()).decode() for o, s in zip(outs, sizes)]


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path or 'config'}: {json.dumps(b, default=str)[:120]} vs {json.dumps(a, default=str)[:120]}"


class GradsiftState:
    """Everything the hook needs, per rank. Picklable without the process group."""

    __slots__ = ("compressor", "transport", "group", "granularity", "on_nonfinite", "named", "name_of",
                 "ordered_ids", "net", "rank", "world_size", "step", "skipped", "_snapshots", "_intervals",
                 "_select_s", "_blocking_s", "_stats", "_last_hook_end", "error", "last", "_pending_build")

    def __init__(self, compressor, transport: DistTransport | None, named: Sequence[tuple[str, torch.nn.Parameter]],
                 granularity: str, on_nonfinite: str, net: NetworkModel, build=None):
        self.granularity = granularity
        self.on_nonfinite = on_nonfinite
        self.named = list(named)
        self.name_of = {id(p): n for n, p in self.named}
        self.ordered_ids = [id(p) for _, p in self.named]
        self.net = net
        self.step = 0
        self.skipped = False
        self.error: BaseException | None = None
        self.last: dict[str, Any] = {}
        self._pending_build = build  # hook_state: transport and compressor made at the first hook call
        self._attach(compressor, transport)

    def _attach(self, compressor, transport: DistTransport | None) -> None:
        self.compressor = compressor
        self.transport = transport
        self.group = transport.group if transport is not None else None
        self.rank = transport.rank if transport is not None else 0
        self.world_size = transport.world_size if transport is not None else 1
        self._reset_step()

    def _ensure_ready(self) -> None:
        if self._pending_build is not None:
            build, self._pending_build = self._pending_build, None
            transport, compressor = build()
            self._attach(compressor, transport)
            verify_same_config(self)

    def _reset_step(self) -> None:
        self.skipped = False
        self._snapshots: list[Any] = []
        self._intervals: list[list[float]] = []
        self._select_s = 0.0
        self._blocking_s = 0.0
        self._last_hook_end = 0.0
        self._stats = {"numel": 0, "counts": [0] * self.world_size, "targets": 0, "bytes": [0] * self.world_size,
                       "wire": 0.0, "est_comm_s": 0.0, "buckets": []}

    # ------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """Checkpointable: the compressor state and settings, never the process group."""
        return {"compressor_state": self.compressor.state_dict(), "step": self.step,
                "granularity": self.granularity, "on_nonfinite": self.on_nonfinite}

    def __setstate__(self, st: dict[str, Any]) -> None:  # pragma: no cover - restore via load_state_dict
        raise TypeError("a GradsiftState is restored with register(...).load_state_dict(sd), not unpickled")

    def state_dict(self) -> dict[str, Any]:
        return self.__getstate__()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("granularity") != self.granularity:
            raise ValueError(f"checkpoint was taken with granularity {sd.get('granularity')!r}, "
                             f"this run uses {self.granularity!r}")
        self.compressor.load_state_dict(sd["compressor_state"])
        self.step = int(sd.get("step", 0))

    # ------------------------------------------------------------ the hook
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._ensure_ready()
        t_start = time.perf_counter()
        params = bucket.parameters()
        grads = bucket.gradients()
        buffer = bucket.buffer()
        if self.granularity == "model":
            if len(params) != len(self.ordered_ids):
                raise ConfigError(
                    f"whole-model compression needs one DDP bucket holding all {len(self.ordered_ids)} gradients, "
                    f"got a bucket with {len(params)}: build DDP with bucket_cap_mb >= the model's gradient size")
            pos = {id(p): i for i, p in enumerate(params)}
            keys = ["model"]
            inputs = [torch.cat([grads[pos[i]].reshape(-1) for i in self.ordered_ids])]
        else:
            keys = [self.name_of[id(p)] for p in params]
            inputs = list(grads)
        finite = all(is_finite(g) for g in inputs)
        flag = 0 if finite else 1
        if self.on_nonfinite == "skip":
            self._snapshots.append(snapshot(self.compressor, keys))
        if not finite:  # compress zeros so every rank issues the same collectives; state is restored or dies
            inputs = [torch.zeros_like(g) for g in inputs]
        t0 = time.perf_counter()
        payloads = [self.compressor.compress(k, g, check_finite=False) for k, g in zip(keys, inputs)]
        self._select_s += time.perf_counter() - t0
        has_sparse = any(p.kind == P.SPARSE for p in payloads)
        header = None
        interval = [t_start, t_start]
        self._intervals.append(interval)
        if has_sparse:
            # the counts exchange carries every rank's non-finite flag: decide here, on every rank alike
            t_h = time.perf_counter()
            header = self.transport.exchange_header(payloads, flag, buffer.device)
            interval[1] = time.perf_counter()
            self._blocking_s += interval[1] - t_h
            bad = [r for r, f in enumerate(header.flags) if f]
            if bad:
                done: torch.futures.Future = torch.futures.Future()
                done.set_result(self._nonfinite(bad, keys, buffer))
                return done
        # without sparse payloads the flag rides in the all-reduce (one extra element)
        pending = self.transport.start(payloads, header=header, flag=None if has_sparse else flag)
        self._last_hook_end = time.perf_counter()

        def finish(fut) -> torch.Tensor:
            try:
                means, any_flag = fut.value()
                if any_flag:
                    return self._nonfinite([-1], keys, buffer)
                self._account(payloads, header, pending)
                if self.compressor.OBSERVES:
                    for k, p, m in zip(keys, payloads, means):
                        self.compressor.observe(k, p, m)
                self._write_back(means, grads, params, buffer)
                return buffer
            finally:
                interval[1] = time.perf_counter()

        return pending.future(with_flag=True).then(finish)

    def _nonfinite(self, bad: list[int], keys, buffer: torch.Tensor) -> torch.Tensor:
        where = f"rank {bad[0]}" if bad[0] >= 0 else "some rank"
        msg = (f"non-finite gradient on {where} at step {self.step + 1} ({', '.join(keys[:3])}"
               f"{', ...' if len(keys) > 3 else ''}); nothing was stored")
        if self.on_nonfinite == "skip":
            self.skipped = True
            buffer.zero_()
            return buffer
        err = NonFiniteGradient(msg + " (use --on-nonfinite skip to skip such steps)")
        self.error = err
        raise err

    def _write_back(self, means, grads, params, buffer: torch.Tensor) -> None:
        if self.granularity == "model":
            pos = {id(p): i for i, p in enumerate(params)}
            off = 0
            flat = means[0]
            for pid in self.ordered_ids:
                g = grads[pos[pid]]
                n = g.numel()
                g.copy_(flat[off:off + n].view_as(g))
                off += n
        else:
            for g, m in zip(grads, means):
                g.copy_(m.view_as(g))
        # grads are views into the bucket buffer; copying into them filled it

    def _account(self, payloads, header: Header | None, pending) -> None:
        st = self._stats
        st["numel"] += sum(p.numel for p in payloads)
        st["targets"] += sum(p.target for p in payloads)
        for r in range(self.world_size):
            for i, p in enumerate(payloads):
                c = header.counts[r][i] if (header is not None and p.kind == P.SPARSE) else p.count
                st["counts"][r] += c
                st["bytes"][r] += c * (p.value_bytes + p.index_bytes) if p.kind == P.SPARSE else p.nbytes
        traffic = pending.traffic()
        st["wire"] += traffic.wire_bytes
        t_est = self.net.group_s(traffic, header is not None)
        st["est_comm_s"] += t_est
        st["buckets"].append((pending.started, t_est))

    # ------------------------------------------------------------ per step
    def end_step(self, backward_start: float | None = None, backward_end: float | None = None) -> bool:
        """Close the step (call after ``backward()``). Returns True if it must be skipped.

        A skipped step (``on_nonfinite="skip"``) restores every bucket's compressor
        state to what it was before the step, on every rank. Given the backward
        pass's start and end (``time.perf_counter()``), ``last`` also holds the
        alpha-beta estimate of the communication that would stick out past
        backward if each bucket's collectives started when its hook was called
        and buckets queued on one link (``est_pipelined_tail_s``).
        """
        skipped = self.skipped
        if skipped:
            for snap in reversed(self._snapshots):
                restore(self.compressor, snap)
        st = self._stats
        n = self.world_size
        union = _union_length(self._intervals)
        self.last = {
            "skipped": skipped,
            "density": (sum(st["counts"]) / n) / st["numel"] if st["numel"] else 0.0,
            "k_ratio": (sum(st["counts"]) / n) / st["targets"] if st["targets"] else 0.0,
            "bytes_per_worker": sum(st["bytes"]) / n,
            "wire_bytes_per_worker": st["wire"],
            "est_comm_s": st["est_comm_s"],
            "comm_s": union,
            "select_s": self._select_s,
            "blocking_comm_s": self._blocking_s,
            "tail_wait_s": max(0.0, max((iv[1] for iv in self._intervals), default=0.0) - self._last_hook_end),
            "buckets": len(self._intervals),
        }
        if backward_start is not None and st["buckets"]:
            # backward's computation ends when the last bucket is handed over (after that,
            # backward() only waits for communication), so that is the reference, not backward_end
            link_free = 0.0
            order = sorted(st["buckets"])
            for started, t_est in order:
                link_free = max(started - backward_start, link_free) + t_est
            self.last["est_pipelined_tail_s"] = max(0.0, link_free - (order[-1][0] - backward_start))
        if not skipped:
            self.step += 1
        self._reset_step()
        return skipped


def _union_length(intervals: list[list[float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def snapshot(compressor, keys: Sequence[str]) -> Any:
    """Copies of everything ``compress`` may change for ``keys`` (memory and per-tensor state)."""
    from .compressors.base import _clone

    inner = compressor.inner
    snap = {"inner": {k: _clone(inner.tensors[k]) if k in inner.tensors else None for k in keys}, "stores": {}}
    for name, store in (compressor.stores().items() if compressor is not inner else ()):
        snap["stores"][name] = {k: (store[k].clone() if k in store else None) for k in keys}
    return snap


def restore(compressor, snap: Any) -> None:
    inner = compressor.inner
    for k, st in snap["inner"].items():
        if st is None:
            inner.tensors.pop(k, None)
        else:
            inner.tensors[k] = st
    for name, saved in snap["stores"].items():
        store = compressor.stores()[name]
        for k, t in saved.items():
            if t is None:
                store.pop(k, None)
            else:
                store[k] = t


def gradsift_hook(state: GradsiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (a plain function: DDP inspects its name and signature)."""
    return state.on_bucket(bucket)


# DDP checks the annotations themselves (not their string form under postponed evaluation)
gradsift_hook.__annotations__ = {"state": GradsiftState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


def _check_bucketing(model, named, granularity: str) -> None:
    if granularity != "model":
        return
    total = sum(p.numel() * p.element_size() for _, p in named)
    cap = getattr(model, "bucket_bytes_cap", None)
    caps = list(getattr(model, "bucket_bytes_cap_list", []) or [])
    first_default = getattr(model, "bucket_bytes_cap_default", False)
    limit = min([cap] + caps) if caps else cap
    if first_default:
        limit = min(limit, dist._DEFAULT_FIRST_BUCKET_BYTES) if limit else dist._DEFAULT_FIRST_BUCKET_BYTES
    if limit is not None and total > limit:
        need = total / 2**20 * 1.05 + 0.01
        raise ConfigError(f"whole-model compression needs one DDP bucket holding every gradient ({total / 2**20:.2f} MiB), "
                          f"but buckets hold at most {limit / 2**20:.2f} MiB: build DDP with bucket_cap_mb={need:.2f} "
                          "(or larger)")


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: str, ratio: float | None = None, *,
             granularity: str = "layer", seed: int = 0, weights: Sequence[float] | None = None,
             on_nonfinite: str = "error", bandwidth_gbps: float = 1.0, latency_us: float = 50.0,
             process_group=None, **options: Any) -> GradsiftState:
    """Register ``compressor`` (a spec string) as ``model``'s communication hook; return its state.

    Must be called on every rank, before the first backward pass. ``weights``
    (one per rank) give a weighted mean; ``on_nonfinite`` is ``"error"`` or
    ``"skip"`` (then call ``state.end_step()`` after each backward and skip the
    optimizer step when it returns True). ``bandwidth_gbps``/``latency_us`` only
    set the alpha-beta estimate reported next to measured times. Other keyword
    options go to the compressor (as in :func:`gradsift.make_compressor`).
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if on_nonfinite not in NONFINITE:
        raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {on_nonfinite!r}")
    group = process_group if process_group is not None else getattr(model, "process_group", None)
    transport = DistTransport(group, weights)
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    _check_bucketing(model, named, granularity)
    comp = make_compressor(compressor, ratio, seed=seed, rank=transport.rank, world_size=transport.world_size,
                           weight=(weights[transport.rank] if weights is not None else None), **options)
    state = GradsiftState(comp, transport, named, granularity, on_nonfinite, NetworkModel(bandwidth_gbps, latency_us))
    verify_same_config(state)
    model.register_comm_hook(state, gradsift_hook)
    return state


def hook_state(module: torch.nn.Module, compressor: str, ratio: float | None = None, *, granularity: str = "layer",
               seed: int = 0, weights: Sequence[float] | None = None, on_nonfinite: str = "error",
               bandwidth_gbps: float = 1.0, latency_us: float = 50.0, process_group=None,
               **options: Any) -> GradsiftState:
    """A hook state for frameworks that wrap the model in DDP themselves (Lightning's ``DDPStrategy``).

    Pass it with :func:`gradsift_hook`: ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradsift_hook)``.
    ``module`` is the model before wrapping. The process group, the compressor
    and the cross-rank configuration check are set up at the first hook call
    (a blocking all-gather then). Whole-model compression needs the wrapper
    built with ``bucket_cap_mb`` large enough for one bucket; the hook checks.
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if on_nonfinite not in NONFINITE:
        raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {on_nonfinite!r}")
    make_compressor(compressor, ratio, **options)  # bad specs fail now, not inside backward
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def build():
        transport = DistTransport(process_group, weights)
        comp = make_compressor(compressor, ratio, seed=seed, rank=transport.rank, world_size=transport.world_size,
                               weight=(weights[transport.rank] if weights is not None else None), **options)
        return transport, comp

    return GradsiftState(None, None, named, granularity, on_nonfinite, NetworkModel(bandwidth_gbps, latency_us), build)


def verify_same_config(state: GradsiftState) -> None:
    """Every rank must run the same configuration; otherwise every rank raises ConfigMismatch."""
    mine = _describe_config(state)
    text = json.dumps(mine, sort_keys=True, default=str)
    texts = _gather_strings(text, state.group)
    digests = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    if len(set(digests)) == 1:
        return
    ref = json.loads(texts[0])
    for r, t in enumerate(texts):
        if digests[r] != digests[0]:
            diff = _first_difference(ref, json.loads(t))
            raise ConfigMismatch(f"ranks run different gradsift configurations: rank {r} differs from rank 0 in {diff}"
                                 + (" (this rank)" if r == state.rank else ""))
    raise ConfigMismatch("ranks run different gradsift configurations")  # pragma: no cover
