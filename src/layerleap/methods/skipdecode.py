"""SkipDecode (Del Corro et al., 2023) and the two early-exit baselines it is compared with.

``skipdecode`` (batched): the prompt runs through every layer; generated position ``n`` (0 = the
first generated token fed back in) gets ONE exit budget ``b(n)`` for the whole batch, decaying from
``max_exit_layer`` at ``n = 0`` to ``min_exit_layer`` at sequence length ``max_len`` (linear, as in
the paper's §2.3, or ``decay="power"``).  A token runs the ``warmup`` bottom layers and then the
top ``b(n) - warmup`` layers, skipping the lower middle::

    layers(b) = [0, warmup) ∪ [n_layers - (b - warmup), n_layers)

Budgets never rise, so the top range only shrinks from below: every layer a token runs was run by
every earlier token, its KV cache is complete, and nothing is recomputed or copied.  A skipped
token's hidden state passes through skipped layers unchanged (the residual stream).

``early-exit`` (batched): every token, prompt included, runs layers ``[0, exit_layer)`` and is
predicted from there with the model's final norm and unembedding (a model truncated at a fixed layer,
the "multi-layer" baseline of the paper's Table 5).

``calm`` (batch 1): CALM's hidden-state saturation adapted to a decoder: a token runs layer by layer
and exits after layer ``l`` once ``cos(h_l, h_{l-1}) >= threshold``; the layers it skipped get KV
entries computed from its exit state (``Transformer.fill_kv``), so later tokens can attend to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F

from types import SimpleNamespace

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..core.stats import SkipStats

DECAYS = O.DECAYS
TARGET_SPEEDUP = O.Option(
    "target_speedup",
    "float",
    "n_layers / the mean layer budget: picks min/max_exit_layer from the paper's Table 2",
    lo=1.0,
    hi=O.N_LAYERS,
    none="2x, unless min/max_exit_layer are given",
)
WARMUP = O.Option("warmup", "int", "the bottom layers every token runs", default=1, lo=0, hi=O.N_LAYERS)
MAX_LEN = O.Option(
    "max_len",
    "int",
    "the sequence length at which the budget reaches min_exit_layer",
    lo=2,
    hi=O.CONTEXT,
    none="the longest prompt + max_new_tokens",
)
POWER = O.Option("power", "float", "the exponent of decay=power", lo=0.0, lo_open=True, none="2 (with decay=power)")
BUDGETS = O.Option(
    "schedule",
    "int_list",
    "explicit exit budgets, one per generated position (non-increasing)",
    lo=1,
    hi=O.N_LAYERS,
    none="budgets decaying from max_exit_layer to min_exit_layer",
)
# The paper's Table 2 (OPT-1.3B, 24 layers, and OPT-6.7B, 32 layers): target speed-up ->
# (warmup, min_exit_layer, max_exit_layer).  The 30-layer column below scales them (×30/24 and
# ×30/32 agree to within a layer) so that the mean budget (min+max)/2 is n_layers / target.
TABLE2 = {
    24: {2: (1, 8, 16), 3: (1, 6, 10), 4: (1, 5, 7), 5: (1, 4, 6)},
    32: {2: (1, 11, 22), 3: (1, 8, 14), 4: (1, 6, 10), 5: (1, 5, 8)},
    30: {2: (1, 10, 20), 3: (1, 7, 13), 4: (1, 6, 9), 5: (1, 5, 7)},
}


@dataclass(frozen=True)
class SkipConfig:
    """One SkipDecode configuration: what ``target_config`` returns."""

    target_speedup: float
    warmup: int
    min_exit_layer: int
    max_exit_layer: int

    def options(self) -> dict:
        return {"warmup": self.warmup, "min_exit_layer": self.min_exit_layer, "max_exit_layer": self.max_exit_layer}


def target_config(n_layers: int, target_speedup: float) -> SkipConfig:
    """The Table 2 configuration for ``target_speedup`` on an ``n_layers`` model: the paper's own
    numbers for 24 and 32 layers, our scaled ones for 30, else min/max chosen around
    ``n_layers / target`` with the paper's max/min ratio of about 2 (2x) to 1.5 (5x)."""
    s = TARGET_SPEEDUP.check(target_speedup, depth(n_layers))
    if s == 1:
        return SkipConfig(1.0, 1, n_layers, n_layers)
    if n_layers in TABLE2 and s in TABLE2[n_layers]:
        w, lo, hi = TABLE2[n_layers][int(s)]
        return SkipConfig(s, w, lo, hi)
    mean = n_layers / s
    ratio = 2.0 if s <= 2 else max(1.4, 2.0 - 0.17 * (s - 2))  # 2x: 20/10 … 5x: 7/5 in Table 2's spirit
    lo = max(1, round(2 * mean / (1 + ratio)))
    hi = min(n_layers, max(lo, round(2 * mean - lo)))
    return SkipConfig(s, 1, lo, hi)


