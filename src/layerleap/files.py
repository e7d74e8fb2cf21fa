"""Writing files atomically, in one place.

Every file layerleap writes (reports, tables, plots, weights, heads, checkpoints) goes through
``atomic_write``: the content is written to a temporary sibling and moved over the target with
``os.replace``, so an interrupted run leaves either the old file or the new one, never half of one.
Weights are safetensors only (``save_safetensors``), never pickles.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import LayerleapError


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then move it over ``path``.

    The temporary name keeps the target's suffix (matplotlib and safetensors go by it).  A failed
    write removes the temporary; an OS error becomes a ``LayerleapError`` naming the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise LayerleapError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_json(path: str | Path, obj, indent: int = 1) -> Path:
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def save_safetensors(path: str | Path, tensors: dict, metadata: dict | None = None) -> Path:
    """``tensors`` (made contiguous, on the CPU) to a safetensors file; metadata values as strings."""
    from safetensors.torch import save_file

    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    return atomic_write(path, lambda p: save_file(data, str(p), metadata=meta))


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
    try:
        old = json.loads(path.read_bytes())
    except (OSError, ValueError):
        old = None
    if not isinstance(old, dict) or not isinstance(old.get("config"), dict) or any(f not in old for f in fields):
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


def cache_root() -> Path:
    """The user cache (converted models, kernel choices): ``$LAYERLEAP_CACHE`` or ``~/.cache/layerleap``."""
    return Path(os.environ.get("LAYERLEAP_CACHE") or Path.home() / ".cache" / "layerleap")
