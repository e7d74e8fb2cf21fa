"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): BiLD's lossless yardstick.

A smaller draft model with the same tokenizer proposes up to γ tokens autoregressively; the target
model scores the last accepted token and all drafts in ONE call, and ``verify.greedy_accept``
(greedy) or ``verify.speculative_accept`` (sampling) keeps a prefix and adds one token of the
target's own.  Greedy output equals the target's greedy decoding token for token; sampled output is
distributed exactly as the target's sampling (same temperature / top-k / top-p warps on both models).

Options:

Defaults: ``draft_len=20, schedule="constant", min_confidence=0.4``, `transformers`' own defaults for
assisted generation and the fastest setting measured on the Qwen2.5-Coder 1.5B / 0.5B pair
(docs/BILD.md): the confidence stop, not γ, decides how long a round is (in one run fixed γ = 4
without it ran 0.82× of greedy, the heuristic schedule alone 0.81×, these defaults 0.99×).

- ``draft_len``: γ, the most drafts per round (with ``schedule="heuristic"``, the first round's γ).
- ``schedule``: ``"constant"`` keeps γ = ``draft_len``; ``"heuristic"`` is `transformers`'
  ``num_assistant_tokens_schedule="heuristic"``: γ + 2 after a round whose drafts were all
  accepted, max(1, γ − 1) otherwise (no upper limit but the tokens left).
- ``min_confidence``: a round stops drafting after a draft token whose draft distribution has a top
  probability below it (0 = off).  The unsure token is still verified (its draft call is already
  paid), as `transformers`' ``assistant_confidence_threshold`` does.

The draft length never depends on the target's rows of the current round, only on the draft's own
distributions and on earlier rounds, so both stay exact: greedy equals the target's greedy
decoding and sampling stays lossless (every position is verified by the same acceptance rule
whatever γ was).

Both caches roll back exactly: the target keeps its entries for the accepted drafts, the draft
keeps what it computed for them, and neither recomputes an accepted token.  A list of prompts
decodes as one batch: the draft model writes every row's chain in the same steps (a row that has
stopped drafting rides along as filler), each row with its own γ and random generator, and the
target scores all chains in one call.  The drafter is
``drafters.companion.DraftModel``; the loop and the acceptance rule are ``draft_verify``'s.

Stats: ``draft_calls``, ``draft_layer_evals`` (the draft's own meters), ``drafted``,
``accepted``, ``acceptance`` (accepted / drafted), ``rounds`` (target calls after the prompt),
``draft_len_mean`` (drafted / rounds: the mean γ used), ``draft_len_max``, ``confidence_stops``
(rounds cut short by ``min_confidence``), ``tokens_per_round``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import Run, register
from ..core.stats import SpeculativeStats
from ..drafters.base import ChainRule, DraftLength
from ..drafters.companion import DraftModel, check_pair
from . import draft_verify

__all__ = ["DraftLength", "speculative"]


@register(
    "speculative",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(O.DRAFT_MODEL, O.DRAFT_LEN.but(default=20), O.SCHEDULE, O.MIN_CONFIDENCE.but(default=0.4)),
)
def speculative(run: Run, *, draft, draft_len: int = 20, schedule: str = "constant", min_confidence: float = 0.4):
    """Speculative decoding with a draft model (draft=, γ = draft_len, schedule, min_confidence):
    greedy-exact or lossless sampling."""
    check_pair(run.model, draft, "draft", "draft")
    rule = ChainRule(DraftLength(draft_len, schedule), float(min_confidence), keep_unsure=True)
    counts = yield from draft_verify.decode(run, DraftModel(run, draft, rule))
    run.record(
        [
            SpeculativeStats(
                draft_len_max=c.draft_max,
                draft_len_mean=c.drafted / c.rounds if c.rounds else None,
                confidence_stops=c.stops["unsure"],
            )
            for c in counts
        ]
    )
