"""The user cache (``$LAYERLEAP_CACHE``, default ``~/.cache/layerleap``): what is in it, and deleting it safely.

``entries()`` lists what layerleap keeps there, one ``Entry`` each: its kind (``KINDS``), what it belongs to,
its size and modification time, and why it is stale, if it is.  Stale means this layerleap, on this machine,
would never read it again: a conversion whose model package is no longer installed or now holds another
file, a user's GGUF conversion whose file is gone or has changed since, a folder of an older conversion
format, a native build or 4-bit pack for another source, CPU or torch version, a file that does not parse,
the temporary of a write whose process no longer runs, a lock file whose entry is gone.  (Another machine
or environment sharing the cache may still use such an entry; it is made again where it is needed, a native
build only by ``layerleap native --build``: until then the Python path runs.)

``clear(...)`` deletes entries (``select`` picks them: stale ones, all, one kind or by name) under the
lock their writers take where they take one (a conversion's ``.locks/NAME.lock``, a native build's
``layerleap.lock``, a measurement or self-distill file's ``files.locked`` lock): an entry another process
is writing is skipped and said so, never deleted under it.  A folder is first renamed aside, then deleted, so an
interrupted deletion never leaves half an entry under its name.  Only what the listing found is deleted,
never through a symbolic link: a link is removed itself, never what it points at.  Files in the cache that
layerleap did not write (kind ``other``) are listed and deleted only when named.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LayerleapError
from .files import _running, cache_root

KINDS = {  # kind -> what the listing calls it
    "model": "model conversion",
    "q4": "4-bit conversion",
    "q4-pack": "4-bit pack",
    "gguf": "joined GGUF",
    "native": "native build",
    "kernels": "kernel timings",
    "call-cost": "call-cost curves",
    "calibration": "calibration",
    "self-distill": "self-distill data",
    "states": "training states",
    "temporary": "temporary",
    "lock": "lock file",
    "other": "not layerleap's",
}
CLEARABLE = tuple(k for k in KINDS if k != "other")  # what --all, --stale and --kind may delete


class CacheError(LayerleapError, ValueError):
    pass


@dataclass
class Entry:
    """One thing in the cache: ``name`` is its path under the cache folder (``/``-separated)."""

    name: str
    kind: str
    path: Path
    belongs_to: str = ""
    size: int = 0
    modified: float = 0.0
    stale: str | None = None  # why it is stale; None: in use (or of unknown use)
    busy: str | None = None  # another process is writing it (it is not deleted)
    inside: str | None = None  # the entry whose folder holds this one (deleted with it)
    locks: list[Path] = field(default_factory=list)  # its lock files (deleted with it, under the lock)

    @property
    def title(self) -> str:
        return KINDS[self.kind]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "title": self.title,
            "belongs_to": self.belongs_to,
            "path": str(self.path),
            "size": self.size,
            "modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.modified)) if self.modified else None,
            "stale": self.stale,
            "busy": self.busy,
            "inside": self.inside,
        }


def human(size: float) -> str:
    """A size in bytes as people read it (``513.2 MB``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""  # not reached


# -- names ------------------------------------------------------------------------------------------------
# the temporaries layerleap's writers leave when killed (files.atomic_write, files.replace_dir,
# core.loading._remove_tree); each names the file or folder it was for
_ATOMIC = re.compile(r"\.(?P<stem>.+)\.(?P<pid>\d+)(?:-[A-Za-z0-9]+)?\.tmp(?P<suffix>(?:\.[^.]+)?)")
_SWAP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]+\.(?:new|old)")
_ASIDE = re.compile(r"\.(?P<name>.+)\.[A-Za-z0-9_]{8}")  # tempfile.mkdtemp(prefix=".NAME.")
# files.locked's lock beside a file (JSON measurements and calibrations, self-distill data)
_LOCK = re.compile(r"\.(?P<name>.+\.jsonl?)\.lock")


def _temporary(name: str, is_dir: bool) -> tuple[str, int | None] | None:
    """``(what it was for, the writer's process id or None)`` for a temporary's name, else None."""
    m = _ATOMIC.fullmatch(name)
    if m and not is_dir:
        return m["stem"] + m["suffix"], int(m["pid"])
    m = _SWAP.fullmatch(name)
    if m and is_dir:
        return m["name"], int(m["pid"])
    m = _ASIDE.fullmatch(name)
    if m and is_dir and _folder_name(m["name"]):
        return m["name"], None
    return None


