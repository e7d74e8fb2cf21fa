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

Three forms:

- **two models** (``small=``): a small and a large model with the same tokenizer, each with its
  own KV cache; the small model's cost is metered in ``small_calls`` / ``small_layer_evals``.
- **early exit** (``exit_layer=E``, §4.4): ONE model; layers ``[0, E)`` and an exit head are the
  small model.  Small steps write the KV entries of layers ``[0, E)`` and keep their layer-E hidden
  states; when the large model takes over it runs layers ``[E, n_layers)`` from those states (and
  the full stack only for tokens the small model has not run), so the skipped layers' caches hold
  real values, not CALM's copies of the exit state, and no layer is computed twice for a kept token.
- **the EAGLE head** (``eagle=``; by default where the model ships one and neither ``small`` nor
  ``exit_layer`` is given): the small model is the trained EAGLE head (``drafters.eagle``), which drafts
  from the large model's own last-layer state of the last kept position, one head step a token; the
  large model's pass over its chain gives the state the next chain starts from.  Its fallback
  confidence is the head's top probability over its draft vocabulary.

BiLD is a policy over the shared draft-and-verify loop (``draft_verify``): the small model is a
step drafter whose chain stops at the fallback rule (``ChainRule.fallback``: a token whose top
probability is not above ``alpha_fb`` is left to the large model; ``max_small`` is the chain's
length), and the large model's pass accepts by the rollback rule (``draft_verify.Rollback``)
instead of a greedy or speculative match.  The drafters are the same as speculative decoding's
(``DraftModel``) and self-speculative decoding's (``EarlyExitDrafter``), and the ``eagle`` method's
(``EagleDrafter``: a chain, and in fp32 its first draft's siblings, which the rollback rule walks as a
tree).

Both caches roll back exactly (``KVCache.truncate``): a rejected token and everything after it
leave every layer; kept tokens are never recomputed.  Greedy (``do_sample=False``) or sampling
(both models sample from their distributions warped by temperature / top-k / top-p; the fallback
and rollback tests use those same distributions).

Exact limits (tested): ``alpha_fb=1`` (always fall back) gives the large model's greedy output;
``alpha_rb < ln 2`` (0.69) keeps only small tokens that are the large model's argmax (a token it
gives more than half its probability is; and greedy never rolls back the large model's own argmax,
which a rollback would only put back), and so also gives its greedy output; ``alpha_fb=0, alpha_rb=inf,
max_small=None`` (never fall back, never roll back, no run limit) gives the small model's greedy
output.

Stats: ``small_steps`` (small-model forward steps), ``small_tokens`` (tokens it proposed),
``large_calls`` (large passes after the prompt) = ``fallbacks`` (low confidence) + ``forced``
(run limit) + ``final_checks`` (pending tokens at the end), ``rollbacks``, ``rolled_back`` (small
tokens discarded), ``large_tokens`` (tokens the large model chose), ``fallback_rate`` (the share of
small steps at or below ``alpha_fb``: fallbacks / small_steps, counting too a first token the small
model was unsure of, which the prompt pass gives with no large pass and so no fallback),
``rollback_rate`` = rollbacks / large_calls, ``exit_layer``, ``head``.
"""

from __future__ import annotations

import torch

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..core.stats import BildStats, ExitStats
from ..drafters.base import ChainRule
from ..drafters import medusa_transfer as weights
from ..drafters.companion import DraftModel, check_pair
from ..drafters.draft_vocab import get_draft_vocab
from ..drafters.eagle import EagleChains, EagleDrafter
from ..drafters.early_exit import EarlyExitDrafter, exit_head
from . import draft_verify
from . import eagle as eagle_method
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
    hi=O.MAX_DRAFT_LEN,
    none="no limit",
)
EAGLE = O.Option(
    "eagle",
    "weights",
    "the small model as the EAGLE head: auto (the shipped head where the model has one and neither small= nor "
    "exit_layer= is given), none, or a weights file",
    default="auto",
    choices=("auto", "none"),
    none="no EAGLE head: small= or the early-exit form",
)
OPTIONS = (
    SMALL,
    O.EXIT_LAYER.but(none="three quarters of the depth (without small= or the EAGLE head)"),
    EAGLE,
    ALPHA_FB,
    ALPHA_RB,
    MAX_SMALL,
    O.HEAD,
)


def small_drafter(run: Run, small, exit_layer, head, eagle, rule: ChainRule):
    """The small model of any form, as a drafter; sets the ``exit_layer`` and ``head`` stats."""
    E, fn = check_form(run, small, exit_layer, head, eagle)
    if fn == "eagle":
        return eagle_drafter(run, E, rule)
    if small is not None:
        return DraftModel(run, small, rule, name="small")
    return EarlyExitDrafter(run, E, fn, rule, draft_first=True)


def eagle_drafter(run: Run, head, rule: ChainRule) -> EagleDrafter:
    """The EAGLE head as BiLD's small model: a chain over the ``eagle`` method's draft vocabulary, ended by
    the fallback rule (a draft whose top probability is not above ``alpha_fb`` is left to the large model)
    or at ``max_small`` drafts, with the ``eagle`` method's fan of its first draft's next candidates
    (``eagle.DEFAULT_WIDTH``: 3 in fp32, none in q4) that the rollback rule walks as a tree."""
    vocab = _eagle_vocab(run.model)
    longest = rule.longest(run.gen.max_new_tokens)
    width = O.per_dtype(run.model, eagle_method.DEFAULT_WIDTH)
    chains = EagleChains(run, head, longest, vocab, rule.min_confidence, width, keep_unsure=rule.keep_unsure)
    return EagleDrafter(run, chains)


def _eagle_vocab(model):
    """The draft vocabulary the EAGLE form scores: the ``eagle`` method's default one."""
    return eagle_method.chains_vocab(model, get_draft_vocab(model, "auto"), "auto")