def exit_layers(
    n_layers: int, min_exit_layer: int | None, max_exit_layer: int | None, target_speedup: float | None = None
) -> tuple[int | None, int | None]:
    """``(min_exit_layer, max_exit_layer)``: the ones given; one not given comes from ``target_speedup``'s
    configuration (``target_config``; 2x when None), kept within the one given (budgets never rise)."""
    if min_exit_layer is not None and max_exit_layer is not None:
        return min_exit_layer, max_exit_layer
    cfg = target_config(n_layers, min(2, n_layers) if target_speedup is None else target_speedup)
    if min_exit_layer is None:
        min_exit_layer = cfg.min_exit_layer if max_exit_layer is None else min(cfg.min_exit_layer, max_exit_layer)
    if max_exit_layer is None:
        max_exit_layer = max(cfg.max_exit_layer, min_exit_layer)
    return min_exit_layer, max_exit_layer


def depth(n_layers: int) -> SimpleNamespace:
    """What the options' model-dependent bounds read, for code that knows only the depth."""
    return SimpleNamespace(n_layers=n_layers)


def check_budget_range(n_layers: int, min_exit_layer: int, max_exit_layer: int, warmup: int) -> None:
    for o, v in ((O.MIN_EXIT_LAYER, min_exit_layer), (O.MAX_EXIT_LAYER, max_exit_layer), (WARMUP, warmup)):
        o.check(v, depth(n_layers))
    if min_exit_layer > max_exit_layer:
        raise GenerationError(
            f"min_exit_layer={min_exit_layer} > max_exit_layer={max_exit_layer}: budgets must "
            "not rise along the sequence (the KV cache of skipped layers would be missing); "
            "swap them"
        )
    if not 0 <= warmup <= min_exit_layer:
        raise GenerationError(
            f"warmup={warmup} must be in [0, min_exit_layer={min_exit_layer}]: every budget "
            "includes the warm-up layers; lower warmup or raise min_exit_layer"
        )


def budget_at(
    n: int, horizon: int, min_exit_layer: int, max_exit_layer: int, decay: str = "linear", power: float = 2.0
) -> int:
    """The exit budget (number of layers) of generated position ``n``: ``max_exit_layer`` at n = 0,
    ``min_exit_layer`` from n = ``horizon`` on.  linear: ``(1-t) max + t min`` with ``t = n / horizon``
    (the paper's formula); power: ``min + (max - min) (1-t)^power`` (falls faster early, power > 1).
    Rounded half up, so it never rises."""
    t = 1.0 if horizon <= 0 else min(1.0, max(0.0, n / horizon))
    if decay == "linear":
        b = (1 - t) * max_exit_layer + t * min_exit_layer
    elif decay == "power":
        b = min_exit_layer + (max_exit_layer - min_exit_layer) * (1 - t) ** power
    else:
        O.DECAY.check(decay)
    return int(min(max_exit_layer, max(min_exit_layer, math.floor(b + 0.5 + 1e-9))))


def exit_schedule(
    n_steps: int, horizon: int, min_exit_layer: int, max_exit_layer: int, decay: str = "linear", power: float = 2.0
) -> list[int]:
    """Budgets of generated positions ``0 .. n_steps-1``."""
    return [budget_at(n, horizon, min_exit_layer, max_exit_layer, decay, power) for n in range(n_steps)]


def layer_ranges(n_layers: int, budget: int, warmup: int) -> list[tuple[int, int]]:
    """The layer ranges ``[start, end)`` a token with ``budget`` layers runs: the ``warmup`` bottom
    layers, then the top ``budget - warmup``."""
    w = min(warmup, budget)
    ranges = [(0, w)] if w else []
    top = budget - w
    if top:
        lo = n_layers - top
        if ranges and lo == w:  # contiguous: the full network
            return [(0, n_layers)]
        ranges.append((lo, n_layers))
    return ranges