def _writing_in(folder: Path) -> str | None:
    """For a folder entry: a running process writing a file or folder in it (its temporary is there), else None."""
    for p in _children(folder):
        temp = _temporary(p.name, _real_dir(p)) if p.name.startswith(".") else None
        if temp is not None and temp[1] is not None and _running(temp[1]):
            return f"process {temp[1]} is writing {temp[0]} in it"
    return None


_NATIVE_NAME = re.compile(r"[0-9a-f]{12}-torch.+")  # core.native.build_dir's
_STATES_NAME = re.compile(r".+-layers[0-9,]*-[0-9a-f]{16}")  # train.state_cache.StateCache's


def _folder_name(name: str) -> bool:
    """Whether ``name`` is one layerleap gives a cache folder it may rename aside to delete (a conversion,
    a native build, a folder of training states): a hidden folder named after another is not ours."""
    return bool(
        _packaged(name)
        or re.fullmatch(r"gguf-.*-[0-9a-f]{10}(?:-q4)?", name)
        or _NATIVE_NAME.fullmatch(name)
        or _STATES_NAME.fullmatch(name)
    )


def _walk(path: Path) -> tuple[int, float]:
    """``(bytes, newest modification time)`` of a file or a folder's tree; links are not followed."""
    try:
        st = path.lstat()
    except OSError:
        return 0, 0.0
    size, newest = st.st_size, st.st_mtime
    if path.is_symlink() or not path.is_dir():
        return size, newest
    size = 0
    try:
        children = list(os.scandir(path))
    except OSError:
        return size, newest
    for c in children:
        s, m = _walk(Path(c.path))
        size, newest = size + s, max(newest, m)
    return size, newest


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:160]


# -- what each kind is and whether it is stale ------------------------------------------------------------
class _Here:
    """What this layerleap, here, would read (worked out once a listing, on demand)."""

    def __init__(self):
        self._sizes: dict[str, int | str] = {}
        self._native: dict[str, str | None] = {}
        self._packs: set[str] | None = None

    def package_size(self, model: str) -> int | str:
        """The packaged model's GGUF size (what its cache entries are named by), or why it has none."""
        if model not in self._sizes:
            from .core.loading import PACKAGED, MissingPackage, _gguf_parts

            try:
                self._sizes[model] = sum(p.stat().st_size for p in _gguf_parts(PACKAGED[model]))
            except (MissingPackage, OSError):
                pk = PACKAGED[model].packages
                self._sizes[model] = (
                    f"its packages ({pk[0]} … {pk[-1]}) are not all installed"
                    if len(pk) > 1
                    else f"its package {pk[0]} is not installed"
                )
        return self._sizes[model]

    def native(self, target: str) -> str | None:
        """The name of this source, torch and CPU's native build folder for the -march ``target`` (a build
        for another target than this CPU's is loaded while LAYERLEAP_NATIVE_MARCH names it); None: none can be."""
        if target not in self._native:
            try:
                from .core.native import build_dir

                self._native[target] = build_dir(target).name
            except Exception:  # no source: no build is this install's
                self._native[target] = None
        return self._native[target]

    def packs(self) -> set[str]:
        """The 4-bit pack files this layerleap reads on this CPU and torch version (either kernel's)."""
        if self._packs is None:
            from .core.gguf_q4 import BLOCKS_LAYOUT
            from .core.kernels import packed_layout

            self._packs = {f"packed-{BLOCKS_LAYOUT}.safetensors", f"packed-{packed_layout()}.safetensors"}
        return self._packs


def _packaged(name: str):
    """``(model, size in hex, q4)`` for a packaged model's conversion folder name, else None."""
    from .core.loading import PACKAGED

    models = "|".join(re.escape(m) for m in PACKAGED)
    m = re.fullmatch(rf"(?P<model>{models})-(?P<size>[0-9a-f]+)(?P<q4>-q4)?", name)
    return (m["model"], m["size"], bool(m["q4"])) if m else None


