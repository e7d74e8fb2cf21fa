"""Big Little Decoder (BiLD; Kim et al. 2023, §3, Algorithm 1, §4.4), for decoder-only models.

A small model generates autoregressively.  **Fallback**: when its top probability is not above
``alpha_fb`` (or it has run ``max_small`` tokens in a row) the large model takes the step: it runs
ONCE, non-autoregressively, over every small-model token it has not seen.  **Rollback**: in that
same pass it scores each pending small token; the first one whose cross-entropy under the large
model, ``-log p_L(token)``, exceeds ``alpha_rb`` is discarded with everything after it, and the
large model's own token takes its place.  With no rollback the large model adds its next token.
Small-model tokens still pending when generation ends (budget or EOS) are checked the same way
before the result is returned, so every emitted small token passed the rollback policy (with
``alpha_rb = inf`` that last pass is skipped: it could not change anything).

Two forms:

- **two models** (``small=``): a small and a large model with the same tokenizer, each with its
  own KV cache; the small model's cost is metered in ``small_calls`` / ``small_layer_evals``.
- **early exit** (``exit_layer=E``, §4.4): ONE model; layers ``[0, E)`` and an exit head are the
  small model.  Small steps write the KV entries of layers ``[0, E)`` and keep their layer-E hidden
  states; when the large model takes over it runs layers ``[E, n_layers)`` from those states (and
  the full stack only for tokens the small model has not run), so the skipped layers' caches hold
  real values, not CALM's copies of the exit state, and no layer is computed twice for a kept token.

BiLD is a policy over the shared draft-and-verify loop (``draft_verify``): the small model is a
step drafter whose chain stops at the fallback rule (``ChainRule.fallback``: a token whose top
probability is not above ``alpha_fb`` is left to the large model; ``max_small`` is the chain's
length), and the large model's pass accepts by the rollback rule (``draft_verify.Rollback``)
instead of a greedy or speculative match.  The drafters are the same as speculative decoding's
(``DraftModel``) and self-speculative decoding's (``EarlyExitDrafter``).

Both caches roll back exactly (``KVCache.truncate``): a rejected token and everything after it
leave every layer; kept tokens are never recomputed.  Greedy (``do_sample=False``) or sampling
(both models sample from their distributions warped by temperature / top-k / top-p; the fallback
and rollback tests use those same distributions).

Exact limits (tested): ``alpha_fb=1`` (always fall back) gives the large model's greedy output;
``alpha_rb <= ln 2`` (0.69) keeps only small tokens the large model gives at least half its
probability, i.e. its argmax, and so also gives its greedy output; ``alpha_fb=0, alpha_rb=inf,
max_small=None`` (never fall back, never roll back, no run limit) gives the small model's greedy
output.

Stats: ``small_steps`` (small-model forward steps), ``small_tokens`` (tokens it proposed),
``large_calls`` (large passes after the prompt) = ``fallbacks`` (low confidence) + ``forced``
(run limit) + ``final_checks`` (pending tokens at the end), ``rollbacks``, ``rolled_back`` (small
tokens discarded), ``large_tokens`` (tokens the large model chose), ``fallback_rate`` =
fallbacks / small_steps, ``rollback_rate`` = rollbacks / large_calls, ``exit_layer``, ``head``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..core.stats import BildStats, ExitStats
from ..drafters.base import ChainRule
from ..drafters.companion import DraftModel, check_pair
from ..drafters.early_exit import EarlyExitDrafter, exit_head
from . import draft_verify
from .baseline import autoregressive_rounds


def default_exit_layer(model) -> int:
    """Three quarters of the depth (23 of 30 on SmolLM2-135M): what ``bild`` uses on one model when
    given neither ``small`` nor ``exit_layer``."""
    return max(1, min(model.config.n_layers - 1, round(0.75 * model.config.n_layers)))


SMALL = O.Option(
    "small", "model", "the small model (same tokenizer)", none="the early-exit form: layers [0, exit_layer) and a head"
)
ALPHA_FB = O.Option(
    "alpha_fb",
    "float",
    "the small model's top probability at or below which the large model takes over; 1 = always",
    default=0.5,
    lo=0.0,
    hi=1.0,
)
ALPHA_RB = O.Option(
    "alpha_rb",
    "float",
    "roll back a small token the large model gives probability below exp(-alpha_rb)",
    default=2.0,
    lo=0.0,
    inf="never roll back",
)
MAX_SMALL = O.Option(
    "max_small",
    "int",
    "the longest run of small-model tokens before the large model checks them",
    default=10,
    lo=1,
    none="no limit",
)
OPTIONS = (
    SMALL,
    O.EXIT_LAYER.but(none="three quarters of the depth (without small=)"),
    ALPHA_FB,
    ALPHA_RB,
    MAX_SMALL,
    O.HEAD,
)


def small_drafter(run: Run, small, exit_layer, head, rule: ChainRule):
    """The small model of either form, as a step drafter; sets the ``exit_layer`` and ``head`` stats."""
    E, fn = check_form(run, small, exit_layer, head)
    if small is not None:
        return DraftModel(run, small, rule, name="small")
    return EarlyExitDrafter(run, E, fn, rule, draft_first=True)


def check_form(run: Run, small, exit_layer, head):
    """Check the small model's options -> ``(E, exit head)`` of the early-exit form, ``(None, None)`` for
    two models; records the ``exit_layer`` and ``head`` stats."""
    model = run.model
    if small is not None:
        if exit_layer is not None:
            raise GenerationError("give either small= (two models) or exit_layer= (early exit on one model), not both")
        if head != "auto":
            raise GenerationError("head= chooses the exit head of the early-exit form: drop it with small=")
        check_pair(model, small, "small", "small")
        run.record_all(ExitStats(exit_layer=None, head=None))
        return None, None
    E = default_exit_layer(model) if exit_layer is None else exit_layer
    fn, label = exit_head(model, E, head)
    run.record_all(ExitStats(exit_layer=E, head=label))
    return E, fn


def decode(run: Run, drafter, alpha_rb: float):
    """Algorithm 1 over the shared loop, yielding after each large-model step; BiLD's statistics."""
    counts = yield from draft_verify.decode(run, drafter, draft_verify.Rollback(alpha_rb), loop_stats=False)
    run.record([bild_stats(steps, c) for steps, c in zip(drafter.draft_steps, counts)])


