"""Assemble the investigations under docs/results/ (and docs/reproductions.md) from the outputs of
benchmarks/docs_numbers.sh. Each investigation has a page of its own, ``docs/results/<date>-<slug>.md`` titled
``# N. ...``; docs/results.md is their front page and index (written by hand: its links name the pages).

    bash benchmarks/docs_numbers.sh          # the measurements (about two hours on 2 cores)
    .venv/bin/python benchmarks/make_results.py
    .venv/bin/python benchmarks/make_results.py --reproductions   # only docs/reproductions.md
    .venv/bin/python benchmarks/make_results.py --splice DIR      # a partial rerun's sections into it
    .venv/bin/python benchmarks/make_results.py --splice-results LAGS_DIR NOTE...  # investigations 1 and 3, rerun

Every table is copied from a file a gradsift command wrote; plots are copied to docs/img/.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "docs"
DOCS = ROOT / "docs"
IMG = DOCS / "img"


def page_of(num: int) -> Path:
    """The page of investigation ``num`` (``docs/results/<date>-<slug>.md``, titled ``# num. ...``)."""
    for page in sorted((DOCS / "results").glob("*.md")):
        if page.read_text().startswith(f"# {num}. "):
            return page
    sys.exit(f"no page of investigation {num} under {DOCS / 'results'}: make one (docs/results.md indexes it)")


def write_section(num: int, title: str, body: list[str]) -> Path:
    """Investigation ``num``'s page anew: its title and body (links and pictures written relative to docs/, as the
    sections are assembled, moved one folder down), its line back to the front page kept."""
    page = page_of(num)
    back = page.read_text().split("\n")[2]  # "[All results](../results.md) -- date"
    text = "\n".join(body)
    text = re.sub(r"\]\((?![a-z]+:|#|\.\./)([^)\s]+)\)", r"](../\1)", text)
    page.write_text(f"# {num}. {title}\n\n{back}\n\n{text.strip()}\n")
    return page


def write_sections(text: str) -> None:
    """Every ``## N. title`` section of ``text`` onto its page."""
    parts = re.split(r"^## (\d+)\. (.*)$", text, flags=re.M)
    for num, title, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        write_section(int(num), title.strip(), body.strip("\n").split("\n"))


def table_lines(report: Path) -> list[str]:
    """The first markdown table of a compare report."""
    lines = report.read_text().splitlines()
    out, inside = [], False
    for l in lines:
        if l.startswith("|"):
            inside = True
            out.append(l)
        elif inside:
            break
    return out


def paragraphs_before_table(report: Path) -> list[str]:
    """Every paragraph of a compare report between its title and its first table (the configuration, and the
    note naming a run whose optimizer differs: a splice that kept only the first dropped it), each followed by a
    blank line."""
    out: list[str] = []
    for l in report.read_text().splitlines()[1:]:
        if l.startswith("|"):
            break
        if l.strip():
            out += [l.strip(), ""]
    return out


def copy_img(src: Path, name: str) -> str:
    IMG.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, IMG / name)
    return f"img/{name}"


def bench_section(d: Path, title: str, img: str) -> list[str]:
    recs = json.loads((d / "bench.json").read_text())
    out = [f"### {title}", "", "Median of 10 calls after 2 warm-up calls, in one process. Cells: time / "
           "`torch.topk` on |x| (below 1 = faster than exact top-k) · time / one read pass "
           "(`torch.linalg.vector_norm(x, 1)`) · achieved/target count over the second half of the calls.", ""]
    sizes = sorted({r["size"] for r in recs})
    ratios = sorted({r["ratio"] for r in recs}, reverse=True)
    specs = list(dict.fromkeys(r["compressor"] for r in recs))
    header = "| compressor | " + " | ".join(f"{s:,} @ {r}" for s in sizes for r in ratios) + " |"
    out += [header, "|---|" + "---|" * (len(sizes) * len(ratios))]
    idx = {(r["compressor"], r["size"], r["ratio"]): r for r in recs}
    for spec in specs:
        cells = []
        for s in sizes:
            for r in ratios:
                x = idx.get((spec, s, r))
                cells.append(f"{x['median_s'] / x['topk_median_s']:.2f} · {x['median_s'] / x['read_pass_s']:.1f} · "
                             f"{x['k_ratio']:.2f}" if x else "-")
        out.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    topk = [f"{s:,} @ {r}: {idx[(specs[0], s, r)]['topk_median_s'] / idx[(specs[0], s, r)]['read_pass_s']:.0f}"
            for s in sizes for r in ratios if (specs[0], s, r) in idx]
    out += ["", "`torch.topk` itself costs (read passes): " + ", ".join(topk) + ".", "",
            f"![{title}]({copy_img(d / 'bench.png', img)})", ""]
    return out


