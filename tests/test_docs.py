"""The documentation builds with no broken link or page (`mkdocs build --strict`), the code reference is
the diagnostics table's, and the README stays short."""

import os
import subprocess
import sys

from pardsl.language.diagnostics import code_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_docs_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "errors" / "index.html").exists()


def test_the_code_reference_is_the_diagnostics_table():
    with open(os.path.join(REPO, "docs", "errors.md"), encoding="utf-8") as page:
        assert page.read() == code_reference(), "regenerate it: pardsl codes > docs/errors.md"


def test_the_readme_starts_short():
    assert os.path.getsize(os.path.join(REPO, "README.md")) <= 10 * 1024