def check_schedule(schedule, n_layers: int, warmup: int) -> list[int]:
    """Validate an explicit list of budgets (one per generated position)."""
    sched = BUDGETS.check(schedule, depth(n_layers))
    rises = [i for i in range(1, len(sched)) if sched[i] > sched[i - 1]]
    if rises:
        i = rises[0]
        raise GenerationError(
            f"schedule is not monotone: position {i} has budget {sched[i]} > {sched[i - 1]} at "
            f"position {i - 1}; budgets must never rise (skipped layers have no KV entries to "
            "attend to): make it non-increasing"
        )
    if warmup > min(sched):
        raise GenerationError(f"warmup={warmup} exceeds the smallest budget {min(sched)} in schedule: lower warmup")
    return sched


def check_conflicts(min_exit_layer, max_exit_layer, max_len, decay, power, schedule, target_speedup) -> None:
    """Refuse options the others make meaningless (each would be ignored): the decay's options with an
    explicit ``schedule``, ``target_speedup`` with both exit layers, ``power`` without ``decay='power'``."""
    if schedule is not None:
        shaping = {"min_exit_layer": min_exit_layer, "max_exit_layer": max_exit_layer, "max_len": max_len}
        shaping |= {"power": power, "target_speedup": target_speedup}
        given = [k for k, v in shaping.items() if v is not None] + (["decay"] if decay != "linear" else [])
        if given:
            raise GenerationError(
                f"schedule gives every budget itself, so {', '.join(given)} would be ignored (they shape the "
                f"decaying budgets): drop {', '.join(given)} or drop schedule"
            )
    if target_speedup is not None and min_exit_layer is not None and max_exit_layer is not None:
        raise GenerationError(
            "target_speedup picks min_exit_layer and max_exit_layer, and both are given: drop target_speedup "
            "or one of them"
        )
    if power is not None and decay != "power":
        raise GenerationError(f"power is the exponent of decay='power', and decay is {decay!r}: add decay='power'")


def _active_layer_stats(run: Run, **schedule) -> None:
    """Record, per row, the average active layers per generated token (the first token's pass, the
    prompt's last position, counts as generation with all the layers it ran), the speed-up it
    implies, and ``schedule`` (``SkipStats``' budgets or exits, the same for every row)."""
    d = run.n_layers
    avgs = [run.layer_evals[b] / len(run.out[b]) if run.out[b] else float(d) for b in range(run.batch)]
    run.record([SkipStats(avg_active_layers=a, budget_speedup=d / a if a else float("inf"), **schedule) for a in avgs])


# -- SkipDecode ------------------------------------------------------------------------------------
@register(
    "skipdecode",
    batched=True,
    sampling=True,
    options=(
        O.MIN_EXIT_LAYER.but(default=None, none="from target_speedup"),
        O.MAX_EXIT_LAYER.but(none="from target_speedup"),
        WARMUP,
        MAX_LEN,
        O.DECAY,
        POWER,
        BUDGETS,
        TARGET_SPEEDUP,
    ),
)
def skipdecode(
    run: Run,
    *,
    min_exit_layer: int | None = None,
    max_exit_layer: int | None = None,
    warmup: int = 1,
    max_len: int | None = None,
    decay: str = "linear",
    power: float | None = None,
    schedule: list[int] | None = None,
    target_speedup: float | None = None,
):
    """SkipDecode: one decaying layer budget per position for the whole batch; skip the lower middle layers."""
    d = run.n_layers
    check_conflicts(min_exit_layer, max_exit_layer, max_len, decay, power, schedule, target_speedup)
    power = 2.0 if power is None else power
    if schedule is None:
        min_exit_layer, max_exit_layer = exit_layers(d, min_exit_layer, max_exit_layer, target_speedup)
        check_budget_range(d, min_exit_layer, max_exit_layer, warmup)
    else:
        schedule = check_schedule(schedule, d, warmup)
    longest = max(len(p) for p in run.prompts)
    ctx = run.model.config.max_position
    if longest + run.gen.max_new_tokens > ctx:
        raise GenerationError(
            f"the batch's longest prompt has {longest} tokens; with max_new_tokens="
            f"{run.gen.max_new_tokens} it exceeds the context length {ctx}: shorten the prompts, "
            "lower max_new_tokens or decode the long prompt in its own batch"
        )
    if max_len is None:
        max_len = longest + run.gen.max_new_tokens
    if not longest < max_len:
        raise GenerationError(
            f"max_len={max_len} must be longer than the batch's longest prompt ({longest} tokens): raise it"
        )
    horizon = max_len - longest

    cache = run.new_cache()
    h = run.prefill(cache)
    used: list[int] = []
    n = 0
    while True:
        tok = run.choose(run.logits(h)[:, -1])
        if run.emit_all(tok):
            break
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            break
        if schedule is not None:
            b = schedule[min(n, len(schedule) - 1)]
        else:
            b = budget_at(n, horizon, min_exit_layer, max_exit_layer, decay, power)
        h = run.model.embed(tok.unsqueeze(1))
        for i, (s, e) in enumerate(layer_ranges(d, b, warmup)):
            h = run.forward(cache, h=h, start=s, end=e, count_call=i == 0)
        used.append(b)
        n += 1
    _active_layer_stats(run, budgets=tuple(used))


