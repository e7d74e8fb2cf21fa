"""Candidate trees for one-pass verification (Medusa's and Hidden Transfer's tree attention), as pure
functions of the tree's shape.

A tree shape is a list of *paths*: a path ``(r1, r2, .., rd)`` is the candidate that takes the
``r1``-th most likely draft token at depth 1, then the ``r2``-th at depth 2, and so on (Medusa's
``medusa_choices``).  Every prefix of a path must be in the tree.  ``topk_paths((2, 1))`` is the
Cartesian product of the top-2 at depth 1 and the top-1 at depth 2: ``[(0,), (1,), (0, 0), (1, 0)]``.

Flattened, the tree is one sequence of ``n = 1 + len(paths)`` nodes: node 0 is the *root*, the token
the model itself chose last round (certain), node ``j >= 1`` is ``paths[j - 1]`` (sorted by depth,
then rank).  ``TreeBuffers`` holds what one verification pass needs:

- ``parents`` ``[n]`` (-1 for the root) and ``depths`` ``[n]`` (the position offset of each node
  from the root, so siblings share a rotary position);
- ``mask`` ``[n, n]`` bool: node i sees node j when j is i or one of its ancestors;
- ``step``/``rank`` ``[n]``: node j's token is the ``rank[j]``-th most likely draft of step
  ``step[j] = depths[j]`` (root: -1);
- ``retrieve`` ``[n_leaves, depth + 1]``: the node indices of each root-to-leaf path, -1 padded.

``pseudo_mask`` adds Hidden Transfer's pseudo states (§3.3) to a flattened tree.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import LayerleapError


MAX_NODES = 512  # a verification pass over the tree costs ~n tokens; n x n masks stay small


class TreeError(LayerleapError, ValueError):
    """A tree shape that cannot be used: the message names the problem and the fix."""


@dataclass(frozen=True)
class TreeBuffers:
    paths: tuple[tuple[int, ...], ...]
    parents: torch.Tensor  # [n] long, -1 for the root
    depths: torch.Tensor  # [n] long, position offsets
    ranks: torch.Tensor  # [n] long, the draft rank of each node (root: -1)
    mask: torch.Tensor  # [n, n] bool, ancestors and self
    retrieve: torch.Tensor  # [n_leaves, depth + 1] long node indices, -1 padded

    @property
    def n(self) -> int:
        return int(self.parents.shape[0])

    @cached_property
    def depth(self) -> int:
        return int(self.depths.max())

    def max_rank(self, depth: int) -> int:
        """How many draft tokens of step ``depth`` the tree uses (the top-k it needs)."""
        sel = self.depths == depth
        return int(self.ranks[sel].max()) + 1 if bool(sel.any()) else 0

    @cached_property
    def widest(self) -> int:
        """The most draft tokens any step uses (the top-k the drafts need; 0 for the root alone)."""
        return max((self.max_rank(d) for d in range(1, self.depth + 1)), default=0)

    @cached_property
    def draft_parents(self) -> torch.Tensor:
        """Each draft node's parent draft ``[n - 1]`` (-1: the root's child), as ``Candidates`` keeps them."""
        return self.parents[1:] - 1

    @cached_property
    def draft_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each draft node's step index and rank ``([n - 1], [n - 1])``: where ``draft_tokens`` reads it."""
        return self.depths[1:] - 1, self.ranks[1:]


def topk_paths(shape) -> list[tuple[int, ...]]:
    """The full tree of the top-``shape[d]`` tokens at each depth ``d`` (a chain when all are 1)."""
    shape = tuple(shape)
    if any(not _integer(k) or k < 1 for k in shape):
        raise TreeError(f"a top-k tree shape is a list of integers >= 1 (top-k per depth), got {list(shape)!r}")
    shape = tuple(int(k) for k in shape)
    nodes, width = 0, 1
    for k in shape:
        width *= k
        nodes += width
        if nodes > MAX_NODES:
            raise TreeError(
                f"the tree {','.join(map(str, shape))} has more than {MAX_NODES} nodes (the limit): give "
                "fewer or narrower levels, e.g. 2,2,1"
            )
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for k in shape:
        level = [p + (r,) for p in level for r in range(k)]
        paths.extend(level)
    return paths


