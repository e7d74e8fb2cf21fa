"""One boundary for bad input: the checks every command and public function makes before heavy work.

Each check has two faces with one message:

- API: ``integer(value, "max_new_tokens", lo=1)`` returns the value or raises ``InputError`` (a
  ``LayerleapError``) whose one-line message names the problem and the fix;
- CLI: ``int_arg(lo=1)`` (``float_arg``, ``seed_arg``, ``report_arg`` ...) is the same check as an
  argparse ``type``: argparse prints ``layerleap CMD: error: argument --x: <message>`` and exits 2.

Values: integers refuse ``bool`` and floats, numbers must be finite, seeds lie in
``[0, SEED_MAX]``, text must be valid UTF-8 (``bytes`` are refused with the fix).  Sizes that would
run for hours or exhaust memory are refused with their limit (``at_most``).

Output paths are tried, not guessed from permissions (the tools may run as root): a temporary
sibling is created and removed (with any missing parent folders).  Known formats go by suffix:
JSON reports (an existing file is only replaced when it is a layerleap report), plots (matplotlib's
formats), markdown tables and safetensors weights.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

from .errors import LayerleapError

MIN_TEMPERATURE = 1e-6  # below it logits / temperature overflow float32 (and sampling is greedy anyway)
SEED_MAX = 2**32 - 1  # training seeds are multiplied by ~1e6 and must stay inside torch's 64-bit seeds
MAX_LIST = 100  # items in a comma list on the command line
LR_MAX = 1.0  # learning rates: Adam's steps are about lr per weight, and 1 already wipes out any weight
NAME_MAX, PATH_MAX = 255, 4096  # bytes in one file name and in a path (Linux's limits; the OS says ENAMETOOLONG)
PLOT_SUFFIXES = (
    ".png",
    ".pdf",
    ".svg",
    ".svgz",
    ".jpg",
    ".jpeg",
    ".tif",
    ".tiff",
    ".webp",
    ".gif",
    ".avif",
    ".eps",
    ".ps",
    ".pgf",
    ".raw",
    ".rgba",
)  # matplotlib's Agg formats
TABLE_SUFFIXES = (".md", ".markdown", ".txt")
HTML_SUFFIXES = (".html", ".htm")
WEIGHTS_SUFFIXES = (".safetensors",)


class InputError(LayerleapError, ValueError):
    """A bad argument: the message names the problem and the fix."""


@contextmanager
def raising(cls: type[LayerleapError]):
    """Re-raise the checks' ``InputError`` as ``cls`` (a module's own error class), same message."""
    try:
        yield
    except InputError as e:
        if isinstance(e, cls):
            raise
        raise cls(str(e)) from None


# -- messages -------------------------------------------------------------------------------------
def show(value, width: int = 48) -> str:
    """``repr(value)`` on one line (a model's or a tensor's repr spans many), cut to ``width`` characters (a
    hostile value may be megabytes long)."""
    try:
        r = repr(value)
    except ValueError:  # an int past Python's digit limit for str (sys.set_int_max_str_digits)
        r = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    r = " ".join(line.strip() for line in r[: width * 4].splitlines())
    return r if len(r) <= width else r[: width - 1] + "…"


def _say(name: str, rest: str) -> str:
    return f"{name} {rest}" if name else rest


def _bounds(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    lo, hi = (f"{x:g}" if isinstance(x, float) else x for x in (lo, hi))
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


# -- values ---------------------------------------------------------------------------------------
def integer(value, name: str, lo: int | None = None, hi: int | None = None, hint: str = "") -> int:
    """An ``int`` (not ``bool``, not a float) within ``[lo, hi]``."""
    want = "must be a positive integer" if (lo, hi) == (1, None) else f"must be an integer{_bounds(lo, hi)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(_say(name, f"{want}, got {show(value)}{hint}"))
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InputError(_say(name, f"{want}, got {show(v)}{hint}"))
    return v


def number(
    value,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    hint: str = "",
) -> float:
    """A finite real number (not ``bool``) within the bounds (``lo_open``/``hi_open``: strict)."""
    want = f"must be a finite number{_bounds(lo, hi, lo_open, hi_open)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(_say(name, f"{want}, got {show(value)}{hint}"))
    v = as_float(value)
    bad = not math.isfinite(v)
    bad |= lo is not None and (v <= lo if lo_open else v < lo)
    bad |= hi is not None and (v >= hi if hi_open else v > hi)
    if bad:  # an integer as an int (10**400 is no inf), another number as a float (not np.float64(...))
        got = int(value) if isinstance(value, numbers.Integral) else v
        raise InputError(_say(name, f"{want}, got {show(got)}{hint}"))
    return v


def as_float(value: numbers.Real) -> float:
    """``float(value)``, with an integer beyond float's range (``10**400``: ``float`` raises
    ``OverflowError``) as the infinity of its sign, which the bounds then refuse like any infinity."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def learning_rate(value, name: str = "lr") -> float:
    """An optimiser's step size in ``(0, LR_MAX]`` (above it Adam's update overflows float32 in a step)."""
    return number(value, name, 0.0, LR_MAX, lo_open=True)


