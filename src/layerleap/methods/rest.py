"""REST, retrieval-based speculative decoding (He et al. 2024), on top of prompt lookup: drafts that
need no draft model and no training, from the prompt and output so far and from a datastore of the
model's own answers.

Each round drafts as prompt lookup does (``methods.prompt_lookup``: the tokens that followed the
latest earlier occurrence of the longest matching suffix, ``max_ngram`` down to ``min_ngram``
tokens).  Where the prompt and output hold no such occurrence, the draft comes from the corpus
(``drafters.corpus``): the continuation most occurrences of the longest matching suffix share there,
token by token.  A corpus looks up n-grams of at most 8 tokens (``drafters.corpus.MAX_N``), so with
one a ``min_ngram`` above 8 is refused.  The shipped corpus of SmolLM2-135M-Instruct holds its greedy
answers to 8,147 ShareGPT prompts (1.29 M tokens); ``layerleap train corpus`` writes one for any
model from its ``layerleap train data --self-distill`` answers.  REST proper drafts from a datastore of other text
(UltraChat, The Stack) as a tree of frequent continuations; here the datastore is the model's own
text and the draft one chain.

One call verifies the last token and the draft, as prompt lookup's: greedy output is greedy decoding
token for token, sampling is lossless (every draft is a one-hot proposal).  Batches, grammars and
the adaptive draft length work as in prompt lookup.  Without a corpus (``corpus="none"``, or a model
none ships for under ``"auto"``, which says so with a ``CorpusWarning``, naming a given
``corpus_draft_len`` as without effect) it is prompt lookup; ``corpus_draft_len`` with
``corpus="none"`` is refused.

Stats, per row: prompt lookup's, and ``corpus_drafts`` (rounds drafted from the corpus; left out
without a corpus).
"""

from __future__ import annotations

import warnings

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..drafters.corpus import COMMAND, MAX_N, CorpusWarning, get_corpus
from ..drafters.prompt_lookup import PromptLookup, lookup_stats
from . import draft_verify
from .prompt_lookup import DEFAULT_MAX_NGRAM, adaptive_default, tuned
from .prompt_lookup import OPTIONS as LOOKUP_OPTIONS

MIN_NGRAM = O.MIN_NGRAM.but(help=f"the shortest n-gram looked up (<= max_ngram; <= {MAX_N} with a corpus, its longest)")
OPTIONS = (*(MIN_NGRAM if o.name == "min_ngram" else o for o in LOOKUP_OPTIONS), O.CORPUS, O.CORPUS_DRAFT_LEN)
# The most tokens a round drafts from the corpus, per weight format.  Its drafts are kept less often
# than a copy from the prompt (in q4 30% of them against 41%), so where a call's extra rows cost
# (q4: x1.23 at 4 tokens) it drafts one; see docs/BENCHMARKS.md ("REST").
CORPUS_DRAFT_LEN = {"float32": None, "bfloat16": None, "float16": None, "q4": 1}


def check_corpus_ngram(store, min_ngram: int) -> None:
    """Refuse a ``min_ngram`` above the longest n-gram a corpus looks up: the corpus would never draft."""
    if store is not None and min_ngram > MAX_N:
        raise GenerationError(
            f"min_ngram ({min_ngram}) is above {MAX_N}, the longest n-gram a corpus looks up, so the corpus would "
            f"never draft: lower min_ngram to {MAX_N} or less, or pass corpus=none"
        )


@register("rest", batched=True, sampling=True, exact=True, grammar=True, prompt_cache=True, options=OPTIONS)
def rest(
    run: Run,
    *,
    draft_len: int | None = None,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int | None = None,
    adaptive: bool | None = None,
    corpus="auto",
    corpus_draft_len: int | None = None,
):
    """REST: prompt lookup, and where the prompt and output hold no match, the draft that a datastore
    of the model's own answers suggests (greedy-exact; lossless sampling); corpus: auto (the shipped
    one for this model), none or a corpus file; corpus_draft_len: the most tokens drafted from it (none:
    the dtype's tuned one, draft_len but in q4 1)."""
    draft_len, min_ngram = tuned(run, draft_len, max_ngram, min_ngram)
    store = get_corpus(run.model, corpus)
    if store is None and corpus in (None, "none") and corpus_draft_len is not None:
        raise GenerationError("corpus_draft_len= limits the drafts a corpus gives, and corpus=none: drop one of them")
    check_corpus_ngram(store, min_ngram)
    if store is None and corpus == "auto":
        unused = ", and corpus_draft_len= has no effect" if corpus_draft_len is not None else ""
        warnings.warn(
            f"rest: no corpus ships for {run.model.config.name or 'this model'}, so it drafts as prompt lookup"
            f"{unused}: write one with `{COMMAND}` (from `layerleap train data --self-distill` answers) and pass "
            "corpus=FILE",
            CorpusWarning,
            stacklevel=2,
        )
    most = O.per_dtype(run.model, CORPUS_DRAFT_LEN) if corpus_draft_len is None else corpus_draft_len
    adaptive = adaptive_default(run, adaptive)
    drafter = PromptLookup(run, draft_len, min_ngram, max_ngram, adaptive, store, most)
    counts = yield from draft_verify.decode(run, drafter)
    run.record(lookup_stats(counts, drafter.index))
