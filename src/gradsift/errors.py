"""Errors every layer may raise; each message is one line naming what was wrong and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad run setting; the message is one line naming what is allowed."""
