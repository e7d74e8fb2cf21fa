"""Hidden Transfer (Wu et al., "Parallel Decoding via Hidden Transfer for Lossless LLM
Acceleration", §3.2-3.4, Figure 2).

Trained projections ``W_i`` at layers ``t_i`` (``drafters.TransferProjections``) turn each
position's hidden state into the *pseudo* hidden state of the token ``i`` ahead.  In one model call
over a flattened candidate tree:

1. the tree's nodes run through layers ``[0, t_1)``;
2. at layer ``t_i`` every node ``x`` gets a step-``i`` pseudo state ``W_i h_x`` (position
   ``pos(x) + i``) appended to the sequence; it sees what ``x`` sees, ``x``, ``x``'s earlier
   pseudo states and itself (``tree.pseudo_mask``; real nodes never see pseudo states);
3. everything runs on to the last layer; the real nodes' logits verify the tree
   (``verify.accept_greedy``), and the accepted last node's pseudo states, through the model's own
   final norm and unembedding, give the draft distributions of the next round's tree.

So each call verifies the previous drafts and produces the next (Figure 2): the drafter is
``drafters.trees.TransferDrafter``, the loop and the rule ``draft_verify``'s.  Only the accepted
path's keys/values stay in the cache.  The first call after the prompt verifies an empty tree (the
prompt pass is plain), so drafting starts with the second token.  Greedy output is exactly the
model's greedy decoding, whatever the projections; sampling verifies the tree by SpecInfer's
multi-draft rule (lossless).

``tree="dynamic"`` (EAGLE-2, ``drafters.trees.DynamicTree``) builds each round's tree from the kept
node's pseudo states' own confidence.  Which positions get pseudo states stays fixed within a round:
every node of the tree, for every step the next tree may take (``tree_depth``; any node may be the
last kept one), so a node costs ``1 + tree_depth`` positions in the upper layers, which the count
chosen each round prices (``TransferDrafter.round_cost``).  The depth is 1 unless given: deeper
trees pay every node's further pseudo states, more than their drafts gain on SmolLM2-135M
(docs/HIDDEN_TRANSFER.md, "Dynamic trees").

Stats as ``medusa`` plus ``pseudo_states`` (pseudo positions evaluated).
"""

from __future__ import annotations

from ..core import options as O
from ..core.run import Run, register
from ..drafters.trees import TransferDrafter
from .medusa import decode_tree

# Trees per weight format, chosen by benchmarks/tree_tuning.py: the tree with the most emitted tokens
# per unit of round cost, from the shipped projections' draft ranks on held-out Spec-Bench prompts and
# each format's call-cost curve (docs/BENCHMARKS.md, "Choosing trees and draft lengths").  Where a
# call over more tokens is nearly free (fp32) the top-3 of the first pseudo state pays; where it is
# not (q4, whose bf16 unembedding is 46% of a step) only the top-1.
DEFAULT_TREES = {"float32": "3", "bfloat16": "3", "float16": "3", "q4": "1"}


def default_tree(model) -> str:
    """The tuned tree for the model's weight format."""
    return O.per_dtype(model, DEFAULT_TREES)


@register(
    "hidden-transfer",
    batched=True,
    sampling=True,
    exact=True,
    grammar=True,
    prompt_cache=True,
    options=(O.TREE_DYNAMIC, O.TREE_NODES, O.TREE_DEPTH, O.TRANSFER, O.DRAFT_VOCAB),
)
def hidden_transfer(run: Run, *, tree=None, tree_nodes=None, tree_depth=None, transfer="trained", draft_vocab="auto"):
    """Hidden Transfer: pseudo hidden states from trained projections draft a tree (tree=, transfer=; tree
    none: the dtype's tuned tree; 'dynamic': each round the paths of the highest product of draft
    probabilities, tree_nodes of them, tree_depth deep, none: 1): greedy-exact; lossless sampling.
    draft_vocab: pseudo states score only a shipped set of frequent tokens ('auto'), all tokens ('full'),
    or a draft-vocabulary file's."""
    tree = default_tree(run.model) if tree is None else tree
    yield from decode_tree(
        run, "transfer", "hidden-transfer", tree, transfer, TransferDrafter, draft_vocab, tree_nodes, tree_depth, 1
    )
