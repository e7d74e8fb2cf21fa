"""The C++ decoder layers (``layerleap.core.native``) against the Python path: equal bit for bit, logits
and cache, for every weight format and the calls decoding makes (prefill, one token, a chain, a
tree, a padded batch).  Skipped when the extension is not built (``layerleap native --build``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import CONFIGS, random_model

from layerleap.core import kernels, model as model_mod, native
from layerleap.core.loading import build, quantize_model

pytestmark = pytest.mark.skipif(
    native.module() is None, reason="the native layers are not built: run `layerleap native --build`"
)


PADDED = (0, 3, 5, 3, 6, 5, 6, 7, 8)  # a rows table that pads one token, a batch of two and a chain of 4


def _in_format(m, fmt: str):
    if fmt.startswith("onednn"):
        rows = PADDED if fmt == "onednn-padded" else None
        for lin in m.projections():
            lin.pack(kernels.OneDNNWeight(lin.weight.detach(), lin.bias, pad_to=rows))
        return m
    if fmt == "bf16":
        sd = {k: v.clone() for k, v in m.dense_state().items()}
        if m.config.tie_embeddings:
            del sd["lm_head.weight"]
        return build(m.config, sd, torch.bfloat16)
    return quantize_model(m) if fmt == "q4" else m


def _calls(m, native_on: bool, monkeypatch):
    """Logits of: a padded prefill of two rows, one token, a chain of 4, a tree of 4; and the cache."""
    monkeypatch.setattr(model_mod, "_native_ok", model_mod._native_ok if native_on else (lambda h, lengths: False))
    g = torch.Generator().manual_seed(0)
    V = m.config.vocab_size
    outs = []
    with torch.inference_mode():
        for batch, pad in ((1, 0), (2, 3)):
            cache = m.new_cache(batch, 40)
            ids = torch.randint(0, V, (batch, 9), generator=g)
            cache.pad[1:] = pad
            outs.append(m(ids, cache=cache))
            outs.append(m(torch.randint(0, V, (batch, 1), generator=g), cache=cache))
            outs.append(m(torch.randint(0, V, (batch, 4), generator=g), cache=cache))
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
            outs.append(m(torch.randint(0, V, (batch, 4), generator=g), cache=cache, mask=tree))
            outs += [cache.k.clone(), cache.v.clone()]
    return outs


@pytest.mark.parametrize("fmt", ["dense", "onednn", "onednn-padded", "bf16", "q4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_layers_equal_python(name, fmt, monkeypatch):
    if fmt == "q4" and not kernels.int4_supported():
        pytest.skip("no int4 kernel")
    m = _in_format(random_model(name, seed=2, scale=2.0), fmt)
    want = _calls(m, False, monkeypatch)
    got = _calls(m, True, monkeypatch)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"output {i} differs"


def test_native_is_used_and_can_be_turned_off(monkeypatch):
    m = random_model("llama-gqa-tied", seed=1)
    calls = []
    real = m._native_layers
    monkeypatch.setattr(m, "_native_layers", lambda *a: calls.append(1) or real(*a), raising=False)
    with torch.inference_mode():
        m(torch.tensor([[1, 2, 3]]), cache=m.new_cache(1, 8))
    assert calls
    monkeypatch.setenv(native.ENV, "0")
    native.module.cache_clear()
    try:
        assert native.module() is None and native.status()["disabled"]
    finally:
        monkeypatch.delenv(native.ENV)
        native.module.cache_clear()
    assert native.module() is not None


def test_a_tree_call_gives_each_node_the_logits_of_its_own_path(monkeypatch):
    """With the native attention, a node of a verified tree (siblings masked) gets the logits that
    decoding its path one token at a time gives, bit for bit, in every format."""
    for fmt in ("onednn", "bf16", "q4"):  # dense F.linear gives a row different results in a bigger call
        if fmt == "q4" and not kernels.int4_supported():
            continue
        m = _in_format(random_model("qwen2-gqa-untied", seed=3, scale=2.0), fmt)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, m.config.vocab_size, (1, 10), generator=g)
        nodes = torch.randint(0, m.config.vocab_size, (1, 4), generator=g)  # root, a, b (sibling of a), a1
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        with torch.inference_mode():
            cache = m.new_cache(1, 20)
            m(prompt, cache=cache)
            got = m(nodes, positions=torch.tensor([[10, 11, 11, 12]]), cache=cache, mask=tree)[0]
            for path, node in (([0, 1, 3], 3), ([0, 2], 2)):
                c = m.new_cache(1, 20)
                m(prompt, cache=c)
                rows = [m(nodes[:, [i]], cache=c)[0, 0] for i in path]
                assert torch.equal(rows[-1], got[node]), f"{fmt}: node {node}"


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
def test_a_tree_call_after_a_long_prompt_gives_each_node_its_path_on_two_threads(fmt):
    """After a long prompt (attention split between threads), a verified tree's node gets the logits of
    decoding its path one token at a time, bit for bit, and one thread gives the same logits as two."""
    if fmt == "q4" and not kernels.int4_supported():
        pytest.skip("no int4 kernel")
    m = random_model(dict(max_position=2048, head_dim=16, n_heads=6, n_kv_heads=2), seed=3, scale=2.0)
    m = _in_format(m, fmt)
    g = torch.Generator().manual_seed(1)
    P = 1000
    prompt = torch.randint(0, m.config.vocab_size, (1, P), generator=g)
    nodes = torch.randint(0, m.config.vocab_size, (1, 4), generator=g)  # root, a, b (sibling of a), a1
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    threads = torch.get_num_threads()
    got = {}
    try:
        with torch.inference_mode():
            cache = m.new_cache(1, P + 8)
            m(prompt, cache=cache)
            for n in (2, 1):
                torch.set_num_threads(n)
                cache.truncate(P)
                got[n] = m(nodes, positions=torch.tensor([[P, P + 1, P + 1, P + 2]]), cache=cache, mask=tree)[0]
            torch.set_num_threads(2)
            for path, node in (([0, 1, 3], 3), ([0, 2], 2)):
                cache.truncate(P)
                rows = [m(nodes[:, [i]], cache=cache)[0, 0] for i in path]
                assert torch.equal(rows[-1], got[2][node]), f"{fmt}: node {node}"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1], got[2])


# multiples of 16 take the 16-key shuffle path alone; 24, 20 and 44 end in a tail of 8, 4 and 12 elements
@pytest.mark.parametrize("hd", [16, 64, 24, 20, 44])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_gives_a_row_what_it_gets_alone(hd, dtype):
    """A query row's output depends only on its query and the keys its mask allows: rows attended
    together (ragged key counts, not multiples of 16) equal each row attended alone, bit for bit."""
    mod = native.module()
    if mod is None:
        pytest.skip("native module not built")
    g = torch.Generator().manual_seed(hd)
    T, S = 37, 5
    q = torch.randn(2, 6, S, hd, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, T, hd, generator=g).to(dtype) for _ in range(2))
    mask = (torch.arange(T).view(1, -1) <= (T - S + torch.arange(S)).view(-1, 1)).view(1, 1, S, T)
    together = mod.attend_rows(q, k, v, mask)
    for s in range(S):
        n = T - S + s + 1  # the keys row s sees
        alone = mod.attend_rows(q[:, :, s : s + 1], k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), None)
        assert torch.equal(together[:, :, s : s + 1], alone), f"row {s}"
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1), attn_mask=mask
    )
    assert torch.allclose(together.float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("hd", [64, 40])  # 40: a head dim that ends in a partial slice of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_at_long_contexts_is_exact_and_the_same_on_any_threads(hd, dtype):
    """Past the sizes that run on the calling thread, attention is split between threads by runs of
    keys, rows and slices of the head dim: a tree's node (its siblings masked, keys past several runs)
    still gets exactly what the call over its own path gives, and 1, 2 and 3 threads give the same bits."""
    mod = native.module()
    g = torch.Generator().manual_seed(hd)
    T0 = 1100  # cached keys (several runs of keys, past the calling-thread-only sizes)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    q = torch.randn(1, 9, 4, hd, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, T0 + 4, hd, generator=g).to(dtype) for _ in range(2))
    mask = torch.cat([torch.ones(4, T0, dtype=torch.bool), tree], 1).view(1, 1, 4, T0 + 4)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(mod.attend_rows(q, k, v, mask))
            for node, path in ((3, [0, 1, 3]), (2, [0, 2])):  # the path's keys, in order, as decoding has them
                idx = torch.tensor(list(range(T0)) + [T0 + i for i in path])
                alone = mod.attend_rows(q[:, :, node : node + 1], k[:, :, idx], v[:, :, idx], None)
                assert torch.equal(outs[-1][:, :, node : node + 1], alone), f"{n} threads, node {node}"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1), attn_mask=mask
    )
    assert torch.allclose(outs[0].float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("hd", [64, 40, 20])  # 40, 20: the last slice of 16 is partial
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [1, 5, 16])
def test_attend_rows_in_half_precision_is_the_fp32_result_rounded(hd, dtype, S):
    """bf16 and fp16 queries, keys and values are widened to fp32 exactly (16 at a time for bf16) and the
    arithmetic is fp32's: the result is the fp32 call's on the widened inputs, rounded once, bit for bit
    (masked keys and a ragged key count included)."""
    mod = native.module()
    if mod is None:
        pytest.skip("native module not built")
    g = torch.Generator().manual_seed(hd * 100 + S)
    T = 300 + S  # two runs of keys, not a multiple of 16
    q = torch.randn(1, 9, S, hd, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, T, hd, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(1, 1, S, T, generator=g) < 0.7
    mask[..., 0] = True
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = mod.attend_rows(q, k, v, mask)
            want = mod.attend_rows(q.float(), k.float(), v.float(), mask).to(dtype)
            assert torch.equal(got, want), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def _q4_blocks(m, monkeypatch):
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    return quantize_model(m)


# wide enough that a team splits the rounding of a call's activations too (8 rows of 512 or 1024 inputs:
# 128 or 256 groups of 32, more than one share's least)
WIDE = dict(hidden_size=512, intermediate_size=1024, n_heads=8, n_kv_heads=2, head_dim=64, n_layers=2)


@pytest.mark.skipif(not kernels.blocks_available(), reason="no native block kernel")
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-gqa-untied", "mistral-gqa-untied", "wide"])
def test_q4_layers_on_a_team_equal_one_thread_and_python(name, monkeypatch):
    """Calls of a few rows on block weights run their layers on a team (thread 0 runs the layers, the
    others take shares of the products, the rounding of their activations and attention, and stream
    weights ahead): the logits and the cache equal those of one thread, of two threads without a team
    and of the Python path, bit for bit."""
    mod = native.module()
    m = _q4_blocks(random_model(WIDE if name == "wide" else name, seed=4, scale=2.0), monkeypatch)
    threads, was = torch.get_num_threads(), mod.team_settings()
    runs, teamed = {}, {}
    try:
        for key, n, team, window, rounds in (
            ("1 thread", 1, 1, -1, 1),
            ("2, no team", 2, 0, -1, 1),
            ("2, team", 2, 1, 6 << 20, 1),
            ("2, team, tiny window", 2, 1, 4096, 1),
            ("2, team, no stream", 2, 1, 0, 1),
            ("2, team, thread 0 rounds", 2, 1, 6 << 20, 0),
        ):
            torch.set_num_threads(n)
            before = mod.team_settings(team, window, rounds)[2]
            runs[key] = _calls(m, True, monkeypatch)
            teamed[key] = mod.team_settings()[2] - before
        torch.set_num_threads(2)
        runs["python"] = _calls(m, False, monkeypatch)
    finally:
        torch.set_num_threads(threads)
        mod.team_settings(was[0], was[1], was[3])
    assert teamed["1 thread"] == teamed["2, no team"] == 0
    assert all(teamed[k] >= 4 for k in teamed if "team," in k), teamed  # one token and a tree, in 2 batches
    for key, outs in runs.items():
        for i, (a, b) in enumerate(zip(runs["1 thread"], outs)):
            assert torch.equal(a, b), f"{key}: output {i} differs"


@pytest.mark.skipif(not kernels.blocks_available(), reason="no native block kernel")
def test_q4_team_hands_back_an_error(monkeypatch):
    """An error in a layer run on a team reaches the caller (and the team's threads stop)."""
    mod = native.module()
    m = _q4_blocks(random_model("llama-gqa-tied", seed=1), monkeypatch)
    args = native.layer_args(m, 0, m.config.n_layers)
    c = m.config
    h = torch.randn(1, 1, c.hidden_size)
    cos = sin = torch.zeros(1, 1, 1, c.head_dim)
    cache = m.new_cache(1, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)

    def run(k, v):
        rest = (c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, False, 16)
        return mod.run_layers(h, cos, sin, k, v, 0, None, None, *rest, *args, native.after_layers(m, c.n_layers))

    before = mod.team_settings()[2]
    try:
        # keys whose head dim is not contiguous: attention (on the team's thread 0) refuses them
        k, v = (t.transpose(3, 4).contiguous().transpose(3, 4) for t in (cache.k, cache.v))
        with pytest.raises(RuntimeError, match="contiguous in the head dim"):
            run(k, v)
        out = run(cache.k, cache.v)
        assert out.shape == h.shape and torch.isfinite(out).all()
        assert mod.team_settings()[2] - before == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("hidden", [200, 1000])  # a tail past the 8-lane vectors; more than 16 rows of them
def test_bf16_layers_of_odd_widths_equal_python(hidden, monkeypatch):
    """bf16 layers whose norms, rope and cache writes run without ATen calls give the Python path's bits
    at widths that are not a multiple of the vector sizes."""
    m = _in_format(random_model(dict(hidden_size=hidden, intermediate_size=136), seed=6, scale=2.0), "bf16")
    want = _calls(m, False, monkeypatch)
    got = _calls(m, True, monkeypatch)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"output {i} differs"


def test_layer_args_follow_a_change_of_format():
    """``layer_args`` keeps the arguments per model and layer range, and makes them again when a
    projection is packed, unpacked or given a new weight: the C++ never reads a weight that is gone."""
    m = random_model("llama-gqa-tied", seed=2)
    first = native.layer_args(m, 0, 2)  # (norms, kinds, weights, ...): one entry per projection
    assert first is not None and native.layer_args(m, 0, 2) is first
    lin = m.layers[1].mlp.down
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    second = native.layer_args(m, 0, 2)
    assert second is not first and second[2][-1] is lin.weight and first[2][-1] is not lin.weight
    assert native.layer_args(m, 0, 2) is second
    if kernels.ONEDNN:
        lin.pack(kernels.OneDNNWeight(lin.weight.detach()))
        third = native.layer_args(m, 0, 2)
        assert third is not second and third[1][-1] != 0  # no longer a dense weight
        lin.unpack()
        assert native.layer_args(m, 0, 2)[1][-1] == 0
    assert native.layer_args(m, 1, 2) is not native.layer_args(m, 0, 2)
    before = native.layer_args(m, 0, 2)
    m.layers[1] = type(m.layers[1])(m.config)  # another layer: its own weights
    swapped = native.layer_args(m, 0, 2)
    assert swapped is not before and swapped[2][-1] is m.layers[1].mlp.down.weight
    m.to(torch.bfloat16)  # cast: the arguments hold the weights as they are now
    moved = native.layer_args(m, 0, 2)
    assert moved[2][-1] is m.layers[1].mlp.down.weight and moved[2][-1].dtype == torch.bfloat16
    assert all(w.dtype == torch.bfloat16 for w in moved[0])  # the norms too


@pytest.mark.parametrize("fmt", ["dense", "q4"])
def test_a_norm_weight_assigned_anew_reaches_the_native_layers(fmt, monkeypatch):
    """A layer norm given a new weight (assigned, not copied into) after the native layers ran: their next
    call reads the new weight, as the Python path does, not the one they were first given."""
    m = _in_format(random_model("llama-gqa-tied", seed=2), fmt)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        m(ids, cache=m.new_cache(1, 8))  # the native layers' arguments are made and kept
    for norm in (m.layers[0].attn_norm, m.layers[1].mlp_norm):
        norm.weight = torch.nn.Parameter(norm.weight.detach() * 3, requires_grad=False)
        with torch.inference_mode():
            got = m(ids, cache=m.new_cache(1, 8))
            monkeypatch.setattr(model_mod, "_native_ok", lambda h, lengths: False)
            want = m(ids, cache=m.new_cache(1, 8))
            monkeypatch.undo()
        assert torch.equal(got, want)


@pytest.mark.skipif(not kernels.blocks_available(), reason="no native block kernel")
def test_rms_norm_of_a_few_bf16_rows_is_one_native_call_with_the_same_bits(monkeypatch):
    """``RMSNorm`` on up to ``NATIVE_NORM_ROWS`` bf16 rows on a CPU outside autograd is decoder.cpp's
    ``rms_norm``: the bits of the ATen formula, contiguous or not; more rows, or autograd, stay in ATen."""
    if native.module() is None or not hasattr(native.module(), "rms_norm"):
        pytest.skip("the native module is not built")
    norm = model_mod.RMSNorm(96, 1e-5).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    calls = []
    real = native.module()

    class Spy:
        def __getattr__(self, name):
            if name != "rms_norm":
                return getattr(real, name)
            return lambda *args: calls.append(1) or real.rms_norm(*args)

    monkeypatch.setattr(native, "module", lambda: Spy())
    for rows in (1, 3, model_mod.NATIVE_NORM_ROWS, model_mod.NATIVE_NORM_ROWS + 1):
        x = (torch.randn(rows, 2, 96, generator=g) * 4).to(torch.bfloat16)[:, 1]  # not contiguous
        want = norm.weight * F.rms_norm(x.float(), (96,), eps=1e-5).to(torch.bfloat16)
        calls.clear()
        with torch.inference_mode():
            got = norm(x)
        assert torch.equal(got, want)
        assert calls == ([1] if rows <= model_mod.NATIVE_NORM_ROWS else [])
    calls.clear()
    assert torch.equal(norm(x[:2]), norm.weight * F.rms_norm(x[:2].float(), (96,), eps=1e-5).to(torch.bfloat16))
    assert calls == []  # autograd on: ATen


def test_eagle_step_equals_the_torch_draft_and_keeps_eagle_and_auto_exact(monkeypatch):
    """In a q4 model whose EAGLE head and draft vocabulary are held as 8-bit blocks, one native call
    (``EagleHead.native_step``) gives the torch path's next states and draft logits bit for bit, the
    same chains, and eagle and auto stay q4 greedy token for token."""
    from layerleap import generate
    from layerleap.drafters import draft_vocab as dv, medusa_transfer
    from layerleap.drafters.eagle import EagleChains

    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    monkeypatch.setattr(kernels, "q8_products_faster", lambda ws: True)
    monkeypatch.setattr(kernels, "draft_head_q8", lambda w: w.shape[1] % kernels.GROUP == 0)
    q4 = quantize_model(random_model("llama-gqa-tied", seed=5, scale=2.0))
    assert q4.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    head = medusa_transfer.new_drafter(q4, "eagle")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    head.eval().requires_grad_(False)  # frozen, as loaded drafters are
    V = q4.config.vocab_size
    vocab = dv.DraftVocab(q4, torch.arange(0, V, 2))
    assert vocab.head.q8 is not None
    with torch.inference_mode():
        step = head.native_step(vocab)
        assert step is not None and head.native_step(vocab) is step  # made once
        assert head.native_step(None) is None  # the full vocabulary: the torch path
        z = q4.final_norm(torch.randn(3, q4.config.hidden_size, generator=g).to(torch.bfloat16))
        x = torch.randint(0, V, (3,), generator=g)
        want_z = q4.final_norm(head.step(z, x))
        got_z, got = step(z, x)
        assert torch.equal(got_z, want_z) and torch.equal(got, vocab.logits(want_z))
    with torch.no_grad():  # a weight changed in place: the step is made again from the new weight
        head.down.weight.mul_(0.5)
        again = head.native_step(vocab)
        assert again is not None and again is not step and head.native_step(vocab) is again
        z2, _ = again(z, x)
        assert torch.equal(z2, q4.final_norm(head.step(z, x))) and not torch.equal(z2, got_z)
        step = again
    with torch.enable_grad():
        assert head.native_step(vocab) is None  # autograd: the torch path

    class Gen:
        eos_ids, stop_at_eos, do_sample = (), False, False

    run = type("R", (), {"model": q4, "gen": Gen()})()
    states = list(torch.randn(3, q4.config.hidden_size, generator=g).to(torch.bfloat16))
    chains = EagleChains(run, head, 4, vocab, width=2)
    native_chains = chains.draft(states, [3, 8, 11], [4, 2, 3])
    monkeypatch.setattr(type(head), "native_step", lambda self, vocab: None)
    assert chains.draft(states, [3, 8, 11], [4, 2, 3]) == native_chains
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "q8_products_faster", lambda ws: True)
    monkeypatch.setattr(kernels, "draft_head_q8", lambda w: w.shape[1] % kernels.GROUP == 0)

    calls = []
    real = type(head).native_step

    def spy(self, vocab):
        out = real(self, vocab)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(type(head), "native_step", spy)
    prompt = [5, 9, 2, 7, 5, 9]
    want = generate(q4, prompt, "greedy", 16, stop_at_eos=False).token_ids
    for method, opts in (("eagle", {"eagle_head": head, "draft_len": 2, "width": 2}), ("auto", {"eagle": head})):
        calls.clear()
        got = generate(q4, prompt, method, 16, stop_at_eos=False, draft_vocab=vocab, **opts)
        assert got.token_ids == want, f"{method} with the native EAGLE step differs from q4 greedy"
        assert calls and all(calls), f"{method} did not draft with the native step"