def probability(value, name: str) -> float:
    return number(value, name, 0.0, 1.0)


def seed(value, name: str = "seed") -> int:
    return integer(value, name, 0, SEED_MAX)


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(_say(name, f"must be True or False, got {show(value)}"))
    return value


def choice(value, name: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        raise InputError(_say(name, f"must be one of {', '.join(choices)}, got {show(value)}"))
    return value


def text(value, name: str) -> str:
    """A ``str`` that is valid UTF-8 (no lone surrogates, as undecodable command-line bytes become)."""
    if isinstance(value, (bytes, bytearray)):
        raise InputError(_say(name, "is bytes: decode it to text first (e.g. value.decode('utf-8'))"))
    if not isinstance(value, str):
        raise InputError(_say(name, f"must be text (str), got {type(value).__name__}"))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            _say(name, f"is not valid UTF-8 text (character {e.start} cannot be encoded): give UTF-8 text")
        ) from None
    return value


def items(value, name: str, what: str = "prompts") -> list:
    """A list (or tuple) of things, not a string (whose characters would pass for items)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (list, tuple)):
        raise InputError(_say(name, f"must be a list of {what}, got {type(value).__name__}: wrap one in a list"))
    return list(value)


def utf8(data: bytes, what: str) -> str:
    """Bytes read from a file or stdin as UTF-8 text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{what} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): convert it to "
            "UTF-8 (e.g. iconv -t utf-8)"
        ) from None


# -- bounded reads: a prompt or data file is read up to a limit, never without one --------------------
LIMITS_MB = {  # env var -> default megabytes
    "LAYERLEAP_MAX_PROMPT_MB": 1,  # one prompt (stdin, --prompt): ~250k tokens, beyond any model's context
    "LAYERLEAP_MAX_INPUT_MB": 64,  # a prompts file, a Spec-Bench question.jsonl, a data or calibration file
}


def limit_bytes(env: str) -> int:
    """The limit in bytes that ``env`` sets (megabytes; its default from ``LIMITS_MB``)."""
    raw = os.environ.get(env, "").strip()
    try:
        mb = float(raw) if raw else LIMITS_MB[env]
    except ValueError:
        raise InputError(f"{env}={show(raw)} must be a number of megabytes") from None
    if not math.isfinite(mb) or mb <= 0:
        raise InputError(f"{env}={show(raw)} must be a positive number of megabytes")
    return int(mb * 1e6)


def read_bounded(source, what: str, env: str = "LAYERLEAP_MAX_INPUT_MB") -> bytes:
    """The bytes of a file (a path) or a binary stream, refused (``InputError``) past ``env``'s limit
    without reading more than the limit (300 MB of NULs on stdin must not grow the process)."""
    most = limit_bytes(env)
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                data = f.read(most + 1)
        else:
            data = source.read(most + 1)
    except OSError as e:
        raise InputError(f"cannot read {what} ({e.strerror or e})") from None
    if len(data) > most:
        raise InputError(
            f"{what} is larger than the limit of {most / 1e6:g} MB: give a smaller one (or set {env}=MB to lift it)"
        )
    return data


def at_most(value: int | float, most: int | float, name: str, fix: str) -> None:
    """Refuse a size beyond ``most`` (work that would run for hours or exhaust memory)."""
    if value > most:
        raise InputError(_say(name, f"{value:,} is beyond the limit of {most:,}: {fix}"))


def callable_or_none(value, name: str):
    if value is not None and not callable(value):
        raise InputError(_say(name, f"must be a function or None, got {type(value).__name__}"))
    return value


