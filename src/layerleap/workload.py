"""Runs of hours refused unless asked: one estimate of a command's work before it starts.

A long command (a sweep, an evaluation over many prompts, a training run) counts its work -- decoding
runs × tokens, or training steps × tokens -- and prices it with a cheap per-token time: decoding
streams every weight once a token (``weight bytes / BYTES_PER_S``, at least ``MIN_TOKEN_S``),
training costs a multiple of the forward FLOPs (``FLOPS``).  The rates are generous for the
device, so the estimate is a floor: a run refused here would take at least that long.  Above
``MAX_HOURS`` the command stops with the estimate in its message; ``--max-hours H`` raises the
limit, ``--yes`` lifts it.
"""

from __future__ import annotations

import math

from .errors import LayerleapError

MAX_HOURS = 2.0  # a run estimated beyond this needs --max-hours or --yes
BYTES_PER_S = {"cpu": 40e9, "cuda": 2e12}  # weights streamed per second while decoding (a generous rate)
FLOPS = {"cpu": 200e9, "cuda": 200e12}  # floating-point operations per second while training (generous)
MIN_TOKEN_S = 1e-3  # a decoding step's own cost however small the model (a model call from Python)
MIN_POSITION_S = 1e-6  # a training position's, likewise


class TooLong(LayerleapError):
    """A run estimated beyond the limit: the message gives the estimate and the flags that allow it."""


def add_args(p) -> None:
    """``--max-hours`` and ``--yes`` on a long command's parser."""
    from . import validate as V

    p.add_argument(
        "--max-hours",
        type=V.positive_float,
        default=MAX_HOURS,
        help=f"refuse to start a run estimated beyond this many hours (default {MAX_HOURS:g})",
    )
    p.add_argument("--yes", action="store_true", help="start however long the run is estimated to take")


def flops(model, n: float, what: str) -> tuple[float, str]:
    """``n`` floating-point operations of training: (seconds, what was counted)."""
    return n / FLOPS[_device(model)], f"{what}: {n:.2g} FLOPs"


def _device(model) -> str:
    dev = getattr(model, "device", None)
    return "cuda" if getattr(dev, "type", "cpu") == "cuda" else "cpu"


def decode_token_s(model) -> float:
    """Seconds per decoded token, at least: every weight read once (batch 1)."""
    bytes_ = model.n_params() * _element_size(model)
    return max(MIN_TOKEN_S, bytes_ / BYTES_PER_S[_device(model)])


def forward_token_s(model, trainable_params: int = 0) -> float:
    """Seconds per training position, at least: the frozen backbone's forward (2 FLOPs a weight) and
    forward plus backward of the trained parameters (6 FLOPs a weight)."""
    return max(MIN_POSITION_S, (2 * model.n_params() + 6 * trainable_params) / FLOPS[_device(model)])


def _element_size(model) -> float:
    try:
        return next(model.parameters()).element_size()
    except (StopIteration, AttributeError):
        return 4.0


def _each(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def hours(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:,.0f} h" if seconds >= 36000 else f"{seconds / 3600:.1f} h"


def check(args, *parts: tuple[float, str]) -> None:
    """Refuse (``TooLong``) a run whose ``parts`` (seconds, what was counted) add up beyond
    ``args.max_hours`` unless ``args.yes``."""
    seconds = sum(s for s, _ in parts)
    limit = getattr(args, "max_hours", MAX_HOURS)
    if getattr(args, "yes", False) or not math.isfinite(seconds) or seconds <= limit * 3600:
        return
    need = math.ceil(seconds / 3600)
    raise TooLong(
        f"this run would take at least {hours(seconds)} ({' + '.join(w for _, w in parts)}), beyond the limit of "
        f"{limit:g} h: add --max-hours {need:,} (or --yes) to run it, or ask for less work"
    )


def decoding(model, runs: int, tokens: int, what: str = "runs") -> tuple[float, str]:
    """``runs`` decodings of ``tokens`` tokens each: (seconds, what was counted)."""
    per = decode_token_s(model)
    return runs * tokens * per, f"{runs:,} {what} × {tokens:,} tokens at ≥{_each(per)} a token"


def training(model, positions: int, trainable_params: int = 0, what: str = "positions") -> tuple[float, str]:
    """``positions`` training positions through the frozen model plus ``trainable_params`` trained."""
    per = forward_token_s(model, trainable_params)
    return positions * per, f"{positions:,} {what} at ≥{_each(per)} each"