def parse_tree(tree) -> list[tuple[int, ...]]:
    """A tree shape from: a top-k list ``[2, 1, 1]`` or text ``"2,1,1"``; explicit paths
    ``[(0,), (1,), (0, 0)]``; or text ``"0;1;0.0"`` (paths separated by ';', ranks by '.').
    ``[]``/``""``/``0``/``"0"`` is the empty tree (no drafts): a top-k of 0, as text or as an integer."""
    empty_int = _integer(tree) and tree == 0  # not False, 0.0
    empty_text = isinstance(tree, str) and tree.strip() in ("", "0")
    if tree is None or empty_text or empty_int or (isinstance(tree, (list, tuple)) and len(tree) == 0):
        return []
    if _integer(tree):
        return topk_paths([tree])
    if isinstance(tree, str):
        text = tree.strip().replace(" ", "")
        try:
            paths = (
                [tuple(int(r) for r in p.split(".")) for p in text.split(";") if p]
                if ";" in text or "." in text
                else None
            )
            shape = [int(k) for k in text.split(",") if k] if paths is None else None
        except ValueError:
            raise TreeError(
                f"cannot read the tree shape {tree!r}: give top-k per depth ('2,1,1') or paths "
                "of ranks ('0;1;0.0;0.0.0')"
            ) from None
        return _check_paths(paths) if paths is not None else topk_paths(shape)
    if isinstance(tree, (list, tuple)):
        if all(_integer(k) for k in tree):
            return topk_paths(tree)
        if all(isinstance(p, (list, tuple)) for p in tree):
            return _check_paths([tuple(p) for p in tree])
    raise TreeError(
        f"a tree shape is top-k per depth ([2, 1, 1] or '2,1,1') or a list of rank paths ([(0,), (0, 0)]), got {tree!r}"
    )


def _integer(k) -> bool:
    """An integer of any integral type (``numpy.int64`` too), never a bool."""
    return isinstance(k, numbers.Integral) and not isinstance(k, bool)


def _check_paths(paths: list[tuple]) -> list[tuple[int, ...]]:
    if len(paths) > MAX_NODES:
        raise TreeError(f"the tree has {len(paths)} paths, beyond the limit of {MAX_NODES} nodes: give fewer")
    for p in paths:
        if not p or any(not _integer(r) or r < 0 for r in p):
            raise TreeError(f"a tree path is a non-empty tuple of ranks >= 0, got {p!r}")
    paths = [tuple(int(r) for r in p) for p in paths]
    if len(set(paths)) != len(paths):
        raise TreeError("the tree lists a path twice: give each path once")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise TreeError(f"the tree path {p} has no parent {p[:-1]}: every prefix of a path must be in the tree")
    return paths


def build(tree) -> TreeBuffers:
    """The flattened tree's buffers (see the module docstring) from any shape ``parse_tree`` reads."""
    return _buffers(sorted(parse_tree(tree), key=lambda p: (len(p), p)))


def chain(n: int) -> TreeBuffers:
    """A chain of ``n`` nodes below the root (the top-1 at each depth), of any length: an internal
    layout (training passes over a whole sequence), not a draft tree, so ``MAX_NODES`` does not apply."""
    return _buffers([(0,) * d for d in range(1, n + 1)])


def _buffers(paths: list[tuple[int, ...]]) -> TreeBuffers:
    """The buffers of checked ``paths``, sorted by depth then rank."""
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [-1]
    for j, p in enumerate(paths, start=1):
        index[p] = j
        parents.append(index[p[:-1]])
        depths.append(len(p))
        ranks.append(p[-1])
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    is_parent = set(parents[1:])
    leaves = [i for i in range(n) if i not in is_parent]
    depth = max(depths)
    retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        chain = mask[leaf].nonzero().flatten().tolist()  # ancestors in index order = root to leaf
        retrieve[row, : len(chain)] = torch.tensor(chain)
    return TreeBuffers(tuple(paths), torch.tensor(parents), torch.tensor(depths), torch.tensor(ranks), mask, retrieve)


def draft_tokens(buffers: TreeBuffers, root: int, topk: torch.Tensor) -> torch.Tensor:
    """The node tokens ``[n]``: the root, then ``topk[step - 1, rank]`` (``topk`` ``[k, K]`` draft
    token ids by step, most likely first)."""
    toks = torch.empty(buffers.n, dtype=torch.long)
    toks[0] = root
    if buffers.n > 1:
        toks[1:] = topk[buffers.draft_index]
    return toks


