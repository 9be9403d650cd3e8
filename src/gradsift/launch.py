"""``gradsift train --runtime ddp``: real data-parallel training under ``torchrun``.

Every rank runs :func:`train_ddp`: the same task, model, optimizer and data
shards as the simulator (rank r reads the simulator's worker r batches), the
model wrapped in ``DistributedDataParallel`` with the gradsift hook. Rank 0
writes ``metrics.jsonl`` and ``summary.json`` with the simulator's fields plus
measured ``comm_s`` (wall time with a gradsift collective in flight) and
``step_s``. Checkpoints (``--checkpoint-every``) hold the model, the optimizer,
every rank's compressor state and RNG streams, and the step (the data
position); they are written atomically, and ``--resume`` continues from one.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .compressors.base import NonFiniteGradient
from .ddp import ConfigMismatch, GradsiftState, register
from .runconfig import ConfigError, RunConfig, make_optimizer, momentum_handoff
from .simulate import run_summary
from .tasks import make_task

DEFAULT_TIMEOUT_S = 120.0


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes in the environment (no-op if already joined)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("--runtime ddp runs under torchrun (RANK and WORLD_SIZE are not set), e.g. "
                          "torchrun --standalone --nproc-per-node 2 -m gradsift train --runtime ddp ...")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("GRADSIFT_DEVICE", "") == "cuda" else "gloo"
    warn_shared_store_restarts()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def warn_shared_store_restarts(env: dict[str, str] | None = None) -> str | None:
    """Warn (rank 0) when torchrun may restart workers on several nodes over its shared, unprefixed store.

    Returns the warning text, or None when the set-up is safe (see docs/ddp.md, "Restarts across machines").
    """
    env = os.environ if env is None else env
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and int(env.get("GROUP_WORLD_SIZE", "1")) > 1):
        text = ("gradsift: warning: torchrun may restart workers on several nodes while they share the agent's "
                "store; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 or a restart can hang in init_process_group")
        if env.get("RANK", "0") == "0":
            print(text, file=sys.stderr)
        return text
    return None


def device_for_rank() -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def model_bucket_mb(model: torch.nn.Module) -> float:
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return total / 2**20 * 1.05 + 0.01


# ------------------------------------------------------------------ checkpoints
def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file, fsync, then rename: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])


def save_checkpoint(directory: Path, iteration: int, updates: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: GradsiftState, cfg: RunConfig) -> Path | None:
    """Gather every rank's compressor state and RNG streams; rank 0 writes one file atomically."""
    mine = {"compressor": state.state_dict(), "rng": rng_state()}
    world = dist.get_world_size()
    gathered: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    path = None
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"ckpt-{iteration:08d}.pt"
        atomic_save({
            "iteration": iteration,
            "updates": updates,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ranks": gathered,
            "config": cfg.as_dict(),
            "world_size": world,
        }, path)
        tmp = directory / ".latest.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, directory / "latest")
    dist.barrier()
    return path


def resolve_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        latest = p / "latest"
        if not latest.exists():
            raise ConfigError(f"--resume {path!r}: no checkpoint in that folder (no 'latest' file)")
        p = p / latest.read_text().strip()
    if not p.is_file():
        raise ConfigError(f"--resume {path!r}: no such checkpoint file")
    return p


def load_checkpoint(path: Path, model, optimizer, state: GradsiftState) -> tuple[int, int]:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck["world_size"] != dist.get_world_size():
        raise ConfigError(f"checkpoint {path} was written by {ck['world_size']} ranks, this run has "
                          f"{dist.get_world_size()}")
    model.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
    mine = ck["ranks"][dist.get_rank()]
    state.load_state_dict(mine["compressor"])
    set_rng_state(mine["rng"])
    return int(ck["iteration"]), int(ck["updates"])


