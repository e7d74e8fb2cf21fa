"""Packaging: every package the library imports is declared (a dependency or an extra), and a command
whose extra is not installed says which one before it loads a model."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from layerleap.cli import main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "layerleap"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    """The distributions pyproject.toml names: its dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {_canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in reqs}


def _imported() -> dict[str, str]:
    """Top-level module -> the first file that imports it, for every absolute import in the package."""
    found: dict[str, str] = {}
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "layerleap" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(f.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared_in_pyproject():
    """An import of a package that only arrives as another one's dependency breaks when that one drops it."""
    declared, owners = _declared(), importlib.metadata.packages_distributions()
    undeclared = []
    for module, where in _imported().items():
        dists = {_canonical(d) for d in owners.get(module, [])}
        assert dists, f"{module} (imported in {where}) is not installed here"
        if not dists & declared:
            undeclared.append(f"{module} ({where}; distribution {', '.join(sorted(dists))})")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


@pytest.mark.parametrize("module", ["prometheus_client", "uvicorn"])
def test_serve_without_a_package_of_its_extra_names_the_extra(monkeypatch, capsys, char_model_dir, module):
    """Checked before the model loads: not a traceback once it has."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    rc = main(["serve", "--model", str(char_model_dir), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"layerleap serve needs {module}: pip install 'layerleap[serve]'" in err.strip().splitlines()[-1]
