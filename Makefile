# make demo: install, compile the Megatron MLP example, run it on 2 CPU ranks and check it against serial.
# make test: install, run the test suite (its forty-six longest integration runs: make test-slow).
PYTHON ?= python3
PIP    := $(PYTHON) -m pip
# torch of the 2.13 series, as pyproject.toml asks, installed only where this Python has none of it: a torch
# already there, CPU or CUDA build, is kept. From PyPI, Linux gets the CUDA build (gigabytes); for the CPU
# build: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH       := torch>=2.13,<2.14
TORCH_INDEX ?=

.PHONY: install demo test test-slow bench fuzz init-sweep docs gpu-check clean

install:
	@$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__.split('.')[:2] != ['2', '13'])" 2>/dev/null \
		|| $(PIP) install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[test]"

demo: install
	$(PYTHON) -m pardsl.cli compile examples/mlp.par -o out/mlp
	$(PYTHON) -m pardsl.cli run examples/mlp.par --nproc 2 --steps 3

# Two workers, a test file each at a time: most of the suite is one process compiling, and a file's tests
# share what they compile. On the 2-core development machine, from a clean clone with an empty inductor
# cache, the suite's own time reached 21 to 22 min (and 23 min on CI's machine, where a terminal test also
# hung): the documented full-depth recipe explains went to benchmarks/recipes.py and `pardsl init`'s sweep
# to a third of the architectures (all of them: make init-sweep), and seven integration runs of about a
# minute each (tests marked slow) to make test-slow: 17 min 53 s with five of them out. Measure it before
# adding to it.
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not slow"

# The tests marked slow: inductor's kernels against serial, training through the API with collectives in
# the compiled graphs, a rank killed mid-step and resumed under two torchrun agents, a checkpoint resumed
# under a pipeline, DeepSeek-V3's experts and FSDP with tensor parallelism searched under a bound and run,
# the mesh's shape searched with a pipeline over three axes, and the longest runs of the CLI, rendezvous,
# robustness and training checks (docs/testing.md lists them).
test-slow: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m slow

# 20,000 inputs (10,000 generated .par files and 10,000 random byte strings, fresh seeds) through
# `pardsl check --json`: exit 0 or 1, JSON, located diagnostics only, no traceback, under 30 s each.
# Then as many again and 1,000 examples stopped midway by a short --time-limit, all checked in one child
# process (as an editor or a notebook calls check), under faulthandler: no crash, no traceback, no hang.
# PARDSL_FUZZ_EXAMPLES sets the 10,000 (the stopped examples are a tenth of it).
fuzz: install
	PARDSL_FUZZ_EXAMPLES=$${PARDSL_FUZZ_EXAMPLES:-10000} $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_fuzz.py --durations=2

# `pardsl init` on every architecture of the installed transformers whose config has a tensor-parallel
# plan (about 140; the suite takes a third of them): each file written compiles, or fails as listed.
init-sweep: install
	PARDSL_INIT_SWEEP=all $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_init.py -k every_architecture

# The documentation site (docs/, mkdocs.yml) into site/; the test suite builds it too, strictly.
docs: install
	$(PYTHON) -m mkdocs build --strict

# On a machine with one NVIDIA GPU and torch's CUDA build (not `make install`'s CPU build): every example
# family against serial on CUDA, the 8B shape's dry run on the GPU, and pardsl against PyTorch's tools there.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

bench: install
	$(PYTHON) benchmarks/compile_and_step.py

clean:
	rm -rf out build dist site *.egg-info .pytest_cache .hypothesis
