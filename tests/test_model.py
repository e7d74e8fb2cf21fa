"""The decoder on tiny random configs: equality with `transformers`, layer ranges, the KV cache,
tree masks, left padding, bf16, and refusing what it cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import CONFIGS, full_logits, random_model, randomize_, tree_depths, tree_mask, tree_path

import layerleap
from layerleap import ModelConfig, Transformer, from_hf, tiny_config, to_hf
from layerleap.core.config import ConfigError
from layerleap.core.loading import build, hf_to_ours, ours_to_hf

ATOL = RTOL = 1e-5


def assert_close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def rand_ids(vocab: int, *shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request) -> Transformer:
    return random_model(request.param, seed=1)


# -- equality with transformers ----------------------------------------------------------------
@pytest.mark.parametrize("layout", ["plain", "optimized"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers_forward(name, layout):
    ours = random_model(name, seed=3)
    hf = to_hf(ours)
    assert type(hf).__name__.lower().startswith(ours.config.model_type)
    if layout == "optimized":  # the column-major layout that build() applies
        ours.optimize_layout()
    ids = rand_ids(ours.config.vocab_size, 2, 13, seed=4)
    with torch.inference_mode():
        expect = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 13, ours.config.vocab_size)
    assert expect.abs().max() > 1  # not trivially small logits
    assert_close(got, expect)


def _random_hf(kind: str, tied: bool, gqa: bool, seed: int = 0, **extra):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kw = dict(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2 if gqa else 6,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=2000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(extra)
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    hf = cls[1](cls[0](**kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(
                1 + 0.3 * r
                if name.endswith("norm.weight")
                else 0.5 * r
                if name.endswith("bias")
                else r / (p.shape[-1] ** 0.5 if "embed" not in name else 1)
            )
    return hf


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_from_hf_reproduces_transformers_logits(kind, tied, gqa):
    hf = _random_hf(kind, tied, gqa, seed=5)
    ours = from_hf(hf)
    c = ours.config
    assert (c.model_type, c.tie_embeddings, c.qkv_bias) == (kind, tied, kind == "qwen2")
    assert c.n_kv_heads == (2 if gqa else 6) and c.rope_theta == 2000.0 and c.rms_norm_eps == 1e-6
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    ids = rand_ids(61, 2, 17, seed=6)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)
    if tied:
        torch.testing.assert_close(ours.lm_head.dense_weight(), ours.tok_embeddings.weight, atol=0, rtol=0)


def test_from_hf_dtype_and_roundtrip():
    hf = _random_hf("qwen2", tied=False, gqa=True, seed=7)
    ours = from_hf(hf, dtype="bfloat16")
    assert ours.dtype == torch.bfloat16
    ours32 = from_hf(hf)
    back = to_hf(ours32)
    ids = rand_ids(61, 1, 9, seed=8)
    with torch.inference_mode():
        assert_close(back(ids).logits, hf(ids).logits)


def test_from_hf_llama_attention_bias():
    """Llama with ``attention_bias=True`` has biases on q, k, v *and* o in `transformers`; layerleap
    reads it as ``qkv_bias`` but has no o-projection bias.  It must either reproduce the logits or
    refuse the config up front, naming attention_bias (not fail later on "unexpected weights")."""
    hf = _random_hf("llama", tied=False, gqa=True, seed=9, attention_bias=True)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    try:
        ours = from_hf(hf)
    except ConfigError as e:
        assert "attention_bias" in str(e), f"unclear refusal: {e}"
        return
    ids = rand_ids(61, 1, 9, seed=10)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)


def test_llama_qkv_bias_is_convertible_or_refused():
    """tiny_config(qkv_bias=True) on a Llama: from_hf now refuses Llama attention_bias (it also biases
    o_proj), so such a config must either be refused up front (ConfigError) or convert with to_hf to
    an equal model -- not fail inside transformers' load_state_dict."""
    try:
        ours = random_model(dict(qkv_bias=True), seed=13)
        hf = to_hf(ours)
    except ConfigError:
        return
    ids = rand_ids(ours.config.vocab_size, 1, 9, seed=14)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_roundtrip_through_transformers(name):
    """config.to_hf() read by transformers and back gives the same config, also for long contexts
    (a Mistral config without ``sliding_window`` must not pick up transformers' default window 4096)."""
    from transformers import AutoConfig

    c = tiny_config(**CONFIGS[name], max_position=8192)
    d = c.to_hf()
    back = ModelConfig.from_hf(AutoConfig.for_model(d.pop("model_type"), **d).to_dict(), name=c.name)
    assert back == c


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("mistral", dict(sliding_window=4)),
        ("mistral", dict(sliding_window=4, use_sliding_window=False)),  # Mistral has no such switch
        ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),  # the last layer slides
    ],
)
def test_from_hf_sliding_window(kind, extra):
    """A model whose ``sliding_window`` is shorter than its context attends to the last
    ``sliding_window`` tokens only.  layerleap runs full attention: it must either refuse such a
    config or bound the context by the window (where both agree), and generate must keep to it."""
    hf = _random_hf(kind, tied=False, gqa=True, seed=11, **extra)
    try:
        ours = from_hf(hf)
    except ConfigError:
        return
    n = 12 if ours.config.max_position > 4 else 4
    ids = rand_ids(61, 1, n, seed=12)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)
    if n == 4:
        with pytest.raises(layerleap.LayerleapError, match="context length 4"):
            layerleap.generate(ours, [1, 2, 3], max_new_tokens=2)
        assert len(layerleap.generate(ours, [1, 2, 3], max_new_tokens=1).token_ids) == 1


