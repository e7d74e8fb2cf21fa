"""This machine's call-cost curve for a model, as measured and saved by ``layerleap info --call-cost``.

``c(S)`` is the time of one model call over ``S`` new tokens relative to a one-token call.  Methods
that choose draft lengths and tree sizes by the expected tokens per unit of call cost
(``drafters.lengths``) read it here: the curve measured for this CPU (or GPU), model shape, weight
format, thread count and device if one was saved, else the weight format's shipped curve.  Curves
are saved in ``<cache>/call_cost.json``; ``$LAYERLEAP_CALL_COST=shipped`` ignores them."""

from __future__ import annotations

import json
import os

import torch

from ..errors import LayerleapError
from ..files import cache_root, write_json
from .cpu import cpu_signature

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # the sizes a saved curve holds
FILE = "call_cost.json"
ENV = "LAYERLEAP_CALL_COST"  # "shipped": use the shipped curves, never a saved one


def key(model) -> str:
    """What a curve depends on: the processor, the model's shape, weight format, threads, device."""
    cfg, device = model.config, model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_signature()} | {torch.get_num_threads()} threads"
    shape = (
        f"{cfg.n_layers} layers x {cfg.hidden_size} (MLP {cfg.intermediate_size}), "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}"
    )
    return f"{where} | {device.type} | {shape} | {model.dtype_name}"


def _known() -> dict:
    try:
        known = json.loads((cache_root() / FILE).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def saved(model) -> dict[int, float] | None:
    """The saved ``{S: c(S)}`` for ``model`` on this machine (every size in ``SIZES``), or None."""
    if os.environ.get(ENV, "").strip().lower() == "shipped":
        return None
    entry = _known().get(key(model))
    if not isinstance(entry, dict) or not isinstance(entry.get("ratios"), dict):
        return None
    try:
        ratios = {int(s): float(r) for s, r in entry["ratios"].items()}
    except (TypeError, ValueError):
        return None
    return ratios if all(s in ratios and ratios[s] > 0 for s in SIZES) else None


def save(model, ratios: dict[int, float], ms_one: float) -> bool:
    """Remember ``ratios`` ``{S: ms(S) / ms(1)}`` (every size in ``SIZES``) for ``model`` on this
    machine; False where the cache cannot be written (the curve is then measured again next time)."""
    missing = [s for s in SIZES if s not in ratios]
    if missing:
        raise ValueError(f"a saved call-cost curve needs the sizes {SIZES}; missing {missing}")
    known = _known()
    known[key(model)] = {"ratios": {str(s): round(float(ratios[s]), 4) for s in SIZES}, "ms_one_token": ms_one}
    try:
        write_json(cache_root() / FILE, known)
    except LayerleapError:
        return False
    return True