# ------------------------------------------------------------------ the loop
def _explain(e: BaseException, state: GradsiftState | None, timeout_s: float) -> BaseException:
    """Turn what a failed backward/collective raised into gradsift's own one-line errors."""
    if state is not None and state.error is not None:
        return state.error
    text = str(e)
    if isinstance(e, (NonFiniteGradient, ConfigMismatch, ConfigError)):
        return e
    if "NonFiniteGradient" in text or "non-finite gradient" in text:
        line = next((l for l in text.splitlines() if "non-finite gradient" in l), text.splitlines()[0])
        return NonFiniteGradient(line.split("NonFiniteGradient:")[-1].strip())
    low = text.lower()
    if "timed out" in low or "timeout" in low or "connection closed" in low or "connection reset" in low:
        first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
        return CollectiveTimeout(f"a collective did not complete within the {timeout_s:g} s timeout "
                                 f"(a peer is unreachable or has died): {first}")
    return e


def train_ddp(cfg: RunConfig, out: str | Path | None = None, *, checkpoint_every: int | None = None,
              checkpoint_dir: str | Path | None = None, resume: str | None = None,
              bucket_cap_mb: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              lags: bool = False, progress=None) -> dict[str, Any]:
    """Train on the process group (initialized here from torchrun's environment if needed).

    Returns a dict with the final parameters (``params``, CPU copies, in
    parameter order), the records (rank 0) and the summary (rank 0).
    """
    init_distributed(timeout_s=timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.workers is not None and cfg.workers != world:
        raise ConfigError(f"--workers {cfg.workers} does not match the world size {world} (omit --workers under torchrun)")
    cfg.workers = world
    cfg.validate()
    task = make_task(cfg.task, world, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data, **cfg.task_options)
    cfg = cfg.resolved(type(task))
    device = device_for_rank()
    model = task.build_model().to(device)
    extra, opt_name = momentum_handoff(cfg)
    if cfg.value_dtype is not None:
        extra["value_dtype"] = cfg.value_dtype
    if cfg.granularity == "model":
        cap = max(bucket_cap_mb or 0.0, model_bucket_mb(model))
    else:
        cap = bucket_cap_mb
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
    optimizer = make_optimizer(cfg, model.parameters(), opt_name)
    state = register(ddp, cfg.compressor, cfg.ratio, granularity=cfg.granularity, seed=cfg.seed,
                     weights=cfg.weights, on_nonfinite=cfg.on_nonfinite, bandwidth_gbps=cfg.bandwidth_gbps,
                     latency_us=cfg.latency_us, **extra)
    planner = None
    if lags:
        from .layerwise import LagsController

        planner = LagsController(ddp, state, cfg)
    start, updates = 0, 0
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else (Path(out) / "checkpoints" if out else None)
    if resume == "auto":  # restarted by torchrun: continue from the latest checkpoint if there is one
        resume = str(ckpt_dir) if ckpt_dir is not None and (ckpt_dir / "latest").exists() else None
    if resume:
        start, updates = load_checkpoint(resolve_checkpoint(resume), model, optimizer, state)
        if planner is not None:
            planner.reapply()
    out_dir = Path(out) if out else None
    writer = None
    records: list[dict[str, Any]] = []
    if rank == 0 and out_dir is not None:
        from .experiments.runner import MetricsWriter, read_metrics

        out_dir.mkdir(parents=True, exist_ok=True)
        mpath = out_dir / "metrics.jsonl"
        if resume and mpath.exists():
            kept = [r for r in read_metrics(mpath) if r["step"] <= updates]
            records.extend(kept)
            writer = MetricsWriter(mpath)
            for r in kept:
                writer.write(r)
        else:
            writer = MetricsWriter(mpath)
    t_run = time.perf_counter()
    skipped_total = 0
    try:
        ctx = progress.task(f"{cfg.compressor} on {cfg.task} (ddp, {world} ranks)", cfg.steps - start) \
            if (progress is not None and rank == 0) else None
        advance = ctx.__enter__() if ctx is not None else (lambda n=1, info="": None)
        try:
            for it in range(start, cfg.steps):
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                batch = to_device(task.batch(rank, it), device)
                loss = task.loss(ddp, batch)
                if cfg.fault_nan_step is not None and it + 1 == cfg.fault_nan_step and rank == world - 1:
                    loss = loss * float("nan")  # fault injection: every gradient of the last rank is NaN
                t_fwd = time.perf_counter()
                if planner is not None:
                    planner.before_backward(it)
                try:
                    loss.backward()
                except Exception as e:  # noqa: BLE001 - mapped to gradsift's errors
                    raise _explain(e, state, timeout_s) from None
                t_bwd = time.perf_counter()
                if planner is not None:
                    planner.after_backward(it)
                skipped = state.end_step(backward_start=t_fwd, backward_end=t_bwd)
                if skipped:
                    skipped_total += 1
                    continue
                if cfg.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                optimizer.step()
                updates += 1
                step_s = time.perf_counter() - t0
                info = state.last
                if rank == 0:
                    rec = make_record(task, model, cfg, updates, it, float(loss.detach()), step_s, t_fwd - t0, info)
                    records.append(rec)
                    if writer:
                        writer.write(rec)
                    advance(1, f"loss {rec['loss']:.4g}")
                if checkpoint_every and ckpt_dir is not None and (it + 1) % checkpoint_every == 0:
                    save_checkpoint(ckpt_dir, it + 1, updates, model, optimizer, state, cfg)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
    finally:
        if writer:
            writer.close()
    wall = time.perf_counter() - t_run
    summary = None
    if rank == 0 and out_dir is not None:
        from .experiments.runner import write_json

        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        extra_summary = {"metric": task.metric, "higher_is_better": task.higher_is_better, "runtime": "ddp",
                         "world_size": world, "backend": dist.get_backend(), "status": "completed"}
        if planner is not None:
            extra_summary["lags"] = planner.report()
        summary = run_summary(cfg, records, wall, dense_bytes, skipped_total, extra=extra_summary)
        summary["totals"]["comm_s"] = sum(r["comm_s"] for r in records)
        summary["totals"]["step_s"] = sum(r["step_s"] for r in records)
        write_json(out_dir / "summary.json", summary)
        atomic_save(model.state_dict(), out_dir / "final_model.pt")
    # leave together: a rank that exits while a peer still writes its summary or checkpoint
    # tears down connections under it (gloo then aborts that peer)
    dist.barrier()
    params = [p.detach().to("cpu").clone() for p in model.parameters()]
    return {"params": params, "records": records, "summary": summary, "state": state, "model": model}


def make_record(task, model, cfg: RunConfig, updates: int, it: int, batch_loss: float, step_s: float,
                forward_s: float, info: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": updates, "loss": task.probe_loss(model), "batch_loss": batch_loss}
    if updates % cfg.eval_every == 0 or it + 1 >= cfg.steps:
        rec.update(task.evaluate(model))
    comm_exposed = info.get("blocking_comm_s", 0.0) + info.get("tail_wait_s", 0.0)
    compute = max(0.0, step_s - comm_exposed - info.get("select_s", 0.0))
    serial = compute + info.get("select_s", 0.0) + info.get("est_comm_s", 0.0)
    est = serial
    if cfg.granularity == "layer" and info.get("est_pipelined_tail_s") is not None:
        # buckets communicate while backward continues: the estimate adds only what would stick out
        est = compute + info.get("select_s", 0.0) + info["est_pipelined_tail_s"]
    rec.update(
        density=info.get("density", 0.0),
        k_ratio=info.get("k_ratio", 0.0),
        bytes_per_worker=info.get("bytes_per_worker", 0.0),
        wire_bytes_per_worker=info.get("wire_bytes_per_worker", 0.0),
        select_s=info.get("select_s", 0.0),
        compute_s=compute,
        est_comm_s=info.get("est_comm_s", 0.0),
        est_step_s=est,
        est_step_serial_s=serial,
        comm_s=info.get("comm_s", 0.0),
        step_s=step_s,
    )
    return rec