# -- paths ----------------------------------------------------------------------------------------
def path(value, name: str) -> Path:
    if isinstance(value, (bytes, bytearray)):
        raise InputError(_say(name, "is bytes: give the path as str"))
    if not isinstance(value, (str, os.PathLike)):
        raise InputError(_say(name, f"must be a path (str), got {type(value).__name__}"))
    s = os.fspath(value)
    if not isinstance(s, str) or not s.strip():
        raise InputError(_say(name, "is empty: give a path"))
    if "\0" in s:
        raise InputError(_say(name, "contains a NUL character: give a plain path"))
    text(s, name)
    if len(s.encode()) >= PATH_MAX or any(len(part.encode()) > NAME_MAX for part in s.split(os.sep)):
        raise InputError(
            _say(name, f"{show(s)} is too long for a path (a name at most {NAME_MAX} bytes): give a shorter one")
        )
    try:
        return Path(s).expanduser()
    except RuntimeError:  # ~user of an unknown user: the path as written
        return Path(s)


RACE_TRIES = 20  # checks of one path by processes racing each other, before a race counts as a failure


def _try_create(p: Path, name: str, folder: bool = False) -> None:
    """Create and remove a temporary file beside ``p`` (inside it when ``folder``), making and then
    removing any missing parent folders: the proof that ``p`` can be written.  Processes that check
    the same path at once (the ranks of a ``torchrun`` job) may make or remove each other's folders
    in between: such a race is tried again, a few times."""
    for attempt in range(RACE_TRIES):
        try:
            return _create_once(p, name, folder)
        except (FileExistsError, FileNotFoundError) as e:
            if attempt == RACE_TRIES - 1:
                raise InputError(
                    _say(name, f"{p} cannot be written ({e.strerror or e}): choose a writable path")
                ) from None
            time.sleep(random.uniform(0.001, 0.01))  # let the other process finish its check


def _create_once(p: Path, name: str, folder: bool) -> None:
    where = p if folder else p.parent
    missing: list[Path] = []
    d = where
    made: list[Path] = []  # the folders this call made, deepest last
    try:
        while not d.exists():
            missing.append(d)
            d = d.parent
        if not d.is_dir():
            if not d.exists():  # removed since it was seen: another process's check
                raise FileNotFoundError(2, "No such file or directory", str(d))
            raise InputError(_say(name, f"{p}: {d} is not a folder: choose another path"))
        for m in reversed(missing):
            try:
                m.mkdir()
            except FileExistsError:  # another process made it: theirs to remove
                continue
            made.append(m)
        probe = where / f".{p.name or 'x'}.{os.getpid()}.probe"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError as e:
        raise InputError(_say(name, f"{p} cannot be written ({e.strerror or e}): choose a writable path")) from None
    finally:
        for m in reversed(made):  # deepest first; only the folders made here, only while empty
            try:
                m.rmdir()
            except OSError:
                pass


def output_file(value, name: str, suffixes: tuple[str, ...] = (), what: str = "file") -> Path:
    """A file path that will be written: the right suffix, not a folder or device, and writable."""
    p = path(value, name)
    if p.is_dir():
        raise InputError(_say(name, f"{p} is a folder: give a file name"))
    if suffixes and p.suffix.lower() not in suffixes:
        ends = " or ".join(suffixes) if len(suffixes) < 4 else "one of " + " ".join(suffixes)
        article = "an" if what[:1] in "aeiouAEIOUH" else "a"
        raise InputError(_say(name, f"{p}: {article} {what} must end in {ends}: rename it"))
    if p.exists() and not p.is_file():
        raise InputError(_say(name, f"{p} is not a regular file: give a file path"))
    _try_create(p, name)
    return p


def is_report(obj) -> bool:
    """Whether a JSON value is a layerleap report (it names the command that made it)."""
    return isinstance(obj, dict) and ("command" in obj or "command" in (obj.get("config") or {}))


def report_file(value, name: str) -> Path:
    """A JSON report path; an existing file is only replaced when it is a layerleap report."""
    p = output_file(value, name, (".json",), "JSON report")
    if p.is_file() and p.stat().st_size:
        try:
            ok = is_report(json.loads(read_bounded(p, f"{name} {p}".strip())))
        except (OSError, ValueError, RecursionError):  # a file past the limit, or nested too deep: not ours
            ok = False
        if not ok:
            raise InputError(
                _say(name, f"{p} exists and is not a layerleap report: choose another file name (or delete it)")
            )
    return p


