"""Prompt lookup decoding (Saxena 2023; `transformers`' ``prompt_lookup_num_tokens``): drafts that
need no draft model and no training.

The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in the prompt
and the output so far; the tokens that followed their latest earlier occurrence are the draft, up to
``draft_len`` of them.  One model call scores the last token and the draft; greedy decoding keeps
the longest prefix the model agrees with plus the model's own next token (output identical to
greedy decoding), sampling keeps each draft token with probability ``p(d)`` and otherwise samples
from ``p`` without ``d`` (lossless: a draft is a one-hot proposal).  Where nothing matches, the call
scores the last token alone, as greedy decoding does.  It pays off where the output copies its
input: summaries, retrieval-augmented answers, code edits.

A list of prompts decodes as one batch: each row keeps its own n-gram index and draft, one call
scores every row's last token and draft (shorter drafts padded with filler tokens that nothing
attends to; finished rows ride along), and each row keeps what it accepts: the cache rolls back to
a length per row.  The drafter is ``drafters.prompt_lookup.PromptLookup``, the loop and the rule
``draft_verify``'s.  Each row's output is what it decodes alone (greedy; sampling with
``seed + row``).

Stats, per row: ``rounds`` (model calls after the prompt while the row ran), ``drafted``,
``accepted``, ``acceptance``, ``lookups_hit`` (rounds that found a draft), ``tokens_per_round``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..drafters import lengths
from ..drafters.prompt_lookup import NgramIndex, PromptLookup, lookup_stats
from . import draft_verify

__all__ = ["NgramIndex", "prompt_lookup"]

# Defaults per weight format, chosen by replaying recorded greedy outputs of 50 held-out Spec-Bench
# prompts (chat, 128 tokens) against each format's measured call-cost curve (2 threads): the draft
# length that maximises accepted tokens per unit of call cost, not per call.  A 4-bit call over 5+
# tokens costs 1.6x a one-token call, fp32's 1.1x, so fp32 drafts longer and from single-token
# matches.  See docs/BENCHMARKS.md ("Choosing draft lengths") for the command and the table.
DEFAULTS = {  # dtype name -> (draft_len, min_ngram)
    "float32": (4, 1),
    "bfloat16": (4, 1),
    "float16": (4, 1),
    "q4": (3, 2),
}
DEFAULT_DRAFT_LEN, DEFAULT_MIN_NGRAM = DEFAULTS["float32"]
DEFAULT_MAX_NGRAM = 4


OPTIONS = (
    O.DRAFT_LEN.but(none="the dtype's tuned one"),
    O.MAX_NGRAM_OPT.but(default=DEFAULT_MAX_NGRAM),
    O.MIN_NGRAM,
    O.ADAPTIVE,
)


def tuned(run: Run, draft_len, max_ngram: int, min_ngram) -> tuple[int, int]:
    """(draft_len, min_ngram) with the dtype's tuned defaults for those not given (a default min_ngram
    never above max_ngram); refuses min_ngram > max_ngram."""
    dl, mn = O.per_dtype(run.model, DEFAULTS)
    draft_len = dl if draft_len is None else draft_len
    min_ngram = min(mn, max_ngram) if min_ngram is None else min_ngram
    if min_ngram > max_ngram:
        raise GenerationError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram}): lower min_ngram")
    return draft_len, min_ngram


def adaptive_default(run: Run, adaptive: bool | None) -> bool:
    """``adaptive`` as given, or on where this machine's call-cost curve makes a second token cost
    (``lengths.adaptive_default``)."""
    return lengths.adaptive_default(run.model) if adaptive is None else adaptive


@register("prompt-lookup", batched=True, sampling=True, exact=True, grammar=True, prompt_cache=True, options=OPTIONS)
def prompt_lookup(
    run: Run,
    *,
    draft_len: int | None = None,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int | None = None,
    adaptive: bool | None = None,
):
    """Prompt lookup: drafts copied from the prompt and output by n-gram match, verified in one call
    (greedy-exact; lossless sampling); draft_len and min_ngram none: the dtype's tuned default;
    adaptive: each round's length from the running acceptance (``drafters.lengths``; none: on where the
    call-cost curve makes a second token cost, as in q4)."""
    draft_len, min_ngram = tuned(run, draft_len, max_ngram, min_ngram)
    adaptive = adaptive_default(run, adaptive)
    drafter = PromptLookup(run, draft_len, min_ngram, max_ngram, adaptive)
    counts = yield from draft_verify.decode(run, drafter)
    run.record(lookup_stats(counts, drafter.index))
