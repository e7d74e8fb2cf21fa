"""Any GGUF file as a llama.cpp user has it: ``layerleap.load("model.gguf")`` on tiny random Llama,
Qwen2 and Mistral files written here with the ``gguf`` package (F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K, Q6_K tensors), their own tokenizer and chat template; a truncated file, an unsupported
architecture or tensor type gets one line naming it."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import layerleap
from layerleap.core import gguf_q4, kernels
from layerleap.core.config import ConfigError
from layerleap.core.kernels import MixedRows
from layerleap.core.loading import check_gguf
from layerleap.core.weight_files import ModelFileError

gguf = pytest.importorskip("gguf")

D, FF, LAYERS, HEADS, KV = 256, 512, 2, 4, 2  # 256: Q4_K/Q5_K/Q6_K super-blocks fit the rows
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, three special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte = sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "o Ġ"]
    tokens = byte + ["he", "ll", "hell", "oĠ", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, merges, types


def _raw_blocks(qtype, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize to: random codes, small finite fp16 scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_rows * n_cols // block, nbytes), dtype=np.uint8)
    halves = {
        gguf.GGMLQuantizationType.Q4_K: (0, 2),
        gguf.GGMLQuantizationType.Q5_K: (0, 2),
        gguf.GGMLQuantizationType.Q6_K: (nbytes - 2, 1),
    }[qtype]
    start, n = halves
    raw[:, start : start + 2 * n] = (rng.random((raw.shape[0], n)) * 0.002 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # 16 signed 8-bit sub-block scales: keep them small
        raw[:, 192:208] = rng.integers(1, 8, (raw.shape[0], 16), dtype=np.uint8)
    return raw.reshape(n_rows, -1)


def write_gguf(
    path: Path,
    qtype: str = "Q4_0",
    arch: str = "llama",
    head: str | None = None,
    seed: int = 0,
    rope_theta: float = 10000.0,
    tensor_types: dict[str, str] | None = None,
    edit=None,
) -> Path:
    """A tiny random model as a GGUF file: layer matrices in ``qtype`` (or ``tensor_types[name]``, e.g.
    ``{"blk.0.attn_v": "Q6_K"}``), the embedding in Q8_0 (tied) or ``head`` (an untied output matrix
    in that type), norms in F32.  ``edit(writer)`` runs before the file is written: metadata and
    tensors to add, replace or remove (``writer.kv_data[0]``, ``writer.tensors[0]``)."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _vocab()
    V, hd = len(tokens), D // HEADS
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(V - 2)
    w.add_eos_token_id(V - 1)
    w.add_chat_template(TEMPLATE)
    Q = gguf.GGMLQuantizationType

    def add(name: str, shape: tuple[int, int], kind: str) -> None:
        t = Q[kind]
        if t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            w.add_tensor(name, _raw_blocks(t, *shape, rng), raw_dtype=t)
            return
        dense = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if t == Q.F32:
            w.add_tensor(name, dense)
        elif t == Q.F16:
            w.add_tensor(name, dense.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(dense, t), raw_dtype=t)

    add("token_embd.weight", (V, D), "Q8_0")
    if head:
        add("output.weight", (V, D), head)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    for i in range(LAYERS):
        for name, shape in (
            ("attn_q", (HEADS * hd, D)),
            ("attn_k", (KV * hd, D)),
            ("attn_v", (KV * hd, D)),
            ("attn_output", (D, HEADS * hd)),
            ("ffn_gate", (FF, D)),
            ("ffn_up", (FF, D)),
            ("ffn_down", (D, FF)),
        ):
            add(f"blk.{i}.{name}.weight", shape, (tensor_types or {}).get(f"blk.{i}.{name}", qtype))
        if arch == "qwen2":
            for name, n in (("attn_q", HEADS * hd), ("attn_k", KV * hd), ("attn_v", KV * hd)):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    blocks = kernels.blocks_available()  # the native module, found (and kept) in the real cache first
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(kernels.KERNEL_ENV, "dense")  # skip the one-time kernel measurements
    monkeypatch.setenv(kernels.Q4_ENV, "blocks" if blocks else "torch")


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_common_type_loads_dense_and_q4(tmp_path, qtype):
    """Q5_0 and Q5_1 are in every Q4_K_M and Q5_K_M file of a model whose rows are not whole super-blocks
    of 256 (llama.cpp's fallback: the packaged Qwen2.5-Coder-0.5B's 896-wide layers and embedding)."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    msgs = []
    dense = layerleap.load(str(path), dtype="float32", progress=msgs.append)
    q4 = layerleap.load(str(path), dtype="q4", progress=msgs.append)
    assert q4.dtype_name == "q4" and q4.fingerprint == dense.fingerprint
    assert dense.config.n_layers == LAYERS and dense.config.hidden_size == D
    kept = qtype in ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
    note = [m for m in msgs if m.startswith("4-bit weights")]
    assert len(note) == 1 and (("re-quantized" in note[0]) != kept) and (kept or qtype in note[0])
    kept = kept and (qtype != "Q6_K" or kernels.blocks_available())  # torch's int4 kernel re-quantizes Q6_K
    if kept:  # blocks kept as stored: the q4 model holds the dense model's values exactly
        for a, b in zip(q4.projections()[:-1], dense.projections()[:-1]):
            assert torch.equal(a.dense_weight().float(), b.dense_weight().float())
    ids = q4.tokenizer.encode("hello hello")
    a, b = _logits(dense, ids), _logits(q4, ids)
    assert (a - b).abs().max() < (0.1 if kept else 0.3) * a.abs().max()  # re-quantized: 4-bit min-max error
    again = []
    layerleap.load(str(path), dtype="q4", progress=again.append)  # the cache: no conversion message
    assert not any(m.startswith("4-bit weights") for m in again)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_and_mistral_files_with_an_untied_head(tmp_path, arch):
    """llama.cpp writes Mistral models under the ``llama`` architecture (rope theta 1e6 here)."""
    path = write_gguf(
        tmp_path / f"tiny-{arch}.gguf",
        "Q4_K",
        arch="qwen2" if arch == "qwen2" else "llama",
        head="Q6_K",
        rope_theta=1e6 if arch == "mistral" else 1e4,
    )
    msgs = []
    dense = layerleap.load(str(path), dtype="float32", progress=msgs.append)
    q4 = layerleap.load(str(path), dtype="q4", progress=msgs.append)
    assert dense.config.qkv_bias == (arch == "qwen2") and dense.config.rope_theta == (1e6 if arch == "mistral" else 1e4)
    assert not dense.config.tie_embeddings
    assert any("lm_head.weight (Q6_K)" in m for m in msgs)
    if kernels.blocks_available():  # the 6-bit head as stored
        assert q4.lm_head.packed.bits == 6 and torch.equal(q4.lm_head.dense_weight(), dense.lm_head.dense_weight())
    ids = q4.tokenizer.encode("hello")
    a, b = _logits(dense, ids), _logits(q4, ids)
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.skipif(not kernels.blocks_available(), reason="the native block kernel is not built")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_lossless_methods_equal_greedy_on_q4_k_and_q6_k_blocks(tmp_path, qtype):
    """Q4_K layers (super-block scales) or Q6_K layers (6-bit blocks), a Q6_K head: every call size gives
    a row the same bits, so drafting methods equal greedy decoding token for token."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, arch="qwen2", head="Q6_K", seed=4)
    q4 = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    draft = layerleap.load(str(write_gguf(tmp_path / "draft.gguf", "Q4_K", head="Q6_K", seed=5)), dtype="q4")
    assert {lin.packed.bits for lin in q4.projections()} == ({4, 6} if qtype == "Q4_K" else {6})
    assert {lin.packed.dm.dtype for lin in q4.projections()} == {torch.uint8}
    ids = q4.tokenizer.encode("hello hello hell hello he")
    want = layerleap.generate(q4, ids, "greedy", 16, stop_at_eos=False).token_ids
    for method, options in (
        ("prompt-lookup", {"draft_len": 4, "max_ngram": 2}),
        ("speculative", {"draft": draft, "draft_len": 4, "min_confidence": 0.0}),
        ("self-spec", {"exit_layer": 1, "draft_len": 3, "head": "shared"}),
    ):
        assert layerleap.generate(q4, ids, method, 16, stop_at_eos=False, **options).token_ids == want, method


