"""One file format for every trained drafter weight: exit heads, an aligned adapter head, Medusa
heads, Hidden Transfer projections.

A file is safetensors (never a pickle), written atomically, with string metadata:

- ``format``: ``layerleap-weights-1``; ``kind``: ``exit-heads``, ``adapter-head``, ``medusa`` or
  ``transfer``;
- ``fingerprint`` and ``model``: the model it was trained for (loading into another is refused);
- ``config``: JSON, what the reader needs to build the module (layers, head kinds, steps, rank);
- ``provenance``: JSON, how it was made: ``data``, ``tokens``, ``steps``, ``train_seconds``,
  ``command`` (the exact command line), ``created`` (UTC), plus what the trainer adds.

``describe(path)`` reads any of them (and the three formats written before this one, so shipped
and older files still load); ``read`` checks a file against a model and a kind and returns its
tensors; ``load`` does that once per model and file (``loaded.per_model``).  ``layerleap heads
info FILE`` prints a file's metadata.
"""

from __future__ import annotations

import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..core.model import Transformer
from ..errors import LayerleapError
from ..files import read_safetensors_meta, save_safetensors
from ..loaded import per_model

FORMAT = "layerleap-weights-1"
KINDS = ("exit-heads", "adapter-head", "medusa", "transfer")
# formats written before this one: format name -> kind (the drafter format names its kind itself)
LEGACY = {"layerleap-exit-heads-v1": "exit-heads", "layerleap-bild-exit-head-v1": "adapter-head",
          "layerleap-drafter-v1": None}
_COMMON = {"format", "kind", "fingerprint", "model", "config", "provenance"}


class WeightsError(LayerleapError, ValueError):
    """A weights file that cannot be written or read: the message names the problem and the fix."""


def command_line() -> str:
    """The command that is running, as a shell would take it (``python -c``/API use: the script)."""
    argv = list(sys.argv) or ["python"]
    if Path(argv[0]).name in ("layerleap", "__main__.py"):
        argv[0] = "layerleap"
    return shlex.join(argv)


def save(path, tensors: dict[str, torch.Tensor], model: Transformer, kind: str, config: dict,
         provenance: dict | None = None) -> Path:
    """Write ``tensors`` as a ``kind`` weights file of ``model``, atomically.  ``provenance`` gets the
    command line and the time when it does not name them."""
    if kind not in KINDS:
        raise WeightsError(f"unknown weights kind {kind!r}: choose one of {', '.join(KINDS)}")
    prov = {"command": command_line(), "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **(provenance or {})}
    meta = {"format": FORMAT, "kind": kind, "fingerprint": model.fingerprint, "model": model.config.name,
            "config": json.dumps(config, default=list), "provenance": json.dumps(prov, default=str)}
    return save_safetensors(path, tensors, meta)


def describe(path, error: type[Exception] = WeightsError, fix: str = "train it again", what: str = "weights") -> dict:
    """A weights file's metadata, in this format's terms: ``format``, ``kind``, ``fingerprint``,
    ``model``, ``config`` (dict), ``provenance`` (dict; for an older file, its extra metadata)."""
    p = Path(path).expanduser()
    try:
        meta = read_safetensors_meta(p)
    except ValueError as e:  # a truncated or foreign file
        raise error(f"cannot read {what} {p}: {e}; {fix}") from None
    fmt = meta.get("format")
    if fmt == FORMAT:
        return {**meta, "config": json.loads(meta.get("config") or "{}"),
                "provenance": json.loads(meta.get("provenance") or "{}")}
    if fmt not in LEGACY:
        return {"format": fmt, "kind": None, "fingerprint": meta.get("fingerprint"), "model": meta.get("model"),
                "config": {}, "provenance": {}}
    kind = LEGACY[fmt] or meta.get("kind")
    if kind == "exit-heads":
        config = {"layers": [int(x) for x in meta["layers"].split(",")], "kinds": meta["kinds"].split(",")}
    elif kind == "adapter-head":
        config = {"exit_layer": int(meta.get("exit_layer", -1)), "rank": int(meta.get("rank", 0) or 0)}
    else:
        config = json.loads(meta.get("config") or "{}")
    extra = {k: v for k, v in meta.items() if k not in _COMMON | {"layers", "kinds", "exit_layer", "rank"}}
    for new, old in (("steps", "train_steps"), ("train_seconds", "train_s"), ("tokens", "positions")):
        if new not in extra and old in extra:  # the older files' names for the same facts
            extra[new] = extra.pop(old)
    return {"format": fmt, "kind": kind, "fingerprint": meta.get("fingerprint"), "model": meta.get("model"),
            "config": config, "provenance": extra}


def read(model: Transformer, path, kind: str, what: str, fix: str, error: type[Exception] = WeightsError,
         label: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``path``'s metadata (``describe``) and tensors, after checking that it is a ``kind`` file made
    for ``model``.  ``what`` names the file in messages ("exit heads"; ``label``, when given, where
    it cannot be read at all), ``fix`` the command that makes one."""
    from safetensors.torch import load_file
    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"no such {what} file {str(path)!r}: give a file written by {fix}")
    info = describe(p, error, f"rewrite it with {fix}", label or what)
    if info["kind"] != kind:
        raise error(f"{p} is not a {what} file (format {info['format']!r}, kind {info['kind']!r}): write one with {fix}")
    if info["fingerprint"] != model.fingerprint:
        raise error(f"{what} {p} were trained for another model (fingerprint {info['fingerprint']}, "
                    f"{info['model']}; this model {model.fingerprint}): train them for this model with {fix}")
    try:
        return info, load_file(str(p))
    except Exception as e:  # a truncated file whose header survived
        raise error(f"cannot read {what} {p}: {e}; rewrite it with {fix}") from None


def load(model: Transformer, path, tag: str, build: Callable[[], object]):
    """``build()`` once per model and file (its result cached while the model lives)."""
    return per_model(model, tag, path, build)
