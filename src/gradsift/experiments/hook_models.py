"""The models ``gradsift bench hook`` times (none is a gradsift task): real layers, or a model's layer shapes alone.

``mlp`` -- an EmbeddingBag, 80 Linear(256, 256) and a head (163 tensors, 5.3M parameters), momentum SGD;
``transformer`` -- 12 pre-norm encoder blocks of d 128 (``nn.TransformerEncoderLayer``, 152 tensors), AdamW;
``resnet50`` -- ResNet-50 (bottleneck blocks 3, 4, 6, 3; batch norm; 161 tensors, 23.5M parameters with a 10-class
head) on 64x64 images, momentum SGD. ``bert-base``, ``gpt2-small``, ``vit-b16`` (or a JSON file of shapes) --
parameters of those layer shapes under a quadratic loss, momentum SGD: the hook sees every tensor as in the real
model while the model's own compute is a few passes over its parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from .model_bench import MODELS as _SHAPES, model_shapes

SHAPE_MODELS = tuple(m for m in _SHAPES if m != "resnet50")
MODELS = ("mlp", "transformer", "resnet50", *SHAPE_MODELS)


class Mlp(nn.Module):
    """163 tensors: an embedding bag, 80 residual Linear(256, 256) layers, a head."""

    def __init__(self, layers: int = 80, d: int = 256, vocab: int = 1000, classes: int = 10):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.bag(ids)
        for lin in self.layers:
            x = x + 0.1 * torch.tanh(lin(x))  # bounded: gradients neither explode nor vanish over 80 layers
        return self.head(x)


class Encoder(nn.Module):
    """A token model of ``blocks`` pre-norm encoder blocks (causal mask) and a tied-free head."""

    def __init__(self, vocab: int = 65, d: int = 128, blocks: int = 12, heads: int = 4, block: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.body(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)), mask=mask,
                                   is_causal=True))


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        out = 4 * planes
        self.body = nn.Sequential(
            nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out))
        self.down = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or inplanes != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016): a 7x7 stem, bottleneck stages of 3, 4, 6 and 3 blocks, a linear head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)]
        inplanes = 64
        for i, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for j in range(blocks):
                layers.append(Bottleneck(inplanes, planes, 2 if (j == 0 and i > 0) else 1))
                inplanes = 4 * planes
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class Shapes(nn.Module):
    """Parameters of the given shapes under ``0.5 * scale * sum((p - target)**2)``, targets heavy-tailed
    (a product of two normals): each step's gradient is ``scale * (p - target)``, moving as the optimizer does."""

    def __init__(self, named: list[tuple[str, tuple[int, ...]]]):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.params = nn.ParameterList(nn.Parameter(0.02 * torch.randn(s, generator=gen)) for _, s in named)
        for i, (_, s) in enumerate(named):
            self.register_buffer(f"target{i}", torch.randn(s, generator=gen) * torch.randn(s, generator=gen))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        targets = [getattr(self, f"target{i}") for i in range(len(self.params))]
        return 0.5 * scale * sum(((p - t) ** 2).sum() for p, t in zip(self.params, targets))


def build(model: str | None, shapes: str | None, device: torch.device):
    """(model, optimizer, batch(generator), loss(model, batch)) for ``model`` (or the shapes in file ``shapes``)."""
    if model == "mlp" and shapes is None:
        net: nn.Module = Mlp().to(device)
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            return (torch.randint(0, 1000, (32, 8), generator=gen).to(device),
                    torch.randint(0, 10, (32,), generator=gen).to(device))

        def loss(m, x):
            return nn.functional.cross_entropy(m(x[0]), x[1])
    elif model == "resnet50" and shapes is None:
        net = ResNet50().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            return (torch.randn((4, 3, 64, 64), generator=gen).to(device),
                    torch.randint(0, 10, (4,), generator=gen).to(device))

        def loss(m, x):
            return nn.functional.cross_entropy(m(x[0]), x[1])
    elif model == "transformer" and shapes is None:
        net = Encoder().to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)

        def batch(gen):
            return (torch.randint(0, 65, (8, 64), generator=gen).to(device),
                    torch.randint(0, 65, (8, 64), generator=gen).to(device))

        def loss(m, x):
            return nn.functional.cross_entropy(m(x[0]).reshape(-1, 65), x[1].reshape(-1))
    else:
        net = Shapes(model_shapes(None if shapes else model, shapes)[1]).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            return (1 + 0.2 * torch.rand((), generator=gen)).to(device)

        def loss(m, x):
            return m(x)
    return net, opt, batch, loss
