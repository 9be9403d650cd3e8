"""``gradsift train --runtime ddp``: the training loop every rank runs under ``torchrun``.

The same task, model, optimizer and data shards as the simulator (rank r reads
the simulator's worker r batches), the model wrapped in
``DistributedDataParallel`` with the gradsift hook -- registered as any user
registers it (:func:`gradsift.ddp.register`), so the loop knows nothing of
routes: where the hook stands aside, the wrapper's forward goes through its
twin by itself. Benchmark tools plug in from outside the core
(:mod:`gradsift.experiments.ddp_runs`): a PyTorch baseline instead of the hook
(``--torch-hook``), the same-process pairing (``--paired-ddp``). Rank 0 owns the output folder (:class:`gradsift.runtime.records.OutputDir`:
refused when not empty unless ``--overwrite`` or ``--resume``, locked while the
run lasts) and writes ``metrics.jsonl`` and ``summary.json`` with the
simulator's fields plus measured ``comm_s`` and ``step_s``. ``summary.json``
always says how the run ended: ``completed``, ``failed: ...`` (a peer that went
away is named where it can be) or ``interrupted``. Checkpoints:
:mod:`gradsift.launch.checkpoint`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ddp import bucket_mb_for, register
from ..memory.adam_step import hand_clip_over
from ..runtime.consensus import control_device
from ..runtime.records import (MetricsWriter, OutputDir, OutputError, progress_info, read_resumed_metrics,
                       rewrite_metrics, write_json)
from ..runtime.runconfig import ConfigError, RunConfig, make_optimizer, set_lr
from ..runtime.sharding import full_params, full_state_dict, shard_model
from ..tasks import make_task
from ..runtime.telemetry import run_summary, step_record
from .bootstrap import (DEFAULT_TIMEOUT_S, Peers, device_for_rank, explain, ignore_sigterm, init_distributed,
                        sigterm_raises, to_device)
from .checkpoint import atomic_save, load_checkpoint, resolve_checkpoint, save_checkpoint


def agree(fn, rank: int) -> Any:
    """Run ``fn`` on rank 0; every rank raises the same one-line error if it failed there (no rank waits alone)."""
    msg: list[Any] = [None]
    result = None
    if rank == 0:
        try:
            result = fn()
        except (OutputError, ConfigError) as e:
            msg[0] = str(e)
    dist.broadcast_object_list(msg, src=0)
    if msg[0] is not None:
        raise OutputError(msg[0])
    return result


def every_rank(fn) -> Any:
    """Run ``fn`` on every rank, then stop every rank alike if it failed anywhere: each raises its own one-line
    error, or the first failing rank's. Ranks fail together, so none is cut short by torchrun stopping the
    others after the first exit."""
    result, mine = None, None
    try:
        result = fn()
    except ConfigError as e:
        mine = e
        ignore_sigterm()  # (before the others learn it: the first rank to exit makes torchrun stop the rest)
    msgs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if mine is None else (type(mine), str(mine)))
    failed = next((m for m in msgs if m is not None), None)
    if failed is not None:
        ignore_sigterm()
        raise mine if mine is not None else failed[0](failed[1])
    return result


def build(cfg: RunConfig, bucket_cap_mb: float | None, lags: bool, rank: int, baseline=None):
    """(task, resolved cfg, device, model, ddp, optimizer, hook state) for this rank; ``baseline(ddp, cfg)`` builds
    a PyTorch baseline's state instead of gradsift's."""
    world = dist.get_world_size()
    task = make_task(cfg.task, world, seed=cfg.seed, batch_size=cfg.batch_size, data=cfg.data, **cfg.task_options)
    cfg = cfg.resolved(type(task))
    device = device_for_rank()
    model = task.build_model().to(device)
    if cfg.fsdp and cfg.compressor.split(":")[0] == "local":
        raise ConfigError("local SGD (--compressor local:...) runs on a model every rank holds whole: use --runtime ddp")
    if cfg.fsdp:  # FSDP2: every module with parameters of its own sharded, gradsift on each one's reduce-scatter
        if lags:
            raise ConfigError("--runtime fsdp compresses each FSDP unit's reduce-scatter: no --lags")
        own = baseline is not None  # --torch-hook fsdp: FSDP's own exchange, timed (native HSDP mesh)
        replicate = None
        if cfg.replicas > 1:  # HSDP: sharded inside each replica, gradsift across replicas
            if world % cfg.replicas:
                raise ConfigError(f"--replicas {cfg.replicas} does not divide the world size {world}")
            mesh = init_device_mesh(device.type, (cfg.replicas, world // cfg.replicas),
                                    mesh_dim_names=("replicate", "shard"))
            model = shard_model(model, mesh=mesh if own else mesh["shard"])
            replicate = mesh["replicate"].get_group()
        else:
            model = shard_model(model)
        optimizer = make_optimizer(cfg, model.named_parameters(), decays=getattr(task, "decays", None))
        if own:
            return task, cfg, device, model, model, optimizer, baseline(model, cfg)
        settings = cfg.settings(cfg.runtime).keywords()
        from ..fsdp import register as register_fsdp  # (here: importing FSDP2 costs every other run a second)

        state = register_fsdp(model, cfg.compressor, cfg.ratio, optimizer=optimizer, replicate_group=replicate,
                              **settings)
        return task, cfg, device, model, model, optimizer, state
    if cfg.compressor.split(":")[0] == "local":  # local SGD: no DDP wrapper, a sync every period steps
        if lags or cfg.lags or baseline is not None:
            raise ConfigError("local SGD (--compressor local:...) syncs every period steps: no --lags, --torch-hook or "
                              "--paired-ddp")
        optimizer = make_optimizer(cfg, model.named_parameters(), decays=getattr(task, "decays", None))
        return task, cfg, device, model, model, optimizer, register_local(model, cfg, optimizer)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    one_bucket = cfg.granularity == "model" or (baseline is not None and baseline.one_bucket(cfg))
    cap = max(bucket_cap_mb or 0.0, bucket_mb_for(named)) if one_bucket else bucket_cap_mb
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
    optimizer = make_optimizer(cfg, model.named_parameters(), decays=getattr(task, "decays", None))
    if baseline is not None:
        state = baseline(ddp, cfg, optimizer)
    else:
        state = register(ddp, cfg.compressor, cfg.ratio, lags=lags or cfg.lags, optimizer=optimizer,
                         **cfg.settings("ddp").keywords())
    return task, cfg, device, model, ddp, optimizer, state


def register_local(model: torch.nn.Module, cfg: RunConfig, optimizer: torch.optim.Optimizer):
    """:func:`gradsift.local.register` for a ``local:period=H,...`` spec: the settings the simulator's workers take
    (:class:`gradsift.runtime.localsgd.LocalSGD`), for this runtime."""
    from ..local import register as register_local_sgd
    from ..runtime.localsgd import local_options, sync_config

    o = local_options(cfg.compressor)
    s = sync_config(cfg, o).settings("local")
    return register_local_sgd(model, s.compressor, s.ratio, period=o["period"], optimizer=optimizer, outer=o["outer"],
                              outer_lr=o["outer_lr"], outer_momentum=o["outer_momentum"], warmup_steps=o["start"],
                              **s.keywords())


def last_summary(summary_for, status: str) -> None:
    """The summary of a run that is ending on an error; a disk too full for it too adds nothing to that error."""
    try:
        summary_for(status)
    except OutputError:
        pass


def train_ddp(cfg: RunConfig, out: str | Path | None = None, *, checkpoint_every: int | None = None,
              checkpoint_dir: str | Path | None = None, resume: str | None = None,
              bucket_cap_mb: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              lags: bool = False, progress=None, overwrite: bool = False, baseline=None, pairing=None) -> dict[str, Any]:
    """Train on the process group (initialized here from torchrun's environment if needed).

    ``baseline`` and ``pairing`` are the benchmark tools' (:mod:`gradsift.experiments.ddp_runs` passes them for
    ``cfg.torch_hook`` and ``cfg.paired_ddp``). Returns a dict with the final parameters (``params``, CPU copies,
    in parameter order), the records (rank 0) and the summary (rank 0).
    """
    init_distributed(timeout_s=timeout_s)
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if cfg.workers is not None and cfg.workers != world:
        raise ConfigError(f"--workers {cfg.workers} does not match the world size {world} (omit --workers under torchrun)")
    cfg.workers = world
    cfg.validate()
    if (cfg.torch_hook is not None and baseline is None) or (cfg.paired_ddp is not None and pairing is None):
        raise ConfigError("--torch-hook and --paired-ddp are benchmark tools: run them through gradsift train "
                          "(gradsift.experiments.ddp_runs.train)")
    peers = Peers()
    task, cfg, device, model, ddp, optimizer, state = build(cfg, bucket_cap_mb, lags, rank, baseline)
    # memory=adam: each rank clips its own gradient before its Adam; the averaged direction is not clipped
    clipped_by_ranks = hand_clip_over(state, optimizer, cfg.clip_norm)
    pair = pairing(state, ddp) if pairing is not None else None
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else (Path(out) / "checkpoints" if out else None)
    # torchrun's restart of this job (--resume auto): continue from the latest checkpoint if there is one, else
    # start over in the job's own folder (a kill before the first checkpoint; --overwrite clears gradsift's files only)
    restarted = resume == "auto" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if resume == "auto":
        resume = str(ckpt_dir) if ckpt_dir is not None and (ckpt_dir / "latest").exists() else None
    out_dir = Path(out) if out else None
    folder = OutputDir(out_dir, overwrite=overwrite or (restarted and not resume), reuse=bool(resume)) \
        if (out_dir and rank == 0) else None
    agree(lambda: folder.open() if folder is not None else None, rank)  # every rank, whichever ones write
    start, updates = 0, 0
    records: list[dict[str, Any]] = []
    comm_seen: list[tuple[int, float | None]] = []  # (update, this rank's comm_s): rank 0's alone counts waits
    writer = None
    t_run = time.perf_counter()

    loaded = [not resume]  # a refused resume leaves the folder's summary (the run it would continue) alone

    def summary_for(status: str) -> dict[str, Any] | None:
        if rank != 0 or out_dir is None or not loaded[0]:
            return None
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        extra = {"metric": task.metric, "higher_is_better": task.higher_is_better,
                 "runtime": ("hsdp" if cfg.replicas > 1 else "fsdp") if cfg.fsdp else "ddp",
                 "world_size": world, "backend": backend, "status": status}
        if baseline is not None:
            extra.update(baseline=state.describe(), note=baseline.note(cfg))
        else:
            extra["routing"] = state.routing.summary(state.compressor)
            extra["memory"] = state.memory_summary()
        if state.lags is not None:
            extra["lags"] = state.lags.report()
        if pair is not None:
            extra["paired_ddp"] = pair.summary(records)
        s = run_summary(cfg.as_dict(), records, time.perf_counter() - t_run, dense_bytes,
                        int(state.totals["skipped_steps"]), extra=extra)
        write_json(out_dir / "summary.json", s)
        return s

    guard = contextlib.ExitStack()
    guard.enter_context(sigterm_raises())  # a rank stopped by torchrun still reports and writes its summary
    try:
        if resume:
            start, updates = every_rank(lambda: load_checkpoint(resolve_checkpoint(resume), model, optimizer, state,
                                                                cfg))
            loaded[0] = True
        if rank == 0 and out_dir is not None:
            mpath = out_dir / "metrics.jsonl"
            kept = [r for r in read_resumed_metrics(mpath) if r["step"] <= updates] \
                if resume and (mpath.exists() or mpath.is_symlink()) else []
            records.extend(kept)
            writer = MetricsWriter(mpath)
            for r in kept:
                writer.write(r)
        with contextlib.ExitStack() as stack:
            if writer is not None:
                stack.callback(writer.close)
            advance = (lambda n=1, info="": None)
            if progress is not None and rank == 0:
                label = cfg.compressor if baseline is None else state.describe()
                runtime = ("hsdp" if cfg.replicas > 1 else "fsdp") if cfg.fsdp else "ddp"
                advance = stack.enter_context(progress.task(f"{label} on {cfg.task} ({runtime}, {world} ranks)",
                                                            cfg.steps - start))
            for it in range(start, cfg.steps):
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                batch = to_device(task.batch(rank, it), device)
                side = pair.side(it) if pair is not None else None
                loss = task.loss(pair.wrapper(side) if side is not None else ddp, batch)
                if cfg.fault_nan_step is not None and it + 1 == cfg.fault_nan_step and rank == world - 1:
                    loss = loss * float("nan")  # fault injection: every gradient of the last rank is NaN
                t_fwd = time.perf_counter()
                try:
                    loss.backward()
                    skipped = (state.end_plain_step(loss) if side == "ddp"
                               else state.end_step(backward_start=t_fwd, loss=loss))
                except Exception as e:  # noqa: BLE001 - mapped to gradsift's errors
                    raise explain(e, state, timeout_s, peers) from None
                if skipped:
                    continue
                if cfg.clip_norm is not None and not clipped_by_ranks:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                set_lr(cfg, optimizer, updates)
                optimizer.step()
                updates += 1
                info = {} if side == "ddp" else state.last
                comm_seen.append((updates, info.get("comm_s")))
                if rank == 0 or cfg.fsdp:  # (an FSDP model's forward, evaluating it, runs on every rank)
                    rec = make_record(task, model, cfg, updates, it, float(loss.detach()), time.perf_counter() - t0,
                                      info)
                    if side is not None:
                        rec["paired"] = side
                    records.append(rec)
                    if writer:
                        writer.write(rec)
                    if rank == 0:
                        advance(1, progress_info(rec, task.metric))
                if checkpoint_every and ckpt_dir is not None and (it + 1) % checkpoint_every == 0:
                    save_checkpoint(ckpt_dir, it + 1, updates, model, optimizer, state, cfg)
                if cfg.stop_at is not None and updates % cfg.eval_every == 0:
                    hit = torch.tensor([float(rank == 0 and reached(task, records[-1], cfg.stop_at))],
                                       device=control_device())
                    dist.all_reduce(hit)  # rank 0 evaluated; every rank stops alike
                    if hit.item():
                        break
    except KeyboardInterrupt:
        ignore_sigterm()  # this rank is stopping: let it finish its report
        last_summary(summary_for, "interrupted")
        if folder is not None:
            folder.close()
        raise
    except BaseException as e:
        ignore_sigterm()  # a peer failing alike must not cut this rank's report short
        err = explain(e, state, timeout_s, peers) if not isinstance(e, (ConfigError, OutputError)) else e
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        last_summary(summary_for, f"failed: {first}")
        if folder is not None:
            folder.close()
        raise err from None
    finally:
        guard.close()
    if baseline is None and world > 1:
        least_comm_over_ranks(records, comm_seen, rank, world, out_dir / "metrics.jsonl" if out_dir else None)
    summary = summary_for("completed")
    final = full_state_dict(model) if cfg.fsdp else model.state_dict()  # (FSDP: gathered on every rank)
    if rank == 0 and out_dir is not None:
        atomic_save(final, out_dir / "final_model.pt")
    # leave together: a rank that exits while a peer still writes its summary or checkpoint
    # tears down connections under it (gloo then aborts that peer)
    dist.barrier()
    if folder is not None:
        folder.close()
    params = full_params(model)
    return {"params": params, "records": records, "summary": summary, "state": state, "model": model}


def least_comm_over_ranks(records: list[dict[str, Any]], mine: list[tuple[int, float | None]], rank: int,
                          world: int, path: Path | None) -> None:
    """Add ``comm_min_s`` to rank 0's records of this run: per step, the least ``comm_s`` over the ranks. A rank
    that reaches a collective before its peers counts their lateness in its own time in flight; the last one to
    arrive waits for nobody, so the least time is the collectives' own. Gathered once at the end (no collective
    per step); ``metrics.jsonl`` is rewritten with the field (atomically). A run that stops early has none."""
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    by_step: dict[int, list[float | None]] = {}
    for seen in every:
        for step, comm in seen:
            by_step.setdefault(step, []).append(comm)
    changed = False
    for rec in records:
        vals = by_step.get(rec["step"], [])
        if len(vals) == world and all(v is not None for v in vals):
            rec["comm_min_s"] = min(vals)  # type: ignore[type-var]
            changed = True
    if changed and path is not None:
        rewrite_metrics(path, records)


def reached(task, rec: dict[str, Any], target: float) -> bool:
    """Whether the record's task metric has reached ``target`` (``--stop-at``)."""
    v = rec.get(task.metric)
    return v is not None and (v >= target if task.higher_is_better else v <= target)


