"""The house of packages: each distribution imports only the rljob packages below it (DESIGN §9).

    rljob_api  <-  rljob_wire  <-  rljob_trainer, rljob_rollout   (neither imports the other)
    rljob_api  <-  rljob_operator  <-  rljob_localcluster

Read from the sources' import statements (every ``import``/``from`` anywhere in a module, lazy ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {
    "api/rljob_api": {"rljob_api"},
    "wire/rljob_wire": {"rljob_api", "rljob_wire"},
    "trainer/rljob_trainer": {"rljob_api", "rljob_wire", "rljob_trainer"},
    "rollout/rljob_rollout": {"rljob_api", "rljob_wire", "rljob_rollout"},
    "operator/rljob_operator": {"rljob_api", "rljob_operator"},
    "localcluster/rljob_localcluster": {"rljob_api", "rljob_operator", "rljob_localcluster"},
}


def rljob_imports(path: Path) -> set[str]:
    """The top-level ``rljob_*`` packages a module imports (absolute imports; relative ones stay in its package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name.startswith("rljob_")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_sits_below_it(package):
    modules = sorted((REPO / package).rglob("*.py"))
    assert modules, f"{package} has no modules"
    wrong = {str(m.relative_to(REPO)): sorted(rljob_imports(m) - ALLOWED[package]) for m in modules}
    assert {m: names for m, names in wrong.items() if names} == {}


def test_every_package_folder_is_checked():
    folders = {str(p.parent.relative_to(REPO)) for p in REPO.glob("*/rljob_*/__init__.py")}
    assert folders == set(ALLOWED)
