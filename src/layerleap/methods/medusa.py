"""Medusa (Cai et al. 2023, Medusa-1): the Hidden Transfer paper's yardstick.

Residual heads on the last layer's normalised state predict the tokens 2..k+1 ahead
(``drafters.MedusaHeads``); their top-k per step make a candidate tree (``tree=``), verified in
one call with tree attention (``treeloop``).  The call that verifies a tree also gives the last
accepted node's state, so the same call drafts the next tree.  Greedy output is exactly the
model's greedy decoding.

Stats: ``rounds``, ``drafted`` (tree depth per round), ``accepted``, ``acceptance``,
``accepted_per_round``, ``tree_nodes``.
"""

from __future__ import annotations

import torch

from ..drafters import medusa_transfer as drafters
from ..core import tree as tree_mod
from ..core.run import Run, register
from . import treeloop

DEFAULT_TREE = "1,1"  # a chain of two drafts: on CPU a wider tree costs more than it gains (docs/HIDDEN_TRANSFER.md)


def _drafts(run: Run, heads: drafters.MedusaHeads, buf, z: torch.Tensor) -> torch.Tensor:
    """Top-k draft tokens ``[depth, K]`` from one normalised last-layer state ``z`` ``[D]``."""
    if buf.n == 1:
        return treeloop.top_drafts(buf, z.new_zeros(0, 1))
    logits = torch.stack([heads.logits(i, z) for i in range(1, buf.depth + 1)])  # [depth, V]
    return treeloop.top_drafts(buf, logits)


@register("medusa", exact=True)
def medusa(run: Run, *, tree=DEFAULT_TREE, heads="trained"):
    """Medusa heads drafting a candidate tree (tree=, heads=), verified with tree attention: greedy-exact."""
    mh = drafters.get_drafter(run.model, "medusa", heads)
    buf = treeloop.setup(run, "medusa", tree, mh.steps)
    model = run.model
    cache = run.new_cache(extra=buf.n + 1)
    z = model.final_norm(run.prefill(cache))[0, -1]  # [D]
    root = int(model.unembed(z.unsqueeze(0)).argmax())
    if run.emit(0, [root]):
        return treeloop.finish(run)
    yield
    topk = _drafts(run, mh, buf, z)
    while True:
        tokens = tree_mod.draft_tokens(buf, root, topk)  # [n]
        start = cache.length(0)
        pos = (start - int(cache.pad[0]) + buf.depths).unsqueeze(0).to(model.device)
        h = run.forward(cache, tokens.unsqueeze(0).to(model.device), positions=pos,
                        mask=buf.mask.to(model.device) if buf.n > 1 else None)
        zs = model.final_norm(h)[0]  # [n, D]
        path, root, done = treeloop.accept(run, cache, start, buf, tokens, model.unembed(zs))
        if done:
            return treeloop.finish(run)
        yield
        topk = _drafts(run, mh, buf, zs[path[-1]])
