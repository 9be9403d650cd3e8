"""Dependencies point one way: no cycles, the layers docs/architecture.md draws, one rank for every runtime, one
owner for every route decision, no module reading another's private attributes, files one can hold."""

from __future__ import annotations

import ast

import import_graph as ig

MODULES = ig.module_files()
GRAPH = ig.imports(MODULES)
# every module of the package in exactly one layer, bottom to top, as docs/architecture.md draws them: a module
# imports only from its own layer or the ones below
LAYERS = {
    "workloads": ["gradsift.tasks"],  # the models and data the simulator and the tools train: no gradsift inside
    "payload": ["gradsift.payload", "gradsift.errors", "gradsift.messages", "gradsift.options"],
    "selection": ["gradsift.compressors", "gradsift.kernels"],
    "memory": ["gradsift.memory"],
    "route": ["gradsift.route", "gradsift.transport"],
    "runtime": ["gradsift.runtime"],
    "runtimes": ["gradsift.ddp", "gradsift.fsdp", "gradsift.local"],
    "tools": ["gradsift.launch", "gradsift.integrations", "gradsift.experiments", "gradsift.cluster", "gradsift.cli",
              "gradsift.__main__"],
}
EDGE = ["gradsift.cluster", "gradsift.experiments", "gradsift.cli"]
CORE = [p for layer in ("workloads", "payload", "selection", "memory", "route", "runtime", "runtimes")
        for p in LAYERS[layer]] + ["gradsift.launch", "gradsift.integrations"]
RUNTIMES = ("gradsift.runtime", "gradsift.ddp", "gradsift.fsdp", "gradsift.local", "gradsift.launch")
ROUTES = {"GATHER", "REDUCE", "DENSIFY", "SCATTER", "SHARD", "WHOLE_ROUTE"}
DECIDER = "gradsift.route.routing"  # the one module that decides how a tensor travels
# private attributes of other libraries that gradsift has to read (each with its reason in the code)
FOREIGN_PRIVATE = {"_get_local_used_map", "_optimizer", "_is_overflow", "_exit", "_fully_shard", "_fsdp_api",
                   "_DEFAULT_FIRST_BUCKET_BYTES", "_gradsift_state", "_gradsift_local", "_replace", "_asdict", "_fields", "_make"}


