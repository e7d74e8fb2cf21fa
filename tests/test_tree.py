"""Tree buffers (pure functions) and tree acceptance, checked against the reference helpers in
tiny_models (tree_mask / tree_path) and hand-worked cases."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tree_depths, tree_mask, tree_path

from layerleap.core import tree, verify


@pytest.mark.parametrize("shape", ["", "1", "1,1,1", "2,1", [3, 2, 1], "2,2,2", "0;1;0.0;0.0.0;1.0"])
def test_buffers_match_reference(shape):
    b = tree.build(shape)
    parents = b.parents.tolist()
    assert parents[0] == -1 and all(0 <= p < j for j, p in enumerate(parents) if j)
    assert torch.equal(b.mask, tree_mask(parents))
    assert b.depths.tolist() == tree_depths(parents)
    assert b.n == 1 + len(b.paths)
    for j, p in enumerate(b.paths, start=1):  # node j is the path p: its ranks along the way
        chain = tree_path(parents, j)
        assert [int(b.ranks[c]) for c in chain[1:]] == list(p)
    leaves = [i for i in range(b.n) if i not in parents]
    assert b.retrieve.shape[0] == len(leaves)
    for row, leaf in zip(b.retrieve.tolist(), leaves):
        assert [x for x in row if x >= 0] == tree_path(parents, leaf)


def test_topk_paths_counts_and_order():
    assert tree.topk_paths([2, 1]) == [(0,), (1,), (0, 0), (1, 0)]
    assert len(tree.topk_paths([3, 2, 2])) == 3 + 6 + 12
    b = tree.build([2, 2])
    assert b.max_rank(1) == 2 and b.max_rank(2) == 2 and b.depth == 2


@pytest.mark.parametrize("bad", ["2,x", [0, 1], [(1, 0)], [(0,), (0,)], "0;0.-1", [(0,), "a"], 1.5])
def test_bad_shapes_are_clear_errors(bad):
    with pytest.raises(tree.TreeError):
        tree.build(bad)


def test_numpy_integers_shape_trees_as_ints():
    """A tree shape takes integers of any integral type (numpy's too), as every integer option does; a bool
    is no integer."""
    np = pytest.importorskip("numpy")
    assert tree.parse_tree(np.int64(3)) == tree.parse_tree(3) == [(0,), (1,), (2,)]
    assert tree.parse_tree([np.int64(2), np.int32(1)]) == tree.parse_tree([2, 1])
    assert tree.parse_tree([[np.int64(0)], (np.int64(0), np.int8(0))]) == [(0,), (0, 0)]
    assert all(type(r) is int for p in tree.parse_tree([np.int64(2), np.int64(2)]) for r in p)
    for bad in (True, [True, 1], [(0,), (False,)]):
        with pytest.raises(tree.TreeError):
            tree.parse_tree(bad)


def test_draft_tokens_take_rank_per_step():
    b = tree.build([2, 1])
    topk = torch.tensor([[10, 11], [20, 21]])  # [step, rank]
    assert tree.draft_tokens(b, 5, topk).tolist() == [5, 10, 11, 20, 20]


def test_pseudo_mask_rules():
    b = tree.build([2, 1])  # nodes 0; 1, 2 (depth 1); 3 (child of 1), 4 (child of 2)
    sources = [0, 1, 2, 3, 4]
    m = tree.pseudo_mask(b.mask, sources, 2)
    n, k = b.n, len(sources)
    assert m.shape == (n + 2 * k, n + 2 * k)
    assert torch.equal(m[:n, :n], b.mask) and not m[:n, n:].any()  # real nodes never see pseudo states
    for s, x in enumerate(sources):
        p1, p2 = n + s, n + k + s
        assert torch.equal(m[p1, :n], b.mask[x]) and torch.equal(m[p2, :n], b.mask[x])
        assert m[p1, p1] and not m[p1, p2]  # step 1 sees itself, not step 2
        assert m[p2, p1] and m[p2, p2]  # step 2 sees the same source's step 1 and itself
        others = [n + t for t in range(k) if t != s] + [n + k + t for t in range(k) if t != s]
        assert not m[p1, others].any() and not m[p2, others].any()
    offs = tree.pseudo_offsets(b.depths, sources, 2)
    assert offs.tolist() == [0, 1, 1, 2, 2] + [1, 2, 2, 3, 3] + [2, 3, 3, 4, 4]
    # the paper's "masked" ablation: only the step-2 -> step-1 block differs
    masked = tree.pseudo_mask(b.mask, sources, 2, see_earlier=False)
    diff = (masked != m).nonzero().tolist()
    assert diff == [[n + k + s, n + s] for s in range(k)] and not masked[n + k :, n : n + k].any()


def _onehot(targets, V=50):
    lg = torch.full((len(targets), V), -1.0)
    lg[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return lg


def test_tree_accept_longest_matching_path():
    b = tree.build([2, 1])  # 0 -> {1, 2}; 1 -> 3; 2 -> 4
    tokens = torch.tensor([7, 8, 9, 30, 40])
    # the model picks 9 after the root (node 2), then 40 (node 4), then 41
    path, nxt = verify.tree_accept(tokens, b.parents, _onehot([9, 0, 40, 0, 41]))
    assert path == [0, 2, 4] and nxt == 41
    path, nxt = verify.tree_accept(tokens, b.parents, _onehot([8, 31, 0, 0, 0]))
    assert path == [0, 1] and nxt == 31
    path, nxt = verify.tree_accept(tokens, b.parents, _onehot([3, 0, 0, 0, 0]))
    assert path == [0] and nxt == 3


def test_tree_accept_on_a_chain_is_greedy_accept():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = int(torch.randint(1, 5, (1,), generator=g))
        logits = torch.randn(k + 1, 6, generator=g)
        draft = torch.randint(0, 6, (k,), generator=g)
        b = tree.build([1] * k)
        path, nxt = verify.tree_accept(torch.cat([torch.tensor([0]), draft]), b.parents, logits)
        assert (len(path) - 1, nxt) == verify.greedy_accept(draft, logits)


def test_zero_is_the_empty_tree_as_text_and_as_an_integer():
    """A top-k of 0 drafts nothing whether it is given as ``0`` or ``"0"`` (``tree="0"`` in Python, or
    a tree read from text): both forms of one shape agree."""
    assert tree.parse_tree("0") == tree.parse_tree(" 0 ") == tree.parse_tree(0) == tree.parse_tree("") == []
    assert tree.build("0").n == tree.build(0).n == 1  # the root alone
    for bad in ("0,1", "00x", [0]):
        with pytest.raises(tree.TreeError):
            tree.parse_tree(bad)
