"""Every ``layerleap`` command line in a code block of README.md and docs/**/*.md is one the command
line accepts: the subcommand exists, every flag is one of its flags, a value with fixed choices is one
of them, every ``--methods`` name is a method and every ``--opt`` names an option its method declares.

Only the names are checked, not the values that depend on this machine or on files a doc's run made
(``--device cuda``, ``--data answers.jsonl``), and nothing runs; a line that elides part of a command
(``...``, ``…``) is left out."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL = {"|", "||", "&&", ";", "&", "2>&1"}  # where the command line ends
ELIDED = ("...", "…", "(the same)")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, the arguments after ``layerleap``) of every layerleap command in the fenced code blocks of
    ``text``: a line continued with ``\\`` is joined, a ``# comment`` dropped, the command cut at the
    first shell operator or redirection."""
    out, block, lines, i = [], False, text.splitlines(), 0
    while i < len(lines):
        line, n = lines[i], i + 1
        i += 1
        if line.lstrip().startswith("```"):
            block = not block
            continue
        if not block:
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line, i = line.rstrip()[:-1] + " " + lines[i], i + 1
        line = re.sub(r"<\([^)]*\)", "FILE", line)  # a process substitution is a file name
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue  # not shell
        if "layerleap" not in tokens or any(e in line.split("#")[0] for e in ELIDED):
            continue
        args = []
        for t in tokens[tokens.index("layerleap") + 1 :]:
            if t in SHELL or re.match(r"\d?>", t):
                break
            args.append(t)
        if args and re.fullmatch(r"[a-z][a-z-]*", args[0]):
            out.append((n, args))
    return out


def names_only(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (changed in place) checking names and fixed choices only: no value types (they look
    for files and devices), no required arguments."""
    for g in parser._mutually_exclusive_groups:
        g.required = False
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                names_only(sub)
            continue
        if a.choices is None:
            a.type = None
        if a.option_strings:
            a.required = False
        elif a.nargs is None:
            a.nargs = "?"
    return parser


def problems(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """Why the command line ``layerleap ARGS`` would be refused by name, or None."""
    from layerleap.decoding import METHODS, get_method
    from layerleap.errors import LayerleapError
    from layerleap.eval import bench

    try:
        ns = parser.parse_args(args)
    except SystemExit:
        return "the command line does not parse (see the message above)"
    try:
        opts = bench.parse_assignments(getattr(ns, "opt", None) or [], "NAME=VALUE")
        methods = getattr(ns, "methods", None)
        if isinstance(methods, str) and methods != "all":
            specs = bench.parse_methods(methods, getattr(ns, "opt", None), check=False)
        elif isinstance(getattr(ns, "method", None), str):  # calibrate's: a comma list, or all
            names = [m for m in ns.method.split(",") if m != "all"]
            specs = {m: (m, opts if len(names) == 1 else {}) for m in names}
        else:
            return None
    except LayerleapError as e:
        return str(e)
    for label, (name, options) in specs.items():
        if name not in METHODS:
            return f"no method {name!r}"
        declared = {o.name for o in get_method(name).declared}
        unknown = sorted(set(options) - declared)
        if unknown:
            return f"{label}: {name} declares no option {', '.join(unknown)}"
    return None


def test_the_scan_finds_commands_and_bad_names(tmp_path):
    from layerleap.cli import build_parser

    text = (
        "```bash\n"
        "layerleap generate --method greedy --prompt 'a # b' \\\n    --max-new-tokens 4  # a comment\n"
        "LAYERLEAP_CALL_COST=shipped layerleap bench --methods g=greedy,sample --json x.json 2>&1 | tee log\n"
        "torchrun --nproc-per-node 2 -m layerleap train transfer --out t.safetensors\n"
        "layerleap bench ... (the same) --json y.json\n"
        "make demo   # installs layerleap + the model\n"
        "```\n"
        "`layerleap generate --nope` in prose is not a command line\n"
    )
    assert commands(text) == [
        (2, ["generate", "--method", "greedy", "--prompt", "a # b", "--max-new-tokens", "4"]),
        (4, ["bench", "--methods", "g=greedy,sample", "--json", "x.json"]),
        (5, ["train", "transfer", "--out", "t.safetensors"]),
    ]
    parser = names_only(build_parser())
    for _, args in commands(text):
        assert problems(parser, args) is None, args
    assert problems(parser, ["generate", "--device", "cuda", "--prompts-file", "absent.jsonl"]) is None
    assert problems(parser, ["generate", "--prompt", "x", "--data-file", "x"]) is not None
    assert problems(parser, ["generate", "--prompt", "x", "--max-tokens", "4"]) is not None  # serve's flag
    assert problems(parser, ["eval", "nothing"]) is not None
    assert problems(parser, ["generate", "--dtype", "float8"]) is not None
    assert "declares no option" in problems(parser, ["generate", "--method", "greedy", "--opt", "draft_len=3"])
    assert "declares no option" in problems(parser, ["bench", "--methods", "s=sample", "--opt", "s.tree=2"])
    assert problems(parser, ["bench", "--methods", "greedy,nope"]) is not None


def test_every_command_line_in_the_docs_parses(capsys):
    from layerleap.cli import build_parser

    parser = names_only(build_parser())
    found = [(doc, n, args) for doc in docs() for n, args in commands(doc.read_text())]
    assert len(found) > 50, "the scan finds too few command lines: has the docs' format changed?"
    bad = []
    for doc, n, args in found:
        why = problems(parser, args)
        if why:
            err = capsys.readouterr().err.strip().splitlines()
            bad.append(f"{doc.relative_to(ROOT)}:{n}: layerleap {shlex.join(args)}\n    {err[-1] if err else why}")
    assert not bad, "docs show command lines layerleap refuses:\n" + "\n".join(bad)


def _leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every runnable command under ``parser``."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _leaf_commands(sub, (*path, name))
            return
    yield " ".join(path), parser


def _limit_row(limit: str) -> str:
    """The 'Applies to' cell of the README's limits-table row whose first cell starts with ``limit``."""
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith(limit):
            return cells[2]
    raise AssertionError(f"README.md's limits table has no row {limit!r}")


def test_the_limits_table_names_every_command_a_limit_applies_to():
    """The rows of the README's limits table that name commands name each command that has the limit:
    every command that reads a prompt from stdin (``--prompt -``), and every one with ``--max-hours``."""
    from layerleap.cli import build_parser

    leaves = dict(_leaf_commands(build_parser()))
    stdin = sorted(
        name
        for name, p in leaves.items()
        if any("--prompt" in a.option_strings and "'-' reads stdin" in (a.help or "") for a in p._actions)
    )
    assert stdin, "no command reads --prompt - (the scan is broken)"
    cell = _limit_row("one prompt read from stdin")
    assert [c for c in stdin if f"`{c}`" not in cell] == []
    hours = sorted(n for n, p in leaves.items() if any("--max-hours" in a.option_strings for a in p._actions))
    cell = _limit_row("estimated run time")
    named = set()
    for m in re.findall(r"`([a-z][a-z /-]*?)(?: --[a-z-]+)?`", cell):  # `train heads/medusa`: two commands
        head, _, last = m.rpartition(" ")
        named |= {f"{head} {w}".strip() for w in last.split("/")}
    assert [c for c in hours if c not in named] == []
