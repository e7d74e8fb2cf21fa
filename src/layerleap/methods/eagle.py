"""The EAGLE head (after Li et al. 2024, EAGLE): a chain drafted from the model's own last-layer
features, one small head call per draft (``drafters.eagle.EagleDrafter``), verified in one call; the
call that verifies a chain gives the state the next chain starts from.  Greedy output is exactly the
model's greedy decoding; sampling verifies the argmax drafts as one-hot proposals (lossless).

Stats: ``rounds``, ``drafted``, ``accepted``, ``acceptance``, ``tokens_per_round`` (``draft_verify``)
and ``head_steps`` (head calls, each drafting one token for every drafting row)."""

from __future__ import annotations

from ..core import options as O
from ..core.run import Run, register
from ..core.stats import EagleStats
from ..drafters import medusa_transfer as weights
from ..drafters.draft_vocab import get_draft_vocab
from ..drafters.eagle import EagleDrafter
from . import draft_verify

# Draft lengths per weight format, from one interleaved run over 10 Spec-Bench prompts x 64 tokens
# at draft_len 1-4 (docs/HIDDEN_TRANSFER.md, "The EAGLE head"): the shipped head's drafts are kept
# 24-26% of the time, so a second draft adds less than its head step and its verification row cost.
DEFAULT_DRAFT_LEN = {"float32": 1, "bfloat16": 1, "float16": 1, "q4": 1}


@register(
    "eagle",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    options=(O.DRAFT_LEN, O.MIN_CONFIDENCE, O.EAGLE_HEAD, O.DRAFT_VOCAB),
)
def eagle(run: Run, *, draft_len=None, min_confidence=0.0, eagle_head="trained", draft_vocab="auto"):
    """The EAGLE head drafting a chain feature by feature (draft_len: the most drafts a round, none: the
    dtype's tuned length; min_confidence: stop after a less sure draft), verified in one call:
    greedy-exact; lossless sampling.  draft_vocab as medusa's."""
    head = weights.get_drafter(run.model, "eagle", eagle_head)
    if draft_len is None:
        draft_len = DEFAULT_DRAFT_LEN.get(run.model.dtype_name, DEFAULT_DRAFT_LEN["float32"])
    drafter = EagleDrafter(run, head, draft_len, get_draft_vocab(run.model, draft_vocab), min_confidence)
    yield from draft_verify.decode(run, drafter)
    run.record([EagleStats(head_steps=drafter.head_steps)] * run.batch)
