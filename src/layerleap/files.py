"""Writing files atomically, in one place.

Every file layerleap writes (reports, tables, plots, weights, heads, checkpoints) goes through
``atomic_write``: the content is written to a temporary sibling and moved over the target with
``os.replace``, so an interrupted run leaves either the old file or the new one, never half of one.
Weights are safetensors only (``save_safetensors``), never pickles.
"""

from __future__ import annotations

import glob
import json
import math
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import LayerleapError


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then move it over ``path``.

    The temporary name keeps the target's suffix (matplotlib and safetensors go by it) and is one of
    its own (the process id and a random part), so threads or processes writing one path at once
    never share one.  A failed write removes the temporary; an OS error becomes a ``LayerleapError``
    naming the file."""
    path = Path(path)
    tmp = _temporary(path, os.getpid(), secrets.token_hex(6))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _umask_mode(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise LayerleapError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _umask_mode(path: Path) -> None:
    """Give the file a plain ``open`` would make: read and write as the umask allows.  A writer that makes
    its file the owner's only (safetensors makes 0600) would leave a shared cache's or a team folder's
    weights unreadable to the others."""
    mode = 0o666 & ~_umask()
    st = os.stat(path)
    if not st.st_mode & 0o111 and st.st_mode & 0o777 != mode:
        os.chmod(path, mode)


def _umask() -> int:
    """The process's umask (Linux: read from /proc, as setting it to read it would race other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def stamp(path: str | Path) -> tuple[int, int, int, int, int]:
    """What tells a new version of the file at ``path`` from the one read (``OSError`` where it cannot be
    read): ``atomic_write`` replaces the file (a new inode), and a replacement within one tick of the file
    system's clock keeps the modification and change times; a file rewritten in place whose modification
    time is copied back (``cp -p``) keeps its inode and size, but not its change time."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _temporary(path: Path, pid: int, unique: str) -> Path:
    """``atomic_write``'s temporary for ``path`` in process ``pid``: ``.STEM.PID-UNIQUE.tmpSUFFIX``."""
    return path.with_name(f".{path.stem}.{pid}-{unique}.tmp{path.suffix}")


def _writer(name: str, head: str, tail: str) -> int | None:
    """The process id in a temporary's file name (``_temporary``; an older layerleap's had no
    ``-UNIQUE``), or None for a name of another form."""
    if not (name.startswith(head) and name.endswith(tail)) or len(name) <= len(head) + len(tail):
        return None
    pid, dash, unique = name[len(head) : -len(tail)].partition("-")
    if not pid.isdigit() or (dash and not (unique.isalnum() and unique.isascii())):
        return None
    return int(pid)