def _conversion_problem(folder: Path, q4: bool) -> str | None:
    """Why a conversion folder cannot be used as it is (a load would convert again), else None."""
    from .core import gguf_q4
    from .core.loading import check_folder

    if not os.access(folder, os.R_OK | os.X_OK):  # another user's (a shared cache), which this one cannot read
        return None
    if not os.path.isfile(folder / "tokenizer.json"):
        return "it has no tokenizer (a load converts it again)"
    try:
        (gguf_q4.check if q4 else check_folder)(folder)
    except Exception as e:  # LayerleapError; anything else a damaged folder raises is no reason to stop the listing
        return f"broken or of an older format, so a load converts it again ({_short(e)})"
    return None


def _model_folder(e: Entry, here: _Here) -> None:
    model, size, q4 = _packaged(e.path.name)
    e.kind, e.belongs_to = ("q4" if q4 else "model"), model
    now = here.package_size(model)
    if isinstance(now, str):
        e.stale = now
    elif f"{now:x}" != size:
        e.stale = "its package now holds another file of the model (a load converts that one)"
    else:
        e.stale = _conversion_problem(e.path, q4)


def _gguf_folder(e: Entry) -> None:
    from .core.loading import GGUF_SOURCE, gguf_key

    m = re.fullmatch(r"gguf-(?P<stem>.*)-(?P<key>[0-9a-f]{10})(?P<q4>-q4)?", e.path.name)
    q4 = bool(m["q4"])
    e.kind = "q4" if q4 else "model"
    note = _read_json(e.path / GGUF_SOURCE)
    source = note.get("path") if isinstance(note, dict) and isinstance(note.get("path"), str) else None
    if source is None:
        e.belongs_to = f"{m['stem']}.gguf (its folder not recorded)"
        e.stale = _conversion_problem(e.path, q4)
        return
    e.belongs_to = source
    try:
        key = gguf_key(Path(source))
    except OSError:
        e.stale = f"its GGUF file {source} is gone"
        return
    if key != m["key"]:
        e.stale = f"its GGUF file {source} has changed since it was converted (a load converts it again)"
    else:
        e.stale = _conversion_problem(e.path, q4)


def _pack(e: Entry, here: _Here) -> None:
    from .core.gguf_q4 import FORMAT
    from .files import read_safetensors_meta

    e.kind = "q4-pack"
    if e.path.name not in here.packs():
        e.stale = "a layout this layerleap does not read on this CPU and torch version"
        return
    try:
        fmt = read_safetensors_meta(e.path).get("format")
    except (ValueError, OSError):
        fmt = None
    if fmt != FORMAT + "-packed":
        e.stale = "not a readable pack (a load packs again)"


def _joined(e: Entry, here: _Here) -> None:
    model, size, _ = _packaged(e.path.name.removesuffix(".gguf"))
    e.kind, e.belongs_to = "gguf", model
    now = here.package_size(model)
    if isinstance(now, str):
        e.stale = now
    elif f"{now:x}" != size or e.size != now:
        e.stale = "its package now holds another file of the model, or it is incomplete"


def _native(e: Entry, here: _Here) -> None:
    e.kind = "native"
    m = re.fullmatch(r"[0-9a-f]{12}-torch(?P<torch>[^-]+)-(?P<cap>[^-]+)-(?P<py>py\d+)(?:-(?P<march>.+))?", e.path.name)
    e.belongs_to = (
        f"torch {m['torch']}, {m['py']}, {m['cap']}" + (f", -march={m['march']}" if m["march"] else "") if m else ""
    )
    if e.path.name != here.native((m["march"] if m else None) or "native"):
        e.stale = "not this layerleap's build for this CPU, torch and Python (another version's source or CPU)"


def _measurements(e: Entry, kind: str) -> None:
    e.kind = kind
    data = _read_json(e.path)
    if not isinstance(data, dict):
        e.stale = "it does not parse (measured again when needed)"
    else:
        e.belongs_to = f"{len(data)} measurement{'s' * (len(data) != 1)}"


