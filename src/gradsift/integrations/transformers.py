"""gradsift in the Hugging Face ``Trainer``: compress the gradients the Trainer's DDP model exchanges.

    from transformers import Trainer
    from gradsift.integrations.transformers import compress

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    compress(trainer, "topk", ratio=0.01, metrics_path="runs/hf/metrics.jsonl")
    trainer.train()

The Trainer builds its DistributedDataParallel wrapper itself (through Accelerate) and takes no
communication hook, so :func:`compress` adds a :class:`GradsiftCallback` that registers gradsift's hook on
``trainer.model_wrapped`` when training begins -- and again when the Trainer wraps the model anew (a retry of
``auto_find_batch_size``) -- handing it the optimizer so momentum-correcting methods (``dgc``) take its momentum
over. Every optimizer step is closed after the last micro-batch's backward (gradient accumulation under
``no_sync`` calls the hook once per optimizer step). A step the non-finite rule skips (``on_nonfinite="skip"``)
leaves the weights, the optimizer's state and the learning rate schedule alone, on every rank, as the Trainer
treats a mixed-precision overflow (``global_step`` still counts it). Telemetry: ``gradsift/*`` means over each
logging window join the Trainer's logs (so its loggers -- TensorBoard, W&B, the console -- see them) and, with
``metrics_path``, rank 0 appends one JSON line per optimizer step (the fields of ``gradsift train``'s
``metrics.jsonl``).

Local SGD instead (:mod:`gradsift.local`): ``compress(trainer, "local:period=8,compressor=topk", ratio=0.01)``
replaces the DDP model's all-reduce with local steps and a compressed sync every ``period`` optimizer steps (the
spec as ``gradsift train`` takes it); each rank's checkpoint file then also holds its own parameters and optimizer
state, put back after the Trainer's (which are rank 0's), so a resumed run goes on as if never stopped.

Checkpoints: every ``checkpoint-N/`` the Trainer saves holds each rank's gradsift state beside the Trainer's own
files (``gradsift-rank<R>.pt``: error-feedback memory, the route, the step and the totals), and
``trainer.train(resume_from_checkpoint=...)`` loads it back on every rank, so a resumed run continues with the
residuals it had. A checkpoint saved without gradsift is resumed with the memory starting from zero, said in one
line. Needs ``pip install 'gradsift[hf]'``.
"""

from __future__ import annotations

import functools
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ..messages import say, warn
from ..ddp import register
from ..local import check_spec, from_spec, is_local_spec
from ..memory.adam_step import hand_clip_over
from ..runtime.settings import Settings
from ..runtime.records import MetricsWriter
from ..runtime.telemetry import FIELDS

# the telemetry fields logged as window means (gradsift/<field>)
LOGGED = tuple(k for k in FIELDS if k in ("density", "k_ratio", "bytes_per_worker", "wire_bytes_per_worker",
                                          "comm_s", "select_s"))


def compress(trainer: Trainer, compressor: str, ratio: float | None = None, *, metrics_path=None,
             **options: Any) -> "GradsiftCallback":
    """Compress ``trainer``'s gradient exchange with ``compressor`` (a spec string, as
    :func:`gradsift.make_compressor`); ``options`` go to :func:`gradsift.ddp.register` (``granularity``,
    ``on_nonfinite``, ``wire_plan``, compressor options ...). Returns the callback, added first so the logs it
    extends reach every other callback."""
    # a bad spec or setting is one line here, not a traceback on every rank at the first backward
    if is_local_spec(compressor):
        check_spec(compressor, ratio, options)
    else:
        Settings.of(compressor, ratio, {k: v for k, v in options.items() if k != "lags"}, "ddp")
    cb = GradsiftCallback(trainer, compressor, ratio, metrics_path=metrics_path, **options)
    trainer.callback_handler.callbacks.insert(0, cb)
    train = trainer.train

    @functools.wraps(train)
    def train_resuming(*args: Any, **kwargs: Any):  # the checkpoint the Trainer resumes from, for the callback
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:
            resume = get_last_checkpoint(trainer.args.output_dir)
        cb.resume_from = resume if isinstance(resume, (str, os.PathLike)) else None
        return train(*args, **kwargs)

    trainer.train = train_resuming
    return cb


