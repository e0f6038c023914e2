"""The import rules of the package, read from its source (every import, inside functions too): no
cycles; the run time (what a rank running a generated module loads) never reaches the compiler; the
layout algebra imports nothing else of pardsl; planning (inference, the search, the cost model) never
imports lowering or the passes after it."""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pardsl")
# Lazy public faces: the package's __init__ (its exports load on first use) and the CLI, which imports
# each command's modules when the command runs.
FACES = {"__init__", "cli"}
RUN_TIME = {"runtime", "parameter_sync", "shared_memory", "kernels", "schedule", "schedules", "layouts"}
COMPILER = {"syntax", "binding", "inference", "search", "cost", "lowering", "pipeline", "codegen", "compiler",
            "reshard", "fused_norms", "fused_rotary", "early_count", "liveness", "chains", "oprules"}
PLANNING = {"inference", "search", "cost"}
AFTER_PLANNING = {"lowering", "pipeline", "codegen", "compiler", "reshard", "fused_norms", "fused_rotary",
                  "early_count", "liveness", "chains"}


def _imports() -> dict[str, set[str]]:
    """Module → the modules of pardsl it imports, anywhere in its file."""
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py")}
    graph = {}
    for module in modules:
        tree = ast.parse(open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8").read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
                found |= {name.split(".")[0] for name in names} & modules
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pardsl."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("pardsl.")}
        graph[module] = found - {module}
    return graph


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_module_imports_itself_through_others():
    graph = {m: deps - FACES for m, deps in _imports().items() if m not in FACES}
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_run_time_never_reaches_the_compiler():
    graph = _imports()
    for module in RUN_TIME:
        assert not (_reachable(graph, module) & COMPILER), (module, _reachable(graph, module) & COMPILER)


def test_the_layout_algebra_stands_alone_and_planning_comes_before_lowering():
    graph = _imports()
    assert graph["layouts"] == set()
    for module in PLANNING:
        assert not (_reachable(graph, module) & AFTER_PLANNING), (module, _reachable(graph, module) & AFTER_PLANNING)