def best_paths(probs: list[list[float]], n: int) -> list[tuple[tuple[int, ...], float]]:
    """EAGLE-2's dynamic tree (Li et al. 2024, §4) for drafts whose steps are drawn from one state: the
    ``n`` paths of highest *value*, the product of the draft probabilities along the path, from
    ``probs[d][r]`` (step ``d + 1``'s ``r``-th most likely draft, most likely first), best first.
    Best-first search: a path is pushed after its predecessor (the sibling of rank one less, or for
    rank 0 the parent) is taken, so every path comes after its parent (the set is a tree)."""
    heap = [(-probs[0][0], (0,), 1.0)] if probs and probs[0] else []  # (-value, path, the parent's value)
    out = []
    while heap and len(out) < n:
        v, path, parent = heapq.heappop(heap)
        out.append((path, -v))
        d, r = len(path), path[-1]
        if r + 1 < len(probs[d - 1]):
            heapq.heappush(heap, (-parent * probs[d - 1][r + 1], path[:-1] + (r + 1,), parent))
        if d < len(probs):
            heapq.heappush(heap, (v * probs[d][0], path + (0,), -v))
    return out


def pseudo_mask(tree_mask: torch.Tensor, sources: list[int], steps: int, see_earlier: bool = True) -> torch.Tensor:
    """Hidden Transfer's attention over ``n`` tree nodes followed by pseudo states of ``steps``
    transfer steps (step-major: all sources' step 1, then step 2, ...): ``[S, S]`` bool with
    ``S = n + steps * len(sources)``.

    The pseudo state of step ``i`` made from node ``x`` stands for the token ``i`` positions after
    ``x``; it sees the real states ``x`` itself sees (the cache and ``x``'s ancestors), ``x``,
    the pseudo states of steps ``< i`` made from ``x``, and itself (§3.3).  Real nodes never see
    a pseudo state, so their outputs are exactly those of the tree alone.  ``see_earlier=False`` is
    the "masked" setting of the paper's ablation (Figure 7): a pseudo state sees no earlier pseudo
    state, only the real states and itself."""
    n = tree_mask.shape[0]
    m = len(sources)
    S = n + steps * m
    mask = torch.zeros(S, S, dtype=torch.bool)
    mask[:n, :n] = tree_mask
    src = torch.tensor(sources, dtype=torch.long)
    for i in range(steps):
        rows = n + i * m + torch.arange(m)
        mask[rows, :n] = tree_mask[src]
        for j in range(i + 1) if see_earlier else (i,):  # the same source's steps 1..i+1 (itself included)
            mask[rows, n + j * m + torch.arange(m)] = True
    return mask


def pseudo_offsets(depths: torch.Tensor, sources: list[int], steps: int) -> torch.Tensor:
    """Position offsets ``[S]`` matching ``pseudo_mask``: a node's depth, and ``depth(x) + i`` for the
    step-``i`` pseudo state of ``x`` (the position of the token it stands for)."""
    src_d = depths[torch.tensor(sources, dtype=torch.long)]
    parts = [depths] + [src_d + i for i in range(1, steps + 1)]
    return torch.cat(parts)


