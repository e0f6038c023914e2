"""The import rules of the package, read from its source (every import, inside functions too): no
cycles; the run time (what a rank running a generated module loads) never reaches the compiler; the
layout algebra imports nothing else of pardsl; planning (inference, the search, the cost model) never
imports the program or the passes over it; and each layer imports only the layers below it."""

import ast
import os
import subprocess
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pardsl")
# Lazy public faces: the package's __init__ (its exports load on first use) and the CLI, which imports
# each command's modules when the command runs.
FACES = {"pardsl", "pardsl.cli"}
# The layers from the bottom up; a module may import its own layer's modules and those below.
LAYERS = ["language", "layouts", "model", "planning", "program", "passes"]
COMPILER = {f"pardsl.{layer}" for layer in LAYERS} | {"pardsl.compiler"}


def _modules() -> dict[str, str]:
    """Dotted name → file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE))[:-3]
                dotted = relative.replace(os.sep, ".").removesuffix(".__init__")
                found[dotted] = os.path.join(folder, name)
    return found


def _imports() -> dict[str, set[str]]:
    """Module → the modules of pardsl it imports, anywhere in its file (a package's own __init__ for
    `from pardsl.x import y` where y is a name, the module pardsl.x.y where it is one)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pardsl":
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "pardsl"}
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{module}: a relative import"
        graph[module] = {m for m in found if m in modules and m != module and m != "pardsl"}
    return graph


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _inside(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_module_imports_itself_through_others():
    graph = {m: deps - FACES for m, deps in _imports().items() if m not in FACES}
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_run_time_never_reaches_the_compiler():
    graph = _imports()
    for module in (m for m in graph if _inside(m, ["pardsl.runtime"])):
        reached = {m for m in _reachable(graph, module) if _inside(m, COMPILER)}
        assert reached <= {"pardsl.layouts.algebra"}, (module, reached)


def test_the_layout_algebra_stands_alone_and_planning_comes_before_the_program():
    graph = _imports()
    assert graph["pardsl.layouts.algebra"] == set()
    for module in (m for m in graph if _inside(m, ["pardsl.planning"])):
        reached = {m for m in _reachable(graph, module) if _inside(m, ["pardsl.program", "pardsl.passes"])}
        assert not reached, (module, reached)


def test_only_the_lazy_faces_import_pardsl_inside_functions():
    """Inside a function an import hides an arrow of the house from whoever reads the top of the file;
    only the package's face and the CLI (each command loads what it needs) import there."""
    inside = []
    for module, path in _modules().items():
        if module in FACES:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                inside += [f"{module}:{node.lineno} {name}" for name in names if name.split(".")[0] == "pardsl"]
    assert inside == []


def test_each_layer_imports_only_the_layers_below_it():
    graph = _imports()
    for module, imported in graph.items():
        layer = next((i for i, name in enumerate(LAYERS) if _inside(module, [f"pardsl.{name}"])), None)
        if layer is None:
            continue
        above = [f"pardsl.{name}" for name in LAYERS[layer + 1:]] + ["pardsl.compiler", "pardsl.api", "pardsl.tools"]
        assert not {m for m in imported if _inside(m, above)}, (module, sorted(m for m in imported if _inside(m, above)))


def test_a_rank_without_a_pipeline_does_not_import_torchs_pipelining():
    """torch.distributed.pipelining brings dynamo and DTensor with it, a second and a half of each process's
    start here: what a rank running a plan without a pipeline loads, and the training API, leave it out
    (a model's own imports, Hugging Face's, may bring dynamo anyway)."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, pardsl.api, pardsl.tools.execution; "
                             "print(sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo') "
                             "if m in sys.modules))"],
                            capture_output=True, text=True, cwd=os.path.dirname(PACKAGE), timeout=120)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
