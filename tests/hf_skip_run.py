"""Run under torchrun by tests/test_hf.py: the example's Trainer with on_nonfinite="skip" and rank 1's loss made
NaN at one optimizer step; rank 0 writes what the weights and the learning rate did across that step."""

import json
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer  # noqa: E402

import gradsift.ddp  # noqa: E402

NAN_STEP = 3  # the optimizer step (1-based) whose gradient is not finite on rank 1


class NanOnRank1(Trainer):
    def compute_loss(self, model, inputs, *a, **k):
        loss = super().compute_loss(model, inputs, *a, **k)
        if torch.distributed.get_rank() == 1 and self.state.global_step + 1 == NAN_STEP:
            loss = loss * float("nan")
        return loss


class Watch(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.seen = trainer, {}

    def on_step_begin(self, args, state, control, **kw):
        self.before = ([p.detach().clone() for p in self.trainer.model.parameters()],
                       self.trainer.lr_scheduler.get_last_lr()[0])

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == NAN_STEP:
            params, lr = self.before
            self.seen = {"unchanged_at_skip": all(torch.equal(a, b) for a, b in zip(params, self.trainer.model.parameters())),
                         "lr_unchanged_at_skip": lr == self.trainer.lr_scheduler.get_last_lr()[0]}


args = hf_trainer.parse_args()
trainer, cb = hf_trainer.build(args, trainer_class=NanOnRank1, on_nonfinite="skip")
watch = Watch(trainer)
trainer.add_callback(watch)
trainer.train()
if cb.state.rank == 0:
    (Path(args.out) / "skip.json").write_text(json.dumps({"skipped": cb.skipped_steps, **watch.seen}))
gradsift.ddp.finish(0)