def _calibration(e: Entry) -> None:
    from .methods.budget import FORMAT

    e.kind = "calibration"
    data = _read_json(e.path)
    parts = e.name.split("/")
    e.belongs_to = f"{parts[-1].removesuffix('.json')}, {parts[-2]}, fingerprint {parts[-3]}"
    if not isinstance(data, dict) or not isinstance(data.get("budgets"), dict):
        e.stale = "it does not parse (`layerleap calibrate` writes it again)"
        return
    if isinstance(data.get("model"), str):
        e.belongs_to = f"{data['model']} {e.belongs_to}"
    fmt = data.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt < FORMAT:
        e.stale = f"format {fmt}, older than this layerleap's ({FORMAT})"


def _self_distill(e: Entry) -> None:
    e.kind = "self-distill"
    m = re.fullmatch(r"(?P<model>.+)-(?P<fp>[0-9a-f]{16})-p(?P<p>\d+)-g(?P<g>\d+)(?P<rest>.*)\.jsonl", e.path.name)
    e.belongs_to = f"{m['model']}, fingerprint {m['fp']}" if m else ""


def _states(e: Entry) -> None:
    from .files import read_safetensors_meta
    from .train.state_cache import FORMAT

    e.kind = "states"
    e.busy = _writing_in(e.path)
    model = e.path.parent.name
    e.belongs_to = f"{model.rsplit('-', 1)[0]}, fingerprint {model.rsplit('-', 1)[-1]}" if "-" in model else model
    shards = sorted(e.path.glob("shard-*.safetensors"))
    if shards:
        try:
            fmt = read_safetensors_meta(shards[0]).get("format")
        except (ValueError, OSError):
            fmt = None
        if fmt != FORMAT:
            e.stale = f"not of this layerleap's format ({FORMAT}): not read"


def _temp(e: Entry, target: str, pid: int | None) -> None:
    e.kind, e.belongs_to = "temporary", target
    if pid is None:
        e.stale = "left by a removal or conversion that did not finish"
    elif _running(pid):
        e.busy = f"process {pid} is writing it"
    else:
        e.stale = f"left by process {pid}, which no longer runs"


# -- the listing ------------------------------------------------------------------------------------------
def _entry(root: Path, path: Path, inside: str | None = None) -> Entry:
    size, modified = _walk(path)
    return Entry(path.relative_to(root).as_posix(), "other", path, size=size, modified=modified, inside=inside)


