"""The user's documentation cannot drift from the code: the API reference is what the docstrings say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_reference_is_what_the_docstrings_say():
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_api.py"), "--check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_the_docs_speak_the_users_words():
    """No issue or stop numbers in the pages a user reads (the project's own bookkeeping)."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md"))]
    found = [f"{p.name}: {m.group(0)}" for p in pages if p.name != "architecture.md"
             for m in re.finditer(r"\b(issue|stop) \d+\b", p.read_text())]
    assert not found, found
