"""The Python in README.md and docs/*.md stays true to the API: every ```python block parses; every
call of ``layerleap.<name>(...)`` (and of ``generate``, ``stream``, ``Decoding``, in blocks and in
inline code) names a function that exists with keywords it takes, and a method and option values
the method's declarations accept; every dotted ``layerleap.a.b`` the prose names resolves; the
attributes read off a ``generate`` result exist.  The README's first example runs on a tiny model.
(The CLI lines are checked by test_doc_commands.py.)"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

import layerleap
from layerleap.core.run import GenerationResult

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]*\b(?:layerleap\.[A-Za-z_][\w.]*|generate|stream|Decoding)\([^`\n]*)`")
DOTTED = re.compile(r"(?<![\w/.-])layerleap(?:\.[A-Za-z_]\w*)+(?![\w/-]|\.py\b|\.\w)")
CALLED = {"generate", "stream", "Decoding"}  # what a bare call may name (``from layerleap import ...``)


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every ```python block of ``path``."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def inline_calls(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of each inline-code call of the API, parsed as Python (``...`` is Ellipsis)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for m in INLINE.finditer(line):
            try:
                ast.parse(m.group(1), mode="eval")
            except SyntaxError:
                continue  # prose around a call, not a call
            out.append((n, m.group(1)))
    return out


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "layerleap":
        return f.attr
    if isinstance(f, ast.Name) and f.id in CALLED:
        return f.id
    return None


def _config():
    """The embedded model's config (n_layers, vocabulary) for the model-dependent bounds, else None."""
    if not layerleap.available_models()["smollm2-135m"]:
        return None
    from layerleap.core.loading import packaged_folder

    folder = packaged_folder("smollm2-135m", progress=lambda m: None)
    return layerleap.ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), name="smollm2-135m")


def call_problems(tree: ast.AST, config=None) -> list[str]:
    """What a block's API calls get wrong: an unknown name, a keyword the function does not take, an
    unknown method, an option value its declaration refuses."""
    problems = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = _callee(call)
        if name is None:
            continue
        where = ast.unparse(call)[:90]
        fn = getattr(layerleap, name, None)
        if fn is None or not callable(fn):
            problems.append(f"layerleap.{name} does not exist: {where}")
            continue
        if name not in ("generate", "stream", "Decoding"):
            params = inspect.signature(fn).parameters
            takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
            problems += [
                f"{name} takes no keyword {k.arg}: {where}"
                for k in call.keywords
                if k.arg and k.arg not in params and not takes_any
            ]
            continue
        params = inspect.signature(layerleap.generate).parameters
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        method = kw.get("method", call.args[2] if len(call.args) > 2 else None)
        method = method.value if isinstance(method, ast.Constant) else "greedy" if method is None else None
        if method is None:
            continue  # a method held in a variable
        if method not in layerleap.METHODS:
            problems.append(f"unknown method {method!r}: {where}")
            continue
        declared = {o.name: o for o in layerleap.METHODS[method].declared}
        for k, v in kw.items():
            if k in params:
                continue
            if k not in declared:
                problems.append(f"method {method!r} has no option {k}: {where}")
                continue
            o = declared[k]
            if not isinstance(v, ast.Constant) or (o.kind == "weights" and "." in str(v.value)):
                continue  # a variable, or a weights file the reader makes
            try:
                o.check(v.value, config)
            except layerleap.LayerleapError as e:
                problems.append(f"{e}: {where}")
    return problems


def result_attribute_problems(tree: ast.AST) -> list[str]:
    """Attributes read off a name bound to a ``generate`` call that a GenerationResult lacks."""
    results = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _callee(n.value) == "generate"
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    fields = {f.name for f in dataclasses.fields(GenerationResult)} | set(dir(GenerationResult))
    return [
        f"a GenerationResult has no {n.attr}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in results
        if n.attr not in fields
    ]


