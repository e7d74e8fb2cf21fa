"""The package's layout is its architecture: imports run one way, from the app down to the core.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` anywhere in a module, at module level or inside a function (a lazy import still
ties the two modules together), relative or absolute, and ``importlib.import_module("layerleap...")``
with a literal name.  ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else
to ``pkg``.  Importing ``a.b.c`` first imports the packages ``a`` and ``a.b``, so those are edges
too -- except the importer's own enclosing packages, which Python has imported before the importer
runs (``methods/__init__.py`` importing ``methods/ppd.py`` is not a cycle with ``ppd`` importing a
sibling).  The root package's lazy exports (``layerleap/__init__.py``'s name table) are strings, not
imports, and the root is every module's enclosing package: it is no edge.

The layers, bottom to top (a module may import its own layer and the ones below):

- base: errors, files, validate, interrupts, loaded, datasets (no torch model, no decoding);
- core: the model, cache, loading, kernels, sampling, trees, verification, the ``Run`` context;
- drafters: what proposes tokens (early exit and its heads, a second model, Medusa/Transfer heads);
- methods: the decoding algorithms, registered by name;
- api: ``decoding`` (``generate``), ``streaming``, ``options``;
- train and eval, side by side (neither imports the other);
- app: the root package, ``__main__``, ``cli``, ``commands``, ``server``, ``scheduler``, ``cache`` (the user cache).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = SRC / "layerleap"

# (layer, rank, module-name prefixes); a name matches a prefix equal to it or below it
LAYERS = [
    (
        "base",
        0,
        (
            "layerleap.errors",
            "layerleap.files",
            "layerleap.validate",
            "layerleap.interrupts",
            "layerleap.loaded",
            "layerleap.datasets",
            "layerleap.workload",
        ),
    ),
    ("core", 1, ("layerleap.core",)),
    ("drafters", 2, ("layerleap.drafters",)),
    ("methods", 3, ("layerleap.methods",)),
    ("api", 4, ("layerleap.decoding", "layerleap.streaming", "layerleap.options")),
    ("train", 5, ("layerleap.train",)),
    ("eval", 5, ("layerleap.eval",)),
    (
        "app",
        6,
        (
            "layerleap.__main__",
            "layerleap.cli",
            "layerleap.commands",
            "layerleap.server",
            "layerleap.scheduler",
            "layerleap.cache",
        ),
    ),
]


def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(node: ast.AST, name: str, is_pkg: bool, known) -> list[str]:
    """The modules of ``known`` that the import statement (or import_module call) ``node`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (see the module docstring for what counts)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in known.items():
        own = set(_ancestors(name)) | ({name} if is_pkg else set())
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, name, is_pkg, known):
                for t in [*_ancestors(target), target]:
                    if t in known and t not in own and t != name:
                        edges.add(t)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, g) for g in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return [*path, start]
            if w not in seen:
                seen.add(w)
                paths.append([*path, w])
    raise AssertionError(f"no cycle in {group}")


def layer_of(name: str) -> tuple[str, int] | None:
    for layer, rank, prefixes in LAYERS:
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return layer, rank
    return None


def test_the_graph_sees_every_kind_of_import():
    """The reader finds module-level, relative, lazy (in a function) and package imports."""
    g = import_graph()
    assert "layerleap.core.model" in g["layerleap.core.loading"]  # from .model import ... (module level)
    assert "layerleap.core.gguf_q4" in g["layerleap.core.loading"]  # from . import gguf_q4 (in a function)
    assert "layerleap.methods" in g["layerleap.decoding"]  # from . import methods
    assert "layerleap.methods" in g["layerleap.eval.theory"]  # the package of methods.ppd, imported first
    assert "layerleap.methods" not in g["layerleap.methods.ppd"]  # its own package is no edge
    assert "layerleap.commands.basic" in g["layerleap.cli"]


def test_find_cycles_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer():
    loose = [m for m in modules() if m != "layerleap" and layer_of(m) is None]
    assert not loose, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {loose}"


@pytest.mark.parametrize("layer", [name for name, _, _ in LAYERS])
def test_imports_only_go_down(layer):
    """A module imports from its own layer or a lower one; train and eval do not import each other."""
    wrong = []
    for src, targets in sorted(import_graph().items()):
        here = layer_of(src)
        if here is None or here[0] != layer:
            continue
        for dst in sorted(targets):
            there = layer_of(dst)
            wrong_layer = there is None or there[1] > here[1] or (there[1] == here[1] and there[0] != here[0])
            if dst != "layerleap" and wrong_layer:
                wrong.append(f"{src} ({here[0]}) imports {dst} ({there[0] if there else 'no layer'})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