def make_record(task, model, cfg: RunConfig, updates: int, it: int, batch_loss: float, step_s: float,
                info: dict[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` record (:func:`gradsift.runtime.telemetry.step_record`), plus the measured ``step_s`` and
    ``comm_s`` and the time model's estimates from them."""
    evaluate = updates % cfg.eval_every == 0 or it + 1 >= cfg.steps
    rec = step_record(task, model, updates, batch_loss, evaluate, info, cfg.probe_every)
    select = info.get("select_s", 0.0)
    compute = max(0.0, step_s - info.get("tail_wait_s", 0.0) - select)
    serial = compute + select + info.get("est_comm_s", 0.0)
    est = serial
    if cfg.granularity == "layer" and info.get("est_pipelined_tail_s") is not None:
        # buckets communicate while backward continues: the estimate adds only what would stick out
        est = compute + select + info["est_pipelined_tail_s"]
    rec.update(compute_s=compute, est_step_s=est, est_step_serial_s=serial,
               comm_s=info.get("comm_s"), step_s=step_s)  # comm_s is None where it cannot be observed (DDP's own)
    if "buckets" in info:  # gradsift's hook: buckets this step, how many were summed in DDP's own buffer, and
        # the messages they went in (small per-layer payloads wait for the next bucket's)
        rec.update(buckets=info["buckets"], buckets_in_place=info.get("buckets_in_place", 0),
                   messages=info.get("messages", info["buckets"]))
    if info.get("ddp_allreduce"):
        rec["ddp_allreduce"] = True
    return rec
