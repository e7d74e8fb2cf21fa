"""Weights loaded for a model (exit heads, drafters, BiLD exit heads), kept while the model lives.

A method asks for its heads on every ``generate`` call; reading and checking the file each time
cost about 30 ms per call, inside the timed path.  ``per_model`` keeps what a loader returned for a
model and file (by path, and its version: ``files.stamp``, the inode, size, modification and change times),
so a file is read once per model; a file that changes is read again and replaces what was kept for it; the
entries go with the model (a weak reference)."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
_CACHE: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _key(kind: str, path) -> tuple[tuple, tuple] | None:
    """(which file: kind and path, its version: ``files.stamp``), or None."""
    from .files import stamp

    p = Path(path).expanduser()
    try:
        return (kind, str(p.resolve())), stamp(p)
    except OSError:
        return None


def per_model(model, kind: str, path, load: Callable[[], T]) -> T:
    """``load()`` once per ``model`` and file ``path`` (a path that cannot be read is not kept: the
    loader's own error names it)."""
    found = _key(kind, path)
    if found is None:
        return load()
    key, version = found
    store = _CACHE.setdefault(model, {})
    kept = store.get(key)
    if kept is None or kept[0] != version:  # one entry per file: a rewritten file's old contents are let go
        store[key] = kept = (version, load())
    return kept[1]


def shipped_files(model, folder: Path, read_meta: Callable[[Path], dict] | None = None) -> list[Path]:
    """The safetensors files in ``folder`` made for ``model`` (matched by the fingerprint in their
    metadata, read by ``read_meta``), looked up once per model."""
    from .files import read_safetensors_meta

    if not folder.is_dir():
        return []
    meta = read_meta or read_safetensors_meta

    def find() -> list[Path]:
        return sorted(p for p in folder.glob("*.safetensors") if meta(p).get("fingerprint") == model.fingerprint)

    return per_model(model, f"shipped {folder}", folder, find)


def shipped_or_file(model, spec, none: str, folder: Path, load: Callable, fail: Callable[[], Exception]):
    """A file-backed option's value: ``none`` (or None) -> None; "auto" -> the newest file shipped in
    ``folder`` for ``model`` (None where none is), loaded by ``load(model, path)``; a path -> that
    file, loaded; anything else -> ``fail()`` raised."""
    if spec == none or spec is None:
        return None
    if spec == "auto":
        files = shipped_files(model, folder)
        return load(model, files[-1]) if files else None
    if isinstance(spec, (str, Path)):
        return load(model, spec)
    raise fail()


def clear(model=None) -> None:
    """Forget what was loaded for ``model`` (or for every model)."""
    if model is None:
        _CACHE.clear()
    else:
        _CACHE.pop(model, None)
