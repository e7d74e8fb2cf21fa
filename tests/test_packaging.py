"""Packaging and CI: every package the library imports is declared (a dependency or an extra), a command
whose extra is not installed says which one before it loads a model, and ``.ci/run`` and the Makefile fail
where a tool the tests need is missing instead of letting its tests skip."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from layerleap.cli import main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "layerleap"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group())


def _declared() -> set[str]:
    """The distributions pyproject.toml names: its dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {_name(r) for r in reqs}


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
        dists = {_canonical(d) for d in owners.get(module) or [module]}  # not installed: its name
        if not dists & declared:
            undeclared.append(f"{module} ({where}; distribution {', '.join(sorted(dists))})")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


# the oldest versions found to work with the newest of the others (numpy 2): a lower bound below one admits
# an install that fails at run time
OLDEST_WORKING = {
    "gguf": (0, 13),  # gguf 0.10 and 0.11 read no GGUF file under numpy 2 (ndarray.newbyteorder)
    "ruff": (0, 16, 1),  # `make test`'s lint and format check: 0.16.0 flags B008, before 0.9 the format differs
}


@pytest.mark.parametrize("name", sorted(OLDEST_WORKING))
def test_a_dependency_s_lower_bound_is_a_version_that_works(name):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    bounds = [re.search(r">=\s*([0-9.]+)", r) for r in reqs if _name(r) == name]
    assert len(bounds) == 1 and bounds[0], f"pyproject.toml declares no lower bound for {name}"
    assert tuple(int(x) for x in bounds[0].group(1).split(".")) >= OLDEST_WORKING[name]


def test_every_data_file_in_the_package_is_package_data():
    """The files the code reads beside its modules (shipped weights, Spec-Bench, calibration, the C++ source
    the native layers build from) are in the wheel only where pyproject.toml's package-data names them."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["layerleap"]
    shipped = {f for pattern in patterns for f in SRC.glob(pattern) if f.is_file()}
    data = {
        f for f in SRC.rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts
    }
    assert {f.relative_to(SRC) for f in data} - {f.relative_to(SRC) for f in shipped} == set()
    assert any(f.name == "decoder.cpp" for f in shipped) and any(f.name == "question.jsonl" for f in shipped)


@pytest.mark.parametrize("module", ["prometheus_client", "uvicorn"])
def test_serve_without_a_package_of_its_extra_names_the_extra(monkeypatch, capsys, char_model_dir, module):
    """Checked before the model loads: not a traceback once it has."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    rc = main(["serve", "--model", str(char_model_dir), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"layerleap serve needs {module}: pip install 'layerleap[serve]'" in err.strip().splitlines()[-1]


def _fake_bin(folder: Path, **scripts: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        f = folder / name.replace("_", "-")
        f.write_text("#!/bin/sh\n" + body + "\n")
        f.chmod(0o755)
    return folder


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("required", ["", "1"])
def test_make_native_fails_where_the_native_layers_are_required(tmp_path, required):
    """Where the build fails (here: no compiler), `make native` goes on with the Python path, except
    under LAYERLEAP_REQUIRE_NATIVE=1 (CI), where the native tests would otherwise all skip."""
    venv = tmp_path / "venv"
    _fake_bin(venv / "bin", layerleap="echo 'layerleap native: error: no C++ compiler' >&2; exit 2")
    (venv / ".installed").touch()
    r = subprocess.run(
        ["make", "-s", "-C", str(ROOT), f"VENV={venv}", "-o", str(venv / ".installed"), "native"],
        env={
            **{k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},  # not make test's
            "LAYERLEAP_REQUIRE_NATIVE": required,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode != 0) == (required == "1"), r.stdout + r.stderr
    assert ("runs its Python path" in r.stdout) == (required != "1")


@pytest.mark.parametrize("apt_fails", [False, True])
def test_ci_installs_what_it_needs_requires_it_and_runs_the_readme_test_command(tmp_path, apt_fails):
    """.ci/run with neither Chromium nor a C++ compiler on PATH: it installs both, runs `make test` with both
    required, and stops at the first failing step."""
    log = tmp_path / "log"
    fake = _fake_bin(
        tmp_path / "bin",
        apt_get=f'echo "apt-get $*" >> {log}' + ("; exit 100" if apt_fails else ""),
        make=f'echo "make $* $LAYERLEAP_REQUIRE_CHROMIUM $LAYERLEAP_REQUIRE_NATIVE" >> {log}',
    )
    (fake / "dirname").symlink_to(shutil.which("dirname"))
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    r = subprocess.run(
        [shutil.which("bash"), str(ROOT / ".ci" / "run")],
        env={**env, "PATH": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = log.read_text().splitlines()
    install = "apt-get install -y -qq --no-install-recommends chromium g++"
    if apt_fails:
        assert r.returncode != 0 and lines == ["apt-get update -qq"], (lines, r.stderr)
    else:
        assert r.returncode == 0, r.stderr
        assert lines == ["apt-get update -qq", install, "make test 1 1"]


def test_native_build_from_python_finds_the_ninja_pip_put_beside_this_python(monkeypatch, tmp_path):
    """`pip install ninja` (the native extra) puts ninja in the environment's bin/, which is not on PATH where
    the environment is not activated (`make` runs .venv/bin/layerleap native --build, which calls
    ``native.build()``): the build finds it there (the compile step is replaced here)."""
    import torch.utils.cpp_extension

    from layerleap.core import native

    scripts = _fake_bin(tmp_path / "venv" / "bin", ninja="exit 0")
    real_get_path = sysconfig.get_path
    monkeypatch.setattr(
        sysconfig, "get_path", lambda name, *a, **k: str(scripts) if name == "scripts" else real_get_path(name, *a, **k)
    )
    monkeypatch.setattr(sys, "executable", str(scripts / "python"))
    system = str(_fake_bin(tmp_path / "system-bin", **{"c++": "exit 0"}))
    monkeypatch.setenv("PATH", system)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))
    found = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: found.append(shutil.which("ninja")))
    native.build()
    assert found == [str(scripts / "ninja")]
    assert os.environ["PATH"] == system  # as it was, after the build
