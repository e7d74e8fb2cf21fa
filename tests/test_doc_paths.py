"""Every file a doc cites exists: README.md and docs/**/*.md name code, scripts and result files by
path, and a moved or never-written file would leave the reader with a dead reference.

Two kinds of citation are checked: a path from the repository root that starts with ``docs/``,
``benchmarks/``, ``src/`` or ``tests/`` and ends in a file extension (in prose, code spans or
commands), and the target of a relative Markdown link (resolved from the doc's own folder)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTED = re.compile(r"(?<![\w./-])((?:docs|benchmarks|src|tests)/[\w./-]*?\w\.[A-Za-z0-9]+)(?![\w/])")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def cited(doc: Path) -> list[tuple[int, str, Path]]:
    """(line, as written, the file it names) for every path citation in ``doc``."""
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in ROOTED.finditer(line):
            out.append((n, m.group(1), ROOT / m.group(1)))
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target) or ROOTED.fullmatch(target):
                continue  # a URL, or a rooted path already counted
            out.append((n, target, doc.parent / target))
    return out


def test_the_scan_finds_citations(tmp_path):
    doc = tmp_path / "X.md"
    doc.write_text(
        "see docs/ppd/match_rates.json and `benchmarks/serve_load.py --x`,\n"
        "[a plot](bench/report.png), [web](https://example.org/a.png), (src/layerleap/cli.py).\n"
    )
    assert [(n, s) for n, s, _ in cited(doc)] == [
        (1, "docs/ppd/match_rates.json"),
        (1, "benchmarks/serve_load.py"),
        (2, "src/layerleap/cli.py"),
        (2, "bench/report.png"),
    ]


def test_every_cited_file_exists():
    assert len(docs()) > 3
    missing = [
        f"{doc.relative_to(ROOT)}:{n}: {text}" for doc in docs() for n, text, path in cited(doc) if not path.exists()
    ]
    assert not missing, "docs cite files that do not exist:\n" + "\n".join(missing)
