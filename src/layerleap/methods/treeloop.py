"""What the tree-verified methods (``medusa``, ``hidden-transfer``) share: option checks, the tree
for the next round from per-step draft logits, and accepting a verified tree (stats, cache, output).

Each round verifies a flattened candidate tree in one model call: node 0 is the token the model
chose last round, the other nodes are drafts; ``verify.tree_accept`` keeps the longest path that
matches the model's greedy choices and adds the model's own next token; the KV cache keeps only
that path (``KVCache.compact``).  The drafts for the next round come from the same call."""

from __future__ import annotations

import torch

from ..core import tree as tree_mod
from ..core import verify
from ..core.run import GenerationError, Run
from ..core.kv_cache import KVCache

EMPTY = tree_mod.build([])  # the first round after the prompt: the root alone


def setup(run: Run, name: str, tree, steps: int) -> tree_mod.TreeBuffers:
    """The tree's buffers, after checking the tree against the trained steps and the context."""
    buf = tree_mod.build(tree)
    V = run.model.config.vocab_size
    if buf.n > 1 and max(buf.max_rank(d) for d in range(1, buf.depth + 1)) > V:
        raise GenerationError(f"the tree takes draft ranks beyond the vocabulary ({V} tokens): give smaller top-k")
    if buf.n > 1 and buf.depth > steps:
        raise GenerationError(f"the tree is {buf.depth} deep but the {name} weights have {steps} step(s): give a "
                              f"tree at most {steps} deep, or train more steps")
    ctx = run.model.config.max_position
    need = len(run.prompts[0]) + run.gen.max_new_tokens + max(buf.depth, steps) + 1
    if need > ctx:
        raise GenerationError(f"the tree does not fit the context: prompt + max_new_tokens + tree depth "
                              f"{max(buf.depth, steps)} + 1 = {need} positions > {ctx}: shorten the prompt, lower "
                              "max_new_tokens or use a shallower tree")
    run.extra.update(rounds=0, drafted=0, accepted=0, tree_nodes=buf.n)
    return buf


def top_drafts(buf: tree_mod.TreeBuffers, step_logits: torch.Tensor) -> torch.Tensor:
    """``[k, V]`` draft logits by step -> ``[depth, K]`` top-K token ids (K: the widest level)."""
    if buf.n == 1:
        return torch.zeros(0, 1, dtype=torch.long)
    K = max(buf.max_rank(d) for d in range(1, buf.depth + 1))
    return step_logits[: buf.depth].topk(K, dim=-1).indices.cpu()


def accept(run: Run, cache: KVCache, start: int, buf: tree_mod.TreeBuffers, tokens: torch.Tensor,
           logits: torch.Tensor) -> tuple[list[int], int, bool]:
    """Verify one round: -> (accepted node path, the model's next token, whether the row is done).
    Keeps only the path's slots in the cache and emits the accepted drafts and the next token."""
    path, nxt = verify.tree_accept(tokens, buf.parents, logits)
    cache.compact(start, torch.tensor(path, dtype=torch.long))
    st = run.extra
    st["rounds"] += 1
    st["drafted"] += buf.depth if buf.n > 1 else 0
    st["accepted"] += len(path) - 1
    done = run.emit(0, tokens[path[1:]].tolist() + [nxt])
    return path, nxt, done


def finish(run: Run) -> None:
    st = run.extra
    st["acceptance"] = st["accepted"] / st["drafted"] if st["drafted"] else None
    st["accepted_per_round"] = st["accepted"] / st["rounds"] if st["rounds"] else None
