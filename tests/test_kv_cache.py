"""KVCache: truncate, compact, per-layer lengths, overflow and the attention mask."""

from __future__ import annotations

import pytest
import torch
from tiny_models import full_logits, random_model, tree_depths, tree_mask, tree_path

from layerleap import KVCache, LayerleapError
from layerleap.core.kv_cache import CacheError


def assert_close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def rand_ids(vocab, *shape, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama-gqa-tied", "qwen2-gqa-untied"])
def model(request):
    return random_model(request.param, seed=2)


def step(model, cache, ids, mask=None, positions=None, start=0, end=None):
    """Append ``ids`` ``[B, S]`` to ``cache`` (layers [start, end)) at each row's next positions."""
    if positions is None:
        positions = (cache.lengths[start] - cache.pad).unsqueeze(1) + torch.arange(ids.shape[1])
    with torch.inference_mode():
        h = model.run_layers(
            model.embed(ids), start, model.config.n_layers if end is None else end, positions, cache, mask
        )
        return model.logits(h)


# -- truncate --------------------------------------------------------------------------------
def test_truncate_scalar_then_continue(model):
    V = model.config.vocab_size
    ids = rand_ids(V, 1, 10, seed=1)
    other = rand_ids(V, 1, 3, seed=2)
    cache = model.new_cache(1, 16)
    step(model, cache, ids)
    cache.truncate(6)
    assert cache.lengths.tolist() == [[6]] * model.config.n_layers
    got = step(model, cache, other)
    ref = full_logits(model, ids[0, :6].tolist() + other[0].tolist())
    assert_close(got[0], ref[6:])
    cache.truncate(9)  # equal to the current length: allowed, no-op
    assert cache.length() == 9


@pytest.mark.parametrize("keep", [(6, 8), (10, 3), (1, 10)])
def test_truncate_per_row_then_decode_ragged(model, keep):
    """Rows rolled back to different lengths keep decoding correctly (the ragged write/mask path)."""
    V = model.config.vocab_size
    ids = rand_ids(V, 2, 10, seed=3)
    nxt = rand_ids(V, 2, 3, seed=4)
    cache = model.new_cache(2, 16)
    step(model, cache, ids)
    cache.truncate(torch.tensor(keep))
    assert cache.lengths.tolist() == [list(keep)] * model.config.n_layers
    with pytest.raises(CacheError, match="different lengths"):
        cache.length()
    got1 = step(model, cache, nxt[:, :1])  # one token per row
    got2 = step(model, cache, nxt[:, 1:])  # then two at once
    for b in range(2):
        ref = full_logits(model, ids[b, : keep[b]].tolist() + nxt[b].tolist())
        assert_close(got1[b, 0], ref[keep[b]])
        assert_close(got2[b], ref[keep[b] + 1 :])


def test_truncate_layer_range(model):
    L = model.config.n_layers
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 8, seed=5))
    cache.truncate(5, layers=range(2, L))
    assert cache.lengths[:2].tolist() == [[8, 8]] * 2 and cache.lengths[2:].tolist() == [[5, 5]] * (L - 2)
    assert cache.length(0) == 8 and cache.length(L - 1) == 5


@pytest.mark.parametrize("length", [9, torch.tensor([3, 9])])
def test_truncate_refuses_growing(model, length):
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 8, seed=6))
    before = cache.lengths.clone()
    with pytest.raises(CacheError, match="cannot truncate") as e:
        cache.truncate(length)
    assert isinstance(e.value, LayerleapError)
    assert torch.equal(cache.lengths, before)  # nothing changed
    cache.truncate(4, layers=range(0, 1))
    with pytest.raises(CacheError):
        cache.truncate(6)  # layer 0 now holds only 4


def test_truncate_refuses_left_padding_of_any_row(model):
    """One length for every row is checked against each row's padding and filled length."""
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 8, seed=7))
    cache.pad[:] = torch.tensor([3, 0])
    with pytest.raises(CacheError, match="cannot truncate"):
        cache.truncate(2)  # inside row 0's padding
    cache.truncate(3, layers=range(1, 2))
    assert cache.lengths[1].tolist() == [3, 3] and cache.lengths[0].tolist() == [8, 8]


# -- compact ---------------------------------------------------------------------------------
TREE = [-1, 0, 0, 1, 2, 3]  # 0 -> {1, 2}; 1 -> 3 -> 5; 2 -> 4


