"""Helpers shared by test_model / test_kv_cache / test_generate: tiny random models and references.

Imported as a plain module (pytest puts tests/ on sys.path); it holds no tests."""

from __future__ import annotations


import torch

from layerleap import Transformer, tiny_config

# name -> overrides of tiny_config(); covers llama and qwen2-style (qkv biases), grouped-query and
# multi-head attention, tied and untied embeddings, non-default rope theta and norm eps.
CONFIGS = {
    "llama-gqa-tied": dict(),
    "llama-mha-untied": dict(n_kv_heads=4, tie_embeddings=False, rope_theta=500.0, rms_norm_eps=1e-6),
    "qwen2-gqa-untied": dict(qkv_bias=True, model_type="qwen2", tie_embeddings=False),
    "qwen2-mqa-tied": dict(qkv_bias=True, model_type="qwen2", n_kv_heads=1, rope_theta=1e6),
    "mistral-gqa-untied": dict(model_type="mistral", tie_embeddings=False, head_dim=16, n_layers=3),
}


def randomize_(model: Transformer, seed: int = 0, scale: float = 1.0) -> Transformer:
    """Fill every parameter with seeded random values: weights ~ N(0, scale/sqrt(fan_in)),
    norm weights ~ 1 + N(0, 0.3) and biases ~ N(0, 0.5), so nothing is trivially 1 or 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head appears once (as tok_embeddings)
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.3 * r
            elif name.endswith("bias"):
                v = 0.5 * r
            elif name == "tok_embeddings.weight":
                v = r * scale
            else:
                v = r * (scale / p.shape[-1] ** 0.5)
            p.copy_(v.to(p.dtype))
    return model


def random_model(name_or_overrides="llama-gqa-tied", seed: int = 0, scale: float = 1.0, **overrides) -> Transformer:
    """A tiny random fp32 model in eval mode."""
    kw = dict(CONFIGS[name_or_overrides]) if isinstance(name_or_overrides, str) else dict(name_or_overrides)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kw)).eval().requires_grad_(False)
    return randomize_(model, seed, scale)


def full_logits(model: Transformer, ids) -> torch.Tensor:
    """Logits ``[S, V]`` of one plain causal no-cache forward of a 1-D id sequence."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.device).reshape(1, -1)
    with torch.inference_mode():
        return model(ids)[0]


def naive_greedy(model: Transformer, prompt: list[int], n: int, eos: tuple[int, ...] = ()) -> list[int]:
    """Reference greedy loop: argmax of a full no-cache forward at every step."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = int(full_logits(model, seq)[-1].argmax())
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


def tree_mask(parents: list[int]) -> torch.Tensor:
    """``[S, S]`` bool: node i may attend to node j when j is i or an ancestor of i."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def tree_depths(parents: list[int]) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def tree_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def save_hf_folder(model: Transformer, folder, tokenizer_from=None, shards: int = 1):
    """``model`` as a Hugging Face folder (config.json, safetensors weights in ``shards`` files with an
    index when more than one), with the tokenizer files of the folder ``tokenizer_from`` copied in."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from layerleap.core.loading import ours_to_hf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=1))
    sd = {k: v.clone() for k, v in ours_to_hf(model).items()}  # fused q/k/v share storage
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"))
    else:
        keys = sorted(sd)
        names = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": keys[i::shards] for i in range(shards)}
        for name, ks in names.items():
            save_file({k: sd[k] for k in ks}, str(folder / name))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: n for n, ks in names.items() for k in ks}})
        )
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if f.is_file() and f.name != "config.json" and "safetensors" not in f.name:
                shutil.copy(f, folder / f.name)
    return folder


CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


def save_char_tokenizer(folder) -> None:
    """A character-level tokenizer (ids 0-2: <unk> <s> </s>, then printable ASCII and newline) with a
    chat template, saved as tokenizer files: it loads in milliseconds, where a real 49k-token one
    takes most of a second."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
    )
    tok.save_pretrained(str(folder))


def spm_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoder: "▁" for spaces, byte-fallback tokens
    ``<0xNN>`` for what the vocabulary lacks, the leading space stripped) over a handful of pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "▁Hello", "▁world", "."):
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_char_model(folder, seed: int = 0, **overrides):
    """A tiny random model (vocabulary 128) with the character tokenizer: a complete text model that
    loads in a fraction of a second."""
    model = random_model(dict(vocab_size=128, max_position=2048, tie_embeddings=False, **overrides), seed=seed)
    save_hf_folder(model, folder)
    save_char_tokenizer(folder)
    return model


# q4's call-cost curve with torch's int4 kernel (S = 1..8, and 16): rows that cost, as the tests of
# chain cutting need; the shipped q4 curve (the block kernel) is nearly flat at 2 tokens.
COSTLY_ROWS = (1.0, 1.122, 1.246, 1.341, 1.8, 1.874, 1.915, 2.089)
COSTLY_ROWS_16 = 3.03