def resolves(dotted: str) -> bool:
    """Whether ``layerleap.a.b.c`` names a module or an attribute of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


def test_the_checks_find_bad_calls():
    tree = ast.parse(
        "m = layerleap.load('smollm2-135m', dtyp='q4')\n"
        "out = layerleap.generate(m, 'p', method='medusa', tree_width=3)\n"
        "layerleap.generate(m, 'p', method='self-spec', schedule='linear')\n"
        "layerleap.generate(m, 'p', 'nope')\n"
        "layerleap.generat(m, 'p')\n"
        "out.texts\n"
    )
    found = call_problems(tree) + result_attribute_problems(tree)
    assert len(found) == 6, found
    for bit in ("no keyword dtyp", "no option tree_width", "schedule must be one of", "unknown method 'nope'"):
        assert any(bit in f for f in found), (bit, found)
    assert any("generat does not exist" in f for f in found)
    assert any("no texts" in f for f in found)
    good = ast.parse(
        "m = layerleap.load('smollm2-135m', dtype='q4')\n"
        "out = layerleap.generate(m, 'p', method='eagle', draft_len=2, width=3, eagle_head='my.safetensors')\n"
        "out.text, out.finish_reason\n"
    )
    assert call_problems(good) + result_attribute_problems(good) == []
    assert resolves("layerleap.core.options.DRAFT_LEN") and not resolves("layerleap.core.options.DRAFT_LENGTH")


def test_every_python_block_and_inline_call_in_the_docs_is_true_to_the_api():
    config = _config()
    problems = []
    for path in DOCS:
        rel = path.relative_to(ROOT)
        for line, src in blocks(path):
            try:
                tree = ast.parse(src)
            except SyntaxError as e:
                problems.append(f"{rel}:{line + (e.lineno or 1) - 1}: does not parse: {e.msg}")
                continue
            problems += [f"{rel}:{line}: {p}" for p in call_problems(tree, config) + result_attribute_problems(tree)]
        for line, src in inline_calls(path):
            problems += [f"{rel}:{line}: {p}" for p in call_problems(ast.parse(src, mode="eval"), config)]
    assert not problems, "\n".join(problems)


def test_every_dotted_name_the_docs_give_resolves():
    bad = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in DOCS
        for name in sorted(set(DOTTED.findall(p.read_text())))
        if not resolves(name)
    ]
    assert not bad, "\n".join(bad)


def test_the_readme_python_example_runs(char_model_dir, capsys):
    """The README's first block, on a tiny model and 3 new tokens: the calls, the result's fields and
    the stream's result."""
    (line, src), *_ = blocks(ROOT / "README.md")
    tiny = layerleap.load(str(char_model_dir))
    tree = ast.parse(src)
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        for k in call.keywords:
            if k.arg == "max_new_tokens":
                k.value = ast.Constant(3)
    code = compile(ast.fix_missing_locations(tree), f"README.md:{line}", "exec")
    real_load = layerleap.load
    ns = {}
    try:
        layerleap.load = lambda *a, **k: tiny
        exec(code, ns)
    finally:
        layerleap.load = real_load
    assert isinstance(ns["out"], GenerationResult) and ns["out"].finish_reason in ("stop", "length")
    assert len(ns["outs"]) == 2 and all(isinstance(o, GenerationResult) for o in ns["outs"])
    assert capsys.readouterr().out == ns["s"].result.text  # the streamed pieces join to the result


def test_from_hf_takes_the_tokenizer_the_readme_gives_it(char_model_dir):
    """``layerleap.from_hf(model, tokenizer)`` decodes text; without a tokenizer a text prompt is refused
    with a message that names from_hf's tokenizer (the model has no folder to add files to)."""
    from transformers import AutoTokenizer

    assert "layerleap.from_hf(model, tokenizer)" in (ROOT / "README.md").read_text()
    ours = layerleap.load(str(char_model_dir))
    hf = layerleap.to_hf(ours)
    want = layerleap.generate(ours, "hello", max_new_tokens=4)
    back = layerleap.from_hf(hf, AutoTokenizer.from_pretrained(str(char_model_dir)))
    assert layerleap.generate(back, "hello", max_new_tokens=4).token_ids == want.token_ids
    with pytest.raises(
        layerleap.GenerationError, match=r"from_hf the tokenizer \(layerleap.from_hf\(hf_model, tokenizer\)\)"
    ):
        layerleap.generate(layerleap.from_hf(hf), "hello", max_new_tokens=4)
    assert layerleap.generate(layerleap.from_hf(hf), want.prompt_ids, max_new_tokens=4).token_ids == want.token_ids
