"""gradsift's import graph, read from the source (imports inside functions included).

Run as a script (``python3 tests/import_graph.py``) it prints every import cycle,
every import of a gradsift module that does not exist, and every source file
over the line limit, and exits 1 if there is any; ``test_architecture.py`` runs
the same checks and the layering rules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "gradsift"
MAX_LINES = 400


def module_files(src: Path = SRC) -> dict[str, Path]:
    """``{"gradsift.runtime.road": path, "gradsift.ddp": path/__init__.py, ...}``."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every gradsift module each module imports (edges of the graph), anywhere in its body."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    graph[mod].add(t)
    return graph


def missing(graph: dict[str, set[str]], modules: dict[str, Path]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() for t in ts if t not in modules)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or not."""
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def long_files(modules: dict[str, Path], limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return [(str(p.relative_to(SRC.parent)), n) for p in modules.values()
            if (n := len(p.read_text().splitlines())) > limit]


def main() -> int:
    modules = module_files()
    graph = imports(modules)
    bad = 0
    for c in cycles(graph):
        print("import cycle:", " <-> ".join(c))
        bad += 1
    for m, t in missing(graph, modules):
        print(f"{m} imports {t}, which does not exist")
        bad += 1
    for path, n in long_files(modules):
        print(f"{path}: {n} lines (limit {MAX_LINES})")
        bad += 1
    print(f"{len(modules)} modules, {sum(len(v) for v in graph.values())} imports between them: "
          + ("no cycle, nothing missing, no file over the limit" if not bad else f"{bad} problem(s)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