MIXED = {"blk.0.attn_v": "Q6_K", "blk.1.attn_k": "Q6_K", "blk.1.ffn_up": "Q6_K"}  # Q4_K_M's mix, and more


@pytest.mark.parametrize("kernel", ["blocks", "torch"])
def test_weights_fused_from_mixed_block_types_keep_every_part(tmp_path, monkeypatch, kernel):
    """Q4_K_M files store some layers' ``attn_q``/``attn_k`` in Q4_K and ``attn_v`` in Q6_K: the fused
    qkv (and q/k/v in three runs, a gate/up pair) keeps each part in the file's own blocks, nothing is
    re-quantized; with the block kernel the q4 model holds the file's dequantized values exactly, and
    with either kernel its logits are as close to the dense model's as the other kept types' (also
    from the packed cache; beside torch's int4 kernel the Q6_K parts are re-quantized at load)."""
    if not (kernels.blocks_available() if kernel == "blocks" else kernels.int4_supported()):
        pytest.skip(f"no {kernel} kernel here")
    monkeypatch.setenv(kernels.Q4_ENV, kernel)
    path = write_gguf(tmp_path / "mixed.gguf", "Q4_K", arch="qwen2", head="Q6_K", seed=6, tensor_types=MIXED)
    msgs = []
    dense = layerleap.load(str(path), dtype="float32", progress=msgs.append)
    q4 = layerleap.load(str(path), dtype="q4", progress=msgs.append)
    note = [m for m in msgs if m.startswith("4-bit weights")]
    assert len(note) == 1 and "re-quantized" not in note[0]
    weights, meta = gguf_q4.read(next((tmp_path / "cache").glob("gguf-mixed-*-q4")))
    assert json.loads(meta["requantized"]) == {}
    kinds = {k: [type(p).__name__ for p in w.parts] for k, w in weights.items() if isinstance(w, MixedRows)}
    assert kinds == {
        "layers.0.attn.qkv.weight": ["QuantizedRows", "Q6Rows"],
        "layers.1.attn.qkv.weight": ["QuantizedRows", "Q6Rows", "QuantizedRows"],
        "layers.1.mlp.gate_up.weight": ["QuantizedRows", "Q6Rows"],
    }
    want = dense.dense_state()
    for k in kinds:  # the file's own values, as gguf dequantizes them
        assert torch.equal(weights[k].dense(), want[k]), k
    if kernel == "blocks":
        assert [p.bits for p in q4.layers[1].attn.qkv.packed.parts] == [4, 6, 4]
        for a, b in zip(q4.projections(), dense.projections()):
            assert torch.equal(a.dense_weight().float(), b.dense_weight().float())
    ids = q4.tokenizer.encode("hello hello")
    a, b = _logits(dense, ids), _logits(q4, ids)
    assert (a - b).abs().max() < 0.1 * a.abs().max()  # as test_every_common_type_loads_dense_and_q4's kept types
    again = layerleap.load(str(path), dtype="q4", progress=msgs.append)  # from the packed cache
    assert torch.equal(_logits(again, ids), b) and type(again.layers[0].attn.qkv.packed) is type(
        q4.layers[0].attn.qkv.packed
    )


