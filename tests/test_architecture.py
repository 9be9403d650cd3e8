"""Dependencies point one way: no cycles, the layers DESIGN.md draws, one road for both runtimes, files one can hold."""

from __future__ import annotations

import import_graph as ig

MODULES = ig.module_files()
GRAPH = ig.imports(MODULES)
CORE = ["gradsift.payload", "gradsift.compressors", "gradsift.feedback", "gradsift.factory", "gradsift.transport",
        "gradsift.road", "gradsift.plan", "gradsift.routing", "gradsift.measure", "gradsift.telemetry",
        "gradsift.records", "gradsift.netmodel", "gradsift.simulate", "gradsift.ddp", "gradsift.launch",
        "gradsift.layerwise", "gradsift.kernels", "gradsift.errors"]
EDGE = ["gradsift.cluster", "gradsift.experiments", "gradsift.cli"]


def under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


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


def test_core_never_imports_the_edges():
    for core in CORE:
        for mod in under(core):
            bad = {t for t in ig.reaches(GRAPH, mod) for e in EDGE if t == e or t.startswith(e + ".")}
            assert not bad, (mod, sorted(bad))


def test_compressors_never_import_memory_or_runtimes():
    for mod in under("gradsift.compressors"):
        reach = ig.reaches(GRAPH, mod)
        for other in ("gradsift.feedback", "gradsift.factory", "gradsift.road", "gradsift.simulate", "gradsift.ddp",
                      "gradsift.transport"):
            assert not any(t == other or t.startswith(other + ".") for t in reach), (mod, other)


def test_transport_knows_no_method_and_planner_no_runtime():
    for mod in under("gradsift.transport"):
        assert not any(t.startswith("gradsift.compressors") for t in ig.reaches(GRAPH, mod)), mod
    reach = ig.reaches(GRAPH, "gradsift.layerwise")
    for runtime in ("gradsift.simulate", "gradsift.ddp", "gradsift.launch", "gradsift.road"):
        assert not any(t == runtime or t.startswith(runtime + ".") for t in reach), runtime
    for neutral in ("gradsift.telemetry", "gradsift.records"):
        reach = ig.reaches(GRAPH, neutral)
        assert not any(t.startswith(("gradsift.simulate", "gradsift.ddp", "gradsift.launch")) for t in reach), neutral


def test_both_runtimes_run_the_one_road_and_read_the_one_route_owner():
    assert "gradsift.road" in GRAPH["gradsift.simulate"]
    assert "gradsift.road" in GRAPH["gradsift.ddp.state"]
    assert "gradsift.transport.local" in GRAPH["gradsift.simulate"]
    assert "gradsift.transport.dist" in GRAPH["gradsift.ddp.state"]
    assert "gradsift.rank" in GRAPH["gradsift.simulate"] and "gradsift.rank" in GRAPH["gradsift.ddp.state"]
    assert "gradsift.rank" in GRAPH["gradsift.fsdp"] and "gradsift.routing" in GRAPH["gradsift.rank"]
    assert "gradsift.routing" in GRAPH["gradsift.road"]


def test_the_route_owner_knows_no_runtime_and_benchmark_tools_stay_outside_the_core():
    for mod in ("gradsift.routing", "gradsift.measure", "gradsift.plan"):
        reach = ig.reaches(GRAPH, mod)
        assert not any(t.startswith(("gradsift.simulate", "gradsift.ddp", "gradsift.launch", "gradsift.transport.dist"))
                       for t in reach), (mod, sorted(reach))
    # PyTorch's baselines and the same-process pairing time gradsift; they are not part of it
    assert "gradsift.experiments.baselines" in MODULES and "gradsift.experiments.pairing" in MODULES
    assert not any(m.startswith("gradsift.ddp") and m.endswith(("baselines", "probe")) for m in MODULES)
