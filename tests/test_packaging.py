"""The grammar and the templates ship inside the package; torch is asked for as a range."""

import os
import re
import subprocess
import sys
import zipfile
from importlib import resources

import pytest


def test_grammar_and_template_load_as_package_resources():
    assert "layout_block" in resources.files("pardsl.grammar").joinpath("par.lark").read_text()
    assert "class CompiledModule" in resources.files("pardsl.templates").joinpath("module.py.j2").read_text()


@pytest.mark.timeout(300)
def test_wheel_contains_grammar_and_templates(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), "."], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr
    [wheel] = tmp_path.glob("pardsl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pardsl/grammar/par.lark" in names
    assert "pardsl/templates/module.py.j2" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pardsl")
    modules = {os.path.relpath(os.path.join(folder, name), os.path.dirname(package)).replace(os.sep, "/")
               for folder, _, files in os.walk(package) for name in files if name.endswith(".py")}
    assert modules - set(names) == set()  # every sub-package listed in pyproject.toml


@pytest.mark.timeout(120)
def test_a_checkout_imported_without_an_install_in_place_finds_its_grammar_and_templates():
    """A script in the repository puts the checkout first on sys.path; beside a plain `pip install .` (no
    editable finder to map grammar/ and codegen/ into the package) pardsl still compiles a file."""
    script = (
        "import os, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)]\n"
        "sys.path.insert(0, '.')\n"
        "import pardsl\n"
        "assert os.path.samefile(os.path.dirname(pardsl.__file__), 'pardsl'), pardsl.__file__\n"
        "from pardsl.compiler import compile_text\n"
        "compiled = compile_text(open('examples/mlp.par').read(), 'examples/mlp.par')\n"
        "print('class CompiledModule' in compiled.source)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"


def test_torch_is_asked_for_as_a_range_that_keeps_an_installed_build():
    """An exact pin resolves to whatever build the index serves (PyPI's is CUDA's) and replaces a torch
    already installed; a range of one minor version keeps an installed CPU or CUDA build of it. The
    Makefile installs torch from the same range."""
    import torch
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as handle:
        dependencies = [Requirement(d) for d in tomllib.load(handle)["project"]["dependencies"]]
    [wanted] = [d for d in dependencies if d.name == "torch"]
    assert wanted.specifier and all(s.operator not in ("==", "===") for s in wanted.specifier), wanted
    assert all(wanted.specifier.contains(v) for v in ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", torch.__version__])
    assert not any(wanted.specifier.contains(v) for v in ["2.12.1", "2.14.0"])  # export's graphs change
    with open(os.path.join(root, "Makefile"), encoding="utf-8") as handle:
        installed = re.search(r"^TORCH\s*:=\s*(.+)$", handle.read(), re.M)[1]
    assert Requirement(installed).specifier == wanted.specifier
