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

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md")),
             *sorted((ROOT / "docs" / "results").glob("*.md"))]
    found = [f"{p.name}: {m.group(0)}" for p in pages if p.name != "architecture.md"
             for m in re.finditer(r"\b(issues?|stops?) \d+\b", p.read_text())]
    assert not found, found


# ---------------------------------------------------------------- reports that say when their numbers went stale
MADE = re.compile(r"^Made by commit `([0-9a-f]{7,40})` from: (.+)$", re.M)
FINGERPRINTS = re.compile(r"^Fingerprints \(`benchmarks/fingerprints.py`\): (.+)$", re.M)
PAIR = re.compile(r"`([\w-]+)` ([0-9a-f]{12}|unavailable)")
PAGES = "docs/results"  # one dated investigation a page; docs/results.md is their front page and index


def reports() -> list[str]:
    """The reports whose sections carry fingerprints: the reproductions and every dated investigation."""
    return ["docs/reproductions.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / PAGES).glob("*.md"))]


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every ``## `` section of a report; a page of one investigation (no ``## ``) is one
    section under its ``# `` title."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    if not parts and text.startswith("# "):
        parts = [text[2:]]
    return [(p.split("\n", 1)[0].strip(), p.split("\n", 1)[1] if "\n" in p else "") for p in parts]


def named_fingerprints(text: str) -> set[str]:
    return {n for m in FINGERPRINTS.finditer(text) for n, _ in PAIR.findall(m.group(1))}


def stale_by_fingerprint(text: str, current: dict[str, str]) -> list[str]:
    """The sections whose "(stale)" mark disagrees with their fingerprints: one whose runs compute something else
    today (a fingerprint in ``current`` differs from the one its numbers came with) must say "(stale)", one whose
    fingerprints all hold must not. Every section names its commit and its fingerprints."""
    found = []
    for heading, body in sections(text):
        if heading == "At a glance":  # (the front page: its numbers are the sections', checked below)
            continue
        if MADE.search(body) is None:
            found.append(f"{heading}: no 'Made by commit ... from: ...' line")
        m = FINGERPRINTS.search(body)
        pairs = PAIR.findall(m.group(1)) if m else []
        if not pairs:
            found.append(f"{heading}: no 'Fingerprints (`benchmarks/fingerprints.py`): `name` hash, ...' line")
            continue
        changed = [n for n, h in pairs if current.get(n) != h]
        if changed and "(stale)" not in heading:
            found.append(f"{heading}: what {', '.join(changed)} computes changed since its numbers were made: rerun "
                         "them (benchmarks/docs_numbers.sh) and take the fingerprints benchmarks/fingerprints.py "
                         "prints, or mark the heading (stale)")
        elif not changed and "(stale)" in heading:
            found.append(f"{heading}: marked (stale), but its fingerprints hold (its runs compute what they did): "
                         "take the mark off")
    return found


def front_page_problems(text: str, root: Path = ROOT) -> list[str]:
    """docs/results.md, the front page and index of the dated investigations, links its numbers to their pages: a
    link says "(stale)" exactly where the page it points to is marked so, and points to a page that exists; every
    page is in the index."""
    found, linked = [], set()
    for label, target in re.findall(r"\[([^\]]+)\]\((results/[\w.-]+\.md)\)", text):
        page = root / "docs" / target
        if not page.is_file():
            found.append(f"results.md: [{label}] points to no page ({target})")
            continue
        linked.add(page.name)
        title = page.read_text().split("\n", 1)[0]
        if ("(stale)" in label) != ("(stale)" in title):
            found.append(f"results.md: [{label}] must say (stale) exactly when '{title}' does")
    found += [f"results.md: the index does not link {p.name}" for p in sorted((root / PAGES).glob("*.md"))
              if p.name not in linked]
    return found


def current_fingerprints(names) -> dict[str, str]:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fingerprints.py"), *sorted(names)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split() for line in r.stdout.splitlines() if line.strip())


def test_a_report_section_is_stale_exactly_when_its_fingerprints_changed():
    """docs/results/*.md and docs/reproductions.md: the fingerprints of today's code (short runs of what each
    section measured, benchmarks/fingerprints.py) against the ones each section's numbers came with; and
    docs/results.md's links to them."""
    if not (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt").exists():
        pytest.skip("the language-model fingerprints need ../shared/data/tinyshakespeare.txt")
    texts = [(doc, (ROOT / doc).read_text()) for doc in reports()]
    current = current_fingerprints(set().union(*(named_fingerprints(t) for _, t in texts)))
    problems = [f"{doc}: {p}" for doc, t in texts for p in stale_by_fingerprint(t, current)]
    problems += front_page_problems((ROOT / "docs" / "results.md").read_text())
    assert not problems, "\n".join(problems)


def test_a_changed_fingerprint_marks_its_section_and_an_unchanged_one_does_not():
    """The rule above, on a made-up report: a section whose fingerprint changed must be marked, one whose
    fingerprints hold must not be; and the digest moves with what a run computes, not with its times."""
    import importlib.util

    line = "Made by commit `abc1234` from: x.py\n\nFingerprints (`benchmarks/fingerprints.py`): "
    report = (f"## A\n\n{line}`one` 111111111111\n\n## B\n\n{line}`one` 111111111111, `two` 222222222222\n\n"
              f"## C (stale)\n\n{line}`two` 222222222222\n\n## D (stale)\n\n{line}`one` 111111111111\n\n"
              "## E\n\nMade by commit `abc1234` from: x.py\n")
    now = {"one": "111111111111", "two": "333333333333"}
    got = stale_by_fingerprint(report, now)
    assert [g.split(":")[0] for g in got] == ["B", "D (stale)", "E"], got
    assert "what two computes changed" in got[0] and "take the mark off" in got[1] and "no 'Fingerprints" in got[2]
    assert stale_by_fingerprint(report.replace("## B", "## B (stale)").replace("## D (stale)", "## D"), now) == got[2:]

    spec = importlib.util.spec_from_file_location("fingerprints", ROOT / "benchmarks" / "fingerprints.py")
    fp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp)
    rows = [{"file": "a", "step": 1, "loss": 2.3456789, "select_s": 0.1, "bytes_per_worker": 300.0}]
    same = [{**rows[0], "select_s": 0.7, "compute_s": 0.2, "new_field": 1}]  # times and new fields: the same
    other = [{**rows[0], "loss": 2.345689}]  # a loss that moved in its 6th digit
    assert fp.digest(rows) == fp.digest(same) != fp.digest(other)
    assert fp.digest(rows) != fp.digest([{**rows[0], "bytes_per_worker": 301.0}])


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
            assert "](docs/results/" in paragraph, line


def test_the_front_page_check_finds_a_wrong_mark_a_missing_page_and_an_unlisted_one(tmp_path):
    pages = tmp_path / "docs" / "results"
    pages.mkdir(parents=True)
    (pages / "2026-01-01-a.md").write_text("# 1. A (stale)\n\nbody\n")
    (pages / "2026-01-02-b.md").write_text("# 2. B\n\nbody\n")
    (pages / "2026-01-03-c.md").write_text("# 3. C\n\nbody\n")
    text = ("[1. A](results/2026-01-01-a.md), [2. B](results/2026-01-02-b.md), [9. Z](results/2026-01-09-z.md)\n"
            "| 2026-01-01 | [1. A (stale)](results/2026-01-01-a.md) |\n")
    got = front_page_problems(text, tmp_path)
    assert len(got) == 3, got
    assert "must say (stale) exactly when '# 1. A (stale)'" in got[0] and "points to no page" in got[1]
    assert "does not link 2026-01-03-c.md" in got[2]
