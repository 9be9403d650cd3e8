"""gradsift in a PyTorch Lightning script: one strategy object, on CPU or GPU.

    pip install 'gradsift[lightning]'
    python examples/lightning_ddp.py --out runs/lightning        # 2 CPU processes

Lightning starts the second process itself (its DDP launcher runs this script
again). ``runs/lightning/metrics.jsonl`` gets one line per step from rank 0:
density, bytes, wire bytes, communication and selection time, and the loss;
the same numbers go to Lightning's logger under ``gradsift/``. With
``--checkpoint-every N`` Lightning saves ``runs/lightning/ckpt/step=N.ckpt``
with every rank's gradsift state in it; ``--resume PATH`` continues from one
with the error-feedback memory it had.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

import gradsift.ddp


def main() -> None:
    import lightning as L

    from gradsift.integrations.lightning import GradsiftDDPStrategy

    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out", default="runs/lightning")
    ap.add_argument("--wire-plan", default="auto", choices=("auto", "measure", "off"))
    ap.add_argument("--measure", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the measured wire plan (warmup, block, rounds, margin), repeatable")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="save a .ckpt every N steps")
    ap.add_argument("--resume", default=None, metavar="CKPT", help="continue from this .ckpt")
    ap.add_argument("--samples", type=int, default=4096, help="training samples (an epoch is samples/64 steps)")
    args = ap.parse_args()
    measure = {k: float(v) if k.endswith("margin") else int(v) for k, v in (m.split("=", 1) for m in args.measure)}

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    x = torch.randn(args.samples, 64)
    y = (x @ torch.randn(64, 10)).argmax(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strategy = GradsiftDDPStrategy(args.compressor, args.ratio, metrics_path=out / "metrics.jsonl",
                                   wire_plan=args.wire_plan, **({"measure": measure} if measure else {}))
    saving = [L.pytorch.callbacks.ModelCheckpoint(out / "ckpt", filename="{step}", every_n_train_steps=args.checkpoint_every,
                                                  save_top_k=-1)] if args.checkpoint_every else []
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=bool(saving), callbacks=saving, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Lit(), data, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        print(f"wrote {out / 'metrics.jsonl'}; gradsift totals: {strategy.gradsift.totals}")
    gradsift.ddp.finish()  # exit 0 every time (gloo can abort a rank at interpreter shutdown: docs/ddp.md)


if __name__ == "__main__":
    main()
