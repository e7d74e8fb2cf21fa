"""The EAGLE head (after Li et al. 2024, EAGLE): a chain drafted from the model's own last-layer
features, one small head call per draft (``drafters.eagle.EagleDrafter``), verified in one call; the
call that verifies a chain gives the state the next chain starts from.  Greedy output is exactly the
model's greedy decoding.  When sampling, the chain's drafts are drawn from the head's own warped
distribution and verified by speculative sampling (``drafters.eagle``): lossless.

Stats: ``rounds``, ``drafted``, ``accepted``, ``acceptance``, ``tokens_per_round`` (``draft_verify``)
and ``head_steps`` (head calls, each drafting one token for every drafting row)."""

from __future__ import annotations

from ..core import options as O
from ..core.run import Run, register
from ..core.stats import EagleStats
from ..drafters import medusa_transfer as weights
from ..drafters.draft_vocab import get_draft_vocab
from ..drafters.eagle import EagleChains, EagleDrafter
from . import draft_verify

# Draft lengths and widths per weight format, from one interleaved run over 10 Spec-Bench prompts x 64
# tokens at draft_len 1-2 and width 1, 3, 5 (benchmarks/eagle_tuning.py, docs/HIDDEN_TRANSFER.md, "The
# EAGLE head"): a second draft of the shipped head adds less than its head step and verification row
# cost; in fp32 two siblings of the first draft lift its acceptance from 26% to 41% at ×1.03 a call.
DEFAULT_DRAFT_LEN = {"float32": 1, "bfloat16": 1, "float16": 1, "q4": 1}
DEFAULT_WIDTH = {"float32": 3, "bfloat16": 3, "float16": 3, "q4": 1}
# How many of the shipped draft vocabulary's most frequent ids the chains score per weight format (None:
# all 12,288).  In q4 the draft-vocabulary product is a seventh of a round: over 39 Spec-Bench prompts x
# 64 tokens (q4 eagle, 1 thread, a 2-core Zen 5 EPYC) the first 8,192 ids gave the same tokens per call
# as all 12,288 (1.364; 4,096: 1.358) at two thirds of the product's bytes.
DRAFT_VOCAB_SIZE = {"float32": None, "q4": 8192}


def chains_vocab(model, vocab, spec):
    """The draft vocabulary EAGLE's chains score: ``vocab`` (what the ``draft_vocab`` option ``spec`` gave),
    cut to the dtype's ``DRAFT_VOCAB_SIZE`` most frequent ids where ``spec`` is "auto" (the shipped set)."""
    size = O.per_dtype(model, DRAFT_VOCAB_SIZE)
    return vocab.first(size) if spec == "auto" and vocab is not None and size else vocab


@register(
    "eagle",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(O.DRAFT_LEN.but(none="the dtype's tuned one"), O.WIDTH, O.MIN_CONFIDENCE, O.EAGLE_HEAD, O.DRAFT_VOCAB),
)
def eagle(run: Run, *, draft_len=None, width=None, min_confidence=0.0, eagle_head="trained", draft_vocab="auto"):
    """The EAGLE head drafting a chain feature by feature (draft_len: the most drafts a round; width: the
    first draft's top-k verified side by side; none: the dtype's tuned ones; min_confidence: stop after a
    less sure draft), verified in one call: greedy-exact; lossless sampling.  draft_vocab as medusa's ("auto"
    in q4: the shipped set's most frequent ids, ``DRAFT_VOCAB_SIZE``)."""
    head = weights.get_drafter(run.model, "eagle", eagle_head)
    draft_len = O.per_dtype(run.model, DEFAULT_DRAFT_LEN) if draft_len is None else draft_len
    width = O.per_dtype(run.model, DEFAULT_WIDTH) if width is None else width
    vocab = chains_vocab(run.model, get_draft_vocab(run.model, draft_vocab), draft_vocab)
    drafter = EagleDrafter(run, EagleChains(run, head, draft_len, vocab, min_confidence, width))
    yield from draft_verify.decode(run, drafter)
    run.record([EagleStats(head_steps=drafter.head_steps)] * run.batch)
