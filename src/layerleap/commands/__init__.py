"""CLI subcommands: each module here registers its own with ``command``; ``layerleap.cli`` imports
them and builds the parser.

A name with a space is a member of a group: ``@command("train heads", ...)`` and
``@command("train transfer", ...)`` in two modules make ``layerleap train heads|transfer``; the
member's name reaches its ``run`` as ``args.what``.  Registering one name twice is an error."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}
GROUP_HELP = {  # the group commands' own help lines
    "train": "train extra weights for a method (the backbone stays frozen)",
    "finetune": "fine-tune a model's own weights for a method",
    "eval": "quality and speed tables of a method",
    "sweep": "sweep a method's thresholds: quality against latency",
    "theory": "a method's theory: formulas, simulation and trade-off plots",
    "heads": "exit heads and drafter weight files: restrict to a sub-vocabulary, show what a file holds, upgrade "
    "an older one",
}


def command(*names: str, help: str):
    """Register ``setup(parser)`` for each subcommand in ``names`` ("generate", or "group member");
    the decorated function is ``run(args) -> int``."""

    def deco(setup: Callable):
        def with_run(run: Callable):
            for name in names:
                if name in _COMMANDS:
                    raise RuntimeError(f"layerleap command {name!r} is registered twice")
                _COMMANDS[name] = (help, setup, run)
            return run

        return with_run

    return deco


def named_paths(args) -> list[tuple[str, Path, object]]:
    """``(flag, path, type)`` of every path argument the command was given."""
    from .. import validate as V

    return [
        (flag, V.path(str(type_.tags.get("path_of", str)(v)), flag), type_)
        for dest, flag, type_ in getattr(args, "_paths", [])
        for v in (lambda x: x if isinstance(x, list) else [x])(getattr(args, dest, None))
        if v is not None
    ]


def check_outputs(args, outputs: list[tuple[str, Path]]) -> None:
    """``outputs`` a command makes from its arguments (``heads sub-vocab``'s ``{vocab}`` names), held
    to ``cli.check_paths``' rule: none is an input, a folder holding one, or another of them."""
    from .. import files

    files.check_distinct(outputs, [(f, p) for f, p, t in named_paths(args) if t.role == "in"])