@pytest.mark.skipif(not kernels.blocks_available(), reason="the native block kernel is not built")
def test_the_packed_cache_reads_block_weights_straight_into_huge_pages(tmp_path, monkeypatch):
    """A load from the packed cache reads every block weight's codes and scales (a fused weight's
    parts too) into one huge-page arena as it reads the file, so the weights are never held twice;
    the model gives the logits of the first load, which moved them there after building them."""
    import mmap

    from layerleap.core.cpu import HUGE_PAGE
    from layerleap.core.kernels import BlockWeight, StackWeight

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no transparent huge pages here")
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    path = write_gguf(tmp_path / "mixed.gguf", "Q4_K", arch="qwen2", head="Q6_K", seed=6, tensor_types=MIXED)
    first = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    ids = first.tokenizer.encode("hello hello")
    monkeypatch.setattr(kernels, "to_huge_pages", lambda formats: pytest.fail("moved after the read"))
    again = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    blocks = {
        id(b): b
        for m in again.modules()
        if isinstance(getattr(m, "packed", None), (BlockWeight, StackWeight))
        for b in (m.packed.parts if isinstance(m.packed, StackWeight) else [m.packed])
    }.values()
    storages = {t.untyped_storage().data_ptr() for b in blocks for t in (b.codes, b.dm)}
    assert len(blocks) > 4 and len(storages) == 1
    assert min(t.data_ptr() for b in blocks for t in (b.codes, b.dm)) % HUGE_PAGE == 0
    assert torch.equal(_logits(again, ids), _logits(first, ids))


def test_a_folder_that_re_quantized_mixed_parts_is_converted_again(tmp_path):
    from safetensors.torch import load_file

    from layerleap.files import read_safetensors_meta, save_safetensors

    path = write_gguf(tmp_path / "mixed.gguf", "Q4_K", seed=6, tensor_types=MIXED)
    layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    folder = next((tmp_path / "cache").glob("gguf-mixed-*-q4"))
    file = folder / gguf_q4.WEIGHTS
    meta = read_safetensors_meta(file)
    del meta["mixed"]
    meta["requantized"] = json.dumps({"layers.0.attn.qkv.weight": "fused from mixed types"})
    save_safetensors(file, load_file(str(file)), meta)  # as an older conversion wrote it
    with pytest.raises(ModelFileError, match="re-quantized its weights fused from mixed block types"):
        gguf_q4.check(folder)
    msgs = []
    layerleap.load(str(path), dtype="q4", progress=msgs.append)
    assert any("rebuilding it" in m for m in msgs) and any(m.startswith("4-bit weights") for m in msgs)
    gguf_q4.check(folder)


@pytest.mark.skipif(not kernels.blocks_available(), reason="the native block kernel is not built")
def test_mixed_parts_give_native_and_python_layers_the_same_bits_and_methods_equal_greedy(tmp_path, monkeypatch):
    from layerleap.core import model as model_mod, native

    path = write_gguf(tmp_path / "mixed.gguf", "Q4_K", arch="qwen2", head="Q6_K", seed=7, tensor_types=MIXED)
    q4 = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    ids = torch.tensor([q4.tokenizer.encode("hello hello hell")])

    def calls(native_on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(model_mod, "_native_ok", real if native_on else (lambda h, lengths: False))
        cache = q4.new_cache(1, 40)
        with torch.inference_mode():
            out = [q4(ids, cache=cache), q4(ids[:, :1], cache=cache), q4(ids[:, :4], cache=cache)]
        return [*out, cache.k.clone(), cache.v.clone()]

    real = model_mod._native_ok
    assert native.layer_args(q4, 0, LAYERS) is not None  # the C++ layers take the stacked weights
    for a, b in zip(calls(False), calls(True)):
        assert torch.equal(a, b)
    monkeypatch.setattr(model_mod, "_native_ok", real)
    want = layerleap.generate(q4, ids[0].tolist(), "greedy", 16, stop_at_eos=False).token_ids
    got = layerleap.generate(q4, ids[0].tolist(), "prompt-lookup", 16, stop_at_eos=False, draft_len=4, max_ngram=2)
    assert got.token_ids == want


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    m = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    tok = m.tokenizer
    assert tok.decode(tok.encode("hello world")) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = layerleap.generate(m, "hello", max_new_tokens=5, chat=True, stop_at_eos=False)
    assert len(out.token_ids) == 5


def test_a_truncated_file_is_named_before_any_tensor_is_read(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFileError, match="cut.gguf is truncated: tensor .* download it again"):
        layerleap.load(str(cut), dtype="q4")
    cut.write_bytes(data[:100])
    with pytest.raises(ModelFileError, match="the GGUF header is cut short or corrupt"):
        layerleap.load(str(cut))
    cut.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelFileError, match="magic bytes: it is not a GGUF file"):
        layerleap.load(str(cut))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("gguf-*"))


