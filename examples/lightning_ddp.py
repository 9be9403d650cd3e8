"""Using gradsift from PyTorch Lightning's DDP strategy (Lightning is not a gradsift dependency).

Lightning wraps the model in DistributedDataParallel itself and registers a
communication hook given as ``ddp_comm_hook`` with ``ddp_comm_state``. gradsift
provides both: a state built from the plain module (the process group, the
compressor and the cross-rank configuration check are set up at the first
hook call) and the hook function.

    python examples/lightning_ddp.py      # with lightning installed, 2 CPU processes
"""

import torch
from torch import nn

import gradsift.ddp


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


def main() -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Model()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit = Lit()
    state = gradsift.ddp.hook_state(lit, "sidco", ratio=0.01)
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradsift.ddp.gradsift_hook)
    x = torch.randn(512, 32)
    y = x[:, :10].argmax(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False)
    trainer.fit(lit, data)


if __name__ == "__main__":
    main()
