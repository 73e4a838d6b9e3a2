"""The server distribution's package list against the tree: a new subpackage must be installed.

The installed import names are the repository's folders with a `specmesh_` prefix (pyproject's
package-dir); a folder with an `__init__.py` missing from `packages` would import from the
checkout and fail once installed.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_in_the_tree_is_in_the_distribution():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = tool["package-dir"]
    expected = set()
    for name, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            expected.add(".".join((name, *parts)))
    assert set(tool["packages"]) == expected


def test_import_names_cannot_collide_with_generic_distributions():
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    assert all(name.startswith("specmesh_") for name in package_dir)
    assert sorted(package_dir.values()) == ["gateway", "kernels", "services"]
