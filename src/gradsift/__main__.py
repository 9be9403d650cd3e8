"""``python -m gradsift`` (and ``torchrun -m gradsift``): the command line."""

from .cli import console

console()
