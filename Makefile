# make demo: install, compile the Megatron MLP example, run it on 2 CPU ranks and check it against serial.
# make test: install, run the whole test suite.
PYTHON ?= python3
PIP    := $(PYTHON) -m pip
# torch of the 2.13 series, as pyproject.toml asks, installed only where this Python has none of it: a torch
# already there, CPU or CUDA build, is kept. From PyPI, Linux gets the CUDA build (gigabytes); for the CPU
# build: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH       := torch>=2.13,<2.14
TORCH_INDEX ?=

.PHONY: install demo test bench fuzz docs gpu-check clean

install:
	@$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__.split('.')[:2] != ['2', '13'])" 2>/dev/null \
		|| $(PIP) install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[test]"

demo: install
	$(PYTHON) -m pardsl.cli compile examples/mlp.par -o out/mlp
	$(PYTHON) -m pardsl.cli run examples/mlp.par --nproc 2 --steps 3

# Two workers, a test file each at a time: most of the suite is one process compiling, and a file's tests
# share what they compile. On the 2-core development machine, from a clean clone with an empty inductor
# cache, the suite's own time was 17 min 44 s, 19 min 22 s and 20 min 59 s on three runs at this stop (the
# last two of one tree bar this comment: the shared machine's pace varies by a tenth), over the 20-minute
# limit on the last, with DCP's round trips, the init
# sweep over every architecture with a tensor-parallel plan, the browser test and the recipes' explains
# added, the collective matmuls' runs on 2 and 4 ranks, and the known recipes weighed in every searched
# compile; earlier stops measured 11 min 31 s to 17 min 46 s. Cut before adding anything more.
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile

# 20,000 inputs (10,000 generated .par files and 10,000 random byte strings, fresh seeds) through
# `pardsl check --json`: exit 0 or 1, JSON, located diagnostics only, no traceback, under 30 s each.
# Then as many again and 1,000 examples stopped midway by a short --time-limit, all checked in one child
# process (as an editor or a notebook calls check), under faulthandler: no crash, no traceback, no hang.
# PARDSL_FUZZ_EXAMPLES sets the 10,000 (the stopped examples are a tenth of it).
fuzz: install
	PARDSL_FUZZ_EXAMPLES=$${PARDSL_FUZZ_EXAMPLES:-10000} $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_fuzz.py --durations=2

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
