"""Where generation ends for a user's own model: the end tokens of a folder's generation_config.json and
of a GGUF file, beside config.json's, without changing the model's fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_model, save_hf_folder

from layerleap import generate
from layerleap.core.config import ConfigError
from layerleap.core.loading import from_hf, load, load_folder, to_hf

PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama folder whose free greedy run from PROMPT is 37, 75, 30, ... (config eos 2)."""
    f = tmp_path_factory.mktemp("gen_eos") / "tiny"
    save_hf_folder(random_model("llama-mha-untied"), f)
    free = generate(load_folder(f), PROMPT, "greedy", 8).token_ids
    assert free[:3] == [37, 75, 30] and 2 not in free
    return f


def with_generation_config(folder, tmp_path, eos):
    out = tmp_path / "tiny"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    return out


@pytest.mark.parametrize("eos", [[2, 30], 30])
def test_generation_config_end_tokens_end_generation_as_transformers_does(folder, tmp_path, eos):
    from transformers import AutoModelForCausalLM

    f = with_generation_config(folder, tmp_path, eos)
    model = load_folder(f)
    r = generate(model, PROMPT, "greedy", 8)
    assert r.token_ids == [37, 75, 30] and r.finish_reason == "stop"
    plain = load_folder(folder)  # heads trained for the folder without the file still load
    assert model.fingerprint == plain.fingerprint and model.config == plain.config
    hf = AutoModelForCausalLM.from_pretrained(f)
    assert hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, 4:].tolist() == r.token_ids
    # a copy for 4 bits, a dense copy and a model wrapped from transformers end there too
    assert generate(load(str(f), dtype="q4"), PROMPT, "greedy", 8).finish_reason == "stop"
    assert 30 in from_hf(hf).eos_ids()
    back = to_hf(model).generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    assert back[0, 4:].tolist() == r.token_ids
    assert generate(model, PROMPT, "greedy", 8, stop_at_eos=False).token_ids[:4] == [37, 75, 30, 89]


def test_generation_config_end_tokens_end_rows_of_the_pool(folder, tmp_path):
    from layerleap.scheduler import Pool

    model = load_folder(with_generation_config(folder, tmp_path, [2, 30]))
    assert 30 in Pool(model, 2).eos_ids


@pytest.mark.parametrize("eos", [[2, 500], "30", [True]])
def test_a_generation_config_end_token_outside_the_vocabulary_is_refused(folder, tmp_path, eos):
    f = with_generation_config(folder, tmp_path, eos)
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id .* not a token id in \[0, 97\)"):
        load_folder(f)


@pytest.mark.parametrize("model_type, extra", [("mistral", {"sliding_window": 16}), ("qwen2", {})])
def test_a_context_bounded_by_a_sliding_window_says_so(tmp_path, model_type, extra):
    from layerleap.errors import LayerleapError

    f = tmp_path / "tiny"
    save_hf_folder(random_model(model_type=model_type, qkv_bias=model_type == "qwen2"), f)
    cfg = json.loads((f / "config.json").read_text())
    if model_type == "qwen2":
        extra = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}
    (f / "config.json").write_text(json.dumps({**cfg, **extra}))
    model = load_folder(f)
    assert model.config.max_position == 16 and model.sliding_window == 16
    with pytest.raises(LayerleapError, match=r"context length 16 \(the model's sliding window"):
        generate(model, list(range(10, 20)), "greedy", 8)
    save_hf_folder(random_model(model_type=model_type, qkv_bias=model_type == "qwen2"), tmp_path / "full")
    with pytest.raises(LayerleapError, match=r"context length 256: shorten"):  # no window: no reason given
        generate(load_folder(tmp_path / "full"), list(range(10, 20)), "greedy", 250)