def plot_file(value, name: str) -> Path:
    """A plot to draw: an image file name, and matplotlib installed (checked before a run, not after it)."""
    p = output_file(value, name, PLOT_SUFFIXES, "plot")
    plotting(name)
    return p


def plotting(name: str = "") -> None:
    """Refuse (``InputError``) to promise a plot where matplotlib is not installed (an extra), without
    importing it."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a module set to None (blocked) or one without a spec
        found = False
    if not found:
        raise InputError(_say(name, "needs matplotlib to draw plots (not installed): pip install 'layerleap[plot]'"))


def table_file(value, name: str) -> Path:
    return output_file(value, name, TABLE_SUFFIXES, "table")


def weights_file(value, name: str) -> Path:
    return output_file(value, name, WEIGHTS_SUFFIXES, "weights file")


def output_dir(value, name: str) -> Path:
    """A folder that will be written (created if missing)."""
    p = path(value, name)
    if p.exists() and not p.is_dir():
        raise InputError(_say(name, f"{p} is a file: give a folder"))
    _try_create(p, name, folder=True)
    return p


def input_file(value, name: str, what: str = "file") -> Path:
    """An existing, readable file."""
    p = path(value, name)
    if p.is_dir():
        raise InputError(_say(name, f"{p} is a folder: give a {what}"))
    if not p.is_file():
        raise InputError(_say(name, f"{p} not found (or not a file): give the path of a {what}"))
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise InputError(_say(name, f"{p} cannot be read ({e.strerror or e}): check its permissions")) from None
    return p


def readable_input(value, name: str, what: str = "file") -> Path:
    """An existing, readable file (``input_file``), or a readable stream named by a path: a FIFO such as the
    shell's ``<(...)``, or ``/dev/stdin``.  A stream reads once, so it is checked without reading it."""
    p = path(value, name)
    if p.is_file() or p.is_dir() or not p.exists():
        return input_file(value, name, what)
    if not os.access(p, os.R_OK):
        raise InputError(_say(name, f"{p} cannot be read: check its permissions"))
    return p


# -- argparse types -------------------------------------------------------------------------------
def _as_arg(check: Callable, convert: Callable | None = None, label: str = "value") -> Callable[[str], object]:
    """``check(value, "")`` as an argparse type over the text (parsed by ``convert`` first)."""

    def parse(text: str):
        try:
            return check(convert(text) if convert else text)
        except LayerleapError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = label
    return parse


def _int_text(text: str, lo=None, hi=None, hint: str = "") -> int:
    try:
        return int(text.strip())
    except ValueError:
        want = "a positive integer" if (lo, hi) == (1, None) else f"an integer{_bounds(lo, hi)}"
        raise InputError(f"must be {want}, got {show(text)}{hint}") from None