# -- one round's proposal ------------------------------------------------------------------------
@dataclass
class Candidates:
    """What a drafter proposes for one row in one round: a chain or a tree of draft tokens after the
    current position, verified in one model call.

    - ``root``: the last chosen token, which the verifier's cache does not hold yet; it is fed in
      front of the drafts and its row of logits predicts the drafts' first level.  ``None`` when
      the previous call already scored that position (the round right after the prompt pass).
    - ``tokens`` ``[k]``: the drafts; ``parents`` ``[k]``: each draft's parent draft, -1 for the
      first level (a chain is ``-1, 0, 1, ..``); parents come before their children.
    - ``q`` ``[k, V]`` or None: the distribution each draft was drawn from (after the same
      temperature / top-k / top-p warps as the verifier's); None means the drafts were chosen
      deterministically (top-k, a copy, an argmax): a certain, one-hot proposal.
    - ``mask`` ``[1 + k, 1 + k]`` and ``depths`` ``[1 + k]`` (root first) for a tree, from
      ``TreeBuffers`` or computed from ``parents``; None for a chain (plain causal attention)."""

    root: int | None
    tokens: torch.Tensor  # [k] long
    parents: torch.Tensor  # [k] long
    q: torch.Tensor | None = None  # [k, V]
    mask: torch.Tensor | None = None  # [1 + k, 1 + k] bool, trees only
    depths: torch.Tensor | None = None  # [1 + k] long, trees only
    stop: str | None = None  # why a chain ended (``drafters.base.ChainRule``)

    @classmethod
    def chain(cls, root: int | None, drafts: list[int], q_rows: list[torch.Tensor] | None = None) -> "Candidates":
        k = len(drafts)
        return cls(
            root,
            torch.tensor(drafts, dtype=torch.long),
            torch.arange(-1, k - 1, dtype=torch.long),
            torch.stack(q_rows) if q_rows else None,
        )

    @classmethod
    def from_tree(cls, buffers: TreeBuffers, root: int, topk: torch.Tensor | None) -> "Candidates":
        """The tree ``buffers`` filled with ``topk`` ``[depth, K]`` draft ids by step (``draft_tokens``); with
        fewer steps drafted (the output ends first), the tree without its deeper levels."""
        if buffers.n == 1 or topk is None or topk.shape[0] == 0:
            return cls.chain(root, [])
        if topk.shape[0] < buffers.depth:
            filled = torch.cat([topk, topk.new_zeros(buffers.depth - topk.shape[0], topk.shape[1])])
            return cls.from_tree(buffers, root, filled).within(topk.shape[0])
        tokens = draft_tokens(buffers, root, topk)
        return cls(root, tokens[1:], buffers.draft_parents, None, buffers.mask, buffers.depths)

    @classmethod
    def from_parents(cls, root: int, tokens: list[int], parents: list[int]) -> "Candidates":
        """A tree of drafts ``tokens`` with ``parents`` (-1: a child of the root; parents before their
        children), its mask and depths computed from the parents."""
        k = len(tokens)
        depths = [0] * (k + 1)  # root first
        seen = [{0}]  # per node: itself and its ancestors, the root included
        for j, p in enumerate(parents, start=1):
            depths[j] = depths[p + 1] + 1
            seen.append(seen[p + 1] | {j})
        mask = torch.tensor([[i in s for i in range(k + 1)] for s in seen], dtype=torch.bool)  # [1 + k, 1 + k]
        return cls(
            root,
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(parents, dtype=torch.long),
            None,
            mask,
            torch.tensor(depths, dtype=torch.long),
        )

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The longest path's length (drafts that one round could accept)."""
        return self.k if self.mask is None else int(self.depths.max())

    @property
    def is_chain(self) -> bool:
        return self.mask is None

    def within(self, depth: int) -> "Candidates":
        """These candidates without the drafts deeper than ``depth`` (no round can keep them: the output
        ends first): a chain cut to ``depth`` drafts (its stop then "budget"), a tree without its deeper
        nodes; no draft left is a plain step (an empty chain).  Itself when nothing is deeper."""
        depth = max(0, depth)
        if self.depth <= depth:
            return self
        if depth == 0:
            cut = Candidates.chain(self.root, [])
        elif self.is_chain:
            cut = Candidates.chain(self.root, self.tokens[:depth].tolist())
            cut.q = None if self.q is None else self.q[:depth]
        else:
            keep = (self.depths[1:] <= depth).nonzero().flatten()  # every kept node's ancestors are shallower
            new = torch.full((self.k,), -1, dtype=torch.long)
            new[keep] = torch.arange(len(keep))
            parents = self.parents[keep]
            rows = torch.cat([torch.zeros(1, dtype=torch.long), keep + 1])  # the root's row and the kept nodes'
            cut = Candidates(
                self.root,
                self.tokens[keep],
                torch.where(parents < 0, parents, new[parents.clamp(min=0)]),
                None if self.q is None else self.q[keep],
                self.mask[rows][:, rows],
                self.depths[rows],
            )
        cut.stop = "budget" if self.is_chain else self.stop
        return cut

    def fed(self) -> list[int]:
        """The tokens one verification call feeds: the root (when the cache lacks it), then the drafts."""
        return ([] if self.root is None else [self.root]) + self.tokens.tolist()

    def kept(self, accepted: list[int]) -> list[int]:
        """Offsets, among the fed tokens, of those the cache keeps: the root and the accepted drafts."""
        first = 0 if self.root is None else 1
        return ([0] if self.root is not None else []) + [first + a for a in accepted]