def compare_section(d: Path, title: str, img: str, command: str) -> list[str]:
    rep = d / "report.md"
    return [f"### {title}", "", f"`{command}`", ""] + paragraphs_before_table(rep) + table_lines(rep) + [
        "", f"![{title}]({copy_img(d / 'curves.png', img)})", ""]


def write_reproductions(rep: Path) -> None:
    """docs/reproductions.md from ``rep``/REPORT.md, with its images copied to docs/reproductions/."""
    if (rep / "REPORT.md").exists():
        target = DOCS / "reproductions"
        if target.exists():
            shutil.rmtree(target)
        for png in rep.rglob("*.png"):
            rel = png.relative_to(rep)
            if "runs" in rel.parts:  # per-run plots stay in runs/
                continue
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(png, dest)
        text = (rep / "REPORT.md").read_text()
        for name in {p.parts[0] for p in (x.relative_to(rep) for x in rep.rglob("*.png"))}:
            text = text.replace(f"]({name}/", f"](reproductions/{name}/")
        text = re.sub(r"^(Made by .*)\.$", r"\1 (`benchmarks/docs_numbers.sh`); images in `docs/reproductions/`.",
                      text, count=1, flags=re.M)
        if rep.name == "reproduce-quick":
            text = text.replace("These are the **quick** (CI-sized) versions: verdicts speak only for that size.",
                                "These are the **quick** (CI-sized) versions: verdicts speak only for that size. The "
                                "full-size report (`gradsift reproduce all`, about an hour on these 2 cores, run alone) has not "
                                "been run yet.")
        (DOCS / "reproductions.md").write_text(text)


def section_1() -> list[str]:
    """Section 1's body: the two issue-3 compares (runs/docs/issue3-RATIO)."""
    lines = []
    for ratio in ("0.01", "0.001"):
        d = RUNS / f"issue3-{ratio}"
        if (d / "report.md").exists():
            lines += compare_section(d, f"mnist1d-cnn, 8 workers, ratio {ratio}", f"issue3-{ratio}.png",
                                     f"gradsift compare --task mnist1d-cnn --workers 8 --ratio {ratio} --compressors "
                                     "dense topk randomk rtopk regtopk gs rsb gsb")
    return lines


def section_3(lags_dir: Path) -> list[str]:
    """Section 3's body: the tables of a `gradsift reproduce lags` section, its figure and its verdict text."""
    lags_sec = lags_dir / "section.md"
    if not lags_sec.exists():
        return []
    text = lags_sec.read_text()
    conf = [l for l in text.splitlines() if l.startswith("**Our configuration.**")]
    verdict = [l for l in text.splitlines() if l.startswith("**Verdict:")]
    blocks, cur = [], []
    for l in text.splitlines():  # each table apart (a blank line between them renders them as tables)
        if l.startswith("|"):
            cur.append(l)
        elif cur:
            blocks += cur + [""]
            cur = []
    blocks += cur
    return ["From `gradsift reproduce lags` (simulated: 8 workers; measured: 4 gloo processes under torchrun "
            "on this machine's loopback, the same model):", ""] + conf + [""] + blocks + [
        "", f"![delta and accuracy]({copy_img(lags_dir / 'lags.png', 'lags.png')})", "",
        "The left panel is eq. (21)'s delta^(l) per layer over training (Assumption 1 holds below 1).", ""] + (
        verdict + [""])


def splice_results(lags_dir: Path, note: str) -> None:
    """Investigations 1 and 3 anew (the compares in runs/docs, the LAGS section of ``lags_dir``) on their pages;
    ``note`` says when and on what they were measured."""
    for num, body in ((1, section_1()), (3, section_3(lags_dir))):
        if not body:
            sys.exit(f"investigation {num}: its runs are missing (runs/docs/issue3-*, {lags_dir}/section.md)")
        title = page_of(num).read_text().split("\n", 1)[0].split(". ", 1)[1]
        write_section(num, title, [note, ""] + body)


