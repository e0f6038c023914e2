"""The grammar and the templates ship inside the package."""

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