@pytest.mark.skipif(not kernels.blocks_available(), reason="no native block kernel")
def test_native_logits_equal_the_final_norm_and_the_head(monkeypatch):
    """``Transformer.logits`` of a q4 model (bf16 rows, an 8-bit block head) in one native call gives the
    Python path's bits, ``unembed(final_norm(h))``, for one row, a chain and a batch; more rows than the
    fused rounding takes, or autograd, take the Python path."""
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    q4 = quantize_model(random_model("llama-gqa-tied", seed=5, scale=2.0))
    assert isinstance(q4.lm_head.packed, kernels.BlockWeight) and q4.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(3)
    D = q4.config.hidden_size
    with torch.inference_mode():
        for shape in ((1, 1, D), (1, 5, D), (2, 3, D), (4, D)):
            h = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
            assert q4._native_logits(h) is not None
            want = q4.unembed(q4.final_norm(h))
            got = q4.logits(h)
            assert got.dtype == torch.float32 and got.shape == want.shape and torch.equal(got, want)
        h = torch.randn(1, q4.NATIVE_LOGITS_ROWS + 1, D).to(torch.bfloat16)
        assert q4._native_logits(h) is None and torch.equal(q4.logits(h), q4.unembed(q4.final_norm(h)))
    with torch.enable_grad():
        assert q4._native_logits(torch.randn(1, 1, D).to(torch.bfloat16)) is None


@pytest.mark.skipif(not kernels.blocks_available(), reason="no native block kernel")
def test_logits_of_no_rows_are_empty_with_a_block_head(monkeypatch):
    """A call over no new tokens (``logits_from`` past the last, an empty id row) gives empty logits with a
    block LM head too, as every other head gives them."""
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    q4 = quantize_model(random_model("llama-gqa-tied", seed=5))
    assert isinstance(q4.lm_head.packed, kernels.BlockWeight)
    V, D = q4.config.vocab_size, q4.config.hidden_size
    with torch.inference_mode():
        for shape in ((1, 0, D), (2, 0, D), (0, D)):
            h = torch.zeros(shape, dtype=torch.bfloat16)
            assert q4.logits(h).shape == (*shape[:-1], V)
        assert q4(torch.tensor([[1, 2, 3]]), logits_from=3).shape == (1, 0, V)
        cache = q4.new_cache(1, 8)
        assert q4(torch.zeros(1, 0, dtype=torch.long), cache=cache).shape == (1, 0, V)