# -- baselines -------------------------------------------------------------------------------------
EXIT_AT = O.EXIT_LAYER.but(
    default=O.REQUIRED, none="", hi=O.N_LAYERS, help="every token runs layers [0, exit_layer); n_layers = greedy"
)


@register("early-exit", batched=True, sampling=True, options=(EXIT_AT,))
def early_exit(run: Run, *, exit_layer: int):
    """Fixed early exit: every token (prompt included) runs layers [0, exit_layer) and is predicted from there."""
    cache = run.new_cache()
    h = run.prefill(cache, end=exit_layer)
    while True:
        tok = run.choose(run.logits(h)[:, -1])
        if run.emit_all(tok):
            break
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            break
        h = run.forward(cache, tok.unsqueeze(1), end=exit_layer)
    _active_layer_stats(run)


NEVER_SATURATES = 1.0 + 1e-3  # a threshold above the largest cosine fp32 rounding gives (1 + a few ulp)


def calm_first_check(d: int, threshold: float, min_exit_layer: int) -> int:
    """The layer before which CALM checks nothing: a token can exit after layer ``min_exit_layer``
    at the earliest, so layers ``[0, min_exit_layer - 1)`` run in one call; a threshold no cosine
    reaches never exits, so all ``d`` layers do (greedy's cost, greedy's tokens)."""
    if threshold > NEVER_SATURATES:
        return d
    return min(d, max(0, min_exit_layer - 1))


@register("calm", batched=False, sampling=True, options=(O.THRESHOLD, O.MIN_EXIT_LAYER))
def calm(run: Run, *, threshold: float = 0.95, min_exit_layer: int = 1):
    """CALM-style early exit on hidden-state saturation (cosine of consecutive layers), skipped KV filled
    from the exit state."""
    d = run.n_layers
    cache = run.new_cache()
    h = run.prefill(cache)
    exits: list[int] = []
    filled = checks = 0
    while True:
        tok = run.choose(run.logits(h)[:, -1])
        if run.emit_all(tok):
            break
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            break
        h = run.model.embed(tok.unsqueeze(1))
        pos = run.positions(cache, 1, 0)
        exit_at = d
        first = calm_first_check(d, threshold, min_exit_layer)  # layers [0, first) run in one call
        h = run.forward(cache, h=h, start=0, end=first, positions=pos) if first else h
        for layer in range(first, d):
            prev = h
            h = run.forward(cache, h=h, start=layer, end=layer + 1, positions=pos, count_call=layer == 0)
            if layer + 1 == d:
                break
            checks += 1
            # in fp32: a bf16 cosine (q4's activations) rounds everything above ~0.998 to 1.0 or 0.996
            if float(F.cosine_similarity(h[0, -1].float(), prev[0, -1].float(), dim=0)) >= threshold:
                exit_at = layer + 1
                break
        if exit_at < d:
            run.model.fill_kv(h, exit_at, d, pos, cache)
            filled += d - exit_at
        exits.append(exit_at)
    _active_layer_stats(run, exit_layers=tuple(exits), kv_filled_layers=filled, exit_checks=checks)


__all__ = [
    "skipdecode",
    "early_exit",
    "calm",
    "target_config",
    "exit_layers",
    "SkipConfig",
    "budget_at",
    "exit_schedule",
    "layer_ranges",
    "check_schedule",
    "check_budget_range",
    "TABLE2",
    "DECAYS",
]
