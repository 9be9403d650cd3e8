"""The Hugging Face Trainer with gradsift: a tiny GPT-2 built from a config in code (nothing downloaded), trained
on CPU by 2 processes. The two lines to add are marked.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out runs/hf

Writes DIR/metrics.jsonl (one line per optimizer step: density, bytes, wire bytes, ...). With ``--save-steps N``
every ``DIR/trainer/checkpoint-N/`` holds each rank's gradsift state too, and ``--resume`` continues from the last
checkpoint with the error-feedback memory it had. Needs ``pip install 'gradsift[hf]'``.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradsift.ddp import finish
from gradsift.integrations.transformers import compress  # (1) import
from gradsift.errors import ConfigError


class Patterns(torch.utils.data.Dataset):
    """Token sequences from a fixed random Markov chain over 64 tokens: something to learn, made in code."""

    def __init__(self, n: int, length: int = 32, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        nxt = torch.randint(vocab, (vocab, 2), generator=g)  # each token is followed by one of two tokens
        seqs = torch.empty(n, length, dtype=torch.long)
        seqs[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(1, length):
            pick = torch.randint(2, (n,), generator=g)
            seqs[:, t] = nxt[seqs[:, t - 1], pick]
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seqs[i], "labels": self.seqs[i]}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="output folder (metrics.jsonl, the Trainer's files)")
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N optimizer steps")
    ap.add_argument("--resume", action="store_true", help="resume from the last checkpoint in DIR/trainer")
    return ap.parse_args(argv)


def build(args: argparse.Namespace, trainer_class=Trainer, **options):
    """The Trainer and gradsift's callback (``options`` to :func:`compress`)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                              bos_token_id=0, eos_token_id=0))
    targs = TrainingArguments(output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=8,
                              gradient_accumulation_steps=args.accumulate, learning_rate=3e-3, logging_steps=10,
                              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                              report_to=[], use_cpu=True, ddp_backend="gloo",
                              disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_find_unused_parameters=False)
    trainer = trainer_class(model=model, args=targs, train_dataset=Patterns(2048))
    cb = compress(trainer, args.compressor, ratio=args.ratio, metrics_path=out / "metrics.jsonl",  # (2) compress
                  **options)
    return trainer, cb


def main() -> int:
    args = parse_args()
    trainer, cb = build(args)
    trainer.train(resume_from_checkpoint=args.resume or None)
    if cb.state.rank == 0:
        t = cb.state.totals
        print(f"gradsift: {t['steps']} steps, {t['compression']:.1f}x fewer payload bytes and "
              f"{t['wire_compression']:.1f}x fewer wire bytes than dense all-reduce")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except ConfigError as e:  # a configuration gradsift cannot run (one process, ...): one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        code = 2
    finish(code)