def main() -> None:
    if not RUNS.exists():
        sys.exit(f"{RUNS} is missing: run benchmarks/docs_numbers.sh first")
    lines = [
        "# Results",
        "",
        "Every number here comes from a gradsift command; `benchmarks/docs_numbers.sh` runs them all and",
        "`benchmarks/make_results.py` copies their tables here. Machine: "
        f"{platform.processor() or platform.machine()}, 2 cores, CPU only, torch {torch.__version__}, "
        f"Python {platform.python_version()}. Speeds are ratios taken in one process; times in compares are "
        "measured compute and selection plus the alpha-beta network model (stated with each table).",
        "",
        "## 1. REGTOP-k, rTop-k and gradient sampling on MNIST-1D (issue 3)",
        "",
    ]
    lines += section_1()
    lines += ["## 2. Selection speed and threshold quality (issues 4 and 14)", "",
              "`gradsift bench select --compressors topk sidco sidco:dist=gp sidco:dist=gamma dgc --sizes 26214400 "
              "--ratios 0.1 0.01 0.001 --dist DIST --calls 5 --threads 2` per distribution (real gradients: "
              "worker 0's whole-model gradients dumped by `gradsift train ... --dump-grads`, tiled to 26M). Ratios "
              "are taken call by call in one process, in rounds; [min, max] over rounds.", ""]
    for dist, title in (("gaussian", "Gaussian"), ("laplace", "Laplace"), ("student-t", "Student-t (3 dof)"),
                        ("charlm-grads", "charlm whole-model gradients (877k parameters)"),
                        ("wordlm-grads", "wordlm whole-model gradients (5.5M parameters, 43% exact zeros)")):
        d = RUNS / f"select-{dist}"
        if (d / "bench.md").exists():
            lines += [f"### {title}", ""] + table_lines(d / "bench.md") + [""]
    for d, title, img, cmd in (
            (RUNS / "issue4-mnist1d", "Threshold methods on mnist1d-cnn", "issue4-mnist1d.png",
             "gradsift compare --task mnist1d-cnn --workers 8 --ratio 0.01 --bandwidth-gbps 1 --compressors dense "
             "topk sidco sidco:dist=gp sidco:dist=gamma dgc redsync gaussiank"),
            (RUNS / "issue4-charlm", "Threshold methods on charlm", "issue4-charlm.png",
             "gradsift compare --task charlm --data ../shared/data/tinyshakespeare.txt --workers 4 --ratio 0.01 "
             "--steps 120 --bandwidth-gbps 1 --compressors dense topk sidco sidco:dist=gp sidco:dist=gamma dgc "
             "redsync gaussiank")):
        if (d / "report.md").exists():
            lines += compare_section(d, title, img, cmd)
    # the full report if it was made, else the CI-sized one (docs_numbers.sh says which ran)
    rep = RUNS / "reproduce"
    if not (rep / "REPORT.md").exists():
        rep = RUNS / "reproduce-quick"
    lines += ["## 3. Real processes: dense, SLGS and LAGS (issue 5)", ""] + section_3(rep / "lags")
    cl = RUNS / "cluster" / "cluster.md"
    lines += ["## 4. Shaped links: against PyTorch's own hooks, time to target, faults (issues 7 and 13)", "",
              "`gradsift cluster bench --out runs/docs/cluster --data ../shared/data/tinyshakespeare.txt` (wordlm, "
              "5.5M parameters, and charlm, 877k; one thread per rank; clusters of 2 and 4 namespace hosts at "
              "100 Mbit/s and 1 Gbit/s).", ""]
    if cl.exists():
        body = cl.read_text().splitlines()[1:]
        for png in ("throughput.png", "quality-vs-time.png"):
            if (RUNS / "cluster" / png).exists():
                body = [l.replace(f"]({png})", f"]({copy_img(RUNS / 'cluster' / png, 'cluster-' + png)})")
                        for l in body]
        lines += body
    write_sections("\n".join(lines) + "\n")
    write_reproductions(rep)
    print("wrote investigations 1-4 under", DOCS / "results", "and", DOCS / "reproductions.md")


