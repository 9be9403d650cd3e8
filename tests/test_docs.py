"""The user's documentation cannot drift from the code: the API reference is what the docstrings say."""

from __future__ import annotations

import re
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
             for m in re.finditer(r"\b(issues?|stops?) \d+\b", p.read_text())]
    assert not found, found


# ---------------------------------------------------------------- reports that cannot drift from their code
MADE = re.compile(r"^Made by commit `([0-9a-f]{7,40})` from: (.+)$", re.M)
REPORTS = ("docs/results.md", "docs/reproductions.md")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every ``## `` section of a report."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return [(p.split("\n", 1)[0].strip(), p.split("\n", 1)[1] if "\n" in p else "") for p in parts]


def drifted(text: str, repo: Path) -> list[str]:
    """The sections of a report that do not say which commit made them, or whose code differs from that commit's
    (a path the section lists changed since) without "(stale)" in their heading."""
    found = []
    for heading, body in sections(text):
        m = MADE.search(body)
        if m is None:
            found.append(f"{heading}: no 'Made by commit ... from: ...' line")
            continue
        if "(stale)" in heading:
            continue
        commit, paths = m.group(1), [p.strip(" `") for p in m.group(2).split(",") if p.strip(" `")]
        diff = subprocess.run(["git", "diff", "--name-only", commit, "HEAD", "--", *paths], cwd=repo,
                              capture_output=True, text=True)
        if diff.returncode != 0:
            found.append(f"{heading}: commit {commit} is not in this history")
        elif diff.stdout.strip():
            changed = diff.stdout.split()
            found.append(f"{heading}: its code changed since {commit} ({', '.join(changed[:3])}"
                         f"{', ...' if len(changed) > 3 else ''}): rerun it, or mark the heading (stale)")
    return found


def test_every_report_section_names_its_commit_and_is_not_older_than_its_code():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone has no history to compare the sections' commits with")
    problems = [f"{doc}: {p}" for doc in REPORTS for p in drifted((ROOT / doc).read_text(), ROOT)]
    assert not problems, "\n".join(problems)


def test_the_drift_check_fails_on_a_section_whose_code_changed(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    git("add", ".")
    git("commit", "-qm", "code")
    made = git("rev-parse", "HEAD")
    report = (f"## A\n\nMade by commit `{made}` from: code.py\n\n| a |\n\n"
              f"## B\n\nMade by commit `{made}` from: other.py\n\n## C\n\nno line\n")
    assert drifted(report, tmp_path) == ["C: no 'Made by commit ... from: ...' line"]
    (tmp_path / "code.py").write_text("x = 2\n")
    git("commit", "-qam", "change")
    got = drifted(report, tmp_path)
    assert len(got) == 2 and got[0].startswith("A: its code changed since") and "(code.py)" in got[0]
    assert drifted(report.replace("## A", "## A (stale)"), tmp_path) == got[1:]


def test_a_spliced_compare_keeps_the_note_on_a_run_whose_optimizer_differs(tmp_path):
    """results.md's compare sections are spliced from compare's report.md: every paragraph before the table travels
    (section 1 once said "optimizer momentum" for every row while rTop-k had stepped with plain SGD)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_results", ROOT / "benchmarks" / "make_results.py")
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    report = tmp_path / "report.md"
    report.write_text("# t\n\nTask `x`, optimizer momentum (lr 0.05).\n\nOptimizer where a run's differs: `rtopk` sgd "
                      "(lr 0.5) -- why.\n\n| compressor | final |\n|---|---|\n| `dense` | 0.9 |\n\nlater text\n")
    lines = mr.paragraphs_before_table(report) + mr.table_lines(report)
    text = "\n".join(lines)
    assert "optimizer momentum" in text and "`rtopk` sgd (lr 0.5)" in text and "later text" not in text
    assert text.index("`rtopk` sgd") < text.index("| compressor |")


def test_a_new_experiment_is_spliced_in_where_reproduces_order_puts_it():
    """A partial rerun that holds an experiment docs/reproductions.md lacks (rtopk-lstm once): its summary row, its
    section and its time go in before the next experiment's, and the splice then fills them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_results", ROOT / "benchmarks" / "make_results.py")
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    doc = ("| experiment | claim | result | verdict |\n|---|---|---|---|\n| [rtopk](#rtopk) | a | b | **not** |\n"
           "| [gsb](#gsb) | a | b | **partly** |\n\nTime per experiment: rtopk 10 s, gsb 20 s.\n\n"
           '<a id="rtopk"></a>\n\n## rtopk\n\n<a id="gsb"></a>\n\n## gsb\n')
    new = ('| [rtopk-lstm](#rtopk-lstm) | c | d | **partly** |\n\nTime per experiment: rtopk-lstm 30 s.\n\n'
           '<a id="rtopk-lstm"></a>\n\n## rtopk-lstm body\n')
    out = mr.insert_section(doc, "rtopk-lstm", "", new)
    lines = out.splitlines()
    assert lines.index("| [rtopk-lstm](#rtopk-lstm) | c | d | **partly** |") == lines.index("| [gsb](#gsb) | a | b | "
                                                                                         "**partly** |") - 1
    assert out.index('<a id="rtopk"></a>') < out.index('<a id="rtopk-lstm"></a>') < out.index('<a id="gsb"></a>')
    assert "gsb 20 s, rtopk-lstm 0 s." in out


def test_the_readme_first_screen_holds_the_picture_the_two_commands_and_the_two_lines():
    """What a reader sees first: a picture that exists, ``make demo`` and ``make test``, the two lines a DDP script
    adds, and every number there linked to the table it comes from."""
    head = (ROOT / "README.md").read_text().splitlines()[:40]
    text = "\n".join(head)
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert pictures and all((ROOT / p).is_file() for p in pictures), pictures
    assert re.search(r"^make demo\b", text, re.M) and re.search(r"^make test\b", text, re.M)
    assert "import gradsift.ddp" in text and "gradsift.ddp.register(" in text
    for line in head:
        if re.search(r"\d+(\.\d+)? s\b", line) and not line.startswith(("make", "![")):
            paragraph = text[text.index(line):].split("\n\n")[0]
            assert "](docs/results.md#" in paragraph, line
