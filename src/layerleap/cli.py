"""The ``layerleap`` command line.  Each subcommand lives in its own module under ``commands/`` and
registers itself there with ``@command``; ``main`` turns a ``LayerleapError`` (or bad arguments) into
a one-line message and exit code 2, never a traceback, and Ctrl-C during a command into one line and
exit code 130 (``layerleap.__main__.run``, the console script, covers start-up too)."""

from __future__ import annotations

import argparse
import re
import sys
import warnings

from . import interrupts
from .commands import _COMMANDS, GROUP_HELP, named_paths as _named_paths
from .errors import LayerleapError


class _Parser(argparse.ArgumentParser):
    # a command whose setup sets this takes its positionals between its flags too (`cache clear --yes A B`):
    # argparse otherwise matches an optional positional and a list after it once, before the first flag
    intermixed = False
    _mixing = False

    def __init__(self, *args, **kwargs):  # a flag is spelt out: an abbreviation would dodge the "flag not used" checks
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True  # parse_known_intermixed_args calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False

    def error(self, message):  # argparse's own errors: one line, exit 2
        flag = re.fullmatch(r"argument (-[^\s/:]+)(?:/\S+)?: expected one argument", message)
        if flag:  # argparse takes a value that starts with '-' (a prompt "-x y", "-1e3") for a flag
            message += f": give it a value (one that starts with '-' is written {flag[1]}=VALUE)"
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _members(group: str) -> str:
    """The ``{a,b,...}`` metavar of a command group: its members' names."""
    return "{" + ",".join(m.partition(" ")[2] for m in _COMMANDS if m.startswith(group + " ")) + "}"


def build_parser() -> argparse.ArgumentParser:
    # the modules that define subcommands (add one here for a new one): importing one registers its commands
    from .commands import basic, bild, calibrate, chat, exactness, heads, hidden_transfer  # noqa: F401
    from .commands import cache, draft_vocab, native, ppd, serve, skipdecode  # noqa: F401

    parser = _Parser(prog="layerleap", description="Faster decoding from intermediate layers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (help_, setup, run) in _COMMANDS.items():
        group, _, member = name.partition(" ")
        if member:
            if group not in groups:
                gp = sub.add_parser(group, help=GROUP_HELP.get(group, group), description=GROUP_HELP.get(group))
                groups[group] = gp.add_subparsers(
                    dest="what", required=True, parser_class=_Parser, metavar=_members(group)
                )
            p = groups[group].add_parser(member, help=help_, description=help_)
        else:
            p = sub.add_parser(name, help=help_, description=help_)
        setup(p)
        p.set_defaults(_run=run, _name=name, _paths=_path_args(p))
    return parser


def _path_args(p: argparse.ArgumentParser) -> list[tuple[str, str, object]]:
    """``(dest, flag, type)`` of the arguments whose type marks a path as an input or an output."""
    return [
        (a.dest, a.option_strings[0] if a.option_strings else a.metavar or a.dest, a.type)
        for a in p._actions
        if getattr(a.type, "role", None) in ("in", "out")
    ]


def check_paths(args) -> None:
    """The one check of every path a command names, before it runs: an output is not an input (nor a
    folder holding one, nor a hard link to one), two outputs are not one path, and an existing output
    is only replaced by the same kind of file (weights of the same kind, a layerleap table or page)."""
    from . import files

    named = _named_paths(args)
    outs = [(flag, p, t) for flag, p, t in named if t.role == "out"]
    beside = [  # the files an output brings beside it (a checkpoint, a work folder): never an input either
        (f"{flag}'s {what}", p.with_name(p.name + suffix))
        for flag, p, t in outs
        for what, suffix in t.tags.get("also", ())
    ]
    allowed = tuple((flag, f) for flag, _, t in outs for f in t.tags.get("may_be", ()))
    ins = [(f, p) for f, p, t in named if t.role == "in"]
    files.check_distinct([(f, p) for f, p, _ in outs] + beside, ins, allowed)
    for flag, p, t in outs:
        kind = t.tags.get("kind")
        if kind is not None:
            files.check_replace(p, kind(args) if callable(kind) else kind, flag)
        if "text" in t.tags:
            files.check_replace_text(p, t.tags["text"], flag)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning on the command line: one line naming its kind, not the library line that raised it."""
    return f"layerleap: {category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.formatwarning = _warning_line
    try:
        with interrupts.deferred():  # importing torch and the commands
            parser = build_parser()
        args = parser.parse_args(argv)
    except SystemExit as e:  # bad arguments (2, one line printed) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    args.argv = argv  # the command line, for reports
    try:
        check_paths(args)
        code = int(args._run(args) or 0)
    except LayerleapError as e:
        if not interrupts.interrupted():  # else a library turned the Ctrl-C into another error
            print(f"layerleap {args._name}: error: {e}", file=sys.stderr)
            return 2
        code = None
    except KeyboardInterrupt:
        code = None
    if code is None or (interrupts.interrupted() and code != 130):
        _close_progress_bars()
        print(f"layerleap {args._name}: interrupted", file=sys.stderr)
        return 130
    return code


def _close_progress_bars() -> None:
    """Close the tqdm bars an interrupt left open, so that their last redraw comes before our line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(tqdm, "tqdm", None)._instances if tqdm is not None else []):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
