"""Self-speculative decoding with an exit head: PPD's single-device counterpart (the same early
prediction at layer d̄, used sequentially instead of in parallel; LayerSkip-style drafting).

Draft: up to ``draft_len`` tokens, each from layers ``[0, d̄)`` and the exit head (greedy).
Verify: ONE pass of the full model over the last verified token and the drafts that continues from
the drafted tokens' layer-d̄ hidden states (their layers ``[0, d̄)`` and KV entries are reused, never
recomputed; only the last draft, which the lower layers have not seen, runs from the embedding).
``verify.greedy_accept`` keeps the longest prefix that equals the full model's argmax and adds the
full model's own next token, so the output is greedy decoding, token for token.  Rejected drafts
leave every layer of the cache (``KVCache.truncate`` per layer range).

The drafter is ``drafters/early_exit.py``'s ``EarlyExitDrafter`` (a cache whose lower layers run
ahead of the upper ones, the pending layer-d̄ states), the loop and the rule ``draft_verify``'s.
Sampling draws the drafts from the exit head's warped distribution and accepts them by speculative
sampling: lossless.

``min_confidence``: stop drafting early when the exit head's top probability falls below it (that
position is left to the full model; 0 = always draft ``draft_len``).  ``schedule="heuristic"``: the
draft length follows the running acceptance (+2 after a round whose drafts were all accepted, -1
otherwise, at least 1; `transformers`' heuristic schedule); ``"constant"`` keeps ``draft_len``.

Stats: ``exit_layer``, ``head``, ``rounds`` (verification passes), ``drafted``, ``accepted``,
``acceptance`` (accepted / drafted), ``tokens_per_round``, ``draft_steps``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import Run, register
from ..core.stats import ExitStats, SelfSpecStats
from ..drafters.base import ChainRule, DraftLength
from ..drafters.early_exit import EarlyExitDrafter
from . import draft_verify


# Draft lengths per weight format, chosen by benchmarks/tree_tuning.py from the exit's per-position
# accuracy on held-out Spec-Bench prompts and the call-cost curve: each draft costs half the layers
# and the exit head's unembedding, so one draft a round is the least loss (docs/BENCHMARKS.md).
DEFAULT_DRAFT_LENS = {"float32": 1, "bfloat16": 1, "float16": 1, "q4": 1}


def default_exit_layer(n_layers: int) -> int:
    """Half the depth (15 of 30 on SmolLM2-135M), as PPD's default d̄."""
    return max(1, min(n_layers - 1, (n_layers + 1) // 2))


@register(
    "self-spec",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(
        O.EXIT_LAYER,
        O.DRAFT_LEN.but(none="the dtype's tuned one"),
        O.MIN_CONFIDENCE,
        O.HEAD,
        O.SCHEDULE,
        O.DRAFT_VOCAB,
    ),
)
def self_spec(
    run: Run,
    *,
    exit_layer: int | None = None,
    draft_len: int | None = None,
    min_confidence: float = 0.0,
    head="auto",
    schedule: str = "constant",
    draft_vocab="auto",
):
    """Self-speculative decoding: draft with layers [0, exit_layer) + exit head, verify with one full
    pass reusing their KV (greedy-exact; lossless sampling).  draft_vocab: the exit head scores only a
    shipped set of frequent tokens ('auto'), all tokens ('full'), or a draft-vocabulary file's."""
    from ..drafters.draft_vocab import get_draft_vocab, with_draft_vocab
    from ..drafters.exit_heads import get_head

    d = run.n_layers
    E = default_exit_layer(d) if exit_layer is None else exit_layer
    draft_len = O.per_dtype(run.model, DEFAULT_DRAFT_LENS) if draft_len is None else draft_len
    exit_head = with_draft_vocab(get_head(run.model, E, head), get_draft_vocab(run.model, draft_vocab))
    run.record_all(ExitStats(exit_layer=E, head=exit_head.kind))
    rule = ChainRule(DraftLength(draft_len, schedule), float(min_confidence), keep_unsure=False)
    drafter = EarlyExitDrafter(run, E, exit_head, rule)
    yield from draft_verify.decode(run, drafter)
    run.record([SelfSpecStats(draft_steps=n) for n in drafter.draft_steps])
