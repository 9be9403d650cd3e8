"""Run by tests/test_integrations.py: GradsiftDDPStrategy with on_nonfinite="skip" and rank 1's loss NaN at one
step; rank 0 writes what the weights, the momentum buffers and global_step did across that step."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

import gradsift.ddp
from gradsift.integrations.lightning import GradsiftDDPStrategy

NAN_STEP = 3  # the optimizer step (1-based) whose gradient is not finite on rank 1


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_rank == 1 and self.trainer.global_step + 1 == NAN_STEP:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Watch(L.Callback):
    seen: dict = {}

    def on_train_batch_start(self, trainer, module, batch, i):
        opt = trainer.optimizers[0]
        self.before = ([p.detach().clone() for p in module.parameters()],
                       [opt.state[p]["momentum_buffer"].clone() if opt.state[p].get("momentum_buffer") is not None
                        else None for p in module.parameters()], trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        if self.before[2] + 1 != NAN_STEP:
            return
        opt = trainer.optimizers[0]
        params, moms, step = self.before
        Watch.seen = {"weights_still": all(torch.equal(a, b) for a, b in zip(params, module.parameters())),
                      "momentum_still": all(m is None or torch.equal(m, opt.state[p]["momentum_buffer"])
                                            for m, p in zip(moms, module.parameters())),
                      "global_step_before": step, "global_step_after": trainer.global_step}


out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x[:, :4] * 3).argmax(1)
strategy = GradsiftDDPStrategy("topk", 0.1, on_nonfinite="skip", wire_plan=False)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[Watch()])
trainer.fit(Lit(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
if trainer.global_rank == 0:
    (out / "skip.json").write_text(json.dumps({**Watch.seen, "skipped": strategy.gradsift.totals["skipped_steps"],
                                               "steps": strategy.gradsift.totals["steps"]}))
gradsift.ddp.finish(0)
