"""``python -m gradsift.cli``."""

import sys

from . import main

sys.exit(main())