def _holder(path: Path) -> int | None:
    """The process holding the file lock on ``path`` (Linux's ``/proc/locks``, read without taking the lock),
    else None (also where the system does not say)."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if where in fields[3:6]:
            pid = fields[fields.index(where) - 1]
            return int(pid) if pid.isdigit() else None
    return None


def _orphan_lock(e: Entry, target: str) -> None:
    """A lock file whose entry ``target`` is gone: stale, unless a process holds it (a first write under way)."""
    pid = _holder(e.path)
    if pid is not None:
        e.busy = f"process {pid} holds it (writing {target} for the first time)"
    else:
        e.stale = f"{target} is gone"


def _hidden(root: Path, path: Path, out: list[Entry], inside: str | None = None) -> bool:
    """Add a temporary or an orphaned lock file at ``path`` (a hidden name) to ``out``; False for another name."""
    is_dir = _real_dir(path)
    lock = _LOCK.fullmatch(path.name)
    if lock and not is_dir:  # files.locked's: listed only once its file is gone
        if not os.path.lexists(path.with_name(lock["name"])):
            e = _entry(root, path, inside)
            e.kind, e.belongs_to, e.locks = "lock", lock["name"], [path]
            _orphan_lock(e, lock["name"])
            out.append(e)
        return True
    temp = _temporary(path.name, is_dir)
    if temp is None:
        return False
    e = _entry(root, path, inside)
    _temp(e, *temp)
    out.append(e)
    return True


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _real_dir(path: Path) -> bool:
    """A folder, not a link to one (False where it cannot be told: a folder without search permission)."""
    return os.path.isdir(path) and not os.path.islink(path)


def entries(root: str | Path | None = None) -> list[Entry]:
    """Everything in the cache folder ``root`` (``files.cache_root()`` by default), one ``Entry`` each (see the
    module's text); [] where the folder does not exist, a ``CacheError`` where something else is there or it
    cannot be read.
    Nothing is written, and no lock is taken."""
    root = Path(root).expanduser() if root is not None else cache_root()
    if not os.path.isdir(root):
        if os.path.lexists(root):
            raise CacheError(
                f"the cache path {root} is not a folder (a file, or a link to nothing): set LAYERLEAP_CACHE to a "
                "folder, or move it away"
            )
        return []
    try:
        os.listdir(root)
    except OSError as e:
        raise CacheError(f"cannot read the cache folder {root}: {e.strerror or e}") from None
    here, out = _Here(), []
    for path in _children(root):
        name = path.name
        if name.startswith("."):
            if name == ".locks" and _real_dir(path):
                _locks(root, path, out)
            elif not _hidden(root, path, out):
                out.append(_entry(root, path))
            continue
        if os.path.islink(path):
            out.append(_entry(root, path))
        elif _real_dir(path):
            _folder(root, path, here, out)
        else:
            e = _entry(root, path)
            if name == "kernels.json":
                _measurements(e, "kernels")
            elif name == "call_cost.json":
                _measurements(e, "call-cost")
            elif name.endswith(".gguf") and _packaged(name.removesuffix(".gguf")):
                _joined(e, here)
            out.append(e)
    locked_kinds = ("model", "q4", "native", "kernels", "call-cost", "calibration", "self-distill")
    for e in out:  # an entry whose lock a process holds is being written (or waited on): busy
        if e.busy is None and e.kind in locked_kinds:
            pid = next((p for p in map(_holder, _lock_paths(root, e)) if p is not None), None)
            if pid is not None:
                e.busy = f"process {pid} holds its lock (it is writing it)"
    return out


def _locks(root: Path, folder: Path, out: list[Entry]) -> None:
    """The conversions' locks (``.locks/NAME.lock``): each goes with its entry; one whose entry is gone is listed."""
    for path in _children(folder):
        target = root / path.name.removesuffix(".lock")
        if path.suffix != ".lock" or os.path.islink(path) or os.path.isdir(path):
            out.append(_entry(root, path))
        elif not os.path.lexists(target):
            e = _entry(root, path)
            e.kind, e.belongs_to, e.locks = "lock", target.name, [path]
            writers = [_temporary(p.name, True) for p in root.glob(f".{glob.escape(target.name)}.*.new")]
            running = [t[1] for t in writers if t is not None and t[0] == target.name and _running(t[1])]
            if running:  # a first conversion: its folder is not there yet
                e.busy = f"process {running[0]} is converting {target.name}"
            else:
                _orphan_lock(e, target.name)
            out.append(e)


def _folder(root: Path, path: Path, here: _Here, out: list[Entry]) -> None:
    name = path.name
    if name == "native":
        for p in _children(path):
            if p.name.startswith(".") and _hidden(root, p, out):
                continue
            e = _entry(root, p)
            if _real_dir(p) and _NATIVE_NAME.fullmatch(p.name):  # a build's name; another folder is not ours
                _native(e, here)
            out.append(e)
        return
    if name in ("self-distill", "calibration", "states"):
        _data(root, path, name, out)
        return
    e = _entry(root, path)
    kept = len(out)
    out.append(e)
    if _packaged(name) or re.fullmatch(r"gguf-.*-[0-9a-f]{10}(?:-q4)?", name):
        lock = root / ".locks" / f"{name}.lock"
        e.locks = [lock] if os.path.exists(lock) else []
        (_model_folder(e, here) if _packaged(name) else _gguf_folder(e))
        if e.kind == "q4":  # its packs and a killed packing's temporary: entries of their own
            for p in _children(path):
                if p.name.startswith("packed-") and p.suffix == ".safetensors" and not os.path.islink(p):
                    pack = _entry(root, p, inside=e.name)
                    _pack(pack, here)
                    pack.belongs_to = e.belongs_to
                    out.append(pack)
                elif p.name.startswith("."):
                    _hidden(root, p, out, inside=e.name)
            e.size -= sum(x.size for x in out[kept + 1 :])
        e.busy = _writing_in(e.path)


def _data(root: Path, folder: Path, kind: str, out: list[Entry]) -> None:
    """``self-distill/*.jsonl``, ``calibration/FINGERPRINT/DTYPE/METHOD.json``, ``states/MODEL/KEY/``."""
    depth = {"self-distill": 1, "calibration": 3, "states": 2}[kind]

    def visit(path: Path, level: int) -> None:
        for p in _children(path):
            if p.name.startswith(".") and _hidden(root, p, out):
                continue
            if level < depth and _real_dir(p):
                visit(p, level + 1)
                continue
            e = _entry(root, p)
            if level == depth and not os.path.islink(p):
                if kind == "self-distill" and p.suffix == ".jsonl" and os.path.isfile(p):
                    _self_distill(e)
                elif kind == "calibration" and p.suffix == ".json" and os.path.isfile(p):
                    _calibration(e)
                elif kind == "states" and os.path.isdir(p) and _STATES_NAME.fullmatch(p.name):
                    _states(e)
                if e.kind in ("self-distill", "calibration"):  # files.locked's lock beside it
                    lock = p.with_name(f".{p.name}.lock")
                    e.locks = [lock] if os.path.exists(lock) else []
            out.append(e)

    visit(folder, 1)


# -- choosing and deleting --------------------------------------------------------------------------------
def check_choice(stale: bool = False, all: bool = False, kind: str | None = None, names=()) -> None:
    """Refuse (``CacheError``) a choice of entries to delete that says nothing, or two things at once."""
    if kind is not None and kind not in CLEARABLE:
        raise CacheError(f"unknown kind {kind!r}: choose one of {', '.join(CLEARABLE)}")
    if names and (stale or all or kind):
        raise CacheError("entry names choose by themselves: give them without --stale, --all or --kind")
    if all and (stale or kind):
        raise CacheError("--all deletes every entry layerleap wrote: give it without --stale or --kind")
    if not (stale or all or kind or names):
        raise CacheError(
            "say what to delete: --stale (with --kind KIND for one kind), --all, --kind KIND, or entry names "
            "(`layerleap cache list` shows them)"
        )


def select(
    found: list[Entry],
    stale: bool = False,
    all: bool = False,
    kind: str | None = None,
    names: list[str] | tuple[str, ...] = (),
    root: str | Path | None = None,
) -> list[Entry]:
    """The entries of ``found`` to delete: the stale ones (``stale``, of ``kind`` when given), every one
    layerleap wrote (``all``), those of ``kind``, or those ``names`` names (each an entry's name or path, as
    ``entries`` lists it); an entry's folder brings the entries inside it.  A wrong choice is a ``CacheError``."""
    root = Path(root).expanduser() if root is not None else cache_root()
    check_choice(stale, all, kind, names)
    if names:
        by_name = {e.name: e for e in found}
        by_path = {os.path.normpath(os.path.abspath(e.path)): e for e in found}
        picked = []
        for n in names:
            hit = by_name.get(str(n).strip("/")) or by_path.get(os.path.normpath(os.path.abspath(Path(n).expanduser())))
            if hit is None:
                raise CacheError(f"no entry {n!r} in the cache {root}: give a name `layerleap cache list` shows")
            picked.append(hit)
    else:
        picked = [
            e
            for e in found
            if e.kind in CLEARABLE and (kind is None or e.kind == kind) and (not stale or e.stale is not None)
        ]
    chosen = {e.name for e in picked}
    return [e for e in found if e.name in chosen or (e.inside is not None and e.inside in chosen)]


@dataclass
class Cleared:
    deleted: list[Entry] = field(default_factory=list)
    skipped: list[tuple[Entry, str]] = field(default_factory=list)  # (entry, why it was not deleted)

    @property
    def freed(self) -> int:
        return sum(e.size for e in self.deleted)


def clear(
    stale: bool = False,
    all: bool = False,
    kind: str | None = None,
    names: list[str] | tuple[str, ...] = (),
    dry_run: bool = False,
    root: str | Path | None = None,
    chosen: list[Entry] | None = None,
) -> Cleared:
    """Delete the entries ``select`` picks (or ``chosen``, entries of ``entries(root)``), each under its
    writers' lock; with ``dry_run`` nothing is deleted and ``deleted`` holds what would be.  An entry
    another process is writing, or that cannot be deleted, is skipped (``Cleared.skipped`` says why)."""
    root = Path(root).expanduser() if root is not None else cache_root()
    if chosen is None:
        chosen = select(entries(root), stale, all, kind, names, root)
    done = Cleared()
    gone: set[str] = set()
    for e in chosen:
        if e.inside is not None and e.inside in gone:  # deleted with its folder
            done.deleted.append(e)
            continue
        try:
            why = e.busy or (_writer_running(e) if dry_run else _delete(root, e))
        except OSError as err:  # a folder on the way this user may not search
            why = f"cannot delete it: {err.strerror or err}"
        if why is None:
            done.deleted.append(e)
            gone.add(e.name)
        else:
            done.skipped.append((e, why))
    return done


def _inside_root(root: Path, path: Path) -> bool:
    """Whether ``path`` lies under ``root`` with no symbolic link on the way (the path itself may be one)."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        return False
    if not rel.parts or ".." in rel.parts:
        return False
    step = root
    for part in rel.parts[:-1]:
        step = step / part
        if step.is_symlink() or not step.is_dir():
            return False
    return True


def _lock_paths(root: Path, e: Entry) -> list[Path]:
    """The lock files ``e``'s writers take (``_delete`` takes them too)."""
    path = e.path
    if e.kind in ("model", "q4") or (e.kind == "temporary" and e.inside is None and _real_dir(path)):
        return [root / ".locks" / f"{e.belongs_to if e.kind == 'temporary' else path.name}.lock"]
    if e.kind == "native" and _real_dir(path):
        return [path / "layerleap.lock"]
    if e.kind in ("kernels", "call-cost", "calibration", "self-distill"):
        return [path.with_name(f".{path.name}.lock")]
    return list(e.locks)


def _delete(root: Path, e: Entry) -> str | None:
    """Delete ``e`` under its lock; why not, or None once it is gone."""
    from filelock import FileLock, Timeout

    path = e.path
    if not os.path.lexists(path):  # another process deleted it meanwhile
        return None
    if not _inside_root(root, path):
        return f"{path} is not inside the cache {root} (a symbolic link on the way): not deleted"
    locks = _lock_paths(root, e)
    held = []
    try:
        for lock_path in locks:
            if not lock_path.exists() and e.kind != "native":
                continue  # no writer has taken it: none is writing (and none made the file to wait on)
            lock = FileLock(str(lock_path))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                return "another process is writing it (its lock is held): try again later"
            except OSError as err:
                return f"cannot take its lock {lock_path}: {err.strerror or err}"
            held.append(lock)
        busy = _writer_running(e)
        if busy:
            return busy
        try:
            _remove(root, path)
            for lock_path in locks:
                # while held: a process waiting on it finds the entry gone and makes it again; never one reached
                # through a link (a linked .locks folder's files are not the cache's)
                if e.kind != "native" and lock_path.exists() and _inside_root(root, lock_path):
                    lock_path.unlink()
        except OSError as err:
            return f"cannot delete it: {err.strerror or err}"
    finally:
        for lock in held:
            lock.release()
    for folder in {path.parent, *(p.parent for p in locks)}:
        _prune(root, folder)
    return None


def _writer_running(e: Entry) -> str | None:
    """For a file that is written without a lock (``atomic_write``), or a folder whose files are: a running
    process writing it (or in it) now."""
    if e.kind == "temporary":
        temp = _temporary(e.path.name, _real_dir(e.path))
        if temp is not None and temp[1] is not None and _running(temp[1]):
            return f"process {temp[1]} is writing it"
        return None
    if e.kind in ("model", "q4", "states") and _real_dir(e.path):
        return _writing_in(e.path)
    if not e.path.is_file() or e.path.is_symlink():
        return None
    for p in e.path.parent.glob(f".{glob.escape(e.path.stem)}.*.tmp{glob.escape(e.path.suffix)}"):
        temp = _temporary(p.name, False)
        if temp is not None and temp[0] == e.path.name and _running(temp[1]):
            return f"process {temp[1]} is writing a new copy of it"
    return None


def _remove(root: Path, path: Path) -> None:
    """Delete a file or link, or rename a folder aside and delete it (no half folder under its name)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}")  # _ASIDE's form: a killed deletion is listed
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process deleted it meanwhile
        return
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.lexists(aside):
        raise OSError(f"could not delete all of {aside}")


def _prune(root: Path, folder: Path) -> None:
    """Remove the folders left empty up to the cache folder (``calibration/FP/DTYPE``, ``.locks``)."""
    while folder != root and _inside_root(root, folder):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
