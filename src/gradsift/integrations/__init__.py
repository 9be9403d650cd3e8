"""Integrations with the training tools people already use (optional dependencies; the core never imports them)."""
