"""Errors every layer may raise; each message is one line naming what was wrong and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad run setting; the message is one line naming what is allowed."""


class OptionError(ValueError):
    """A bad specification or option of a method, memory or setting; the message is one line."""
