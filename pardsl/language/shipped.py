"""The files that ship inside the package: the grammar (pardsl.grammar) and the templates
(pardsl.templates), which live at the top of the repository (grammar/, codegen/) and are mapped into the
package when it is installed."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_CHECKOUT_FOLDERS = {"pardsl.grammar": "grammar", "pardsl.templates": "codegen"}


def read_text(package: str, name: str) -> str:
    """`name` from `package`; imported from a checkout that was never installed in place (a script in
    the repository with its root first on sys.path, beside a plain `pip install .`), from the
    checkout's own folder."""
    try:
        return resources.files(package).joinpath(name).read_text()
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[2] / _CHECKOUT_FOLDERS[package] / name
        if not checkout.is_file():
            raise
        return checkout.read_text()
