"""What the two language-model tasks share (``charlm``, ``wordlm``): a text file read once, an LSTM language
model, one contiguous chunk of the training ids per worker, windows drawn from ``(seed, worker, step)``, and
perplexity on a held-out tail. A subclass turns the text into ids (:meth:`TextLM.encode`) and sets its constants."""

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


def read_text(path: str | None, task: str) -> str:
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


class LSTMLM(nn.Module):
    """Embedding, a stacked LSTM, a linear head over the vocabulary."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


class TextLM(Task):
    """Base of the text tasks. Options every one has: ``seq_len``, ``embed``, ``hidden``, ``layers``,
    ``valid_fraction``; ``EVAL_OPTION`` names how many held-out ids are evaluated."""

    metric = "perplexity"
    higher_is_better = False
    PROBE_SALT = 0  # seeds of the fixed probe windows and of the batches (kept per task: runs reproduce)
    BATCH_SALT = 0
    EVAL_BATCH = 64
    EVAL_OPTION = "eval_tokens"
    INTEGER_OPTIONS = ("seq_len", "embed", "hidden", "layers")

    def encode(self, text: str) -> tuple[torch.Tensor, int]:
        """(every id of the text, how many of them, from the end, are held out); sets the vocabulary."""
        raise NotImplementedError

    def vocab_size(self) -> int:
        raise NotImplementedError

    def setup(self) -> None:
        o = self.options
        for key in (*self.INTEGER_OPTIONS, self.EVAL_OPTION):
            if isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < 1:
                raise TaskError(f"{self.name}: {key} must be an integer >= 1, got {o[key]!r}")
        if not (0 < float(o["valid_fraction"]) < 1):
            raise TaskError(f"{self.name}: valid_fraction must be in (0, 1), got {o['valid_fraction']!r}")
        ids, n_valid = self.encode(read_text(self.data_path, task=self.name))
        span = o["seq_len"] + 1
        train, valid = ids[:-n_valid], ids[-n_valid:]
        per = len(train) // self.workers
        if per < span + 1:
            raise TaskError(f"{self.name}: the text is too short for {self.workers} workers and seq_len {o['seq_len']}")
        self.chunks = [train[w * per:(w + 1) * per] for w in range(self.workers)]
        n_eval = min(len(valid) - 1, int(o[self.EVAL_OPTION]))
        rows = max(1, n_eval // o["seq_len"])
        v = valid[: rows * o["seq_len"] + 1]
        self.valid_x = v[:-1].reshape(rows, o["seq_len"])
        self.valid_y = v[1:].reshape(rows, o["seq_len"])
        starts = np.random.default_rng([self.seed, self.PROBE_SALT]).integers(0, len(train) - span, size=8)
        self.probe = torch.stack([train[s:s + span] for s in starts])

    def make_model(self) -> nn.Module:
        o = self.options
        return LSTMLM(self.vocab_size(), o["embed"], o["hidden"], o["layers"])

    def batch(self, worker: int, step: int):
        span = self.options["seq_len"] + 1
        chunk = self.chunks[worker]
        rng = np.random.default_rng([self.seed, worker, step, self.BATCH_SALT])
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
            for i in range(0, len(valid_x), self.EVAL_BATCH):
                logits = model(valid_x[i:i + self.EVAL_BATCH])
                y = valid_y[i:i + self.EVAL_BATCH]
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
                count += y.numel()
        model.train(was)
        ce = total / count
        return {"perplexity": math.exp(min(ce, 700.0)), "valid_loss": ce}