def remove_stale_temporaries(path: str | Path) -> None:
    """Delete the temporaries of ``path`` that ``atomic_write`` left in processes that were killed (no
    longer running): a write that fails or is interrupted removes its own, a killed one cannot.  For
    large files rewritten in place (the packed 4-bit cache); best effort."""
    path = Path(path)
    head, tail = f".{path.stem}.", f".tmp{path.suffix}"
    try:
        found = list(path.parent.glob(glob.escape(head) + "*" + glob.escape(tail)))
    except OSError:
        return
    for p in found:
        pid = _writer(p.name, head, tail)
        if pid is not None and not _running(pid):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (this one, and another user's, count as running)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number past any process id's range
        return False
    except OSError:  # not ours to signal, or no way to tell: assume it runs
        return True
    return True


def replace_dir(
    path: str | Path, fill: Callable[[Path], None], keep: Callable[[Path], bool] | None = None, fix: str = ""
) -> Path:
    """Call ``fill(tmp)`` on a temporary sibling folder of ``path`` (``.NAME.*.new``), then swap it in:
    an existing ``path`` is renamed aside, the new folder renamed into place, and the old one deleted,
    so an interrupted run leaves the old folder or the new one (the old one at worst beside it, as
    ``.NAME.*.old``), never neither; a failed ``fill`` removes the temporary folder.

    ``keep`` is for a folder another process may finish first (a cache entry): an existing ``path``
    that ``keep(path)`` accepts stays, and the new copy is dropped.  An OS error becomes a
    ``LayerleapError`` naming ``path`` (and ``fix``, what to do about it, when given)."""
    import shutil

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # made as ``mkdir`` makes a folder, with the umask's permissions (``mkdtemp``'s are the owner's only:
        # a shared cache's entries would be unreadable to the others)
        tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.new"
        tmp.mkdir()
        try:
            fill(tmp)
            if keep is None or not _move_in_unless_kept(tmp, path, keep):
                _swap_in(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise LayerleapError(f"cannot write {path}: {e.strerror or e}" + (f"; {fix}" if fix else "")) from None
    return path


def _move_in_unless_kept(new: Path, path: Path, keep: Callable[[Path], bool]) -> bool:
    """Rename ``new`` to ``path`` when nothing is there (one atomic step, so a folder another process
    renamed in first is never moved aside), or leave an existing ``path`` that ``keep`` accepts; False
    when neither happened (``path`` exists and is not kept: it is to be swapped out)."""
    try:
        os.replace(new, path)
        return True
    except OSError:
        if not path.exists():
            raise
        return keep(path)


def _swap_in(new: Path, path: Path) -> None:
    """Rename ``new`` to ``path``, an existing ``path`` renamed aside first (and back if that fails),
    then deleted."""
    import shutil

    old = new.with_suffix(".old")
    if path.exists():
        os.replace(path, old)
    try:
        os.replace(new, path)
    except OSError:
        if old.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_text(path: str | Path, text: str) -> Path:
    """``text`` as UTF-8 whatever the locale (an HTML report says ``charset=utf-8``; tables hold ``×``)."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


# -- JSON: strict on the way out, one reader on the way in ---------------------------------------------
NOT_FINITE = ("inf", "-inf", "nan")  # how a JSON file of layerleap's holds a float that is not finite


def strict(obj):
    """``obj`` as strict JSON can hold it: a float that is not finite (``alpha_rb=inf``, a speed-up over
    no time, a perplexity that overflowed) as its text, ``"inf"``, ``"-inf"`` or ``"nan"`` (JSON has no
    Infinity or NaN: browsers' ``JSON.parse`` and ``jq`` refuse them), which ``number`` and ``float()`` read
    back; tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(float(obj))
    if isinstance(obj, dict):
        return {
            (str(float(k)) if isinstance(k, float) and not math.isfinite(k) else k): strict(v) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def number(value):
    """A float that ``strict`` wrote as its text read back (``"inf"`` as ``inf``); any other value as it is."""
    return float(value) if isinstance(value, str) and value in NOT_FINITE else value


def json_text(obj, indent: int | None = None, **kw) -> str:
    """``obj`` as strict JSON text (``strict``): what every JSON file and ``--json`` print of layerleap's holds."""
    return json.dumps(strict(obj), allow_nan=False, indent=indent, **kw)


def write_json(path: str | Path, obj, indent: int = 1) -> Path:
    """``obj`` as strict JSON (``json_text``), atomically."""
    return write_text(path, json_text(obj, indent) + "\n")


def read_json(
    path: str | Path,
    what: str = "JSON file",
    fix: str = "delete it",
    *,
    kind: type | None = dict,
    cache: bool = False,
    error: type = LayerleapError,
    limit: str | None = "LAYERLEAP_MAX_INPUT_MB",
):
    """The JSON value in ``path`` (of type ``kind`` unless None): every JSON file layerleap reads goes
    through here.  A file that cannot be read, is not UTF-8, is not JSON (truncated, or nested past the
    parser's depth), holds another type of value or is larger than ``limit``'s size limit (an environment
    variable of ``validate.LIMITS``; None: none) is an ``error`` naming it and ``fix``; with ``cache`` each
    is None instead (a cache miss).  ``number`` reads back the non-finite floats ``strict`` wrote."""
    from .validate import limit_bytes

    path = Path(path)
    most = limit_bytes(limit) if limit else None
    try:
        large = most is not None and path.stat().st_size > most
        value = None if large else json.loads(path.read_bytes())  # bytes: UTF-8 (or 16, 32) by the first bytes
    except OSError as e:
        if cache:
            return None
        raise error(f"cannot read {what} {path} ({e.strerror or e}): {fix}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; brackets nested too deep
        if cache:
            return None
        why = f"{type(e).__name__}: " + " ".join(str(e).split())[:100]
        raise error(f"{what} {path} is not valid JSON ({why}): {fix}") from None
    if large:
        if cache:
            return None
        raise error(
            f"{what} {path} is larger than the limit of {most / 1e6:g} MB: {fix} (or set {limit}=MB to lift it)"
        )
    if kind is not None and not isinstance(value, kind):
        if cache:
            return None
        need = "an object" if kind is dict else "a list" if kind is list else kind.__name__
        raise error(f"{what} {path} holds JSON {type(value).__name__}, not {need}: {fix}")
    return value


LOCK_WAIT_S = 30.0  # the longest ``locked`` waits for another process's update of one file


@contextmanager
def locked(path: str | Path, wait: float | None = None, busy: str | None = None):
    """Hold ``path``'s file lock (a hidden sibling, ``.NAME.lock``) for a read-modify-write of a file that
    several processes update (a cache of measurements): read it again inside, change it, write it
    (``atomic_write``), so no process's entry is lost to another's write.  Readers need no lock (the
    writes are atomic).  A lock not had within ``wait`` seconds (``LOCK_WAIT_S``), or a folder that
    cannot be written, is a ``LayerleapError`` naming ``path``; ``busy``: its message for the lock not had
    (a file one process writes at a time)."""
    from filelock import FileLock, Timeout

    path = Path(path)
    lock = FileLock(str(path.with_name(f".{path.name}.lock")))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=LOCK_WAIT_S if wait is None else wait)
    except Timeout:
        raise LayerleapError(
            busy
            or f"cannot write {path}: another process held its lock {lock.lock_file} for too long; "
            "try again, or delete the lock file if no other layerleap runs"
        ) from None
    except OSError as e:
        raise LayerleapError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def save_safetensors(
    path: str | Path, tensors: dict, metadata: dict | None = None, may_replace: Callable[[dict], bool] | None = None
) -> Path:
    """``tensors`` (made contiguous, on the CPU) to a safetensors file; metadata values as strings.
    An existing file is only replaced when it holds the same kind of thing (``holds``) or
    ``may_replace(its metadata)`` says so: weights never replace training data, a model or other weights.
    A failed write is a ``LayerleapError`` naming the file (``atomic_write``)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    meta = {k: str(v) for k, v in (metadata or {}).items()}
    check_replace(path, holds(meta), may_replace=may_replace)
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}

    def write(p: Path) -> None:
        try:
            save_file(data, str(p), metadata=meta)
        except SafetensorError as e:  # safetensors' kind for a failed write (a full disk, a file size limit)
            raise OSError(str(e)) from None

    return atomic_write(path, write)


# -- what an existing output holds: replaced only by the same kind of thing ---------------------------
_OLD_KINDS = {"layerleap-exit-heads-v1": "exit-heads", "layerleap-bild-exit-head-v1": "exit-heads"}


def holds(meta: dict) -> str:
    """What a safetensors file holds, from its metadata: a weights file's ``kind`` (``medusa``,
    ``transfer``, ``eagle``, ``exit-heads``, ``variant``, ``corpus``, ``draft-vocab``, ``token-chunks``),
    ``training state``, else its ``format``."""
    fmt = str(meta.get("format") or "")
    if fmt.startswith("layerleap-train-state"):
        return "training state"
    kind = meta.get("kind") or _OLD_KINDS.get(fmt)
    if kind == "adapter-head":
        return "exit-heads"
    return kind or (f"tensors of format {fmt!r}" if fmt else "tensors without a layerleap kind")


def check_replace(
    path: str | Path, kind: str, name: str = "", may_replace: Callable[[dict], bool] | None = None
) -> None:
    """Refuse (``LayerleapError``) to replace an existing file that is not a safetensors file holding
    ``kind``; a missing file passes."""
    path = Path(path)
    if not path.exists():
        return
    say = f"{name} {path}" if name else str(path)
    fix = f"choose another {name or 'path'} (or delete it)"
    try:
        old = read_safetensors_meta(path)
    except (ValueError, OSError):
        raise LayerleapError(f"{say} exists and is not a safetensors file: {fix}") from None
    if holds(old) != kind and not (may_replace is not None and may_replace(old)):
        raise LayerleapError(f"{say} exists and holds {holds(old)}, not {kind}: {fix}")


TEXT_MARKS = {  # how a text output layerleap wrote can be told from a user's file
    "table": (lambda head, tail: head.startswith(b"`layerleap ")),
    "HTML report": (lambda head, tail: b"Written by layerleap" in tail),
}


def check_replace_text(path: str | Path, what: str, name: str = "") -> None:
    """Refuse to replace an existing, non-empty text file (a table, an HTML report) that layerleap did
    not write (``TEXT_MARKS``): ``--table README.md`` must not eat a README."""
    path = Path(path)
    if not path.is_file() or not path.stat().st_size:
        return
    with open(path, "rb") as f:
        head = f.read(64)
        f.seek(max(0, path.stat().st_size - 4096))
        tail = f.read()
    if not TEXT_MARKS[what](head, tail):
        say = f"{name} {path}" if name else str(path)
        raise LayerleapError(f"{say} exists and is not a layerleap {what}: choose another file name (or delete it)")


def _same(a: Path, b: Path) -> bool:
    """The same file or folder: one inode (hard links, symbolic links) or, for missing ones, one path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _inside(inner: Path, outer: Path) -> bool:
    return outer.is_dir() and inner.resolve().is_relative_to(outer.resolve())


def check_distinct(outputs: list[tuple[str, Path]], inputs: list[tuple[str, Path]], allowed=()) -> None:
    """The paths one command names: refuse (before any work) an output that is an input (by inode, so
    hard links too), a folder output that holds an input, and two outputs that are one path.
    ``outputs``/``inputs`` are ``(flag, path)``; ``allowed`` holds ``(output flag, input flag)`` pairs
    that may be one file (``heads upgrade FILE --out FILE`` rewrites in place)."""
    for i, (oname, out) in enumerate(outputs):
        flag = oname.split("'")[0]  # "--out's checkpoint": the fix is another --out
        for iname, inp in inputs:
            if (oname, iname) in allowed or not inp.exists():
                continue
            if _same(out, inp):
                raise LayerleapError(
                    f"{oname} {out} is also {iname}: writing it would destroy the input: choose another {flag}"
                )
            if _inside(inp, out):
                raise LayerleapError(
                    f"{oname} {out} holds {iname} {inp}: writing there could destroy the input: choose another {flag}"
                )
        for oname2, out2 in outputs[i + 1 :]:
            if _same(out, out2):
                raise LayerleapError(f"{oname} and {oname2} name one path, {out}: give each its own")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or a ``LayerleapError`` saying how to install it
    (plots are an extra: ``pip install 'layerleap[plot]'``)."""
    try:
        import matplotlib
    except ImportError:
        raise LayerleapError("this command draws plots and needs matplotlib: pip install 'layerleap[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure as an image (the format from the suffix), then closed."""
    import matplotlib.pyplot as plt

    from . import validate as V

    try:
        V.plot_file(path, "plot")
        return atomic_write(path, lambda p: fig.savefig(p, dpi=dpi))
    finally:
        plt.close(fig)


@contextmanager
def reading(path: str | Path, what: str = "file", fix: str = "delete it to start again"):
    """Reading a checkpoint, state or work file: any failure but a ``LayerleapError`` (a truncated or
    foreign file: safetensors', json's and torch's own errors) becomes one naming the file and the fix."""
    try:
        yield
    except LayerleapError:
        raise
    except Exception as e:
        why = " ".join(str(e).split())[:100]
        raise LayerleapError(f"{what} {path} cannot be read ({type(e).__name__}: {why}): {fix}") from None


def read_report(path: str | Path, what: str, fields: tuple[str, ...] = ("config", "records")) -> dict | None:
    """An earlier JSON report to resume from: None when there is none (or the file is empty); a
    ``LayerleapError`` when the file is something else (it is never overwritten then)."""
    path = Path(path)
    if not path.is_file() or not path.stat().st_size:
        return None
    old = read_json(path, what, cache=True)  # a file past the size limit is not a report of ours either
    if old is None or not isinstance(old.get("config"), dict) or any(f not in old for f in fields):
        raise LayerleapError(f"{path} exists and is not {what}: choose another --json (or delete it)")
    return old


def read_safetensors_meta(path: str | Path) -> dict:
    """The metadata of a safetensors file; ``ValueError`` for a truncated or foreign file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:
        raise ValueError(str(e)) from None


def newer_format(found, ours: str) -> bool:
    """Whether the format ``found`` is a later version of ``ours`` (``layerleap-weights-3`` of
    ``layerleap-weights-2``): a file a newer layerleap wrote."""
    if not isinstance(found, str):
        return False
    name, _, version = ours.rpartition("-")
    head, _, theirs = found.rpartition("-")
    return head == name and theirs.isdigit() and version.isdigit() and int(theirs) > int(version)


def newer_file(path, found: str, ours: str, command: str) -> str:
    """The message for a file of a later format than ``ours`` (``newer_format``)."""
    return (
        f"{path} was written by a newer layerleap (format {found!r}; this version reads {ours!r}): "
        f"upgrade layerleap (pip install -U layerleap), or write it again with `{command}`"
    )


def no_fingerprint(path, what: str, command: str) -> str:
    """The message for a layerleap file whose metadata names no model (``fingerprint``)."""
    return f"{path} ({what}) has no model fingerprint in its metadata: write it again with `{command}`"


def read_made_for(path, fmt: str, name: str, fingerprint: str, what: str, command: str, error: type, framework="pt"):
    """``(tensor, metadata)``: the tensor ``name`` of a layerleap file of format ``fmt`` made for the model
    with ``fingerprint``.  A missing, truncated or foreign file, or another model's, raises ``error``
    (a ``LayerleapError``) naming the file and the fix (``command``, which writes one)."""
    from safetensors import safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"no such {what} file {str(path)!r}: write one with `{command}`")
    try:
        meta = read_safetensors_meta(p)
        with safe_open(str(p), framework) as f:
            tensor = f.get_tensor(name) if meta.get("format") == fmt else None
    except Exception as e:  # truncated or foreign: safetensors' own error kinds
        raise error(f"cannot read {what} {p}: {str(e)[:100]}; write it again with `{command}`") from None
    if tensor is None:
        if newer_format(meta.get("format"), fmt):
            raise error(newer_file(p, meta["format"], fmt, command))
        raise error(f"{p} is not a {what} file (format {meta.get('format')!r}): use `{command}`")
    if not meta.get("fingerprint"):
        raise error(no_fingerprint(p, what, command))
    if meta.get("fingerprint") != fingerprint:
        raise error(
            f"{p} was made for another model (fingerprint {meta.get('fingerprint')}, "
            f"{meta.get('model') or 'unnamed'}; this model {fingerprint}): write one for it with `{command}`"
        )
    return tensor, meta


def cache_root() -> Path:
    """The user cache (converted models, kernel choices): ``$LAYERLEAP_CACHE`` (a leading ``~`` is the home
    folder, as a shell would expand it) or ``~/.cache/layerleap``."""
    return Path(os.environ.get("LAYERLEAP_CACHE") or Path.home() / ".cache" / "layerleap").expanduser()