STATE_FILE = "gradsift-rank{rank}.pt"


class GradsiftCallback(TrainerCallback):
    """The callback :func:`compress` adds; ``self.state`` is the registered :class:`gradsift.ddp.GradsiftState`
    (its ``last`` and ``totals`` as in a plain DDP script)."""

    def __init__(self, trainer: Trainer, compressor: str, ratio: float | None = None, *, metrics_path=None,
                 **options: Any):
        self.trainer, self.spec, self.ratio, self.options = trainer, compressor, ratio, options
        self.metrics_path = metrics_path
        self.state = None
        self.skipped_steps = 0
        self.resume_from: str | None = None  # the checkpoint folder trainer.train resumes from
        self._wrapped = None  # the DDP model the hook is registered on
        self._writer = None
        self._window: list[dict[str, Any]] = []
        self._skip_patch = None

    # ---------------------------------------------------------------- registration
    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if wrapped is self._wrapped:
            return
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # Accelerate's wrapper
        make = from_spec if is_local_spec(self.spec) else register
        self.state = make(wrapped, self.spec, self.ratio, optimizer=optimizer, **self.options)
        self._wrapped = wrapped
        targs = self.trainer.args
        if hand_clip_over(self.state, optimizer, getattr(targs, "max_grad_norm", None)):  # memory=adam: p.grad holds the direction
            if self.state.global_rank == 0:
                say(f"gradsift: max_grad_norm={targs.max_grad_norm:g} now clips each rank's own gradient before its "
                    "Adam (memory=adam); the Trainer clips nothing")
            targs.max_grad_norm = 0.0
        if self.metrics_path is not None and self.state.rank == 0 and self._writer is None:
            self._writer = MetricsWriter(self.metrics_path)
        if self.resume_from is not None:
            self._load(Path(self.resume_from))

    # ---------------------------------------------------------------- checkpoints
    def _load(self, folder: Path) -> None:
        path = folder / STATE_FILE.format(rank=self.state.global_rank)
        if not path.exists():
            if self.state.global_rank == 0:
                warn(f"gradsift: {folder} holds no gradsift state (saved without it): the error-feedback memory "
                     "and the totals start from zero")
            return
        self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def on_save(self, args, state, control, **kwargs):
        """Beside the Trainer's files in ``checkpoint-<step>/``: this rank's state (every rank writes its own)."""
        if self.state is None:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.state.state_dict(), folder / STATE_FILE.format(rank=self.state.global_rank))

    # ---------------------------------------------------------------- every optimizer step
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.state is None:
            return
        if self.state.end_step():  # skipped on every rank: the optimizer must not move
            self.skipped_steps += 1
            opt = self.trainer.optimizer
            opt.step = lambda *a, **k: None  # (this one call; the class's step is back at on_optimizer_step)
            if hasattr(opt, "_is_overflow"):  # Accelerate's wrapper: the Trainer then leaves the schedule alone
                opt._is_overflow = True
            self._skip_patch = opt

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._skip_patch is not None:
            del self._skip_patch.step

    def on_step_end(self, args, state, control, **kwargs):
        if self.state is None:
            return
        if self._skip_patch is not None:
            if hasattr(self._skip_patch, "_is_overflow"):
                self._skip_patch._is_overflow = False
            self._skip_patch = None
            return
        last = self.state.last
        self._window.append(last)
        if self._writer is not None:
            self._writer.write({"step": state.global_step, **{k: v for k, v in last.items() if k != "skipped"}})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._window or self.state is None:
            return
        for k in LOGGED:
            vals = [float(r[k]) for r in self._window if r.get(k) is not None]
            if vals:
                logs[f"gradsift/{k}"] = statistics.fmean(vals)
        t = self.state.totals
        if t.get("compression"):
            logs["gradsift/compression"] = float(t["compression"])
        if t.get("wire_compression"):
            logs["gradsift/wire_compression"] = float(t["wire_compression"])
        self._window = []

    def on_train_end(self, args, state, control, **kwargs):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

