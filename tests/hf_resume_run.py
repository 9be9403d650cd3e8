"""Run under torchrun by tests/test_hf.py: the example's Trainer, killed (SIGKILL, every rank) right after the
checkpoint of step --kill-at is written -- a node lost mid-run."""

import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer  # noqa: E402

kill_at = int(sys.argv.pop(sys.argv.index("--kill-at") + 1))
sys.argv.remove("--kill-at")


class Kill(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        if state.global_step == kill_at:
            dist.barrier()  # every rank's files are written
            os.kill(os.getpid(), signal.SIGKILL)


args = hf_trainer.parse_args()
trainer, cb = hf_trainer.build(args)
trainer.add_callback(Kill())
trainer.train()
