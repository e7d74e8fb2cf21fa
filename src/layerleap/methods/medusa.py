"""Medusa (Cai et al. 2024, Medusa-1): the Hidden Transfer paper's yardstick.

Residual heads on the last layer's normalised state predict the tokens 2..k+1 ahead
(``drafters.medusa_transfer.MedusaHeads``); their top-k per step make a candidate tree (``tree=``),
verified in one call with tree attention; ``tree="dynamic"`` builds each round's tree from the heads' own confidence
(EAGLE-2, ``drafters.trees.DynamicTree``).  The call that verifies a tree also gives the last
accepted node's state, so the same call drafts the next tree (``drafters.trees.MedusaDrafter``; the
loop and the rule are ``draft_verify``'s).  Greedy output is exactly the model's greedy decoding;
sampling verifies the tree by SpecInfer's multi-draft rule (lossless).

Stats: ``rounds``, ``drafted`` (tree depth per round), ``accepted``, ``acceptance``,
``accepted_per_round``, ``tree_nodes``, ``tokens_per_round``.
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..drafters import medusa_transfer as weights
from ..drafters.draft_vocab import get_draft_vocab
from ..drafters.trees import DynamicTree, MedusaDrafter, tree_buffers
from . import draft_verify

# Trees per weight format, chosen by benchmarks/tree_tuning.py as hidden-transfer's are: each head
# ends in the full unembedding, so one level of the first head's top-k beats any deeper tree here.
DEFAULT_TREES = {"float32": "3", "bfloat16": "3", "float16": "3", "q4": "2"}


def decode_tree(
    run: Run,
    kind: str,
    name: str,
    tree,
    spec,
    drafter_cls,
    draft_vocab="auto",
    tree_nodes=None,
    tree_depth=None,
    tuned_depth=None,
):
    """A tree method: its ``kind`` of weights (``spec``), the draft vocabulary, the checked tree (or
    ``"dynamic"``: EAGLE-2's tree each round, ``tree_nodes`` nodes or, None, the count chosen each
    round, at most ``tree_depth`` deep, None: ``tuned_depth``, or every step of the weights), the shared
    loop."""
    for opt, value in (("tree_nodes", tree_nodes), ("tree_depth", tree_depth)):
        if value is not None and tree != "dynamic":
            raise GenerationError(
                f"{opt} shapes a dynamic tree only, and the tree is not one: give tree='dynamic' too, or drop {opt}"
            )
    w = weights.get_drafter(run.model, kind, spec)
    if tree_depth is not None and tree_depth > w.steps:
        raise GenerationError(
            f"tree_depth is {tree_depth} but the {name} weights have {w.steps} step(s): give tree_depth at most "
            f"{w.steps}, or train more steps"
        )
    vocab = get_draft_vocab(run.model, draft_vocab)
    depth = tree_depth or min(tuned_depth or w.steps, w.steps)
    dynamic = DynamicTree(depth, tree_nodes) if tree == "dynamic" else None
    buf = tree_buffers(run, name, "" if dynamic else tree, w.steps, vocab)
    drafter = drafter_cls(run, w, buf, vocab, dynamic)
    counts = yield from draft_verify.decode(run, drafter)
    run.record(drafter.tree_stats(counts))


@register(
    "medusa",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(O.TREE_DYNAMIC, O.TREE_NODES, O.TREE_DEPTH, O.MEDUSA_HEADS, O.DRAFT_VOCAB),
)
def medusa(run: Run, *, tree=None, tree_nodes=None, tree_depth=None, heads="trained", draft_vocab="auto"):
    """Medusa heads drafting a candidate tree (tree=, heads=; tree none: the dtype's tuned tree; 'dynamic':
    each round the paths of the highest product of draft probabilities, tree_nodes of them), verified with
    tree attention: greedy-exact; lossless sampling.  draft_vocab: the heads score only a shipped set of
    frequent tokens ('auto'), all tokens ('full'), or a draft-vocabulary file's."""
    tree = O.per_dtype(run.model, DEFAULT_TREES) if tree is None else tree
    yield from decode_tree(run, "medusa", "medusa", tree, heads, MedusaDrafter, draft_vocab, tree_nodes, tree_depth)
