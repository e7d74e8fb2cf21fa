"""This machine's call-cost curve for a model, as measured and saved by ``layerleap info --call-cost``.

``c(S)`` is the time of one model call over ``S`` new tokens relative to a one-token call.  Methods
that choose draft lengths and tree sizes by the expected tokens per unit of call cost
(``drafters.lengths``) read it here: the curve measured for this CPU (or GPU), model shape, weight
format, thread count and device if one was saved, else the weight format's shipped curve (measured
on CPUs).  On a GPU, where no shipped curve applies, the first method that needs the curve measures
it (``measure``, under a second for a small model) and saves it.  Curves are saved in
``<cache>/call_cost.json`` (an entry with a size missing or a time or ratio that is not a finite positive
number counts as absent); ``$LAYERLEAP_CALL_COST=shipped`` ignores them and measures nothing."""

from __future__ import annotations

import json
import math
import os
import time

import torch

from ..errors import LayerleapError
from ..files import cache_root, locked, stamp, write_json
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


_READ: dict = {}  # path -> (stamp, contents): the file is read again only when it changes (``files.stamp``)


def _known(fresh: bool = False) -> dict:
    """The saved curves; ``fresh``: read the file even where it seems the one last read (``files.stamp``)."""
    path = cache_root() / FILE
    try:
        now = stamp(path)
        if fresh or _READ.get(path, (None,))[0] != now:
            known = json.loads(path.read_text(encoding="utf-8"))
            _READ[path] = (now, known if isinstance(known, dict) else {})
    except (OSError, ValueError, RecursionError):  # RecursionError: brackets nested past the parser's depth
        return {}
    return dict(_READ[path][1])


def saved(model) -> dict[int, float] | None:
    """The saved ``{S: c(S)}`` for ``model`` on this machine (every size in ``SIZES``), or None: also
    where the entry is damaged (a size missing, a ratio or the one-token time not a finite positive
    number), so that the curve is measured again or the shipped one used."""
    if os.environ.get(ENV, "").strip().lower() == "shipped":
        return None
    entry = _known().get(key(model))
    if not isinstance(entry, dict) or not isinstance(entry.get("ratios"), dict):
        return None
    try:
        ratios = {int(s): float(r) for s, r in entry["ratios"].items()}
        ms_one = float(entry["ms_one_token"])
    except (KeyError, TypeError, ValueError):
        return None
    whole = all(s in ratios and 0 < ratios[s] < math.inf for s in SIZES) and 0 < ms_one < math.inf  # NaN: False
    return ratios if whole else None


def save(model, ratios: dict[int, float], ms_one: float) -> bool:
    """Remember ``ratios`` ``{S: ms(S) / ms(1)}`` (every size in ``SIZES``) for ``model`` on this
    machine; False where the cache cannot be written (the curve is then measured again next time)."""
    missing = [s for s in SIZES if s not in ratios]
    if missing:
        raise ValueError(f"a saved call-cost curve needs the sizes {SIZES}; missing {missing}")
    entry = {"ratios": {str(s): round(float(ratios[s]), 4) for s in SIZES}, "ms_one_token": ms_one}
    path = cache_root() / FILE
    try:
        with locked(path):  # read again under the lock: curves other processes saved meanwhile are kept
            known = _known(fresh=True)
            known[key(model)] = entry
            write_json(path, known)
            _READ[path] = (stamp(path), known)
    except (LayerleapError, OSError):
        return False
    return True


def time_calls(model, context: int, sizes, rounds: int) -> tuple[int, dict[int, list[float]]]:
    """``(context used, {S: seconds of each round's call})``: ``rounds`` model calls over ``S`` new
    tokens (causal among themselves, all layers and the LM head) after ``context`` cached tokens, for
    each ``S`` in ``sizes`` (1 always), round-robin over the sizes so that a disturbance hits every
    size alike; each call is rolled back before the next.  A model with a short context uses what
    fits.  On a GPU a call ends when its kernels do."""
    sizes = sorted({int(s) for s in sizes} | {1})
    n = model.config.n_layers
    context = max(1, min(context, model.config.max_position - max(sizes)))  # a short-context model: what fits
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    times: dict[int, list[float]] = {s: [] for s in sizes}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        cache = model.new_cache(1, context + max(sizes))
        model(torch.randint(0, vocab, (1, context), generator=gen).to(model.device), cache=cache)
        ids = {s: torch.randint(0, vocab, (1, s), generator=gen).to(model.device) for s in sizes}
        pos = {s: (context + torch.arange(s)).unsqueeze(0).to(model.device) for s in sizes}

        def call(s: int) -> None:
            model.logits(model.run_layers(model.embed(ids[s]), 0, n, pos[s], cache))
            sync()
            cache.truncate(context)

        for s in sizes:  # warm-up
            call(s)
        for _ in range(rounds):
            for s in sizes:
                t = time.perf_counter()
                call(s)
                times[s].append(time.perf_counter() - t)
    return context, times


def measure(model, rounds: int = 5) -> dict[int, float]:
    """Measure ``model``'s curve here (``SIZES``, 256 cached tokens, the best of ``rounds`` per size),
    save it, and return ``{S: c(S)}``."""
    best = {s: min(ts) for s, ts in time_calls(model, 256, SIZES, rounds)[1].items()}
    ratios = {s: best[s] / best[1] for s in SIZES}
    save(model, ratios, best[1] * 1e3)
    return ratios


def for_model(model) -> dict[int, float] | None:
    """The curve to price ``model``'s calls by: the saved one; on a GPU without one, measured now; else
    None (the caller's shipped curve)."""
    if os.environ.get(ENV, "").strip().lower() == "shipped":
        return None
    ratios = saved(model)
    return measure(model) if ratios is None and model.device.type == "cuda" else ratios
