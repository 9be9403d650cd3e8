"""What gradsift tells the user, through the standard library's logging: one logger, ``logging.getLogger("gradsift")``.

By default it writes each message as it is (one line that begins "gradsift: ") to the standard error stream of the
moment, from INFO up, and does not pass it on to the root logger: a script that sets up no logging sees them as
printed lines. To keep only problems, send them to the application's own handlers, or silence them::

    logging.getLogger("gradsift").setLevel(logging.WARNING)       # notices off, problems on
    logging.getLogger("gradsift").propagate = True                 # also to the application's handlers ...
    logging.getLogger("gradsift").handlers.clear()                 # ... and only there

A message meant once for the job is said by rank 0 (its callers check); one about a rank, by that rank.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("gradsift")


class _Stderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a message comes (a test, a notebook or a
    launcher may have replaced it since the handler was made)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


if not LOGGER.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def say(message: str) -> None:
    """A notice (INFO): what gradsift did on the user's behalf (a momentum taken over, a route changed)."""
    LOGGER.info(message)


def warn(message: str) -> None:
    """A problem the run goes on with (WARNING): a step or a sync skipped, a checkpoint without gradsift's state."""
    LOGGER.warning(message)