def under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def within(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_no_import_cycle_and_every_import_exists():
    assert ig.cycles(GRAPH) == []
    assert ig.missing(GRAPH, MODULES) == []


def test_the_checker_finds_a_cycle_and_a_missing_module():
    """The checks above can fail: a made-up graph with a cycle and a dangling import."""
    graph = {"gradsift.a": {"gradsift.b"}, "gradsift.b": {"gradsift.c"}, "gradsift.c": {"gradsift.a"},
             "gradsift.d": {"gradsift.nowhere"}}
    assert ig.cycles(graph) == [["gradsift.a", "gradsift.b", "gradsift.c"]]
    assert ig.missing(graph, {m: None for m in graph}) == [("gradsift.d", "gradsift.nowhere")]


def test_no_source_file_over_the_limit():
    assert ig.long_files(MODULES) == []


def test_every_module_sits_in_one_layer_of_the_tree():
    """The folders are the layers: a module outside every layer (a new file dropped at the package's top) fails."""
    placed = {m: [name for name, prefixes in LAYERS.items() if within(m, prefixes)] for m in MODULES}
    assert {m: where for m, where in placed.items() if len(where) != 1 and m != "gradsift"} == {}
    top = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert top == {p.split(".")[1] for prefixes in LAYERS.values() for p in prefixes}, top


def layer_of(mod: str) -> int:
    return next(i for i, prefixes in enumerate(LAYERS.values()) if within(mod, prefixes))


def package_of(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a module to one in a higher layer (the package's own ``__init__`` aside: it offers the API)."""
    return sorted((a, b) for a, bs in graph.items() if a != "gradsift" for b in bs
                  if b != "gradsift" and layer_of(b) > layer_of(a))


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles between packages (``gradsift.memory`` -> ``gradsift.compressors`` -> ``gradsift.memory``)."""
    packages: dict[str, set[str]] = {}
    for a, bs in graph.items():
        if a == "gradsift":
            continue
        packages.setdefault(package_of(a), set()).update(package_of(b) for b in bs
                                                          if b != "gradsift" and package_of(b) != package_of(a))
    return ig.cycles(packages)


def test_layers_point_down_and_no_package_imports_another_both_ways():
    assert upward_imports(GRAPH) == []
    assert package_cycles(GRAPH) == []


def test_the_layer_checks_find_an_upward_import_and_a_package_cycle():
    graph = {"gradsift.payload": {"gradsift.memory.feedback"}, "gradsift.memory.feedback": {"gradsift.payload"},
             "gradsift.compressors.topk": {"gradsift.kernels.many"}, "gradsift.kernels.many": {"gradsift.compressors.base"}}
    assert upward_imports(graph) == [("gradsift.payload", "gradsift.memory.feedback")]
    assert sorted(map(sorted, package_cycles(graph))) == [["gradsift.compressors", "gradsift.kernels"],
                                                          ["gradsift.memory", "gradsift.payload"]]


def test_core_never_imports_the_edges():
    for core in CORE:
        for mod in under(core):
            bad = {t for t in ig.reaches(GRAPH, mod) if within(t, EDGE)}
            assert not bad, (mod, sorted(bad))


def test_compressors_never_import_memory_or_runtimes():
    for mod in under("gradsift.compressors"):
        reach = ig.reaches(GRAPH, mod)
        for other in ("gradsift.memory.feedback", "gradsift.memory.factory", "gradsift.runtime.road", "gradsift.runtime",
                      "gradsift.ddp", "gradsift.fsdp", "gradsift.transport", "gradsift.route"):
            assert not any(within(t, [other]) for t in reach), (mod, other)


def test_transport_knows_no_method_and_the_core_and_the_route_know_no_runtime():
    for mod in under("gradsift.transport"):
        assert not any(t.startswith("gradsift.compressors") for t in ig.reaches(GRAPH, mod)), mod
    for layer in ("gradsift.payload", "gradsift.memory", "gradsift.route", "gradsift.transport"):
        for mod in under(layer):
            reach = ig.reaches(GRAPH, mod)
            assert not any(within(t, RUNTIMES) for t in reach), (mod, sorted(t for t in reach if within(t, RUNTIMES)))
    assert not any(t == "gradsift.transport.dist" for t in ig.reaches(GRAPH, DECIDER))


def test_every_runtime_is_the_one_rank_over_the_one_road_and_route_owner():
    for runtime in ("gradsift.ddp.state", "gradsift.fsdp", "gradsift.runtime.simulate", "gradsift.runtime.localstate"):
        assert "gradsift.runtime.rank" in GRAPH[runtime], runtime
    # local SGD's two runtimes (real ranks, the simulator's workers) are one object
    assert "gradsift.runtime.localstate" in GRAPH["gradsift.local"] and \
        "gradsift.runtime.localstate" in GRAPH["gradsift.runtime.localsgd"]
    assert {"gradsift.runtime.road", "gradsift.route.routing", "gradsift.runtime.settings"} <= GRAPH["gradsift.runtime.rank"]
    assert "gradsift.route.routing" in GRAPH["gradsift.runtime.road"]
    # the runtimes do not reach into each other: DDP and FSDP share the rank, not each other's modules
    assert not any(within(t, ["gradsift.ddp"]) for t in ig.reaches(GRAPH, "gradsift.fsdp"))
    assert not any(within(t, ["gradsift.fsdp"]) for t in ig.reaches(GRAPH, "gradsift.ddp"))
    # PyTorch's baselines and the same-process pairing time gradsift; they are not part of it
    assert "gradsift.experiments.baselines" in MODULES and "gradsift.experiments.pairing" in MODULES


# ---------------------------------------------------------------- one owner per route decision
def route_decisions(tree: ast.AST) -> list[int]:
    """Lines that decide a route: a ``Decision`` built, or a route name used other than in a comparison (made into
    a value, appended, returned, passed)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Decision":
            out.append(node.lineno)
        if isinstance(node, ast.Name) and node.id in ROUTES and isinstance(node.ctx, ast.Load):
            up = parents.get(node)
            while isinstance(up, (ast.Tuple, ast.List, ast.Set)):
                up = parents.get(up)
            if not isinstance(up, ast.Compare):
                out.append(node.lineno)
    return sorted(set(out))


def test_only_the_route_owner_decides_a_route():
    """Outside ``route/routing.py`` (and the wire format that names the routes) a route name appears only where a
    route that was decided is read: in a comparison."""
    found = {}
    for mod, path in MODULES.items():
        if mod in (DECIDER, "gradsift.transport.wire"):
            continue
        lines = route_decisions(ast.parse(path.read_text()))
        if lines:
            found[mod] = lines
    assert found == {}


def test_the_route_check_finds_a_decision_made_elsewhere():
    assert route_decisions(ast.parse("routes.append(SHARD)\nd = Decision('whole')\nif r == GATHER: pass\n"
                                     "ok = r in (SCATTER, DENSIFY)")) == [1, 2]


# ---------------------------------------------------------------- private attributes
def private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``obj._name`` where ``obj`` is not ``self`` or ``cls`` (dunders and other libraries' names allowed)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr in FOREIGN_PRIVATE or (isinstance(owner, ast.Name) and owner.id in ("torch", "dist", "os")):
                continue
            out.append((node.lineno, node.attr))
    return out


def test_no_module_reads_another_objects_private_attributes():
    found = {mod: private_reads(ast.parse(path.read_text())) for mod, path in MODULES.items()}
    assert {m: v for m, v in found.items() if v} == {}
    assert private_reads(ast.parse("x = self._a + road._partitions + obj.__class__")) == [(1, "_partitions")]


def test_the_runtimes_stay_thin_adapters_over_the_rank():
    """What a rank is lives in runtime/rank.py; DDP's and FSDP's adapters stay small (300 and 250 lines)."""
    lengths = {name: len(MODULES[name].read_text().splitlines()) for name in ("gradsift.ddp.state", "gradsift.fsdp")}
    assert lengths["gradsift.ddp.state"] <= 300 and lengths["gradsift.fsdp"] <= 250, lengths


def test_a_runtime_holds_its_rank_and_the_rank_calls_no_runtime_back():
    """No class extends the rank (the runtimes hold one, ``core``); the rank calls nothing a runtime would define:
    the end of a runtime's step is handed to it."""
    bases = {mod: [n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                   and any(isinstance(b, ast.Name) and b.id == "Rank" for b in n.bases)] for mod, path in MODULES.items()}
    assert {m: v for m, v in bases.items() if v} == {}
    rank = MODULES["gradsift.runtime.rank"].read_text()
    assert "self.end_step" not in rank and "self.ensure_ready" not in rank
    for mod in ("gradsift.ddp.state", "gradsift.fsdp", "gradsift.runtime.localstate"):
        assert "self.core = Rank(" in MODULES[mod].read_text(), mod


HISTORY = __import__("re").compile(
    r"\bthe issue\b|\bissues? ?#?\d+|\bstops? \d+\b|results\.md.{0,3}section \d+|\bsection \d+ of (docs|results)",
    __import__("re").IGNORECASE)


def history_references(text: str) -> list[str]:
    """The places where source text speaks of the project's history (an issue, a stop, a results-page section
    number) instead of what the code does."""
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_source_speaks_of_code_not_of_the_projects_history():
    from pathlib import Path

    src = Path(ig.__file__).resolve().parents[1] / "src" / "gradsift"
    found = [f"{p.relative_to(src)}: {hit}" for p in sorted(src.rglob("*")) if p.suffix in (".py", ".c", ".h")
             for hit in history_references(p.read_text())]
    assert not found, found
    # the check finds what it is for, and lets a verb through
    assert len(history_references("as the issue asked; see results.md section 15; measured at stop 51; issue 58")) == 4
    assert not history_references("Issue the group's collectives (asynchronous); section of the tree")
