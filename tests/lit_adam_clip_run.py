"""Run by tests/test_integrations.py: GradsiftDDPStrategy under AdamW with gradient_clip_val=1.0; rank 0 writes
where the clip went (the workers', memory=adam) and whether Lightning still clips."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

import gradsift.ddp
from gradsift.integrations.lightning import GradsiftDDPStrategy


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x[:, :4] * 3).argmax(1)
strategy = GradsiftDDPStrategy("topk", 0.1, wire_plan=False)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=30, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    gradient_clip_val=1.0)
module = Lit()
trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
if trainer.global_rank == 0:
    c = strategy.gradsift.compressor
    with torch.no_grad():
        acc = float((module.net(x).argmax(1) == y).float().mean())
    (out / "clip.json").write_text(json.dumps({"memory": c.memory_name, "clip": c.memory_options["clip"],
                                               "lightning_clip": trainer.gradient_clip_val, "accuracy": acc}))
gradsift.ddp.finish(0)