@pytest.mark.parametrize("accept", [5, 4, 3, 0], ids=["deep-path", "other-branch", "mid-path", "root-only"])
def test_compact_tree_path_equals_fresh_forward(model, accept):
    """Verify a draft tree, keep the accepted root->node path, then decode on: equal to a fresh
    forward of the accepted sequence."""
    V = model.config.vocab_size
    P = 7
    prompt = rand_ids(V, P, seed=7).tolist()
    nodes = rand_ids(V, len(TREE), seed=8).tolist()
    nxt = rand_ids(V, 2, seed=9).tolist()
    cache = model.new_cache(1, 20)
    step(model, cache, torch.tensor([prompt]))
    pos = torch.tensor([[P + d for d in tree_depths(TREE)]])
    step(model, cache, torch.tensor([nodes]), mask=tree_mask(TREE), positions=pos)
    path = tree_path(TREE, accept)
    cache.compact(P, torch.tensor(path))
    assert cache.lengths.tolist() == [[P + len(path)]] * model.config.n_layers
    accepted = prompt + [nodes[i] for i in path]
    got = step(model, cache, torch.tensor([nxt]))
    ref = full_logits(model, accepted + nxt)
    assert_close(got[0], ref[len(accepted) :])
    # and the compacted slots hold exactly what a fresh cache holds for the accepted sequence
    fresh = model.new_cache(1, 20)
    step(model, fresh, torch.tensor([accepted + nxt]))
    n = len(accepted) + len(nxt)
    assert_close(cache.k[:, :, :, :n], fresh.k[:, :, :, :n])
    assert_close(cache.v[:, :, :, :n], fresh.v[:, :, :, :n])


def test_compact_per_row(model):
    """``keep`` ``[B, K]`` and a per-row ``start``: each row keeps its own path."""
    V = model.config.vocab_size
    prompts = [rand_ids(V, 7, seed=10).tolist(), rand_ids(V, 4, seed=11).tolist()]
    nodes = rand_ids(V, 2, len(TREE), seed=12)
    cache = model.new_cache(2, 20)
    step(model, cache, torch.tensor([prompts[0], prompts[1] + [0, 0, 0]]))
    cache.truncate(torch.tensor([7, 4]))  # ragged rows
    pos = torch.tensor([[7 + d for d in tree_depths(TREE)], [4 + d for d in tree_depths(TREE)]])
    step(model, cache, nodes, mask=tree_mask(TREE), positions=pos)
    paths = [tree_path(TREE, 5), tree_path(TREE, 4)]  # [0,1,3,5] and [0,2,4] -> pad the second
    keep = torch.tensor([paths[0], paths[1] + [paths[1][-1]]])
    cache.compact(torch.tensor([7, 4]), keep)
    cache.truncate(torch.tensor([7 + 4, 4 + 3]))  # row 1 kept 3 of its 4 "kept" slots
    nxt = rand_ids(V, 2, 1, seed=13)
    got = step(model, cache, nxt)
    for b in range(2):
        accepted = prompts[b] + nodes[b, paths[b]].tolist() + nxt[b].tolist()
        assert_close(got[b, 0], full_logits(model, accepted)[-1])


def test_compact_layer_range_only_touches_those_layers(model):
    L = model.config.n_layers
    cache = model.new_cache(1, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 1, 9, seed=14))
    k0 = cache.k.clone()
    cache.compact(5, torch.tensor([1, 3]), layers=range(1, L))
    assert cache.lengths[0].tolist() == [9] and cache.lengths[1:].tolist() == [[7]] * (L - 1)
    assert torch.equal(cache.k[0], k0[0])
    assert torch.equal(cache.k[1:, :, :, 5], k0[1:, :, :, 6]) and torch.equal(cache.k[1:, :, :, 6], k0[1:, :, :, 8])
    assert torch.equal(cache.k[1:, :, :, :5], k0[1:, :, :, :5])


def test_compact_keep_all_is_noop(model):
    cache = model.new_cache(1, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 1, 9, seed=15))
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.compact(4, torch.arange(5))
    assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0) and cache.length() == 9


