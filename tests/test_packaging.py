"""The server distribution's package list against the tree: a new subpackage must be installed.

The installed import names are the repository's folders with a `specmesh_` prefix (pyproject's
package-dir); a folder with an `__init__.py` missing from `packages` would import from the
checkout and fail once installed.
"""
from __future__ import annotations

import ast
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


ROLES = ("datastore", "drafter", "router", "verifier")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_roles_talk_only_through_the_protos_and_the_pool():
    """A role imports the common package and its own modules, never another role's."""
    folders = {f"specmesh_services.{role}": REPO / "services" / role for role in ROLES}
    folders["specmesh_gateway"] = REPO / "gateway"
    others = [*folders, "specmesh_services.launch"]
    for own, folder in folders.items():
        for path in folder.rglob("*.py"):
            for module in _imported_modules(path):
                foreign = [o for o in others if o != own and (module == o or
                                                              module.startswith(o + "."))]
                assert not foreign, f"{path.relative_to(REPO)} imports {module}"