def eagle_head(model, eagle, given: bool):
    """The EAGLE head ``eagle`` names, or None: "auto" is the shipped head when the model has one and no
    other small model is ``given``; "none" / None is none."""
    if eagle is None or eagle == "none" or (eagle == "auto" and (given or not weights.shipped_files(model, "eagle"))):
        return None
    if given:
        raise GenerationError("give one small model: small=, exit_layer= or eagle=, not two of them")
    return weights.get_drafter(model, "eagle", "trained" if eagle == "auto" else eagle)


def eagle_step(model):
    """One step of BiLD's small model in its default form on ``model`` when that is the EAGLE head (one
    draft from a state, over the draft vocabulary), as a callable for pricing it; None otherwise."""
    head = eagle_head(model, "auto", False)
    if head is None:
        return None
    vocab = _eagle_vocab(model)
    g = torch.Generator().manual_seed(0)
    z = model.final_norm(torch.randn(1, model.config.hidden_size, generator=g).to(model.device, model.dtype))  # [1, D]
    x = torch.tensor([1], device=model.device)  # [1]
    native = head.native_step(vocab)

    def step() -> None:
        if native is not None:
            logits = native(z.contiguous(), x)[1]
        else:
            s = model.final_norm(head.step(z, x))  # [1, D]
            logits = model.unembed(s) if vocab is None else vocab.logits(s)
        int(logits.argmax(-1)[0])

    return step


def check_form(run: Run, small, exit_layer, head, eagle="none"):
    """Check the small model's options -> ``(E, exit head)`` of the early-exit form, ``(None, None)`` for
    two models, ``(the EAGLE head, "eagle")`` for the EAGLE form; records the ``exit_layer`` and ``head``
    stats."""
    model = run.model
    found = eagle_head(model, eagle, small is not None or exit_layer is not None)
    if found is not None:
        if head != "auto":
            why = (
                f'this model ships an EAGLE head, BiLD\'s small model by default: give eagle="none" for the '
                f"early-exit form with head={head!r}, or drop head="
                if eagle == "auto"
                else "drop it with eagle= (the EAGLE form has no exit head)"
            )
            raise GenerationError(f"head= chooses the exit head of the early-exit form: {why}")
        run.record_all(ExitStats(exit_layer=None, head="eagle"))
        return found, "eagle"
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
    large_calls = fallbacks + forced + final_checks  # passes after the prompt: a round that fed the large model
    unsure = fallbacks + int(c.prompt_stop == "unsure")  # with the first token's, which the prompt pass gave
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
        fallback_rate=unsure / small_steps if small_steps else 0.0,
        rollback_rate=c.rollbacks / large_calls if large_calls else 0.0,
        scored_drafts=c.scored,
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
    eagle="auto",
):
    """Big Little Decoder: a small model (small=, exit_layer= or the EAGLE head) with fallback and rollback
    to the large one."""
    rule = ChainRule.fallback(max_small, float(alpha_fb))
    if rule.never_drafts:
        yield from large_only(run, small, exit_layer, head, eagle)
        return
    drafter = small_drafter(run, small, exit_layer, head, eagle, rule)
    yield from decode(run, drafter, float(alpha_rb))


def large_only(run: Run, small, exit_layer, head, eagle="none"):
    """``alpha_fb = 1``: every step falls back, so the large model decodes alone, one call a token, and
    no small step runs (its token would be thrown away); the options are checked as for any setting."""
    check_form(run, small, exit_layer, head, eagle)
    yield from autoregressive_rounds(run)
    run.record([_large_only_stats(len(out)) for out in run.out])


def _large_only_stats(n: int) -> BildStats:
    calls = max(0, n - 1)  # the first token is the prompt pass's
    return BildStats(
        small_steps=0,
        small_tokens=0,
        fallbacks=calls,
        forced=0,
        final_checks=0,
        rollbacks=0,
        rolled_back=0,
        large_tokens=n,
        large_calls=calls,
        fallback_rate=float(n > 0),  # every step the large model's
        rollback_rate=0.0,
    )
