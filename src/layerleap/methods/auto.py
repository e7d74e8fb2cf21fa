"""``auto``: one lossless method that chooses, round by round, how to draft on this machine.

Every round verifies, in one model call, either prompt lookup's copied chain (a plain call; where
nothing matches it is a greedy step), Hidden Transfer's tree with the lookup chain merged in as
one more branch (a transfer call, which also makes the pseudo states that draft the next tree),
Medusa's tree with the chain merged in (a Medusa call; ``medusa=``), or the EAGLE head's drafts
(its chain and the first draft's top-k, the ``eagle`` method's per-dtype draft length and width)
with the chain merged in (an EAGLE call; ``eagle=``).  Which is decided from the
tokens per millisecond each kind of round has given on this request (``drafters.auto.Chooser``): a
request that copies its prompt stays on cheap plain calls, one where a tree's drafts pay keeps that
tree, and one where none does decodes at greedy's pace.  Self-speculation is not among its drafts:
early-exit drafts cost more than they save on the models and machines measured
(``docs/BENCHMARKS.md``).

The greedy output is greedy decoding, token for token, whatever was chosen; sampling is lossless
(SpecInfer's rule: the EAGLE head's chain drafts drawn from its distribution, every other draft
one-hot).  A list of prompts decodes as one batch (one mode for the batch; a transfer or Medusa call
verifies each row's tree alone, without its lookup chain): greedy rows are the rows alone, and so are
sampled ones where every call is of one kind (EAGLE calls only, or lookup only); otherwise a sampled row
draws other drafts than its prompt alone seeded ``seed + i``, so other tokens, from the same distribution.  Without
drafter weights for the model (``transfer``, ``medusa`` and ``eagle`` "auto" find none, or none are
given), it is prompt lookup.  In q4 the trees cost more than they gain and are left out by default
(``NO_TRANSFER_DTYPES``); so is the EAGLE head, unless this machine's call-cost curve is flat enough
that every call is an EAGLE call (``NO_EAGLE_DTYPES``, ``left_out``).  Where the EAGLE head is in use,
``transfer`` and ``medusa`` "auto" mean none: its calls beat both trees' on the models and machines
measured, and each kind of call more is probed at its cost (a weights file still adds them).

Stats: as ``prompt-lookup``, plus ``lookup_rounds``, ``transfer_rounds``, ``medusa_rounds``,
``eagle_rounds``, ``mode_switches``, ``tree_nodes`` (the mean nodes a call verified, the root included,
whatever the kind of call: a plain call's chain, a tree with the chain merged in, the EAGLE head's drafts;
rounded) and ``accepted_per_round``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..drafters import medusa_transfer as weights
from ..drafters import lengths
from ..drafters.auto import AutoDrafter
from ..drafters.corpus import get_corpus
from ..drafters.draft_vocab import get_draft_vocab
from ..drafters.eagle import EagleChains
from ..drafters.prompt_lookup import lookup_stats
from ..drafters.trees import tree_buffers
from . import draft_verify
from . import eagle as eagle_method
from .hidden_transfer import default_tree
from .medusa import DEFAULT_TREES as MEDUSA_TREES
from .prompt_lookup import DEFAULT_MAX_NGRAM, OPTIONS, adaptive_default, tuned
from .rest import MIN_NGRAM, check_corpus_ngram


# Weight formats where "auto" leaves Hidden Transfer out: in q4 a call over a tree's rows costs far more
# than a one-token call (x1.6 at 4 rows, against fp32's x1.05), and the transfer tree lost to greedy
# in every category of the 15-prompt q4 run (0.82x on a Zen 4 EPYC with the block kernel, 0.72x on
# a Zen 5 with torch's int4 kernel; docs/BENCHMARKS.md), so its probes only cost.
NO_TRANSFER_DTYPES = ("q4",)
# Weight formats where "auto" leaves the EAGLE head out unless this machine's call-cost curve is flat
# (``plain_calls`` false): in q4 with plain calls beside them, EAGLE calls (one draft, no fan: the eagle
# method's q4 defaults) and their probes cost what they gain: interleaved on 15 Spec-Bench prompts x 64
# tokens (2 threads, a 2-core Zen 5 EPYC, best of 3), auto with the head ran at 1.06x greedy against
# 1.07x without it on torch's int4 kernel's q4 curve (x1.12 at 2 tokens).  Where a second token costs
# under ADAPTIVE_STEP (the block kernel's curve on that EPYC, q4's shipped one: x1.03-1.08 at 2
# tokens), every call is an EAGLE call with the lookup
# chain merged in: 1.08x and 1.09x against 1.05x, in two runs (docs/BENCHMARKS.md, "auto with EAGLE calls").
NO_EAGLE_DTYPES = ("q4",)


# Where the EAGLE head is in use and this machine's call-cost curve is flat (a second token costs less
# than lengths.ADAPTIVE_STEP of a one-token call, as in fp32), every call is an EAGLE call with the
# lookup chain merged in: no plain calls, so nothing to probe.  With the head in use, "auto" (the
# default) for transfer and medusa means none: the head's drafts beat both trees, and each kind of call
# more is probed at its cost.  On 15 Spec-Bench prompts in fp32 (Zen 5, 2 threads, best of 3) that is
# 1.42x greedy against 1.28x for lookup, Hidden Transfer and Medusa calls chosen round by round
# (docs/BENCHMARKS.md, "auto with EAGLE calls").
def plain_calls(model) -> bool:
    """Whether ``auto`` makes plain calls beside EAGLE calls: where this machine's call-cost curve makes a
    second token cost (``lengths.adaptive_default``; see the comment above)."""
    return lengths.adaptive_default(model)


LEFT_OUT = {"transfer": NO_TRANSFER_DTYPES, "medusa": NO_TRANSFER_DTYPES, "eagle": NO_EAGLE_DTYPES}


def left_out(model, kind: str) -> bool:
    """Whether "auto" weights leave ``kind`` out on ``model`` (``LEFT_OUT``; the EAGLE head only where this
    machine's curve also makes a second token cost, see ``NO_EAGLE_DTYPES``)."""
    if model.dtype_name not in LEFT_OUT[kind]:
        return False
    return kind != "eagle" or plain_calls(model)


def drafter_weights(run: Run, kind: str, spec):
    """The ``kind`` weights ("transfer", "medusa" or "eagle") ``spec`` names, or None: "auto" is the
    shipped ones when the model has any and is not left out for the kind (``left_out``);
    None / "none" is none."""
    if spec is None or spec == "none":
        return None
    if spec == "auto":
        if left_out(run.model, kind) or not weights.shipped_files(run.model, kind):
            return None
        return weights.get_drafter(run.model, kind)
    return weights.get_drafter(run.model, kind, spec)


TRANSFER = O.TRANSFER.but(
    default="auto",
    choices=("auto", "none"),
    none="no Hidden Transfer: prompt lookup alone",
    help="Hidden Transfer projections: auto (the shipped ones, if any, except in q4 or with the EAGLE head), none, "
    "or a weights file",
)
ADAPTIVE = O.ADAPTIVE.but(
    none="a chain merged into a tree: always (its rows are priced beside the tree's, lengths.MergedChainCut); "
    "a plain call's: where a 2-token call costs x1.10 or more of a 1-token one (q4 with torch's int4 kernel; fp32 not)"
)
AUTO_OPTIONS = tuple({"adaptive": ADAPTIVE, "min_ngram": MIN_NGRAM}.get(o.name, o) for o in OPTIONS)
MEDUSA = O.AUTO_MEDUSA
EAGLE = O.AUTO_EAGLE
CORPUS = O.CORPUS.but(default="none")


@register(
    "auto",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(*AUTO_OPTIONS, O.TREE, TRANSFER, MEDUSA, EAGLE, O.DRAFT_VOCAB, CORPUS),
)
def auto(
    run: Run,
    *,
    draft_len: int | None = None,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int | None = None,
    tree=None,
    transfer="auto",
    medusa=MEDUSA.default,
    eagle=EAGLE.default,
    draft_vocab="auto",
    adaptive: bool | None = None,
    corpus=CORPUS.default,
):
    """Lossless: prompt lookup's chain, Hidden Transfer's tree, Medusa's or the EAGLE head's drafts, the
    fastest per round on this machine (draft_len, min_ngram, tree none: the dtype's tuned defaults;
    transfer, medusa, eagle: 'auto', a weights file or none;
    draft_vocab: the pseudo states score a shipped set of frequent tokens ('auto'), all ('full') or a file's;
    adaptive: chain lengths from the running acceptance and the call-cost curve; none: a chain merged
    into a tree always, a plain call's where the curve makes a second token cost, as in q4;
    corpus: where the prompt and output hold no match, the chain from this datastore (rest's))."""
    draft_len, min_ngram = tuned(run, draft_len, max_ngram, min_ngram)
    store = get_corpus(run.model, corpus)
    check_corpus_ngram(store, min_ngram)
    head = drafter_weights(run, "eagle", eagle)
    proj = None if head is not None and transfer == "auto" else drafter_weights(run, "transfer", transfer)
    heads = None if head is not None and medusa == "auto" else drafter_weights(run, "medusa", medusa)
    if proj is None and tree is not None:
        raise GenerationError(
            "tree= shapes Hidden Transfer's tree, and no Hidden Transfer projections are in use here "
            "(transfer=none, none ship for this model, this dtype leaves them out, or the EAGLE head stands in "
            "for them): drop tree=, or give transfer="
        )
    buf = medusa_buf = chains = None
    vocab = get_draft_vocab(run.model, draft_vocab) if any(d is not None for d in (proj, heads, head)) else None
    if proj is not None:
        buf = tree_buffers(run, "transfer", default_tree(run.model) if tree is None else tree, proj.steps, vocab)
    if heads is not None:
        medusa_buf = tree_buffers(run, "medusa", O.per_dtype(run.model, MEDUSA_TREES), heads.steps, vocab)
    if head is not None:
        eagle_len = O.per_dtype(run.model, eagle_method.DEFAULT_DRAFT_LEN)
        width = O.per_dtype(run.model, eagle_method.DEFAULT_WIDTH)
        eagle_vocab = eagle_method.chains_vocab(run.model, vocab, draft_vocab)
        chains = EagleChains(run, head, eagle_len, eagle_vocab, width=width)
    cut_merged = adaptive is not False
    adaptive = adaptive_default(run, adaptive)
    plain = head is None or plain_calls(run.model)
    drafter = AutoDrafter(
        run,
        draft_len,
        min_ngram,
        max_ngram,
        proj,
        buf,
        vocab,
        adaptive,
        heads,
        medusa_buf,
        chains,
        plain,
        cut_merged,
        corpus=store,
    )
    counts = yield from draft_verify.decode(run, drafter)
    run.record(lookup_stats(counts, drafter.index))
    run.record(drafter.tree_stats(counts))
    run.record(drafter.auto_stats())
