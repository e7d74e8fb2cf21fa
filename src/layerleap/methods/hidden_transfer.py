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
   (``verify.tree_accept``), and the accepted last node's pseudo states, through the model's own
   final norm and unembedding, give the draft distributions of the next round's tree.

So each call verifies the previous drafts and produces the next (Figure 2).  Only the accepted
path's keys/values stay in the cache.  The first call after the prompt verifies an empty tree (the
prompt pass is plain), so drafting starts with the second token.  Greedy output is exactly the
model's greedy decoding, whatever the projections.

Stats as ``medusa`` plus ``pseudo_states`` (pseudo positions evaluated).
"""

from __future__ import annotations

import torch

from ..drafters import medusa_transfer as drafters
from ..core import tree as tree_mod
from ..core.run import Run, register
from ..core.kv_cache import KVCache
from . import treeloop

DEFAULT_TREE = "1,1"  # see medusa.DEFAULT_TREE


def transfer_pass(run: Run, cache: KVCache, tokens: torch.Tensor, buf: tree_mod.TreeBuffers,
                  proj: drafters.TransferProjections, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One model call over tree ``tokens`` ``[n]`` with pseudo states of ``steps`` transfer steps for
    every node: -> (real nodes' last hidden states ``[n, D]``, pseudo states ``[steps, n, D]``)."""
    model = run.model
    n = buf.n
    sources = list(range(n))
    mask = tree_mod.pseudo_mask(buf.mask, sources, steps).to(model.device)  # [S, S]
    base = cache.length(0) - int(cache.pad[0])
    pos = (base + tree_mod.pseudo_offsets(buf.depths, sources, steps)).unsqueeze(0).to(model.device)  # [1, S]
    h = model.embed(tokens.unsqueeze(0).to(model.device))  # [1, n, D]
    bounds = proj.layers[:steps] + [model.config.n_layers]
    layer = 0
    for i, end in enumerate(bounds):
        S = h.shape[1]
        h = run.forward(cache, h=h, start=layer, end=end, positions=pos[:, :S],
                        mask=mask[:S, :S] if S > 1 else None, count_call=False)
        layer = end
        if i < steps:
            h = torch.cat([h, proj.transfer(i + 1, h[:, :n])], dim=1)  # step i+1's pseudo states
    run.count(0, 0)  # the segments above are one model call
    run.extra["pseudo_states"] += steps * n
    return h[0, :n], h[0, n:].reshape(steps, n, h.shape[-1])


@register("hidden-transfer", exact=True)
def hidden_transfer(run: Run, *, tree=DEFAULT_TREE, transfer="trained"):
    """Hidden Transfer: pseudo hidden states from trained projections draft a tree (tree=, transfer=): greedy-exact."""
    proj = drafters.get_drafter(run.model, "transfer", transfer)
    buf = treeloop.setup(run, "hidden-transfer", tree, proj.steps)
    steps = buf.depth if buf.n > 1 else 0
    run.extra["pseudo_states"] = 0
    model = run.model
    cache = run.new_cache(extra=buf.n * (steps + 1) + 1)
    root = int(run.logits(run.prefill(cache))[0, -1].argmax())
    if run.emit(0, [root]):
        return treeloop.finish(run)
    yield
    cur = treeloop.EMPTY
    topk = None
    while True:
        tokens = tree_mod.draft_tokens(cur, root, topk)  # [n]
        start = cache.length(0)
        h, pseudo = transfer_pass(run, cache, tokens, cur, proj, steps)
        path, root, done = treeloop.accept(run, cache, start, cur, tokens, model.logits(h))
        if done:
            return treeloop.finish(run)
        yield
        cur = buf
        if steps:
            topk = treeloop.top_drafts(buf, model.logits(pseudo[:, path[-1]]))  # [depth, K]
        else:
            cur = treeloop.EMPTY