def test_compact_refuses_offsets_that_do_not_increase(model):
    """Slots move down in place, so the kept offsets must increase; a refused call moves nothing."""
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 9, seed=16))
    k0 = cache.k.clone()
    with pytest.raises(CacheError, match="must increase"):
        cache.compact(4, [torch.tensor([0, 2]), torch.tensor([3, 1])])
    with pytest.raises(CacheError, match="must increase"):
        cache.compact(4, torch.tensor([[0, 1, 2], [0, 0, 1]]))  # a repeat before the last offset
    assert torch.equal(cache.k, k0) and cache.length() == 9


@pytest.mark.parametrize(
    "start,keep,what",
    [
        (4, torch.tensor([0, 5]), "are filled"),  # slot 9: never written
        (4, torch.tensor([0, 9]), "are filled"),  # slot 13: past the allocation
        (4, torch.tensor([-2, 1]), "are filled"),  # slot 2: before the start
        (4, [torch.tensor([0, 1]), torch.tensor([0, 5])], "are filled"),  # row 0 fine, row 1 not
        (10, torch.tensor([0]), "outside"),  # a start past the filled length
        (1, torch.tensor([0]), "outside"),  # a start inside row 0's left padding
        (4, [torch.tensor([0])], "each of the 2 rows"),
    ],
    ids=["past-filled", "past-allocated", "negative", "second-row", "start-past", "start-in-padding", "rows"],
)
def test_compact_refuses_slots_outside_the_filled_ones(model, start, keep, what):
    """Every kept slot must hold an entry and the start must lie in [left padding, filled length]: a kept
    slot past them would be read as a token's keys, and a refused call moves nothing."""
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 9, seed=16))
    cache.pad[0] = 2
    k0, lengths = cache.k.clone(), cache.lengths.clone()
    with pytest.raises(CacheError, match=what):
        cache.compact(start, keep)
    assert torch.equal(cache.k, k0) and torch.equal(cache.lengths, lengths)
    L = model.config.n_layers
    cache.truncate(6, layers=range(1, L))  # layers [1, L) hold 6 slots: a kept slot must be filled in each
    with pytest.raises(CacheError, match="are filled"):
        cache.compact(4, torch.tensor([0, 2]))
    cache.compact(4, torch.tensor([1]), layers=range(1, L))
    assert cache.lengths[1:].tolist() == [[5, 5]] * (L - 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.truncate(4, layers=range(0, 99)),
        lambda c: c.truncate(4, layers=range(2, 0, -1)),
        lambda c: c.truncate(torch.tensor([3, 4, 5])),
        lambda c: c.truncate(3.5),
        lambda c: c.compact(4, torch.tensor([0]), layers=range(0, 99)),
    ],
    ids=["layers-past", "layers-reversed", "rows", "float", "compact-layers-past"],
)
def test_truncate_and_compact_refuse_bad_layers_and_lengths(model, call):
    cache = model.new_cache(2, 12)
    step(model, cache, rand_ids(model.config.vocab_size, 2, 8, seed=6))
    before = cache.lengths.clone()
    with pytest.raises(CacheError, match="layers must be a range|give an integer length"):
        call(cache)
    assert torch.equal(cache.lengths, before)
    cache.truncate(4, layers=range(1, 1))  # an empty range: nothing to do
    cache.compact(4, torch.tensor([0]), layers=range(2, 2))
    assert torch.equal(cache.lengths, before)


# -- per-layer lengths -----------------------------------------------------------------------
@pytest.mark.parametrize("a", [1, 2, 3])
def test_per_layer_lengths_then_catch_up(model, a):
    """Layers [0, a) run ahead on three tokens while [a, L) see only the first; then [a, L) catch
    up on the remaining two from the saved hidden states.  Logits equal a full forward."""
    L = model.config.n_layers
    V = model.config.vocab_size
    prompt = rand_ids(V, 1, 6, seed=16)
    new = rand_ids(V, 1, 3, seed=17)
    cache = model.new_cache(1, 12)
    step(model, cache, prompt)
    with torch.inference_mode():
        pos = torch.arange(6, 9).unsqueeze(0)
        h_low = model.run_layers(model.embed(new), 0, a, pos, cache)  # all three through the low layers
        assert cache.lengths[:a].tolist() == [[9]] * a
        first = model.run_layers(h_low[:, :1], a, L, pos[:, :1], cache)  # only the first through the rest
        assert cache.lengths[a:].tolist() == [[7]] * (L - a)
        assert cache.length(0) == 9 and cache.length(a) == 7  # rows agree; layers do not
        # catching up: the remaining two through [a, L), positions taken from layer a's length
        base = int(cache.lengths[a, 0])
        rest = model.run_layers(h_low[:, 1:], a, L, torch.arange(base, base + 2).unsqueeze(0), cache)
        # a run over all layers now sees uniform lengths again
        assert cache.lengths.tolist() == [[9]] * L
        last = model.forward(rand_ids(V, 1, 1, seed=18), positions=torch.tensor([[9]]), cache=cache)
    ref = full_logits(model, prompt[0].tolist() + new[0].tolist() + rand_ids(V, 1, 1, seed=18)[0].tolist())
    assert_close(model.logits(first)[0, 0], ref[6])
    assert_close(model.logits(rest)[0], ref[7:9])
    assert_close(last[0, 0], ref[9])