def test_from_hf_no_sliding_window_keeps_context():
    """Qwen2's sliding_window is inert unless use_sliding_window is set; Mistral's None means none."""
    q = from_hf(_random_hf("qwen2", tied=False, gqa=True, seed=15, sliding_window=4, use_sliding_window=False))
    m = from_hf(_random_hf("mistral", tied=False, gqa=True, seed=16, sliding_window=None))
    assert q.config.max_position == m.config.max_position == 128


def test_from_hf_swish_is_silu():
    """transformers' hidden_act "swish" is the SiLU of "silu": the same model, not an unsupported one."""
    hf = _random_hf("llama", tied=False, gqa=True, seed=19, hidden_act="swish")
    ours = from_hf(hf)
    ids = rand_ids(61, 1, 9, seed=20)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)


@pytest.mark.parametrize(
    "extra",
    [dict(max_window_layers=3), dict(layer_types=["full_attention"] * 3)],
    ids=["max_window_layers", "layer_types"],
)
def test_from_hf_qwen2_window_on_no_layer_keeps_context(extra):
    """Qwen2 slides the window from layer max_window_layers on (or where layer_types says): a window
    that no layer uses leaves the whole context, with transformers' logits past the window."""
    hf = _random_hf("qwen2", tied=False, gqa=True, seed=17, use_sliding_window=True, sliding_window=4, **extra)
    ours = from_hf(hf)
    assert ours.config.max_position == 128
    ids = rand_ids(61, 1, 12, seed=18)
    with torch.inference_mode():
        assert_close(ours(ids), hf(ids).logits)


@pytest.mark.parametrize("kind,extra", [("mistral", {}), ("qwen2", dict(use_sliding_window=True, max_window_layers=1))])
def test_an_absent_sliding_window_is_transformers_default(kind, extra):
    """A hand-written config.json without sliding_window gets transformers' default window (4096)."""
    from transformers import AutoConfig

    d = dict(_hf_cfg(model_type=kind, max_position_embeddings=8192, **extra))
    d.pop("sliding_window", None)
    window = AutoConfig.for_model(**d).sliding_window
    assert window == 4096
    assert ModelConfig.from_hf(d).max_position == window


# -- layer ranges -----------------------------------------------------------------------------
@pytest.mark.parametrize("a,b", [(0, 0), (0, 4), (1, 3), (2, 2), (3, 4), (1, 1), (4, 4)])
def test_run_layers_split_equals_one_call(model, a, b):
    L = model.config.n_layers
    a, b = min(a, L), min(b, L)
    ids = rand_ids(model.config.vocab_size, 2, 9, seed=a * 10 + b)
    pos = torch.arange(9).expand(2, -1)
    with torch.inference_mode():
        h0 = model.embed(ids)
        one = model.run_layers(h0, 0, L, pos)
        h = model.run_layers(h0, 0, a, pos)
        h = model.run_layers(h, a, b, pos)
        h = model.run_layers(h, b, L, pos)
        assert_close(h, one, atol=0, rtol=0)
        assert_close(model.logits(h), model(ids), atol=0, rtol=0)


