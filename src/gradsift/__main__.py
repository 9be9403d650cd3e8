"""``python -m gradsift`` (and ``torchrun -m gradsift``): the command line."""

import sys

from .cli import main

sys.exit(main())
