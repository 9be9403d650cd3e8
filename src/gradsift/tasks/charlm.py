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

import torch

from .base import TaskError
from .textlm import TextLM


class CharLM(TextLM):
    name = "charlm"
    defaults = {"lr": 1.0, "batch_size": 16, "steps": 300, "optimizer": "sgd", "eval_every": 50}
    OPTIONS = {"seq_len": 64, "embed": 64, "hidden": 256, "layers": 2, "valid_fraction": 0.1,
               "eval_chars": 16384, "max_chars": 0}
    SUMMARY = "2-layer LSTM character LM on a text file (--data PATH); metric perplexity on a held-out tail"
    PROBE_SALT, BATCH_SALT, EVAL_BATCH, EVAL_OPTION = 31337, 17, 64, "eval_chars"

    def encode(self, text: str) -> tuple[torch.Tensor, int]:
        o = self.options
        if o["max_chars"]:
            text = text[: int(o["max_chars"])]
        chars = sorted(set(text))
        if len(chars) < 2:
            raise TaskError("charlm: the text needs at least 2 distinct characters")
        self.vocab = chars
        lut = {ch: i for i, ch in enumerate(chars)}
        ids = torch.tensor([lut[ch] for ch in text], dtype=torch.long)
        return ids, max(int(len(ids) * float(o["valid_fraction"])), o["seq_len"] + 1)

    def vocab_size(self) -> int:
        return len(self.vocab)
