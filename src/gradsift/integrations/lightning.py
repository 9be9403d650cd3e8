"""gradsift in PyTorch Lightning: a DDP strategy that really compresses, on CPU and GPU alike.

    import lightning as L
    from gradsift.integrations.lightning import GradsiftDDPStrategy

    strategy = GradsiftDDPStrategy("topk", ratio=0.01, metrics_path="runs/lit/metrics.jsonl")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a communication
hook only when its device is CUDA (``_register_ddp_hooks``), so on CPU the hook
is silently never called. This strategy registers gradsift's hook itself, on
any device, once Lightning has wrapped the model and built the optimizers
(so a momentum-correcting compressor such as ``dgc`` takes the optimizer's
momentum over instead of applying it twice); closes every step after the
backward pass (``state.end_step()``) and leaves the optimizer alone on a step
that must be skipped (``on_nonfinite="skip"``: weights and momentum do not
move); stands aside for DDP's own all-reduce where the hook would only repeat
it, as every ``register`` user does (:mod:`gradsift.ddp.aside`); sends
gradsift's per-step telemetry to
Lightning's loggers (``gradsift/density``, ``gradsift/bytes_per_worker``, ...)
and, with ``metrics_path``, appends one JSON line per step on rank 0, the
fields of ``gradsift train``'s ``metrics.jsonl`` plus the loss. Every ``.ckpt``
Lightning saves holds every rank's gradsift state under ``"gradsift"``
(error-feedback memory, the route, the step, the totals: gathered to rank 0,
which writes the file), and ``trainer.fit(..., ckpt_path=...)`` gives each rank
its own back (from a run of another world size, folded as an elastic resume
does). A checkpoint saved without gradsift resumes with the memory starting from
zero, said in one line. Needs the ``lightning`` package
(``pip install gradsift[lightning]``).

Local SGD instead (:mod:`gradsift.local`): ``GradsiftDDPStrategy("local:period=8,compressor=topk", ratio=0.01)``
(the spec as ``gradsift train`` takes it) replaces DDP's all-reduce with local steps and a compressed sync every
``period`` optimizer steps. Each rank's parameters and optimizer state ride in the ``.ckpt`` with its gradsift state
and are put back after Lightning restores rank 0's, so a run resumed mid-period goes on as if never stopped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy

from ..messages import say, warn
from ..ddp import register
from ..local import check_spec, from_spec, is_local_spec
from ..memory.adam_step import hand_clip_over
from ..runtime.records import MetricsWriter
from ..runtime.telemetry import FIELDS
from ..runtime.elastic import AllRanks
from ..runtime.settings import Settings


class GradsiftDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with gradsift's hook: ``GradsiftDDPStrategy(spec, ratio, **options)``.

    ``options`` go to :func:`gradsift.ddp.register` (``granularity``, ``lags``,
    ``on_nonfinite``, ``bandwidth_gbps``, ``wire_plan``, compressor options ...);
    ``ddp_kwargs`` to Lightning's ``DDPStrategy`` (``find_unused_parameters``,
    ``bucket_cap_mb``, ...). ``self.gradsift`` is the registered state.
    """

    strategy_name = "gradsift_ddp"

    def __init__(self, compressor: str, ratio: float | None = None, *, metrics_path=None,
                 ddp_kwargs: dict[str, Any] | None = None, **options: Any):
        super().__init__(**(ddp_kwargs or {}))
        # a bad spec or setting is one line here, not a traceback on every rank at the first backward
        self.local = is_local_spec(compressor)
        if self.local:
            check_spec(compressor, ratio, options)
        else:
            Settings.of(compressor, ratio, {k: v for k, v in options.items() if k != "lags"}, "ddp")
        self.spec, self.ratio, self.options = compressor, ratio, options
        self.metrics_path = metrics_path
        self.gradsift = None
        self._writer = None
        self._restore: dict[str, Any] | None = None  # gradsift's state from the checkpoint being resumed

    def _register_ddp_hooks(self) -> None:
        """Lightning would register a hook on CUDA only; gradsift's is registered in :meth:`setup`."""

    def setup(self, trainer) -> None:
        super().setup(trainer)
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            make = from_spec if self.local else register
            self.gradsift = make(self.model, self.spec, self.ratio,
                                 optimizer=optimizers[0] if len(optimizers) == 1 else None, **self.options)
            clip = trainer.gradient_clip_val if trainer.gradient_clip_algorithm in (None, "norm") else None
            if hand_clip_over(self.gradsift, optimizers[0] if len(optimizers) == 1 else None, clip):
                if self.global_rank == 0:  # memory=adam: p.grad holds the averaged direction
                    say(f"gradsift: gradient_clip_val={clip:g} now clips each rank's own gradient before its Adam "
                        "(memory=adam); Lightning clips nothing")
                trainer.gradient_clip_val = None
            if self.metrics_path is not None and self.global_rank == 0:
                self._writer = MetricsWriter(self.metrics_path)
            self._restore_gradsift()

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Lightning calls this on every rank; rank 0 writes. Every rank's gradsift state goes into the file."""
        if self.gradsift is not None:
            checkpoint[AllRanks.KEY] = self.gradsift.all_ranks().state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restore = checkpoint.get(AllRanks.KEY, {})
        self._restore_gradsift()
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Lightning restores rank 0's optimizer state on every rank after :meth:`setup`; under local SGD each rank's
        own parameters and optimizer state (in its gradsift state) go back once more, after it."""
        super().load_optimizer_state_dict(checkpoint)
        saved = checkpoint.get(AllRanks.KEY) if self.local else None
        if self.gradsift is not None and saved:
            self.gradsift.all_ranks().load_state_dict(saved)

    def _restore_gradsift(self) -> None:
        if self.gradsift is None or self._restore is None:
            return
        saved, self._restore = self._restore, None
        if not saved:
            if self.global_rank == 0:
                warn("gradsift: the checkpoint holds no gradsift state (saved without it): the error-feedback "
                     "memory and the totals start from zero")
            return
        self.gradsift.all_ranks().load_state_dict(saved)

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self.gradsift is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        out = closure()  # forward and backward: the hook (or DDP's own all-reduce) averages the gradients
        loss = out if isinstance(out, torch.Tensor) else None
        if self.gradsift.end_step(loss=loss):
            return out  # skipped on every rank: the optimizer does not step
        self._report(out)
        return super().optimizer_step(optimizer, lambda: out, model, **kwargs)

    def _report(self, loss: Any) -> None:
        if self.global_rank != 0:
            return
        last = self.gradsift.last
        step = self.lightning_module.trainer.global_step + 1
        if self._writer is not None:
            rec = {"step": step, **{k: v for k, v in last.items() if k != "skipped"}}
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                rec["loss"] = float(loss.detach())
            self._writer.write(rec)
        metrics = {f"gradsift/{k}": float(last[k]) for k in FIELDS if last.get(k) is not None}
        for logger in self.lightning_module.trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def teardown(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        super().teardown()
