"""``gptlm``: a small decoder-only transformer character language model, trained as language models are.

The model (:class:`TinyGPT`): token and learned position embeddings, ``layers`` pre-norm blocks (causal
multi-head self-attention, a 4x GELU MLP, residual connections), a final LayerNorm and a head tied to the token
embedding. Training is what most users run: AdamW (decoupled weight decay on matrices only, not on norms, biases
or embeddings' positions), a linear warm-up then a cosine decay of the learning rate to a tenth
(:func:`gradsift.runtime.runconfig.lr_factor`), gradient clipping at norm 1.

Data as ``charlm``'s (:mod:`gradsift.tasks.textlm`): the characters of a UTF-8 text file (``--data PATH``; tests
use ``../shared/data/tinyshakespeare.txt``), the last 10% held out, one contiguous chunk of the rest per worker,
windows drawn from ``(seed, worker, step)``. Metric: ``perplexity`` on the held-out tail, with ``valid_loss`` (its
cross-entropy per character) beside it.

Sized to run: 8 simulated workers finish the default 600 steps in a few minutes on two CPU cores (about 0.4M
parameters at context 64 and batch 8 per worker).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .charlm import CharLM


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer with learned positions and a head tied to the token embedding."""

    # the root's forward reads the token embedding's weight (the tied head): under FSDP it must be gathered with the
    # root's parameters, not resharded after the embedding's own forward (gradsift.runtime.sharding.fsdp_units)
    FSDP_IN_ROOT = ("tokens",)

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tokens(x) + self.positions(pos)
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.tokens.weight.t()


class GptLM(CharLM):
    name = "gptlm"
    defaults = {"lr": 3e-3, "batch_size": 8, "steps": 600, "optimizer": "adamw", "eval_every": 50,
                "weight_decay": 0.1, "clip_norm": 1.0, "schedule": "cosine", "warmup_steps": 60}
    OPTIONS = {"seq_len": 64, "embed": 96, "layers": 3, "heads": 4, "valid_fraction": 0.1,
               "eval_chars": 16384, "max_chars": 0}
    INTEGER_OPTIONS = ("seq_len", "embed", "layers", "heads")
    SUMMARY = ("decoder-only transformer character LM on a text file (--data PATH), AdamW with warm-up and cosine "
               "decay; metric perplexity on a held-out tail")
    PROBE_SALT, BATCH_SALT, EVAL_BATCH, EVAL_OPTION = 4242, 23, 64, "eval_chars"

    def make_model(self) -> nn.Module:
        o = self.options
        return TinyGPT(self.vocab_size(), o["seq_len"], o["embed"], o["layers"], o["heads"])

    @staticmethod
    def decays(name: str, p: torch.Tensor) -> bool:
        """AdamW's weight decay goes to the matrices of the blocks and the tied token embedding only."""
        return p.dim() >= 2 and not name.startswith("positions")