def insert_section(doc: str, name: str, sec: str, new: str) -> str:
    """``doc`` with experiment ``name``'s section, summary row and time added (empty placeholders the splice then
    fills), before the first experiment that follows it in ``gradsift reproduce``'s order, else at the end."""
    from gradsift.experiments.reproduce import EXPERIMENTS

    order = list(EXPERIMENTS)
    later = [e for e in order[order.index(name) + 1:] if f'<a id="{e}"></a>' in doc]
    anchor = f'<a id="{later[0]}"></a>' if later else None
    doc = doc.replace(anchor, f'<a id="{name}"></a>\n\n' + anchor, 1) if anchor else \
        doc.rstrip("\n") + f'\n\n<a id="{name}"></a>\n'
    row = re.search(rf"^\| \[{re.escape(name)}\]\(#{re.escape(name)}\).*$", new, flags=re.M).group(0)
    nxt = re.search(rf"^\| \[{re.escape(later[0])}\]\(#.*$", doc, flags=re.M) if later else None
    if nxt:
        doc = doc[:nxt.start()] + row + "\n" + doc[nxt.start():]
    took = re.search(rf"\b{re.escape(name)} (\d+) s\b", new)
    if took:
        doc = re.sub(r"^(Time per experiment: .*)\.$", lambda m: f"{m.group(1)}, {name} 0 s.", doc, count=1,
                     flags=re.M)
    return doc


def splice_reproductions(rep: Path) -> list[str]:
    """Replace, in docs/reproductions.md, the sections (their summary row, their time, their images) of the
    experiments rerun into ``rep`` -- a partial rerun -- keeping the others; returns the experiments spliced."""
    new = (rep / "REPORT.md").read_text()
    doc = (DOCS / "reproductions.md").read_text()
    names = [m for m in re.findall(r'^<a id="([^"]+)"></a>', new, flags=re.M)]
    for name in names:
        sec = re.search(rf'^<a id="{re.escape(name)}"></a>\n.*?(?=^<a id=|\Z)', new, flags=re.M | re.S).group(0)
        sec = sec.replace(f"]({name}/", f"](reproductions/{name}/")
        if f'<a id="{name}"></a>' not in doc:  # a new experiment: its section, row and time where its order puts them
            doc = insert_section(doc, name, sec, new)
        doc = re.sub(rf'^<a id="{re.escape(name)}"></a>\n.*?(?=^<a id=|\Z)', lambda _: sec, doc, count=1,
                     flags=re.M | re.S)
        row = re.search(rf"^\| \[{re.escape(name)}\]\(#{re.escape(name)}\).*$", new, flags=re.M).group(0)
        doc = re.sub(rf"^\| \[{re.escape(name)}\]\(#{re.escape(name)}\).*$", lambda _: row, doc, count=1,
                     flags=re.M)
        took = re.search(rf"\b{re.escape(name)} (\d+) s\b", new)
        if took:
            doc = re.sub(rf"\b{re.escape(name)} \d+ s\b", f"{name} {took.group(1)} s", doc, count=1)
        target = DOCS / "reproductions" / name
        if target.exists():
            shutil.rmtree(target)
        for png in (rep / name).rglob("*.png"):
            rel = png.relative_to(rep / name)
            if "runs" in rel.parts:  # per-run plots stay in runs/
                continue
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(png, target / rel)
    (DOCS / "reproductions.md").write_text(doc)
    return names


if __name__ == "__main__":
    if sys.argv[1:] == ["--reproductions"]:  # only docs/reproductions.md, from runs/docs/reproduce
        write_reproductions(RUNS / "reproduce")
        print("wrote", DOCS / "reproductions.md")
    elif sys.argv[1:2] == ["--splice-results"]:  # investigations 1 and 3, rerun
        splice_results(Path(sys.argv[2]), " ".join(sys.argv[3:]))
        print("wrote investigations 1 and 3 under", DOCS / "results")
    elif sys.argv[1:2] == ["--splice"]:  # a partial rerun's sections into docs/reproductions.md
        print("spliced", ", ".join(splice_reproductions(Path(sys.argv[2]))), "into", DOCS / "reproductions.md")
    else:
        main()