def bild_stats(small_steps: int, c: draft_verify.RoundCounts) -> BildStats:
    """One row's BiLD statistics from its small-model steps and the loop's counts."""
    fallbacks, forced, final_checks = c.stops["unsure"], c.stops["length"], c.stops["budget"] + c.stops["eos"]
    large_calls = fallbacks + forced + final_checks
    return BildStats(
        small_steps=small_steps,
        small_tokens=c.drafted,
        fallbacks=fallbacks,
        forced=forced,
        final_checks=final_checks,
        rollbacks=c.rollbacks,
        rolled_back=c.rolled_back,
        large_tokens=c.target_tokens,
        large_calls=large_calls,
        fallback_rate=fallbacks / small_steps if small_steps else 0.0,
        rollback_rate=c.rollbacks / large_calls if large_calls else 0.0,
    )


@register("bild", batched=True, sampling=True, options=OPTIONS)
def bild(
    run: Run,
    *,
    small=None,
    exit_layer: int | None = None,
    alpha_fb: float = 0.5,
    alpha_rb: float = 2.0,
    max_small: int | None = 10,
    head="auto",
):
    """Big Little Decoder: a small model (small= or exit_layer=) with fallback and rollback to the large one."""
    rule = ChainRule.fallback(max_small, float(alpha_fb))
    if rule.never_drafts:
        yield from large_only(run, small, exit_layer, head)
        return
    drafter = small_drafter(run, small, exit_layer, head, rule)
    yield from decode(run, drafter, float(alpha_rb))


def large_only(run: Run, small, exit_layer, head):
    """``alpha_fb = 1``: every step falls back, so the large model decodes alone, one call a token, and
    no small step runs (its token would be thrown away); the options are checked as for any setting."""
    check_form(run, small, exit_layer, head)
    yield from autoregressive_rounds(run)
    run.record([_large_only_stats(len(out)) for out in run.out])


def _large_only_stats(n: int) -> BildStats:
    return BildStats(
        small_steps=0,
        small_tokens=0,
        fallbacks=n,
        forced=0,
        final_checks=0,
        rollbacks=0,
        rolled_back=0,
        large_tokens=n,
        large_calls=n,
        fallback_rate=float(n > 0),  # every step the large model's
        rollback_rate=0.0,
    )