@pytest.mark.parametrize("a,b", [(0, 1), (1, 3), (2, 4)])
def test_run_layers_split_with_cache(model, a, b):
    """Splitting the layer range also works through the cache (prefill, then decode 3 tokens)."""
    L = model.config.n_layers
    b = min(b, L)
    ids = rand_ids(model.config.vocab_size, 1, 12, seed=b)
    cache = model.new_cache(1, 16)
    with torch.inference_mode():
        for s, e in [(0, 9), (9, 10), (10, 11), (11, 12)]:
            pos = torch.arange(s, e).unsqueeze(0)
            h = model.embed(ids[:, s:e])
            for lo, hi in [(0, a), (a, b), (b, L)]:
                h = model.run_layers(h, lo, hi, pos, cache)
            assert_close(model.logits(h)[0], full_logits(model, ids[0, :e])[s:e])
    assert cache.lengths.tolist() == [[12]] * L


def test_run_layers_refuses_bad_range(model):
    h = model.embed(torch.zeros(1, 2, dtype=torch.long))
    pos = torch.arange(2).unsqueeze(0)
    for s, e in [(-1, 2), (2, 1), (0, model.config.n_layers + 1)]:
        with pytest.raises(ValueError, match="layer range"):
            model.run_layers(h, s, e, pos)


@pytest.mark.parametrize("start", [-1, 3, 11])
def test_logits_from_scores_only_the_positions_asked_for(model, start):
    ids = rand_ids(model.config.vocab_size, 2, 12, seed=5)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(2, 16)
        got = model(ids, cache=cache, logits_from=start)
    assert got.shape == full[:, start:].shape
    assert_close(got, full[:, start:])
    assert cache.lengths.tolist() == [[12, 12]] * model.config.n_layers  # every position's keys are kept


# -- cached decoding --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chunks",
    [[1] * 12, [5, 1, 1, 1, 1, 1, 1, 1], [3, 4, 2, 3], [7, 5], [12]],
    ids=["one-by-one", "prefill+single", "chunks-3423", "chunks-75", "one-chunk"],
)
def test_cached_decoding_equals_full_forward(model, chunks):
    ids = rand_ids(model.config.vocab_size, 2, sum(chunks), seed=len(chunks))
    with torch.inference_mode():
        expect = model(ids)
        cache = model.new_cache(2, 20)
        got, s = [], 0
        for n in chunks:
            got.append(model(ids[:, s : s + n], positions=torch.arange(s, s + n).expand(2, -1), cache=cache))
            s += n
    assert_close(torch.cat(got, 1), expect)
    assert cache.lengths.tolist() == [[s, s]] * model.config.n_layers


def test_rope_tables_grow_with_the_positions_and_give_the_full_tables_values():
    """A model holds rope tables for ``ROPE_ROWS`` positions at first (a 32k-position model's full
    tables take 16 MB in bf16); a call past them doubles the tables, and every row equals the row of
    the full table, so a long prompt decodes as with the full tables (cached and not)."""
    from layerleap.core.model import ROPE_ROWS, rope_tables

    cfg = tiny_config(max_position=8192, head_dim=64, n_heads=2, n_kv_heads=1, hidden_size=128)
    full_cos, full_sin = rope_tables(cfg, cfg.max_position)
    cos, sin = rope_tables(cfg)
    assert (
        cos.shape[0] == ROPE_ROWS and torch.equal(cos, full_cos[:ROPE_ROWS]) and torch.equal(sin, full_sin[:ROPE_ROWS])
    )
    model = random_model(dict(max_position=4096), seed=2).to(torch.bfloat16)
    ref = random_model(dict(max_position=4096), seed=2).to(torch.bfloat16)
    ref.rope_cos, ref.rope_sin = (t.to(torch.bfloat16) for t in rope_tables(ref.config, 4096))
    assert model.rope_cos.shape[0] == ROPE_ROWS
    prompt = rand_ids(model.config.vocab_size, 1, ROPE_ROWS + 100, seed=5)[0].tolist()
    got = layerleap.generate(model, prompt, "greedy", 8, stop_at_eos=False).token_ids
    assert model.rope_cos.shape[0] == 2 * ROPE_ROWS and model.rope_cos.dtype == torch.bfloat16
    assert got == layerleap.generate(ref, prompt, "greedy", 8, stop_at_eos=False).token_ids
    fresh = random_model(dict(max_position=4096), seed=2).to(torch.bfloat16)
    assert torch.equal(full_logits(fresh, prompt), full_logits(ref, prompt))  # no cache: grown by a scan
    with pytest.raises(IndexError):  # past max_position, as before
        fresh(torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([[4096]]))
    odd = random_model(dict(max_position=4096), seed=2).to(torch.bfloat16)  # a position past the cache's slots
    tok, at = torch.tensor([[3]]), torch.tensor([[3000]])
    with torch.inference_mode():
        got, want = odd(tok, positions=at, cache=odd.new_cache(1, 8)), ref(tok, positions=at, cache=ref.new_cache(1, 8))
    assert torch.equal(got, want) and odd.rope_cos.shape[0] == 4096