def test_unsupported_architecture_or_type_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", "Q4_0", arch="falcon")
    with pytest.raises(ConfigError, match="architecture 'falcon' is not supported") as e:
        check_gguf(path)
    assert "\n" not in str(e.value)
    Q2_K = gguf.GGMLQuantizationType.Q2_K

    def q2_k(w):
        w.tensors[0].pop("blk.0.ffn_up.weight")
        block, nbytes = gguf.GGML_QUANT_SIZES[Q2_K]
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((FF, D // block * nbytes), np.uint8), raw_dtype=Q2_K)

    path = write_gguf(tmp_path / "q2_k.gguf", "Q4_0", edit=q2_k)
    with pytest.raises(
        ConfigError, match="tensor blk.0.ffn_up.weight is of GGUF type Q2_K, which layerleap does not read"
    ) as e:
        layerleap.load(str(path), dtype="q4")
    assert "\n" not in str(e.value)


def test_cli_takes_a_gguf_path(tmp_path, capsys):
    from layerleap.cli import main

    path = write_gguf(tmp_path / "tiny.gguf", "Q4_1")
    code = main(
        ["generate", "--model", str(path), "--dtype", "q4", "--prompt", "hello", "--max-new-tokens", "3", "--json"]
    )
    out = capsys.readouterr()
    assert code == 0 and json.loads(out.out)["stats"]["new_tokens"] == 3
    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err


def _drop(key: str):
    return lambda w: w.kv_data[0].pop(key)


def _set(key: str, value, kind: str = "UINT32"):
    return lambda w: w.add_key_value(key, value, gguf.GGUFValueType[kind])


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (_drop("tokenizer.ggml.tokens"), ModelFileError, r"has no token list \(tokenizer.ggml.tokens\)"),
        (_set("tokenizer.ggml.model", "bert", "STRING"), ConfigError, r"GGUF tokenizer 'bert' .* is not supported"),
        (_set("general.alignment", 0), ModelFileError, "general.alignment is 0, not a power of two"),
        (_set("tokenizer.ggml.eos_token_id", 10**6), ModelFileError, r"metadata cannot be read \(IndexError: "),
    ],
    ids=["no token list", "bert tokenizer", "alignment 0", "end token past the list"],
)
def test_metadata_transformers_cannot_read_is_one_line(tmp_path, edit, error, match):
    path = write_gguf(tmp_path / "bad.gguf", "Q4_0", edit=edit)
    for dtype in ("float32", "q4"):
        with pytest.raises(error, match=match) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert "\n" not in str(e.value) and "bad.gguf" in str(e.value)


