"""Every file the package opens as text names its encoding.  Without ``encoding=`` Python takes the
locale's (cp1252 on Windows, Latin-1 or ASCII on some servers), and the shipped Spec-Bench prompts, chat
templates, tokenizer configs and reports are UTF-8."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "layerleap"


def _text_opens_without_encoding(tree: ast.AST) -> list[int]:
    """Lines of ``x.read_text()``, ``x.write_text(s)``, ``open(f)`` / ``x.open()`` in a text mode, with no
    ``encoding=``."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name in ("read_text", "write_text") and isinstance(f, ast.Attribute):
            lines.append(node.lineno)
        elif name == "open" and (isinstance(f, ast.Name) or isinstance(f.value, ast.Name | ast.Call | ast.Attribute)):
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("os", "gzip"):
                continue
            mode_at = 1 if isinstance(f, ast.Name) else 0
            mode = (
                node.args[mode_at]
                if len(node.args) > mode_at
                else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            text = mode is None or (isinstance(mode, ast.Constant) and "b" not in str(mode.value))
            if text:
                lines.append(node.lineno)
    return lines


def test_every_text_file_the_package_opens_names_its_encoding():
    found = {
        str(p.relative_to(PKG)): lines
        for p in sorted(PKG.rglob("*.py"))
        if (lines := _text_opens_without_encoding(ast.parse(p.read_text(encoding="utf-8"))))
    }
    assert not found, f"text opened without encoding= (give encoding='utf-8'): {found}"


def test_the_check_finds_what_it_looks_for():
    src = "p.read_text()\nopen(f)\nopen(f, 'rb')\np.open('w')\np.read_text(encoding='utf-8')\nos.open(f, 0)\n"
    assert _text_opens_without_encoding(ast.parse(src)) == [1, 2, 4]