@pytest.mark.parametrize("rows", [16, 8], ids=["full-tables", "grown-tables"])
def test_a_position_past_the_context_names_the_context_length(rows):
    """A call past ``max_position`` (a full cache of ``max_position`` slots given one more token, or a
    prompt longer than the context) is refused with the context length, not a bare index error."""
    from layerleap.core.model import PositionError, rope_tables

    model = random_model(dict(max_position=16), seed=2)
    model.rope_cos, model.rope_sin = rope_tables(model.config, rows)
    ids = rand_ids(model.config.vocab_size, 1, 17, seed=3)
    with torch.inference_mode():
        with pytest.raises(PositionError, match="context length 16") as e:
            model(ids)
        assert isinstance(e.value, layerleap.LayerleapError) and isinstance(e.value, IndexError)
        cache = model.new_cache(1, 16)
        model(ids[:, :16], cache=cache)  # exactly the context: fine
        with pytest.raises(PositionError, match="context length 16"):
            model(ids[:, 16:], cache=cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_of_one_position_equal_the_gathered_rows(dtype):
    """A decoding step's one position reads a row of the tables kept in the activations' dtype; it equals
    the row gathered for many positions, converted as before, and follows the tables when they grow."""
    model = random_model(dict(max_position=4096), seed=2)
    for at in (0, 7, 1023, 1500):  # the last one grows the tables
        cos, sin = model._rope(torch.tensor([[at]]), dtype, at + 1)
        many_cos, many_sin = model._rope(torch.tensor([[at, 0]]), dtype, at + 1)
        assert cos.shape == (1, 1, 1, model.config.head_dim) and cos.dtype == dtype
        assert torch.equal(cos[0, 0], many_cos[0, 0]) and torch.equal(sin[0, 0], many_sin[0, 0])
        assert torch.equal(cos[0, 0, 0], model.rope_cos[at].to(dtype))
        assert torch.equal(sin[0, 0, 0], model.rope_sin[at].to(dtype))
    assert model.rope_cos.shape[0] == 2048


@pytest.mark.parametrize("native", [False, True])
def test_cache_dtype_on_cpu_is_fp32_for_bf16_without_native_bf16(model, monkeypatch, native):
    from layerleap.core import model as model_mod

    monkeypatch.setattr(model_mod, "cpu_has_native_bf16", lambda: native)
    m16 = build(model.config, {k: v.clone() for k, v in model.state_dict().items()}, dtype=torch.bfloat16)
    assert m16.new_cache(1, 4).k.dtype == (torch.bfloat16 if native else torch.float32)
    assert model.new_cache(1, 4).k.dtype == torch.float32
    assert m16.new_cache(1, 4, dtype=torch.bfloat16).k.dtype == torch.bfloat16


# -- tree masks -------------------------------------------------------------------------------
TREES = {
    "root-2children-1grandchild": [-1, 0, 0, 1],
    "chain": [-1, 0, 1, 2],
    "wide": [-1, 0, 0, 0, 1, 2, 4],
    "forest": [-1, -1, 0, 1, 1],  # two roots (two first-token candidates)
}


@pytest.mark.parametrize("prefix", [0, 6], ids=["no-prefix", "prefix6"])
@pytest.mark.parametrize("tree", list(TREES))
def test_tree_mask_node_logits_equal_path_forward(model, tree, prefix):
    parents = TREES[tree]
    n = len(parents)
    V = model.config.vocab_size
    ctx = rand_ids(V, prefix, seed=20).tolist()
    nodes = rand_ids(V, n, seed=21).tolist()
    depth = tree_depths(parents)
    mask = tree_mask(parents)
    pos = torch.tensor([prefix + d for d in depth]).unsqueeze(0)
    with torch.inference_mode():
        if prefix:
            cache = model.new_cache(1, prefix + n + 2)
            model(torch.tensor([ctx]), cache=cache)
            got = model(torch.tensor([nodes]), positions=pos, cache=cache, mask=mask)[0]
            assert cache.lengths.tolist() == [[prefix + n]] * model.config.n_layers
        else:  # no cache: the mask is the whole attention pattern
            got = model(torch.tensor([nodes]), positions=pos, mask=mask)[0]
            # and the same through an empty cache
            cache = model.new_cache(1, n)
            assert_close(model(torch.tensor([nodes]), positions=pos, cache=cache, mask=mask)[0], got)
    for i in range(n):
        path = [nodes[j] for j in tree_path(parents, i)]
        assert_close(got[i], full_logits(model, ctx + path)[-1])


def test_tree_mask_per_row(model):
    """A ``[B, S, S]`` mask gives each row its own tree."""
    V = model.config.vocab_size
    trees = [TREES["root-2children-1grandchild"], TREES["chain"]]
    ctx = rand_ids(V, 2, 5, seed=30)
    nodes = rand_ids(V, 2, 4, seed=31)
    mask = torch.stack([tree_mask(p) for p in trees])
    pos = torch.tensor([[5 + d for d in tree_depths(p)] for p in trees])
    with torch.inference_mode():
        cache = model.new_cache(2, 12)
        model(ctx, cache=cache)
        got = model(nodes, positions=pos, cache=cache, mask=mask)
    for b, parents in enumerate(trees):
        for i in range(4):
            path = nodes[b, tree_path(parents, i)].tolist()
            assert_close(got[b, i], full_logits(model, ctx[b].tolist() + path)[-1])


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_tree_mask_of_ones_and_zeros_means_the_same_with_and_without_a_cache(model, native, monkeypatch):
    """A 0/1 mask of another dtype is read as the bool mask it stands for, with a cache and without
    (``F.scaled_dot_product_attention`` would add a float mask to the scores)."""
    from layerleap.core import native as native_mod

    if not native:
        monkeypatch.setattr(native_mod, "module", lambda: None)
    parents = TREES["wide"]
    n = len(parents)
    nodes = rand_ids(model.config.vocab_size, 1, n, seed=21)
    mask = tree_mask(parents)
    pos = torch.tensor([tree_depths(parents)])
    with torch.inference_mode():
        want = model(nodes, positions=pos, mask=mask)
        for other in (mask.float(), mask.int()):
            assert_close(model(nodes, positions=pos, mask=other), want)
            assert_close(model(nodes, positions=pos, cache=model.new_cache(1, n), mask=other), want)


# -- batches with left padding ---------------------------------------------------------------
def _padded_prefill(model, prompts, max_len):
    longest = max(map(len, prompts))
    B = len(prompts)
    ids = torch.zeros(B, longest, dtype=torch.long)
    cache = model.new_cache(B, max_len)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)
        cache.pad[b] = longest - len(p)
    pos = (torch.arange(longest).unsqueeze(0) - cache.pad.unsqueeze(1)).clamp(min=0)
    return model(ids, positions=pos, cache=cache), cache


