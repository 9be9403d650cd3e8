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
import re

import torch

from .base import TaskError
from .textlm import TextLM

TOKEN = re.compile(r"[A-Za-z']+|[.,!?;:]")


@functools.lru_cache(maxsize=4)
def _tokens(text: str) -> tuple[str, ...]:
    return tuple(TOKEN.findall(text))


class WordLM(TextLM):
    name = "wordlm"
    defaults = {"lr": 5.0, "batch_size": 10, "steps": 300, "optimizer": "sgd", "eval_every": 50, "clip_norm": 0.25}
    OPTIONS = {"vocab": 12000, "seq_len": 35, "embed": 200, "hidden": 200, "layers": 2, "valid_fraction": 0.1,
               "eval_tokens": 8192}
    SUMMARY = "word-level 2-layer LSTM LM, 12k-word vocabulary, ~5.5M parameters (--data PATH); metric perplexity"
    PROBE_SALT, BATCH_SALT, EVAL_BATCH, EVAL_OPTION = 4242, 23, 32, "eval_tokens"
    INTEGER_OPTIONS = ("vocab", "seq_len", "embed", "hidden", "layers")

    def encode(self, text: str) -> tuple[torch.Tensor, int]:
        o = self.options
        if o["vocab"] < 2:
            raise TaskError("wordlm: vocab must be at least 2")
        tokens = _tokens(text)
        span = o["seq_len"] + 1
        n_valid = max(int(len(tokens) * float(o["valid_fraction"])), span)
        if len(tokens) - n_valid < 2 * span:
            raise TaskError(f"wordlm: {self.data_path!r} holds too few words ({len(tokens)})")
        counts = collections.Counter(tokens[:-n_valid])
        self.words = ["<unk>"] + [word for word, _ in counts.most_common(o["vocab"] - 1)]
        lut = {word: i for i, word in enumerate(self.words)}
        return torch.tensor([lut.get(word, 0) for word in tokens], dtype=torch.long), n_valid

    def vocab_size(self) -> int:
        return len(self.words)