@pytest.mark.parametrize(
    "edit, what",
    [
        (_set("llama.rope.scaling.type", "linear", "STRING"), r"'linear' \(llama.rope.scaling.type\)"),
        (_set("llama.rope.scaling.type", "yarn", "STRING"), r"'yarn' \(llama.rope.scaling.type\)"),
        (_set("llama.rope.scaling.factor", 4.0, "FLOAT32"), r"'linear' \(llama.rope.scaling.factor 4.0\)"),
        (
            lambda w: w.add_tensor("rope_freqs.weight", np.ones(D // HEADS // 2, np.float32)),
            r"'llama3' \(tensor rope_freqs.weight\)",
        ),
    ],
    ids=["linear", "yarn", "factor alone", "rope_freqs"],
)
def test_rope_scaling_is_refused_not_ignored(tmp_path, edit, what):
    """A folder's config.json with rope scaling is refused (``ModelConfig.from_hf``); a GGUF's is too."""
    path = write_gguf(tmp_path / "scaled.gguf", "Q4_0", edit=edit)
    for dtype in ("float32", "q4"):
        with pytest.raises(ConfigError, match=f"scaled.gguf: unsupported rope scaling {what}: only the default"):
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
    plain = write_gguf(tmp_path / "plain.gguf", "Q4_0", edit=_set("llama.rope.scaling.type", "none", "STRING"))
    check_gguf(plain)


def test_linear_rope_scaling_by_one_is_the_default_embedding(tmp_path):
    """Linear scaling by a factor of 1 divides the positions by 1: taken, and the logits are the plain file's."""

    def edit(w):
        _set("llama.rope.scaling.type", "linear", "STRING")(w)
        _set("llama.rope.scaling.factor", 1.0, "FLOAT32")(w)

    plain, unscaled = write_gguf(tmp_path / "plain.gguf", "Q4_0"), write_gguf(tmp_path / "one.gguf", "Q4_0", edit=edit)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    for dtype in ("float32", "q4"):
        a, b = (layerleap.load(str(p), dtype=dtype, progress=lambda s: None) for p in (plain, unscaled))
        with torch.inference_mode():
            torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)


@pytest.mark.parametrize("key_length", [False, True], ids=["head from tensors", "key_length"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rotary_embedding_of_part_of_each_head_is_refused_not_ignored(tmp_path, arch, key_length):
    """llama.cpp rotates the first rope.dimension_count values of each head; `transformers` ignores the
    key for qwen2 (rotating the whole head: other logits) and takes it for the head size for llama
    (a shape error that blames the file)."""
    hd = D // HEADS

    def edit(w):
        w.add_rope_dimension_count(hd // 2)
        if key_length:
            w.add_key_length(hd)

    path = write_gguf(tmp_path / "partial.gguf", "Q4_0", arch=arch, edit=edit)
    for dtype in ("float32", "q4"):
        with pytest.raises(ConfigError, match=rf"partial.gguf: rotary embedding of {hd // 2} of each head.s {hd}") as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert f"{arch}.rope.dimension_count" in str(e.value) and "\n" not in str(e.value)
    check_gguf(write_gguf(tmp_path / "whole.gguf", "Q4_0", arch=arch, edit=lambda w: w.add_rope_dimension_count(hd)))


def _tensor(name: str, shape: tuple[int, int], qtype: str):
    """Replace tensor ``name`` by one of ``shape`` (rows, columns) in ``qtype``."""

    def edit(w):
        w.tensors[0].pop(name)
        t = gguf.GGMLQuantizationType[qtype]
        dense = np.random.default_rng(1).standard_normal(shape).astype(np.float32) / 16
        w.add_tensor(name, gguf.quants.quantize(dense, t), raw_dtype=t)

    return edit


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_tensor_of_another_shape_is_the_same_one_line_in_every_dtype(tmp_path, qtype):
    """The 4-bit conversion compares a tensor's shape with the config's before reshaping its blocks
    (Q4_0: kept as blocks; Q8_0: an 8-bit embedding, a re-quantized layer)."""
    V = len(_vocab()[0])
    wide = write_gguf(tmp_path / "wide.gguf", edit=_tensor("blk.0.ffn_down.weight", (D, FF + 256), qtype))
    big = write_gguf(tmp_path / "big.gguf", edit=_tensor("token_embd.weight", (V + 5, D), qtype))
    wide_error = (
        rf"wide.gguf: GGUF tensor blk.0.ffn_down.weight -> .* has shape \({D}, {FF + 256}\), expected \({D}, {FF}\)"
    )
    big_error = rf"has shape \({V + 5}, {D}\), expected \({V}, {D}\) \(a row per token: the tokenizer has {V} tokens\)"
    for dtype in ("q4", "float32"):
        with pytest.raises(ConfigError, match=wide_error + ": the file's tensors and metadata disagree"):
            layerleap.load(str(wide), dtype=dtype, progress=lambda s: None)
        with pytest.raises(ConfigError, match=big_error):
            layerleap.load(str(big), dtype=dtype, progress=lambda s: None)


def test_a_token_list_longer_than_the_embedding_is_refused(tmp_path):
    V = len(_vocab()[0])

    def edit(w):
        w.add_vocab_size(V - 5)  # the config's vocab_size, which the embedding matches
        w.add_eos_token_id(V - 10)
        _tensor("token_embd.weight", (V - 5, D), "Q8_0")(w)

    path = write_gguf(tmp_path / "short.gguf", edit=edit)
    for dtype in ("q4", "float32"):
        with pytest.raises(ConfigError, match=f"short.gguf: the tokenizer has {V} tokens, the embedding {V - 5} rows"):
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)


@pytest.mark.parametrize("chunks", [False, True], ids=["one file", "chunks"])
def test_a_damaged_packaged_model_is_checked_and_names_its_packages(tmp_path, monkeypatch, chunks):
    from layerleap.core import loading

    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()[:-1000]  # a truncated download
    site = tmp_path / "site"
    mods = ("fake_chunks1", "fake_chunks2") if chunks else ("fake_model",)
    for i, m in enumerate(mods):
        (site / m / "data").mkdir(parents=True)
        (site / m / "__init__.py").write_text("")
        part = data[: len(data) // 2] if i == 0 else data[len(data) // 2 :]
        (site / m / "data" / f"part{i + 1}.bin").write_bytes(part if chunks else data)
    pm = loading.PackagedModel("fake", "Fake", mods, None if chunks else "data/part1.bin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(loading.PACKAGED, "fake", pm)
    where = "fake's 2 chunks, joined," if chunks else str(site / "fake_model" / "data" / "part1.bin")
    fix = "reinstall its 2 packages (fake-chunks1 … fake-chunks2)" if chunks else "reinstall its package: pip"
    for dtype in ("float32", "q4"):
        with pytest.raises(ModelFileError) as e:
            layerleap.load("fake", dtype=dtype, progress=lambda s: None)
        assert re.fullmatch(
            rf"{re.escape(where)} is truncated: tensor .*, the file has \d+: {re.escape(fix)}.*", str(e.value)
        )


def test_a_failed_weights_write_is_a_clear_error_and_the_packed_cache_is_best_effort(tmp_path, monkeypatch):
    """A full disk makes safetensors raise its own ``SafetensorError``: converting a file then fails
    with a one-line error, while the packed 4-bit cache is only skipped (the model still loads)."""
    import safetensors.torch
    from safetensors import SafetensorError

    from layerleap.errors import LayerleapError

    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if "packed-" in filename or "model-" in filename:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(LayerleapError, match=r"cannot write .*model-00001.safetensors: .*No space left on device"):
        layerleap.load(str(path), dtype="float32", progress=lambda s: None)
    q4 = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert q4.dtype_name == "q4" and not list((tmp_path / "cache").glob("gguf-tiny-*-q4/packed-*"))


@pytest.mark.parametrize("raised", ["OSError", "tokenizers' Exception"])
def test_a_tokenizer_that_cannot_be_saved_into_the_cache_is_one_line_with_the_fix(tmp_path, monkeypatch, raised):
    """A full disk while the tokenizer files are written: Python's writes raise ``OSError``, the `tokenizers`
    library's (tokenizer.json) a plain ``Exception``; either is the cache entry named with the fix, and
    the conversion leaves nothing behind."""
    import errno

    import transformers

    from layerleap.errors import LayerleapError

    def full_disk(self, *args, **kwargs):
        if raised == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise Exception("No space left on device (os error 28)")

    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", full_disk)
    cache = tmp_path / "cache"
    for dtype, suffix in (("float32", ""), ("q4", "-q4")):
        with pytest.raises(LayerleapError) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        (entry,) = {m[1] for m in re.finditer(r"cannot write (\S+):", str(e.value))}
        assert Path(entry).parent == cache and entry.endswith(suffix) and not Path(entry).exists()
        assert str(e.value) == (
            f"cannot write {entry}: No space left on device; "
            "free space on its disk, or set LAYERLEAP_CACHE to a writable folder with room"
        )
        assert sorted(p.name for p in cache.iterdir()) == [".locks"]


def test_the_packed_cache_leaves_no_temporary_when_interrupted_or_killed(tmp_path, monkeypatch):
    """Ctrl-C while the packed 4-bit cache is written removes its temporary file; the one a killed
    process left (its process gone) is removed by the next load that writes the packed cache."""
    import subprocess
    import sys

    import safetensors.torch

    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    (folder,) = (tmp_path / "cache").glob("gguf-tiny-*-q4")
    (packed,) = folder.glob("packed-*")
    files = sorted(p.name for p in folder.iterdir())
    real = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt

    packed.unlink()
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert sorted(p.name for p in folder.iterdir()) == sorted(set(files) - {packed.name})

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    killed = folder / f".{packed.stem}.{dead}.tmp{packed.suffix}"
    killed.write_bytes(b"half a file")
    layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert sorted(p.name for p in folder.iterdir()) == files


def test_a_cache_folder_that_cannot_be_used_is_one_line(tmp_path, monkeypatch):
    from layerleap.errors import LayerleapError

    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "a-file"))
    for dtype in ("float32", "q4"):
        with pytest.raises(LayerleapError) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        fix = "set LAYERLEAP_CACHE to a writable folder"
        assert str(e.value) == f"cannot use the cache folder {tmp_path / 'a-file'}: Not a directory; {fix}"


@pytest.mark.parametrize("damage", ["tokenizer.json {}", "no tokenizer.json", "no tokenizer files"])
def test_a_cache_entry_whose_tokenizer_does_not_load_is_rebuilt(tmp_path, damage):
    """A cache entry is derived data: one without a tokenizer that loads is converted again, in either dtype."""
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    for dtype, pattern in (("float32", "gguf-tiny-*[0-9a-f]"), ("q4", "gguf-tiny-*-q4")):
        layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        (folder,) = (tmp_path / "cache").glob(pattern)
        if damage == "tokenizer.json {}":
            (folder / "tokenizer.json").write_text("{}")
        else:
            (folder / "tokenizer.json").unlink()
        if damage == "no tokenizer files":
            (folder / "tokenizer_config.json").unlink()
        msgs = []
        model = layerleap.load(str(path), dtype=dtype, progress=msgs.append)
        assert f"the cached conversion {folder} has no tokenizer that loads: rebuilding it" in msgs
        assert model.tokenizer.decode(model.tokenizer.encode("hello world")) == "hello world"
        assert (folder / "tokenizer.json").is_file()


def test_a_tensor_whose_rows_are_not_whole_blocks_is_named(tmp_path):
    data = bytearray(write_gguf(tmp_path / "tiny.gguf", "Q4_0").read_bytes())
    name = b"token_embd.weight"
    at = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4  # the name, its number of dims
    assert struct.unpack_from("<Q", data, at) == (D,)
    struct.pack_into("<Q", data, at, D - 6)  # a corrupt header: rows of 250 values in blocks of 32
    path = tmp_path / "rows.gguf"
    path.write_bytes(data)
    for dtype in ("float32", "q4"):
        with pytest.raises(ModelFileError) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert str(e.value) == (
            f"{path}: tensor token_embd.weight has rows of {D - 6} values, not a multiple of Q8_0's blocks of 32: "
            "the file is corrupt, download it again"
        )


def test_a_killed_conversions_leftovers_are_removed_whatever_the_file_is_called(tmp_path):
    path = write_gguf(tmp_path / "m[1].gguf", "Q4_0")  # glob's brackets in the cache entry's name
    layerleap.load(str(path), progress=lambda s: None)
    (folder,) = (tmp_path / "cache").glob("gguf-*")
    leftover = folder.parent / f".{folder.name}.killed"
    leftover.mkdir()
    layerleap.load(str(path), progress=lambda s: None)
    assert not leftover.exists()


def test_a_mixture_of_experts_file_is_refused_before_any_tensor_is_read(tmp_path):
    path = write_gguf(tmp_path / "mixtral.gguf", "Q4_0", edit=lambda w: w.add_expert_count(8))
    with pytest.raises(ConfigError) as e:
        layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert str(e.value) == (
        "mixtral.gguf: a mixture-of-experts model (llama.expert_count 8): layerleap runs dense decoders only"
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("gguf-*"))


@pytest.mark.parametrize("part", [0, 1])
def test_one_part_of_a_split_file_is_named_before_any_tensor_is_read(tmp_path, part):
    """llama.cpp's gguf-split writes a model as several files: one of them is refused with the fix, not
    converted to the end and then found to lack the other parts' tensors (or, past the first part, the
    metadata)."""

    def split(w):
        w.add_uint16("split.no", part)
        w.add_uint16("split.count", 2)
        for name in [n for n in w.tensors[0] if n.startswith("blk.1.")]:
            w.tensors[0].pop(name)

    path = write_gguf(tmp_path / f"tiny-0000{part + 1}-of-00002.gguf", edit=split)
    for dtype in ("float32", "q4"):
        with pytest.raises(ConfigError) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert str(e.value) == (
            f"{path.name} is part {part + 1} of a GGUF model split into 2 files: merge them into one with "
            "llama.cpp (llama-gguf-split --merge FIRST-PART merged.gguf) and load the merged file"
        )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("gguf-*"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_file_without_head_count_kv_has_as_many_kv_heads_as_heads(tmp_path, monkeypatch, arch):
    """llama.cpp reads a missing ``{arch}.attention.head_count_kv`` as ``head_count`` (no grouped-query
    attention); `transformers`' Qwen2 default of 32 key/value heads is not the file's."""
    monkeypatch.setitem(globals(), "KV", HEADS)
    path = write_gguf(tmp_path / f"mha-{arch}.gguf", "Q4_0", arch=arch, edit=_drop(f"{arch}.attention.head_count_kv"))
    for dtype in ("float32", "q4"):
        model = layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert model.config.n_kv_heads == model.config.n_heads == HEADS
        assert len(layerleap.generate(model, "hello", max_new_tokens=3, stop_at_eos=False).token_ids) == 3


def test_q4_of_a_model_whose_layer_sizes_are_not_whole_groups_is_one_line_with_the_fix(tmp_path, monkeypatch):
    """Rows of 4-bit groups of 32: a GGUF file (or a folder) with an intermediate size of 80 loads in
    float32, and dtype q4 names the file, the size and the dtypes that load it, before any tensor is read."""
    monkeypatch.setitem(globals(), "FF", 80)
    path = write_gguf(tmp_path / "odd.gguf", "F16")
    layerleap.load(str(path), dtype="float32", progress=lambda s: None)
    why = "dtype q4 multiplies 4-bit groups of 32 inputs, and its intermediate_size 80 is not a multiple of 32"
    fix = f"{why}: load it with dtype float32 or bfloat16"
    with pytest.raises(ConfigError) as e:
        layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert str(e.value) == f"odd.gguf: {fix}"
    (folder,) = (tmp_path / "cache").glob("gguf-odd-*")
    with pytest.raises(ConfigError) as e:
        layerleap.load(str(folder), dtype="q4", progress=lambda s: None)
    assert str(e.value) == f"{folder}: {fix}"


@pytest.mark.parametrize(
    "extra",
    [
        {
            f"blk.{i}.{n}.bias": KV * D // HEADS if n != "attn_q" else D
            for i in range(LAYERS)
            for n in ("attn_q", "attn_k")
        },
        {"blk.1.attn_output.bias": D},
        {"blk.0.unknown.weight": 32},
    ],
    ids=["llama q/k biases", "an output bias", "an unknown tensor"],
)
def test_a_tensor_the_decoder_has_no_place_for_is_refused_not_ignored(tmp_path, extra):
    """llama.cpp runs a llama file's attention biases (and refuses a tensor it does not use); dropping one
    would load another model, so it is one line naming the tensor, before any tensor is read."""

    def edit(w):
        for name, n in extra.items():
            w.add_tensor(name, np.full(n, 0.5, np.float32))

    path = write_gguf(tmp_path / "extra.gguf", "Q4_0", edit=edit)
    first, more = next(iter(extra)), len(extra) - 1
    for dtype in ("float32", "q4"):
        with pytest.raises(ConfigError) as e:
            layerleap.load(str(path), dtype=dtype, progress=lambda s: None)
        assert str(e.value) == (
            f"extra.gguf: GGUF tensor {first}{f' (and {more} more)' if more else ''} has no place in layerleap's "
            "llama decoder, which would ignore it and so compute another model: choose a file without it"
        )
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".locks"]


def test_a_file_replaced_by_another_of_its_size_and_time_is_converted_again(tmp_path):
    """Two files of the same name in two folders are two cache entries; a file overwritten by another of
    the same size whose modification time is then copied back (``cp -p``, ``rsync -t``, ``touch -r``)
    is converted again, not served from the old file's entry."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = write_gguf(tmp_path / "a" / "m.gguf", seed=1), write_gguf(tmp_path / "b" / "m.gguf", seed=2)
    assert a.stat().st_size == b.stat().st_size
    for dtype in ("float32", "q4"):
        fa = layerleap.load(str(a), dtype=dtype, progress=lambda s: None).fingerprint
        fb = layerleap.load(str(b), dtype=dtype, progress=lambda s: None).fingerprint
        assert fa != fb
    st = a.stat()
    a.write_bytes(b.read_bytes())
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    for dtype in ("float32", "q4"):
        assert layerleap.load(str(a), dtype=dtype, progress=lambda s: None).fingerprint == fb


def test_a_chat_template_that_does_not_parse_is_one_line_not_a_traceback(tmp_path, capsys):
    from layerleap.cli import main
    from layerleap.core.run import GenerationError

    def edit(w):
        w.kv_data[0].pop("tokenizer.chat_template")
        w.add_chat_template("{% for m in messages %}{{ m['content'] }")

    path = write_gguf(tmp_path / "badchat.gguf", "Q4_0", edit=edit)
    model = layerleap.load(str(path), progress=lambda s: None)  # the template is only needed for chat
    assert len(layerleap.generate(model, "hello", max_new_tokens=2, stop_at_eos=False).token_ids) == 2
    want = (
        "the model's chat template does not parse (line 1: unexpected '}'): repair its chat template "
        "(tokenizer.chat_template), or give the prompt as it is, without chat=True (--chat)"
    )
    with pytest.raises(GenerationError) as e:
        layerleap.generate(model, "hello", max_new_tokens=2, chat=True)
    assert str(e.value) == want
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err


def test_a_big_endian_file_is_named_as_such(tmp_path):
    """llama.cpp's converter writes big-endian files on request (``--bigendian``): its version then reads
    as 50331648 in little-endian order, which is not the problem to name."""
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError) as e:
        layerleap.load(str(path), progress=lambda s: None)
    assert str(e.value) == (
        f"{path} is a big-endian GGUF file: layerleap reads little-endian ones, convert the model again "
        "without --bigendian"
    )


def test_a_head_size_other_than_hidden_over_heads_comes_from_key_length(tmp_path):
    """Mistral Nemo's llama file has heads of 128 beside a hidden size of 5120 and 32 heads: llama.cpp
    reads the head size from ``llama.attention.key_length``, which `transformers` ignores."""
    from layerleap.core.loading import to_hf

    hd = 32  # D // HEADS is 64

    def edit(w):
        w.add_key_length(hd)
        w.add_value_length(hd)
        for i in range(LAYERS):
            for name, shape in (("attn_q", (HEADS * hd, D)), ("attn_k", (KV * hd, D)), ("attn_v", (KV * hd, D))):
                _tensor(f"blk.{i}.{name}.weight", shape, "Q4_0")(w)
            _tensor(f"blk.{i}.attn_output.weight", (D, HEADS * hd), "Q4_0")(w)

    path = write_gguf(tmp_path / "heads.gguf", "Q4_0", edit=edit)
    dense = layerleap.load(str(path), progress=lambda s: None)
    q4 = layerleap.load(str(path), dtype="q4", progress=lambda s: None)
    assert dense.config.head_dim == q4.config.head_dim == hd
    ids = dense.tokenizer.encode("hello hello")
    with torch.inference_mode():
        want = to_hf(dense)(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(dense, ids), want, atol=1e-4, rtol=1e-4)
    assert (_logits(q4, ids) - want).abs().max() < 0.1 * want.abs().max()
    rotated = write_gguf(tmp_path / "rotated.gguf", "Q4_0", edit=lambda w: (edit(w), w.add_rope_dimension_count(hd)))
    check_gguf(rotated)  # the whole head of the file's own size is rotated
    odd = write_gguf(tmp_path / "odd.gguf", "Q4_0", edit=lambda w: (edit(w), w.add_value_length(16)))
    with pytest.raises(ConfigError, match="odd.gguf: heads with keys of 32 values and values of 16"):
        layerleap.load(str(odd), progress=lambda s: None)


def test_a_packed_file_another_process_removes_while_it_is_read_is_rebuilt(tmp_path, monkeypatch):
    """A process loading a q4 model reads the packed cache while another one, loading the same model,
    removes it to write its own (``save_packed``): the first packs the weights again, no crash."""
    from layerleap.core import weight_files
    from layerleap.files import save_safetensors

    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    path = gguf_q4.packed_file(tmp_path)
    meta = {"format": gguf_q4.FORMAT + "-packed", "fingerprint": "f" * 16, "modules": "{}"}
    save_safetensors(path, {"norm.weight": torch.ones(4)}, meta)
    header = weight_files.safetensors_header

    def removed_after_the_header(p, *a, **k):
        out = header(p, *a, **k)
        Path(p).unlink()
        return out

    monkeypatch.setattr(weight_files, "safetensors_header", removed_after_the_header)
    assert gguf_q4.load_packed(tmp_path, None, None) is None


@pytest.mark.parametrize("key", ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"])
def test_end_of_turn_and_message_tokens_end_generation_as_in_llama_cpp(tmp_path, key):
    ids = [60, 70, 80]
    plain = layerleap.load(str(write_gguf(tmp_path / "plain.gguf", "Q8_0")))
    free = layerleap.generate(plain, ids, "greedy", 6).token_ids
    assert free[:2] == [151, 141] and len(free) == 6  # the file's end token (262) does not come
    path = write_gguf(tmp_path / "eot.gguf", "Q8_0", edit=_set(key, 141))
    r = layerleap.generate(layerleap.load(str(path)), ids, "greedy", 6)
    assert r.token_ids == [151, 141] and r.finish_reason == "stop"
    for dtype in ("float32", "q4"):  # (q4 re-quantizes Q8_0 layers, so its tokens differ)
        model = layerleap.load(str(path), dtype=dtype)
        assert 141 in model.eos_ids()
        assert model.fingerprint == layerleap.load(str(tmp_path / "plain.gguf"), dtype=dtype).fingerprint
    past = write_gguf(tmp_path / "past.gguf", "Q8_0", edit=_set(key, 10**6))  # llama.cpp ignores it too
    assert len(layerleap.generate(layerleap.load(str(past)), ids, "greedy", 6).token_ids) == 6
