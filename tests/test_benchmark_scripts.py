"""The scripts in benchmarks/ against the library as it is now: each compiles, every ``layerleap`` name it
imports exists, every attribute it reads off an imported ``layerleap`` module or class exists, and every
call of an imported ``layerleap`` function or class binds to its signature (the count of positional
arguments and the keyword names).  Read with ``ast``: no script runs.  The library's internals move;
these scripts are run by hand, so a renamed function or a changed signature breaks them silently."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _resolve(module: str, name: str):
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")  # a submodule not imported by its package


def _top_level(tree: ast.Module) -> set[str]:
    """The names a script binds at its top level: functions, classes, assignments and imports."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def _names(tree: ast.Module, problems: list[str]) -> dict:
    """Local name -> the ``layerleap`` object it is bound to by an import anywhere in the script."""
    names: dict = {}
    for node in ast.walk(tree):
        sibling = BENCH / f"{node.module}.py" if isinstance(node, ast.ImportFrom) and node.module else None
        if sibling is not None and sibling.is_file():  # another script's names (benchmarks/ on the path)
            defined = _top_level(ast.parse(sibling.read_text()))
            problems += [
                f"line {node.lineno}: {sibling.name} defines no {a.name}" for a in node.names if a.name not in defined
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "layerleap":
            for a in node.names:
                try:
                    names[a.asname or a.name] = _resolve(node.module, a.name)
                except (ImportError, AttributeError) as e:
                    problems.append(f"line {node.lineno}: from {node.module} import {a.name}: {e}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "layerleap":
                    continue
                try:
                    mod = importlib.import_module(a.name)
                except ImportError as e:
                    problems.append(f"line {node.lineno}: import {a.name}: {e}")
                    continue
                names[a.asname] = mod if a.asname else importlib.import_module("layerleap")
                if not a.asname:
                    names["layerleap"] = importlib.import_module("layerleap")
    return names


def _lookup(expr: ast.expr, names: dict, problems: list[str]):
    """The object ``expr`` (a name or an attribute chain) stands for, where it starts at an imported
    ``layerleap`` module or class; None where it does not (or is an instance's attribute)."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if not isinstance(expr, ast.Attribute):
        return None
    base = _lookup(expr.value, names, problems)
    if not (inspect.ismodule(base) or inspect.isclass(base)):
        return None
    if hasattr(base, expr.attr):
        return getattr(base, expr.attr)
    if inspect.ismodule(base):
        try:
            return importlib.import_module(f"{base.__name__}.{expr.attr}")
        except ImportError:
            pass
    elif dataclasses.is_dataclass(base) and expr.attr in {f.name for f in dataclasses.fields(base)}:
        return None  # a field without a class-level default
    problems.append(f"line {expr.lineno}: {base.__name__} has no attribute {expr.attr!r}")
    return None


def check_script(source: str) -> list[str]:
    """What in ``source`` no longer matches the library (empty: nothing)."""
    tree = ast.parse(source)
    problems: list[str] = []
    names = _names(tree, problems)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            _lookup(node, names, problems)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = _lookup(node.func, names, [])  # (missing attributes are reported above)
        if fn is None or inspect.ismodule(fn) or not callable(fn):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue  # *args / **kwargs: the count is not known here
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one
            continue
        try:
            sig.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as e:
            problems.append(f"line {node.lineno}: {getattr(fn, '__qualname__', fn)}(...): {e}")
    return problems


def test_scripts_found():
    assert len(SCRIPTS) > 30


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_matches_the_library(path: Path):
    source = path.read_text()
    compile(source, str(path), "exec")
    assert check_script(source) == []


def test_check_script_finds_drift():
    """The checks themselves: a missing name, a missing module attribute, a wrong keyword, too many
    arguments, each reported; a right call, a dataclass field and an instance's attribute are not."""
    bad = (
        "from layerleap.train import exit_heads as th\n"
        "from layerleap.drafters.trees import transfer_pass, no_such_name\n"
        "import layerleap\n"
        "th.sharegpt_token_seqs(None, 1, 2)\n"
        "transfer_pass(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)\n"
        "th.HeadTrainConfig(layers=(1,), no_such_keyword=1)\n"
        "from call_cost_any import primed_calls, no_such_function\n"
    )
    problems = check_script(bad)
    assert len(problems) == 5, problems
    assert any("call_cost_any.py defines no no_such_function" in p for p in problems)
    assert any("no_such_name" in p for p in problems)
    assert any("sharegpt_token_seqs" in p for p in problems)
    assert any("transfer_pass" in p for p in problems)
    assert any("no_such_keyword" in p for p in problems)
    good = (
        "import layerleap\n"
        "from layerleap.train import exit_heads as th\n"
        "cfg = th.HeadTrainConfig(layers=(1,), kind='lens')\n"
        "m = layerleap.load('smollm2-135m')\n"
        "m.anything_at_all\n"
        "th.HeadTrainResult.heads\n"
    )
    assert check_script(good) == []


def _script(name: str):
    """``benchmarks/<name>.py`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kernel", ["blocks", "torch"])
def test_q4_quality_mapping_measures_the_loaded_kernel(kernel, monkeypatch, tmp_path):
    """``q4_quality.py``'s weight-mapping check on a tiny q4 model, whichever 4-bit kernel holds its
    weights: the block kernel keeps the file's values (|Δw| 0), torch's int4 kernel rounds its scales
    to bf16 (a small |Δw|)."""
    from layerleap.core import kernels
    from layerleap.core.loading import quantize_model
    from tiny_models import random_model

    if kernel == "blocks" and not kernels.blocks_available():
        pytest.skip("no native block kernel here")
    if kernel == "torch" and not kernels.int4_supported():
        pytest.skip("no torch int4 kernel here")
    monkeypatch.setenv(kernels.Q4_ENV, kernel)
    q4 = quantize_model(random_model("llama-gqa-tied", seed=3))
    file = {
        k: kernels.quantize(v)  # the 4-bit projections (the file's embedding is 8-bit)
        for k, v in random_model("llama-gqa-tied", seed=3).dense_state().items()
        if v.dim() == 2 and k not in ("tok_embeddings.weight", "lm_head.weight")
    }
    script = _script("q4_quality")
    (tmp_path / "smollm2-135m-0-q4").mkdir()
    monkeypatch.setattr(script, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(script.gguf_q4, "read", lambda folder: (file, {}))
    got = script.mapping_error(q4)
    n_layers = q4.config.n_layers
    assert got["tensors"] == 4 * n_layers  # qkv, o, gate_up, down
    assert got["kernel"] == ("BlockWeight" if kernel == "blocks" else "Int4Weight")
    if kernel == "blocks":
        assert got["max_abs_dw"] == 0.0
    else:
        assert 0.0 < got["relative_mean_dw"] < 0.05
