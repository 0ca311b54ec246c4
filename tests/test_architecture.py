"""The package's dependencies point one way (docs/architecture.md):

    vocabulary (passes, instructions, placement, lowering, errors, registry) <- definitions
    vocabulary, definitions <- runtime, simulator <- observe <- planner <- the package's entry point

The runtime never imports the simulator or the observation tools, the simulator never imports the
runtime, nothing imports in a cycle, and the package never imports the application (train.py,
the models, data.py). Imports are read from the source (inside functions too), not executed.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "schedules"
APPLICATION = {p.stem for p in ROOT.glob("*.py")}  # train, gptlite, deep_model, layers, data, ...

# role -> the roles it may import
ALLOWED = {
    "vocabulary": {"vocabulary"},
    "registry": {"vocabulary", "definitions"},
    "definitions": {"vocabulary", "definitions"},
    "runtime": {"vocabulary", "registry", "runtime"},
    "simulator": {"vocabulary", "registry", "definitions", "simulator"},
    "observe": {"vocabulary", "registry", "runtime", "simulator", "observe"},
    "planner": {"vocabulary", "registry", "definitions", "runtime", "simulator", "observe", "planner"},
    "entry": {"vocabulary", "registry", "definitions", "runtime", "simulator", "observe", "planner", "entry"},
}
# the planner times layers with torch: of the runtime it reads only the B / W split and the split head's layers and
# their layout (vocab_parallel, which imports no engine either), and times the experts' exchange as they run it
# (all_to_all), never an engine
PLANNER_RUNTIME = {"schedules.runtime.weight_grad", "schedules.runtime.vocab_parallel", "schedules.runtime.all_to_all"}


def role(module):
    parts = module.split(".")
    if module == "schedules":
        return "entry"
    if parts[1] == "registry":
        return "registry"
    if parts[1] in ("definitions", "runtime", "simulator", "observe", "planner"):
        return parts[1]
    return "vocabulary"


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path):
    """Every module `path` imports (top-level and inside functions), as dotted names."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from schedules.runtime import weight_grad` imports the submodule when there is one
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_graph():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: sorted(m for m in imports_of(path) if m in modules and m != name) for name, path in modules.items()}
    outside = {name: sorted(m for m in imports_of(path) if m.split(".")[0] in APPLICATION)
               for name, path in modules.items()}
    return graph, outside


def violations(graph):
    """(importer, imported) pairs that break the role rules. A module importing its own parent
    package (for its __init__) is not an edge of the architecture."""
    return [(a, b) for a, deps in graph.items() for b in deps
            if not a.startswith(b + ".") and role(b) not in ALLOWED[role(a)]]


def cycles(graph):
    """One import cycle per strongly connected group of modules (parent-package edges left out)."""
    edges = {a: [b for b in deps if not a.startswith(b + ".")] for a, deps in graph.items()}
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def test_dependencies_point_one_way():
    graph, _ = package_graph()
    assert len(graph) > 20  # the whole package was read
    assert violations(graph) == []


def test_the_planner_never_imports_an_engine():
    graph, _ = package_graph()
    used = {b for a, deps in graph.items() if role(a) == "planner" for b in deps if role(b) == "runtime"}
    assert used <= PLANNER_RUNTIME


def test_no_import_cycle():
    graph, _ = package_graph()
    assert cycles(graph) == []


def test_the_package_does_not_import_the_application():
    _, outside = package_graph()
    assert {name: deps for name, deps in outside.items() if deps} == {}


@pytest.mark.parametrize("edge", [("schedules.runtime.split_engine", "schedules.simulator.simulate"),
                                  ("schedules.simulator.simulate", "schedules.runtime.chunked_engine"),
                                  ("schedules.placement", "schedules.observe.trace"),
                                  ("schedules.definitions.vshape", "schedules.registry")])
def test_the_checks_catch_a_wrong_way_import(edge):
    graph, _ = package_graph()
    graph[edge[0]] = graph[edge[0]] + [edge[1]]
    assert edge in violations(graph)


def test_the_checks_catch_a_cycle():
    graph, _ = package_graph()
    graph["schedules.placement"] = graph["schedules.placement"] + ["schedules.lowering"]
    graph["schedules.lowering"] = graph["schedules.lowering"] + ["schedules.placement"]
    assert any({"schedules.placement", "schedules.lowering"} <= set(c) for c in cycles(graph))


def test_an_unmarked_test_cannot_launch_ranks():
    """conftest.py refuses launches from tests without the multiprocess marker (the fast tier's promise)."""
    from local_launch import launch
    with pytest.raises(AssertionError, match="mark it @pytest.mark.multiprocess"):
        launch(2, ["--help"])