@pytest.mark.parametrize("lengths", [(5, 9), (9, 5, 1, 7), (3, 3)])
def test_left_padded_batch_equals_batch_of_one(model, lengths):
    V = model.config.vocab_size
    prompts = [rand_ids(V, n, seed=40 + i).tolist() for i, n in enumerate(lengths)]
    nxt = rand_ids(V, len(lengths), 3, seed=49)
    longest = max(lengths)
    with torch.inference_mode():
        logits, cache = _padded_prefill(model, prompts, longest + 4)
        steps = []
        for t in range(3):  # then decode three tokens per row, one at a time
            pos = (cache.lengths[0] - cache.pad).unsqueeze(1)
            steps.append(model(nxt[:, t : t + 1], positions=pos, cache=cache))
    for b, p in enumerate(prompts):
        ref = full_logits(model, p + nxt[b].tolist())
        assert_close(logits[b, longest - len(p) :], ref[: len(p)])
        for t in range(3):
            assert_close(steps[t][b, 0], ref[len(p) + t])


# -- bf16 -------------------------------------------------------------------------------------
def test_bf16_model_runs_and_is_close(model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    m16 = build(model.config, sd, dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16
    ids = rand_ids(model.config.vocab_size, 2, 10, seed=50)
    with torch.inference_mode():
        ref = model(ids)
        got = m16(ids)
        cache = m16.new_cache(2, 12)
        inc = torch.cat(
            [m16(ids[:, :7], cache=cache), m16(ids[:, 7:], positions=torch.arange(7, 10).expand(2, -1), cache=cache)], 1
        )
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 0.1 * scale
    assert (inc - ref).abs().max() < 0.1 * scale
    # bf16 agrees with transformers' own bf16 forward about as well as with fp32
    hf16 = to_hf(m16)
    with torch.inference_mode():
        assert (hf16(ids).logits.float() - ref).abs().max() < 0.1 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7


# -- configs we cannot run --------------------------------------------------------------------
def _hf_cfg(**kw):
    d = tiny_config().to_hf()
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "hf_cfg,message",
    [
        (_hf_cfg(model_type="gpt2"), "model_type='gpt2'"),
        (_hf_cfg(model_type=None), "config.json has no model_type: add the architecture of the weights, one of llama"),
        (_hf_cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
        (_hf_cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "llama3"),
        (_hf_cfg(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
        (_hf_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
        (_hf_cfg(hidden_act="gelu"), "gelu"),
        (_hf_cfg(mlp_bias=True), "mlp_bias"),
        (_hf_cfg(attention_bias=True), "attention_bias"),
        (_hf_cfg(model_type="mistral", attention_bias=True), "attention_bias"),
    ],
    ids=[
        "gpt2",
        "no-type",
        "llama3-scaling",
        "llama3-parameters",
        "linear",
        "yarn",
        "gelu",
        "mlp-bias",
        "llama-attention-bias",
        "mistral-attention-bias",
    ],
)
def test_unsupported_configs_raise_config_error(hf_cfg, message):
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig.from_hf(hf_cfg)
    assert isinstance(e.value, layerleap.LayerleapError)


@pytest.mark.parametrize("kw,message", [(dict(n_heads=4, n_kv_heads=3), "multiple"), (dict(head_dim=7), "even")])
def test_impossible_model_config(kw, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_hf_roundtrip(name):
    c = tiny_config(**CONFIGS[name])
    assert ModelConfig.from_hf(c.to_hf(), name=c.name) == c


def test_default_rope_config_accepted():
    for rope in ({"rope_type": "default", "rope_theta": 321.0}, {"type": "default"}, None):
        c = ModelConfig.from_hf(_hf_cfg(rope_parameters=rope))
        assert c.rope_theta == (321.0 if rope and "rope_theta" in rope else 10000.0)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 1.0})),
        ("qwen2", dict(mlp_bias=False)),
        ("mistral", dict(attention_bias=False)),
    ],
    ids=["linear-by-one", "qwen2-no-mlp-bias", "mistral-no-attention-bias"],
)
def test_config_values_that_change_nothing_are_taken(kind, extra):
    """Linear rope scaling by 1 (positions / 1), and biases set off: transformers' model runs as without them."""
    assert ModelConfig.from_hf(_hf_cfg(model_type=kind, **extra)) == ModelConfig.from_hf(_hf_cfg(model_type=kind))
    hf = _random_hf(kind, tied=False, gqa=True, seed=11, **extra)  # (transformers adds rope_theta to rope_scaling)
    ids = rand_ids(61, 1, 40, seed=12)
    with torch.inference_mode():
        assert_close(from_hf(hf)(ids), hf(ids).logits)
    with pytest.raises(ConfigError, match="linear"):  # a factor that scales is refused
        ModelConfig.from_hf(_hf_cfg(rope_scaling={"type": "linear", "factor": True}))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_an_absent_max_position_is_transformers_default(kind):
    """A config without max_position_embeddings has the context transformers' config class gives it (Qwen2
    32768, Mistral 131072 bounded by its 4096 window, Llama 2048), not 2048 for every architecture."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}
    hf = _hf_cfg(model_type=kind)
    del hf["max_position_embeddings"]
    if kind == "mistral":
        hf.pop("sliding_window", None)  # absent: transformers' 4096
    want = min(cls[kind]().max_position_embeddings, 4096 if kind == "mistral" else 1 << 30)
    assert ModelConfig.from_hf(hf).max_position == want


# -- state dict mapping -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_sd():
    m = random_model("qwen2-gqa-untied", seed=60)
    return m.config, {k: v.clone() for k, v in ours_to_hf(m).items()}, m


def test_hf_to_ours_roundtrip(hf_sd):
    config, sd, m = hf_sd
    ours = hf_to_ours(sd, config)
    assert set(ours) == set(m.state_dict())
    for k, v in ours.items():
        assert torch.equal(v, m.state_dict()[k]), k
    # the loader prefixes and rotary buffers of older checkpoints are accepted
    sd2 = dict(sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)})
    assert set(hf_to_ours(sd2, config)) == set(ours)


def test_hf_to_ours_refuses_missing_key(hf_sd):
    config, sd, _ = hf_sd
    bad = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ConfigError, match=r"'layers\.1\.mlp\.up_proj\.weight' is missing"):
        hf_to_ours(bad, config)
    bad = {k: v for k, v in sd.items() if k != "model.layers.0.self_attn.k_proj.bias"}
    with pytest.raises(ConfigError, match="k_proj.bias' is missing"):
        hf_to_ours(bad, config)
    bad = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # untied model without a head
    with pytest.raises(ConfigError, match="'lm_head.weight' is missing"):
        hf_to_ours(bad, config)


def test_hf_to_ours_refuses_wrong_shape(hf_sd):
    config, sd, _ = hf_sd
    bad = dict(sd)
    bad["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(config.hidden_size, config.hidden_size + 1)
    with pytest.raises(ConfigError, match=r"o_proj\.weight' has shape \(32, 33\), expected \(32, 32\)"):
        hf_to_ours(bad, config)
    bad = dict(sd, **{"model.embed_tokens.weight": torch.zeros(config.vocab_size + 1, config.hidden_size)})
    with pytest.raises(ConfigError, match="embed_tokens.weight' has shape"):
        hf_to_ours(bad, config)


def test_hf_to_ours_refuses_unexpected_key(hf_sd):
    config, sd, _ = hf_sd
    bad = dict(sd, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(config.hidden_size)})
    expect = r"unexpected weights in the checkpoint: \['layers\.0\.self_attn\.o_proj\.bias'\]"
    with pytest.raises(ConfigError, match=expect):
        hf_to_ours(bad, config)
    # a fifth layer in a 4-layer config
    bad = dict(sd, **{"model.layers.4.input_layernorm.weight": torch.ones(config.hidden_size)})
    with pytest.raises(ConfigError, match="unexpected weights.*layers.4.input_layernorm"):
        hf_to_ours(bad, config)


def test_tied_checkpoint_with_stored_head_loads():
    m = random_model("llama-gqa-tied", seed=61)
    sd = {k: v.clone() for k, v in ours_to_hf(m).items()}
    assert "lm_head.weight" not in sd  # tied: the head is the embedding
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    ours = build(m.config, hf_to_ours(sd, m.config))
    ids = rand_ids(m.config.vocab_size, 1, 7, seed=62)
    with torch.inference_mode():
        assert_close(ours(ids), m(ids))


def test_build_keeps_tied_head_tied():
    m = random_model("llama-gqa-tied", seed=63)
    ours = build(m.config, hf_to_ours({k: v.clone() for k, v in ours_to_hf(m).items()}, m.config))
    assert ours.lm_head.weight is ours.tok_embeddings.weight or torch.equal(
        ours.lm_head.dense_weight(), ours.tok_embeddings.weight
    )
    assert not any(p.requires_grad for p in ours.parameters()) and not ours.training


def test_fingerprint_same_for_fp32_and_bf16_and_differs_between_models():
    a = random_model("llama-gqa-tied", seed=64)
    b = build(a.config, {k: v.clone() for k, v in a.state_dict().items()}, dtype=torch.bfloat16)
    c = random_model("llama-gqa-tied", seed=65)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    d = Transformer(dataclasses.replace(a.config, name="other"))
    d.load_state_dict(a.state_dict())
    assert d.fingerprint == a.fingerprint  # the name does not count


def test_randomize_leaves_nothing_trivial():
    m = random_model("qwen2-gqa-untied", seed=66)
    for name, p in m.named_parameters():
        assert not torch.all(p == 0) and not torch.all(p == 1), name
    assert randomize_(random_model("qwen2-gqa-untied", seed=0), seed=66).state_dict().keys() == m.state_dict().keys()
