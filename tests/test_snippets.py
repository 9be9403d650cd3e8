"""Every code block in README.md and docs/ runs as written, or is the part of a tested script it says it is.

Each ```python or ```bash block is preceded by an HTML comment that says how it is checked:

* ``<!-- snippet: runs -->``: a complete program, run with this environment's python in a fresh folder;
* ``<!-- snippet: excerpt of PATH -->``: lines of the script at PATH, in order (a line ``...`` stands for lines
  left out), compared line by line without indentation; PATH is an example that a test runs
  (:data:`RUN_BY`, checked here);
* ``<!-- snippet: commands -->``: shell lines. ``gradsift ...`` (also behind ``torchrun ... -m``) is parsed by
  gradsift's own command line, its compressor specs built and its task looked up; ``make T`` must be a Makefile
  target; ``pip install`` of gradsift names extras pyproject.toml has; a line with ``...`` in it is a pattern, not
  a command, and is skipped.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- snippet: (?P<how>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
RUN_BY = {  # the examples the docs quote, and the test that runs each
    "examples/ddp_train.py": "tests/test_launch.py::test_plain_pytorch_example_runs",
    "examples/fsdp_train.py": "tests/test_fsdp.py::test_fsdp_example_trains_and_resumes",
    "examples/hf_trainer.py": "tests/test_hf.py",
    "examples/accelerate_train.py": "tests/test_hf.py",
    "examples/lightning_ddp.py": "tests/test_integrations.py",
}


def blocks():
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group("lang") in ("python", "bash"):
                line = text[:m.start("body")].count("\n") + 1
                yield pytest.param(page, m.group("how"), m.group("lang"), m.group("body"),
                                   id=f"{page.relative_to(ROOT)}:{line}")


SNIPPETS = list(blocks())


def test_every_block_says_how_it_is_checked():
    unmarked = [p.id for p in SNIPPETS if p.values[1] is None]
    assert not unmarked, f"code blocks without a <!-- snippet: ... --> line before them: {unmarked}"
    assert len(SNIPPETS) >= 20


@pytest.mark.parametrize("page,how,lang,body", SNIPPETS)
def test_snippet(page, how, lang, body, tmp_path):
    if how is None:
        pytest.skip("unmarked (test_every_block_says_how_it_is_checked fails)")
    if how == "runs":
        assert lang == "python"
        script = tmp_path / "snippet.py"
        script.write_text(body)
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    elif how.startswith("excerpt of "):
        path = how.removeprefix("excerpt of ").strip()
        assert path in RUN_BY, f"{path} is not among the examples a test runs"
        assert_excerpt(body, (ROOT / path).read_text(), path)
    elif how == "commands":
        assert lang == "bash"
        for line in command_lines(body):
            check_command(line)
    else:
        raise AssertionError(f"unknown snippet kind {how!r}")


def test_the_quoted_examples_are_run_by_their_tests():
    for path, test in RUN_BY.items():
        file, _, name = test.partition("::")
        text = (ROOT / file).read_text()
        assert Path(path).name in text, f"{file} does not run {path}"
        if name:
            assert f"def {name}(" in text, test


def assert_excerpt(body: str, script: str, path: str) -> None:
    """The snippet's lines, stripped, appear in the script's in order: its first line anywhere, ``...`` skipping
    any lines, other lines following one another."""
    have = [l.strip() for l in script.splitlines() if l.strip()]
    want = [l.strip() for l in body.splitlines() if l.strip()]
    i, gap = 0, True
    for w in want:
        if w == "...":
            gap = True
            continue
        if gap:
            while i < len(have) and have[i] != w:
                i += 1
        assert i < len(have) and have[i] == w, f"{path} has no line {w!r} here (after line {i} of its non-blank lines)"
        i, gap = i + 1, False


def command_lines(body: str) -> list[str]:
    joined, cur = [], ""
    for raw in body.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        cur += line
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            joined.append(cur.strip())
        cur = ""
    return joined


def check_command(line: str) -> None:
    from gradsift.cli import build_parser
    from gradsift import make_compressor
    from gradsift.tasks import available_tasks

    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[:2] in (["make", "demo"], ["make", "test"], ["make", "wheel"]):
        assert re.search(rf"^{words[1]}:", (ROOT / "Makefile").read_text(), re.M), line
        return
    if words[:3] == ["python", "-m", "venv"]:
        return
    if words[:2] == ["pip", "install"]:
        target = words[2]
        if target.startswith("torch=="):
            assert target == "torch==" + torch_pin(), line
            return
        extras = re.findall(r"\[([^\]]+)\]", target)
        declared = (ROOT / "pyproject.toml").read_text()
        for extra in ",".join(extras).split(",") if extras else []:
            assert re.search(rf"^{extra}\s*=", declared, re.M), f"{line}: no extra {extra!r} in pyproject.toml"
        return
    if words[0] == "torchrun":
        assert "-m" in words and words[words.index("-m") + 1] == "gradsift", line
        words = ["gradsift", *words[words.index("-m") + 2:]]
    assert words[0] == "gradsift", f"a command this test does not know: {line}"
    argv = words[1:]
    if "..." in argv:  # a pattern ("torchrun ... -m gradsift train --runtime ddp ..."), not a command
        return
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"gradsift refuses {line!r}") from e
    specs = ([args.compressor] if getattr(args, "compressor", None) else []) + list(getattr(args, "compressors", None) or [])
    for spec in specs:
        if spec.split(":")[0] == "local":  # local SGD: its options checked, and the compressor of its syncs built
            from gradsift.runtime.localsgd import local_options

            spec = local_options(spec)["compressor"]
        make_compressor(spec, getattr(args, "ratio", None) or 0.01)
    if getattr(args, "task", None):
        assert args.task in available_tasks(), line


def torch_pin() -> str:
    m = re.search(r"torch==([\w.]+)", (ROOT / "Makefile").read_text())
    assert m, "the Makefile pins no torch"
    return m.group(1)