def test_run_layers_mixed_lengths_in_one_call(model):
    """One run_layers call over layers whose lengths differ (a lagging upper half): each layer
    appends at its own length and sees its own history."""
    L = model.config.n_layers
    V = model.config.vocab_size
    ids = rand_ids(V, 8, seed=19).tolist()
    cache = model.new_cache(1, 12)
    step(model, cache, torch.tensor([ids[:6]]))
    cache.truncate(5, layers=range(L // 2, L))  # upper layers lost the last token
    # re-run token 5 through the upper layers only, from its lower-half hidden state
    with torch.inference_mode():
        fresh = model.new_cache(1, 12)
        h = model.run_layers(model.embed(torch.tensor([ids[:6]])), 0, L // 2, torch.arange(6).unsqueeze(0), fresh)
        model.run_layers(h[:, 5:], L // 2, L, torch.tensor([[5]]), cache)
    assert cache.lengths.tolist() == [[6]] * L
    got = step(model, cache, torch.tensor([ids[6:]]))
    assert_close(got[0], full_logits(model, ids)[6:])


# -- overflow --------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2])
def test_overflow_raises(model, batch):
    V = model.config.vocab_size
    cache = model.new_cache(batch, 8)
    step(model, cache, rand_ids(V, batch, 8, seed=20))  # exactly full is fine
    with pytest.raises(CacheError, match=r"overflow: 9 slots needed, 8 allocated") as e:
        step(model, cache, rand_ids(V, batch, 1, seed=21))
    assert isinstance(e.value, LayerleapError)
    cache2 = model.new_cache(batch, 8)
    with pytest.raises(CacheError, match="overflow"):
        step(model, cache2, rand_ids(V, batch, 9, seed=22))
    if batch == 2:  # ragged rows: the longest row decides
        cache3 = model.new_cache(2, 8)
        step(model, cache3, rand_ids(V, 2, 8, seed=23))
        cache3.truncate(torch.tensor([3, 8]))
        with pytest.raises(CacheError, match="overflow"):
            step(model, cache3, rand_ids(V, 2, 1, seed=24))


# -- the attention mask ----------------------------------------------------------------------
def _cache(lengths, pad=None, max_len=10):
    c = KVCache(1, len(lengths), 1, max_len, 2)
    c.lengths[:] = torch.tensor(lengths)
    if pad is not None:
        c.pad[:] = torch.tensor(pad)
    return c


def _expected(start, pad, n_new, new_mask=None, total=None):
    """Reference mask for one row: old slots [pad, start) visible, new slot j visible from new i when
    allowed (causal or new_mask), a token always sees itself."""
    total = start + n_new if total is None else total
    m = torch.zeros(n_new, total, dtype=torch.bool)
    for i in range(n_new):
        for t in range(total):
            if t < start:
                m[i, t] = t >= pad
            elif t < start + n_new:
                j = t - start
                allowed = (j <= i) if new_mask is None else bool(new_mask[i, j])
                m[i, t] = allowed and t >= pad or j == i
    return m


def test_mask_fast_path_single_token():
    mask, total = _cache([5]).attention_mask(0, 1, None)
    assert mask is None and total == 6


def test_mask_causal_shape_and_contents():
    mask, total = _cache([4]).attention_mask(0, 3, None)
    assert total == 7 and mask.shape == (1, 1, 3, 7) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], _expected(4, 0, 3))
    assert mask[0, 0].tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]


def test_mask_left_padding():
    mask, total = _cache([6, 6], pad=[0, 3]).attention_mask(0, 2, None)
    assert total == 8 and mask.shape == (2, 1, 2, 8)
    assert torch.equal(mask[0, 0], _expected(6, 0, 2))
    assert torch.equal(mask[1, 0], _expected(6, 3, 2))
    assert not mask[1, 0, :, :3].any()  # padding never visible
    # even one new token needs a mask when there is padding
    mask1, _ = _cache([6, 6], pad=[0, 3]).attention_mask(0, 1, None)
    assert mask1 is not None and mask1[1, 0, 0].tolist() == [False] * 3 + [True] * 4


def test_mask_prefill_padding_rows_see_themselves():
    """During a padded prefill the padding queries see only themselves (finite softmax)."""
    mask, total = _cache([0, 0], pad=[0, 2]).attention_mask(0, 4, None)
    assert total == 4
    assert mask[1, 0].tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]
    assert torch.equal(mask[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("batched_mask", [False, True])
def test_mask_tree(batched_mask):
    parents = [-1, 0, 0, 1]
    tm = tree_mask(parents)
    nm = torch.stack([tm, tm]) if batched_mask else tm
    mask, total = _cache([3, 3], pad=[0, 1]).attention_mask(0, 4, nm)
    assert total == 7 and mask.shape == (2, 1, 4, 7)
    for b, pad in enumerate([0, 1]):
        assert torch.equal(mask[b, 0], _expected(3, pad, 4, tm))
    assert mask[0, 0, 2].tolist() == [True, True, True, True, False, True, False]  # node 2 sees root + itself


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("batched_mask", [False, True])
def test_mask_tree_without_padding(rows, batched_mask):
    """Rows without padding at one length take one tree mask (every old slot, the tree among the new
    tokens, each token itself even where the tree mask leaves it out), as the general rule gives."""
    tm = tree_mask([-1, 0, 0, 1])
    tm[3, 3] = False  # a mask without its diagonal still lets a token see itself
    nm = tm.unsqueeze(0) if batched_mask else tm
    mask, total = _cache([5] * rows).attention_mask(0, 4, nm)
    assert total == 9 and mask.shape == (rows, 1, 4, 9)
    for b in range(rows):
        assert torch.equal(mask[b, 0], _expected(5, 0, 4, tm))
    assert mask[0, 0, 3].tolist() == [True] * 5 + [True, True, False, True]


def test_mask_ragged_rows_with_tree():
    """Rows at different lengths: each row's new tokens start at its own length; slots past them
    (stale entries up to the longest row) are hidden."""
    parents = [-1, 0, 1]
    tm = tree_mask(parents)
    mask, total = _cache([2, 5]).attention_mask(0, 3, torch.stack([tm, torch.ones(3, 3, dtype=torch.bool).tril()]))
    assert total == 8
    assert torch.equal(mask[0, 0], _expected(2, 0, 3, tm, total=8))
    assert not mask[0, 0, :, 5:].any()
    assert torch.equal(mask[1, 0], _expected(5, 0, 3, None, total=8))


def test_mask_uses_the_layer_given():
    c = KVCache(2, 1, 1, 10, 2)
    c.lengths[:] = torch.tensor([[4], [2]])
    assert c.attention_mask(0, 2, None)[1] == 6 and c.attention_mask(1, 2, None)[1] == 4


def test_write_and_advance():
    c = KVCache(2, 2, 1, 6, 2)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    c.write(1, k, -k)
    assert torch.equal(c.k[1, :, :, :3], k) and torch.equal(c.v[1, :, :, :3], -k) and not c.k[0].any()
    assert c.lengths.sum() == 0  # write does not advance
    c.advance(1, 2, 3)
    assert c.lengths.tolist() == [[0, 0], [3, 3]]
    c.lengths[1] = torch.tensor([3, 1])  # ragged write
    c.write(1, k[:, :, :2], k[:, :, :2])
    assert torch.equal(c.k[1, 0, :, 3:5], k[0, :, :2]) and torch.equal(c.k[1, 1, :, 1:3], k[1, :, :2])


def test_for_model_shape(model):
    c = KVCache.for_model(model.config, 3, 11)
    cfg = model.config
    assert c.k.shape == (cfg.n_layers, 3, cfg.n_kv_heads, 11, cfg.head_dim) == c.v.shape
    assert c.lengths.shape == (cfg.n_layers, 3) and c.pad.shape == (3,) and c.max_len == 11
    assert c.n_layers == cfg.n_layers and c.batch == 3