def _float_text(text: str, want: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise InputError(f"must be a {want}, got {show(text)}") from None


def int_arg(lo: int | None = None, hi: int | None = None, hint: str = "") -> Callable[[str], int]:
    return _as_arg(lambda t: integer(_int_text(t, lo, hi, hint), "", lo, hi, hint), label="integer")


def float_arg(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    want = f"finite number{_bounds(lo, hi, lo_open, hi_open)}"
    return _as_arg(lambda t: number(_float_text(t, want), "", lo, hi, lo_open=lo_open, hi_open=hi_open), label="number")


positive_int = int_arg(1)
nonneg_int = int_arg(0)
seed_arg = int_arg(0, SEED_MAX)
probability_arg = float_arg(0.0, 1.0)
positive_float = float_arg(0.0, lo_open=True)
temperature_arg = float_arg(MIN_TEMPERATURE)
lr_arg = float_arg(0.0, LR_MAX, lo_open=True)


def threads_arg(text: str) -> int:
    """``--threads``: 1 .. the machine's cores (torch crashes on absurd thread counts)."""
    n = os.cpu_count() or 1
    return int_arg(1, n, f"; this machine has {n} cores")(text)


def int_list_arg(lo: int | None = None, hi: int | None = None, none: bool = False) -> Callable[[str], list[int]]:
    """A comma list of integers (``none`` allows the word 'none' or '' for an empty list)."""

    def check(t: str) -> list[int]:
        return _items(t, none, lambda s: integer(_int_text(s, lo, hi), "", lo, hi))

    return _as_arg(check, label="integer list")


def float_list_arg(
    lo: float | None = None, hi: float | None = None, none: bool = False, allow_inf: bool = False
) -> Callable[[str], list[float]]:
    """A comma list of finite numbers (``allow_inf``: also 'inf')."""

    def one(s: str) -> float:
        v = _float_text(s, f"finite number{_bounds(lo, hi)}")
        return v if allow_inf and v == math.inf else number(v, "", lo, hi)

    return _as_arg(lambda t: _items(t, none, one), label="number list")


def _items(t: str, none: bool, one: Callable) -> list:
    if none and t.strip().lower() in ("", "none"):
        return []
    items = [s.strip() for s in t.split(",") if s.strip()]
    if not items:
        raise InputError(f"is empty: give a comma list, e.g. 1,2{' (or none)' if none else ''}")
    if len(items) > MAX_LIST:
        raise InputError(f"has {len(items)} items, beyond the limit of {MAX_LIST}: give fewer")
    try:
        return [one(s) for s in items]
    except InputError as e:
        raise InputError(f"each item {e}") from None


def _file_arg(check: Callable, label: str, role: str | None = None, **tags) -> Callable[[str], str]:
    """A path check as an argparse type that keeps the text (commands print and store it).

    ``role`` ("in" or "out") and ``tags`` mark what the path is for the command line's one check of
    all paths before a command runs (``cli.check_paths``): an output is never an input, never another
    output, and replaces only a file of its own kind (``kind``: what a weights output holds, a string
    or a function of the parsed args; ``text``: the kind of text file; ``may_be``: input flags it may
    equal, as ``heads upgrade FILE --out FILE``; ``also``: ``(what, suffix)`` of the files written
    beside it, named by the output's name and a suffix, such as a checkpoint)."""
    parse = _as_arg(lambda t: (check(t, ""), t)[1], label=label)
    parse.role, parse.tags = role, tags
    return parse


def tagged(parse: Callable, role: str, **tags) -> Callable:
    """``parse`` (an argparse type, e.g. a model name or folder) marked as an input or output path."""

    def wrapped(text: str):
        return parse(text)

    wrapped.__name__ = getattr(parse, "__name__", "path")
    wrapped.role, wrapped.tags = role, tags
    return wrapped


def weights_out(kind, **tags) -> Callable[[str], str]:
    """A weights output (.safetensors) that replaces only a file holding ``kind`` (``files.holds``)."""
    return _file_arg(weights_file, "weights file", "out", kind=kind, **tags)


path_arg = _file_arg(path, "path")
in_path_arg = _file_arg(path, "path", "in")
out_path_arg = _file_arg(path, "path", "out")
report_arg = _file_arg(report_file, "JSON report", "out")
plot_arg = _file_arg(plot_file, "plot file", "out")
table_arg = _file_arg(table_file, "table file", "out", text="table")
html_arg = _file_arg(
    lambda v, n: output_file(v, n, HTML_SUFFIXES, "HTML report"), "HTML report", "out", text="HTML report"
)
weights_arg = _file_arg(weights_file, "weights file", "out")
jsonl_arg = _file_arg(lambda v, n: output_file(v, n, (".jsonl",), "JSON lines file"), "JSON lines file", "out")
out_dir_arg = _file_arg(output_dir, "folder", "out")
in_file_arg = _file_arg(input_file, "file", "in")
in_stream_arg = _file_arg(readable_input, "file", "in")  # a file, or a stream read once (a FIFO, /dev/stdin)


def name_or_file_arg(names: tuple[str, ...], what: str) -> Callable[[str], str]:
    """One of ``names`` or an existing file (e.g. an exit head: auto, shared, trained or a heads file)."""

    def check(t: str) -> str:
        if t in names:
            return t
        p = path(t, "")
        if not p.is_file():
            raise InputError(
                f"{show(t)} is neither one of {', '.join(names)} nor an existing {what}: give one of those"
            )
        return input_file(t, "", what) and t

    return tagged(_as_arg(check, label=what), "in")


def _names(t: str) -> str:
    text(t, "")
    if not any(s.strip() for s in t.split(",")):
        raise InputError(f"{show(t)} names none: give a comma-separated list (or drop the flag for its default)")
    return t


names_arg = _as_arg(_names, label="comma list")  # a comma list of names, kept as the text; empty is refused


def text_arg(t: str) -> str:
    return _as_arg(lambda s: text(s, ""), label="text")(t)
