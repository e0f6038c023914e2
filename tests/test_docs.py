"""The documentation builds with no broken link or page (`mkdocs build --strict`), the code reference is
the diagnostics table's, the README stays short, and the `pardsl` commands the pages and the examples show
run as written from the repository root."""

import glob
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from pardsl import cli
from pardsl.language.diagnostics import code_reference
from pardsl.model.loading import import_paths, par_import_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_docs_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "errors" / "index.html").exists()


def test_the_code_reference_is_the_diagnostics_table():
    with open(os.path.join(REPO, "docs", "errors.md"), encoding="utf-8") as page:
        assert page.read() == code_reference(), "regenerate it: pardsl codes > docs/errors.md"


def test_the_api_page_documents_every_public_name():
    """docs/api.md renders each name `import pardsl` gives from the module that defines it (the names load
    lazily, which mkdocstrings cannot follow through `pardsl`)."""
    import pardsl

    with open(os.path.join(REPO, "docs", "api.md"), encoding="utf-8") as page:
        shown = set(re.findall(r"^::: pardsl\.([\w.]+)$", page.read(), re.M))
    assert shown == {f"{module}.{name}" for name, module in pardsl._EXPORTS.items()}


def test_getting_started_plans_a_cluster_in_five_commands_or_fewer():
    with open(os.path.join(REPO, "docs", "getting-started.md"), encoding="utf-8") as page:
        first = re.search(r"^```\n(.*?)^```", page.read(), re.S | re.M)[1]
    lines = [line for line in first.splitlines() if line.strip()]
    assert lines[0].startswith("git clone") and lines[-1].startswith("pardsl explain") and len(lines) <= 5


def test_the_readme_starts_short():
    assert os.path.getsize(os.path.join(REPO, "README.md")) <= 10 * 1024


# A `pardsl ...` line of a code block or of an example's comment header; what follows ` # ` is a comment.
COMMAND = re.compile(r"^(?:\$ )?(pardsl .*?)(?:\s+#.*)?$")


def documented_commands() -> dict[str, str]:
    """Every `pardsl ...` command written in README.md's and docs/*.md's code blocks and in the comments heading
    the files under examples/, each with the first file that writes it."""
    found = {}
    for page in ["README.md", *sorted(glob.glob(os.path.join("docs", "*.md"), root_dir=REPO))]:
        with open(os.path.join(REPO, page), encoding="utf-8") as handle:
            blocks = re.findall(r"^```[^\n]*\n(.*?)^```", handle.read(), re.S | re.M)
        for line in "\n".join(blocks).splitlines():
            if match := COMMAND.match(line.strip()):
                found.setdefault(match[1], page)
    for example in sorted(glob.glob(os.path.join("examples", "**", "*.p[ay]*"), root_dir=REPO, recursive=True)):
        with open(os.path.join(REPO, example), encoding="utf-8") as handle:
            for line in handle:
                if not line.startswith("#"):
                    break
                if match := COMMAND.match(line.lstrip("#").strip()):
                    found.setdefault(match[1], example)
    return found


# The documented commands not run here, each with why; every other one must exit 0.
NOT_RUN = {
    "pardsl check big.par --time-limit 30": "big.par stands for the reader's own file",
    "pardsl explain plan.par --machine h100-nvlink-ib": "plan.par stands for the reader's own file",
    "pardsl dryrun plan.par --rank 37 --json": "plan.par stands for the reader's own file",
    "pardsl init \"examples.hf_models:llama_causal_lm(layers=2)\" -o examples/my_llama.par":
        "its file must lie in examples/ to import the model, where the suite writes nothing; tests/test_init.py runs init",
    "pardsl export ckpt/step-30 -o model.safetensors": "needs a checkpoint a training run made earlier",
    "pardsl dryrun examples/scale/llama3_8b_tp8.par --device cuda --machine h100-nvlink-ib": "needs a GPU",
    # Too long for the suite on the 2-core machine; their model lines are checked below.
    "pardsl dryrun examples/scale/llama32_1b_tp8.par --rank 0": "too long: 30 s and 7 GiB",
    "pardsl explain examples/scale/llama3_70b_dp32_pp4_tp8.par --machine h100-nvlink-ib": "too long: 20 s",
    "pardsl calibrate --nproc 2": "too long: 8 s of timing collectives, whose figures are this machine's",
    # The published recipes at full depth (80 to 126 layers traced on the meta device): benchmarks/recipes.py
    # explains each of them, and tests/test_recipes.py compiles them at a few layers
    "pardsl explain examples/recipes/llama31_405b_fsdp8_tp8_pp8.par --machine h100-nvlink-ib": "too long: 50 s",
    "pardsl explain examples/recipes/llama3_405b_dp128_pp16_tp8.par --machine h100-nvlink-ib": "too long: 47 s",
    "pardsl explain examples/recipes/llama3_405b_dp8_pp16_cp16_tp8.par --machine h100-nvlink-ib": "too long: 48 s",
    "pardsl explain examples/recipes/deepseek_v3_dp2_pp16_ep64.par --machine h800-nvlink-ib": "too long: 49 s",
    "pardsl explain examples/recipes/llama31_70b_fsdp32_tp8.par --machine h100-nvlink-ib": "too long: 35 s",
    "pardsl explain examples/recipes/gpt3_175b_dp8_pp16_tp8.par --machine a100-nvlink-ib": "too long: 22 s",
    "pardsl explain examples/scale/llama3_8b_fsdp8.par --machine h100-nvlink-ib":
        "too long: 26 s; tests/test_cost.py and tests/test_explain_html.py compile and explain it",
}
DOCUMENTED = documented_commands()


def test_every_command_not_run_is_still_documented():
    assert set(NOT_RUN) <= set(DOCUMENTED)


@pytest.fixture
def as_installed(monkeypatch, tmp_path):
    """The command as a user runs it from the repository root with only the package installed: the root is
    not on the import path and `examples` not imported yet, so a model module the .par file's folder does not
    reach fails here as it fails there; the calibration a command writes or reads is this test's own."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != REPO])
    for name in [name for name in sys.modules if name == "examples" or name.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("command", sorted(DOCUMENTED))
def test_a_documented_command_runs_as_written(command, as_installed, tmp_path, capsys):
    if command in NOT_RUN:
        pytest.skip(f"{command}: {NOT_RUN[command]}")
    argv = shlex.split(command)[1:]
    for i, word in enumerate(argv[:-1]):  # what the command writes goes under tmp_path, not into the checkout
        if word in ("-o", "--html"):
            argv[i + 1] = str(tmp_path / argv[i + 1])
    try:
        code = cli.main(argv)
    except SystemExit as done:  # argparse ends --help and --version so
        code = done.code
    output = capsys.readouterr()
    assert code == 0, f"{command} (written in {DOCUMENTED[command]}) exited {code}:\n{output.out}\n{output.err}"


def test_every_example_plan_names_a_model_module_its_folder_reaches(as_installed):
    for plan in sorted(glob.glob(os.path.join(REPO, "examples", "**", "*.par"), recursive=True)):
        with open(plan, encoding="utf-8") as handle:
            module = re.search(r"^model\s+([\w.]+):", handle.read(), re.M)[1]
        for name in [name for name in sys.modules if name == "examples" or name.startswith("examples.")]:
            del sys.modules[name]  # each plan imports from its own folder, not from the plan before it
        try:
            with import_paths(*par_import_paths(plan, module)):
                importlib.import_module(module)
        except ImportError as error:
            pytest.fail(f"{os.path.relpath(plan, REPO)}: its folder does not reach `{module}`: {error}")
