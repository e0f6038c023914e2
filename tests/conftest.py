import multiprocessing
import os
import sys
import tempfile

import pytest

# The layout search stops at a wall-clock budget (note N006) and compiles the best plan found by then: on
# a slow or busy machine (the suite runs on two workers) a test's plan would depend on the machine. Tests
# let every search run to its end (set before pardsl is imported, which reads it); the budget's own test
# sets it to 0.
os.environ.setdefault("PARDSL_SEARCH_BUDGET_S", "600")
# Each test worker computes on its share of the cores (and the processes it starts inherit that): more
# threads than cores spin in OpenMP's waits, burning the time the other worker needs (four of the test
# files took 9 % longer so on the 2-core development machine)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402

from pardsl.compiler import compile_text  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# The cost model reads a calibration file from the user's cache when there is one: tests see none, so
# that every estimate they check is from the defaults or a file they write themselves.
# Made by pytest's process and removed as it ends; the pools' workers (spawned children, which import
# this file through the tests' modules) inherit it, as they are stopped without running finalizers.
if multiprocessing.parent_process() is None:
    _CACHE_DIR = tempfile.TemporaryDirectory(prefix="pardsl-test-cache-")
    os.environ["PARDSL_CACHE_DIR"] = _CACHE_DIR.name

_POOLS = {}

# `make test` hands each of its two workers whole files, in the order collected: the longest files first
# (as measured with --durations on the 2-core development machine), so that the workers end together
# instead of one running a long file alone at the end (collected alphabetically, the longest came late)
LONGEST_FILES_FIRST = ["test_search.py", "test_training.py", "test_init.py", "test_pipeline.py", "test_robustness.py",
                       "test_compiled_layers.py", "test_docs.py", "test_recompute.py", "test_memory.py",
                       "test_cli.py", "test_hf_models.py", "test_shared_memory.py", "test_mesh_search.py",
                       "test_multi_axis.py", "test_cost.py", "test_rendezvous.py", "test_experts.py"]


def pytest_collection_modifyitems(items):
    first = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's order kept


@pytest.fixture(scope="session")
def pools():
    """Gloo worker pools by world size, started on first use and once per session."""
    from pardsl.tools.pool import WorkerPool

    def get(world_size: int) -> WorkerPool:
        pool = _POOLS.get(world_size)
        if pool is None or pool.broken:
            pool = _POOLS[world_size] = WorkerPool(world_size, timeout_s=60)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()


@pytest.fixture
def search_once(monkeypatch):
    """Compile with the layout search run once under a bound and recomputation chosen for the plan it
    finds, not weighed against the layouts (which searches again at lower shares of the activations): for
    tests whose subject is something else. tests/test_recompute.py tests the weighing."""
    from pardsl import compiler

    monkeypatch.setattr(compiler, "RECOMPUTATION_STEPS", 0)


@pytest.fixture
def round_figures(monkeypatch):
    """Compile without a calibration file under tests/figures.py's ROUND_GLOO, not today's defaults."""
    from pardsl.planning import cost

    from .figures import ROUND_GLOO

    monkeypatch.setitem(cost.DEFAULTS, "gloo", ROUND_GLOO)


@pytest.fixture
def compile_par(tmp_path):
    """Compile .par text written to a file in a temporary folder (so spans and paths are real)."""
    def compile_(text: str, name: str = "model.par"):
        path = tmp_path / name
        path.write_text(text)
        cwd = os.getcwd()
        os.chdir(REPO)
        try:
            return compile_text(text, str(path))
        finally:
            os.chdir(cwd)
    return compile_


def run_on(pools, compiled, steps: int = 2, seed: int = 0) -> dict:
    from pardsl.tools.execution import job_for

    return pools(compiled.program.mesh.size).run(job_for(compiled, seed=seed, steps=steps, timeout_s=60))
