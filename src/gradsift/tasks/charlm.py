"""``charlm``: a 2-layer LSTM character language model on a UTF-8 text file.

The communication-heavy benchmark (the papers' LSTM-PTB stand-in): the
embedding, both LSTM layers' input and recurrent matrices, and the output
projection are large dense tensors. ``--data PATH`` names the text file
(tests and benchmarks use ``../shared/data/tinyshakespeare.txt``).

Data: the vocabulary is the sorted set of characters in the file; the last
``valid_fraction`` (10%) of the file is held out. The training part is cut into
one contiguous chunk per worker; each step a worker reads ``batch_size``
windows of ``seq_len + 1`` characters at positions drawn from
``(seed, worker, step)``. Metric: ``perplexity`` = exp(mean cross-entropy per
character) on up to ``eval_chars`` characters of the held-out tail (lower is
better).
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Task, TaskError


@functools.lru_cache(maxsize=4)
def _read_text(path: str, mtime: float) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_text(path: str | None, task: str = "charlm") -> str:
    if not path:
        raise TaskError(f"{task} needs a text file: pass --data PATH (e.g. ../shared/data/tinyshakespeare.txt)")
    if not os.path.isfile(path):
        raise TaskError(f"{task}: --data {path!r} is not a readable file")
    try:
        text = _read_text(os.path.abspath(path), os.path.getmtime(path))
    except UnicodeDecodeError as e:
        raise TaskError(f"{task}: {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TaskError(f"{task}: cannot read {path!r}: {e.strerror}") from None
    return text


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


class CharLM(Task):
    name = "charlm"
    metric = "perplexity"
    higher_is_better = False
    defaults = {"lr": 1.0, "batch_size": 16, "steps": 300, "optimizer": "sgd", "eval_every": 50}
    OPTIONS = {"seq_len": 64, "embed": 64, "hidden": 256, "layers": 2, "valid_fraction": 0.1,
               "eval_chars": 16384, "max_chars": 0}
    SUMMARY = "2-layer LSTM character LM on a text file (--data PATH); metric perplexity on a held-out tail"

    def setup(self) -> None:
        o = self.options
        for key in ("seq_len", "embed", "hidden", "layers", "eval_chars"):
            if not isinstance(o[key], int) or o[key] < 1:
                raise TaskError(f"charlm: {key} must be an integer >= 1, got {o[key]!r}")
        if not (0 < float(o["valid_fraction"]) < 1):
            raise TaskError(f"charlm: valid_fraction must be in (0, 1), got {o['valid_fraction']!r}")
        text = read_text(self.data_path)
        if o["max_chars"]:
            text = text[: int(o["max_chars"])]
        chars = sorted(set(text))
        if len(chars) < 2:
            raise TaskError("charlm: the text needs at least 2 distinct characters")
        self.vocab = chars
        lut = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([lut[c] for c in text], dtype=torch.long)
        n_valid = max(int(len(ids) * float(o["valid_fraction"])), o["seq_len"] + 1)
        train, valid = ids[:-n_valid], ids[-n_valid:]
        span = o["seq_len"] + 1
        per = len(train) // self.workers
        if per < span + 1:
            raise TaskError(f"charlm: the text is too short for {self.workers} workers and seq_len {o['seq_len']}")
        self.chunks = [train[w * per:(w + 1) * per] for w in range(self.workers)]
        self.train_ids = train
        n_eval = min(len(valid) - 1, int(o["eval_chars"]))
        rows = n_eval // o["seq_len"]
        v = valid[: rows * o["seq_len"] + 1]
        self.valid_x = v[:-1].reshape(rows, o["seq_len"])
        self.valid_y = v[1:].reshape(rows, o["seq_len"])
        g = np.random.default_rng([self.seed, 31337])
        starts = g.integers(0, len(train) - span, size=8)
        self.probe = torch.stack([train[s:s + span] for s in starts])

    def make_model(self) -> nn.Module:
        o = self.options
        return CharLSTM(len(self.vocab), o["embed"], o["hidden"], o["layers"])

    def batch(self, worker: int, step: int):
        span = self.options["seq_len"] + 1
        chunk = self.chunks[worker]
        rng = np.random.default_rng([self.seed, worker, step, 17])
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
            for i in range(0, len(valid_x), 64):
                logits = model(valid_x[i:i + 64])
                y = valid_y[i:i + 64]
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
                count += y.numel()
        model.train(was)
        ce = total / count
        return {"perplexity": math.exp(min(ce, 700.0)), "valid_loss": ce}
