"""``wordlm``: a word-level LSTM language model on a text file -- the communication-bound task.

The laptop-scale analogue of the papers' LSTM-PTB: the embedding and the output
projection over a vocabulary of ``vocab`` (12,000) words are large dense
tensors (about 5.5M parameters in all with the defaults), while the compute per
step is small, so on slow links the gradient's all-reduce dwarfs the step's
computation. The embedding's gradient is mostly exact zeros (only the rows of
the words in the batch), as in any real language model.

Data (``--data PATH``, e.g. ``../shared/data/tinyshakespeare.txt``): words and
punctuation marks as tokens (``[A-Za-z']+`` or one of ``.,!?;:``, case kept);
the vocabulary is the ``vocab - 1`` most frequent tokens of the training part
plus ``<unk>``; the last ``valid_fraction`` (10%) of the tokens is held out. The
training part is cut into one contiguous chunk per worker; each step a worker
reads ``batch_size`` windows of ``seq_len + 1`` tokens at positions drawn from
``(seed, worker, step)``. Metric: ``perplexity`` = exp(mean cross-entropy per
token) on up to ``eval_tokens`` held-out tokens (lower is better).
"""

from __future__ import annotations

import collections
import functools
import math
import re

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Task, TaskError
from .charlm import read_text

TOKEN = re.compile(r"[A-Za-z']+|[.,!?;:]")


@functools.lru_cache(maxsize=4)
def _tokens(text: str) -> tuple[str, ...]:
    return tuple(TOKEN.findall(text))


class WordLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


class WordLM(Task):
    name = "wordlm"
    metric = "perplexity"
    higher_is_better = False
    defaults = {"lr": 5.0, "batch_size": 10, "steps": 300, "optimizer": "sgd", "eval_every": 50, "clip_norm": 0.25}
    OPTIONS = {"vocab": 12000, "seq_len": 35, "embed": 200, "hidden": 200, "layers": 2, "valid_fraction": 0.1,
               "eval_tokens": 8192}
    SUMMARY = "word-level 2-layer LSTM LM, 12k-word vocabulary, ~5.5M parameters (--data PATH); metric perplexity"

    def setup(self) -> None:
        o = self.options
        for key in ("vocab", "seq_len", "embed", "hidden", "layers", "eval_tokens"):
            if isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < 1:
                raise TaskError(f"wordlm: {key} must be an integer >= 1, got {o[key]!r}")
        if o["vocab"] < 2:
            raise TaskError("wordlm: vocab must be at least 2")
        if not (0 < float(o["valid_fraction"]) < 1):
            raise TaskError(f"wordlm: valid_fraction must be in (0, 1), got {o['valid_fraction']!r}")
        tokens = _tokens(read_text(self.data_path, task="wordlm"))
        span = o["seq_len"] + 1
        n_valid = max(int(len(tokens) * float(o["valid_fraction"])), span)
        if len(tokens) - n_valid < 2 * span:
            raise TaskError(f"wordlm: {self.data_path!r} holds too few words ({len(tokens)})")
        train_tokens = tokens[:-n_valid]
        counts = collections.Counter(train_tokens)
        self.words = ["<unk>"] + [w for w, _ in counts.most_common(o["vocab"] - 1)]
        lut = {w: i for i, w in enumerate(self.words)}
        ids = torch.tensor([lut.get(w, 0) for w in tokens], dtype=torch.long)
        train, valid = ids[:-n_valid], ids[-n_valid:]
        per = len(train) // self.workers
        if per < span + 1:
            raise TaskError(f"wordlm: the text is too short for {self.workers} workers and seq_len {o['seq_len']}")
        self.chunks = [train[w * per:(w + 1) * per] for w in range(self.workers)]
        n_eval = min(len(valid) - 1, int(o["eval_tokens"]))
        rows = max(1, n_eval // o["seq_len"])
        v = valid[: rows * o["seq_len"] + 1]
        self.valid_x = v[:-1].reshape(rows, o["seq_len"])
        self.valid_y = v[1:].reshape(rows, o["seq_len"])
        g = np.random.default_rng([self.seed, 4242])
        starts = g.integers(0, len(train) - span, size=8)
        self.probe = torch.stack([train[s:s + span] for s in starts])

    def make_model(self) -> nn.Module:
        o = self.options
        return WordLSTM(len(self.words), o["embed"], o["hidden"], o["layers"])

    def batch(self, worker: int, step: int):
        span = self.options["seq_len"] + 1
        chunk = self.chunks[worker]
        rng = np.random.default_rng([self.seed, worker, step, 23])
        starts = rng.integers(0, len(chunk) - span, size=self.batch_size)
        return torch.stack([chunk[s:s + span] for s in starts])

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def probe_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, self.beside(model, self.probe)))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        total, count = 0.0, 0
        valid_x, valid_y = self.beside(model, self.valid_x), self.beside(model, self.valid_y)
        with torch.no_grad():
            for i in range(0, len(valid_x), 32):
                logits = model(valid_x[i:i + 32])
                y = valid_y[i:i + 32]
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
                count += y.numel()
        model.train(was)
        ce = total / count
        return {"perplexity": math.exp(min(ce, 700.0)), "valid_loss": ce}
