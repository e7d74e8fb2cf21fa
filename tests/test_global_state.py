"""The Python API leaves its caller's process as it found it."""

from __future__ import annotations

import os

import pytest
import torch

import layerleap
from layerleap.drafters import exit_heads, medusa_transfer


@pytest.fixture(scope="module")
def char_model(char_model_dir):
    return layerleap.load(str(char_model_dir))


def _drafter_file(model, kind, folder):
    if kind == "heads":
        return exit_heads.save_heads([exit_heads.new_head(model, 2, "lens")], folder / "h.safetensors")
    config = {"medusa": dict(steps=2), "transfer": dict(layers=[1]), "eagle": {}}[kind]
    drafter = medusa_transfer.new_drafter(model, kind, **config)
    return medusa_transfer.save_drafter(drafter, folder / f"{kind}.safetensors")


@pytest.mark.parametrize(
    "method, kind, option, more",
    [
        ("medusa", "medusa", "heads", {}),
        ("eagle", "eagle", "eagle_head", {}),
        ("hidden-transfer", "transfer", "transfer", {}),
        ("ppd", "heads", "head", {"exit_layer": 2}),
    ],
)
def test_a_greedy_call_that_reads_a_drafter_file_draws_nothing_from_the_global_generator(
    char_model, tmp_path, method, kind, option, more
):
    """Building a drafter's modules before its weights are copied in initialises them at random: that
    must not advance the caller's generator (greedy decoding draws nothing)."""
    path = _drafter_file(char_model, kind, tmp_path)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    layerleap.generate(char_model, "hello", method, max_new_tokens=4, **{option: str(path)}, **more)
    assert torch.equal(torch.get_rng_state(), before)


def test_timing_the_kernels_draws_nothing_from_the_global_generator(monkeypatch, tmp_path):
    """The first call on a machine times the draft heads' and drafters' kernels (then remembered): its
    random inputs come from a generator of its own, so that call advances the caller's no more than later
    ones."""
    from layerleap.core import kernels

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "_best_of_rounds", lambda configs, rounds=7: {k: 1.0 for k in configs})
    weight = torch.randn(64, 64)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    kernels._measure_draft_head(weight, q8=False)
    assert torch.equal(torch.get_rng_state(), before)
    if kernels.blocks_available():  # 8-bit products are timed only with the native kernel
        kernels.q8_products_faster([torch.zeros(1024, 1024)])
        assert "q8 products 1024x1024" in (tmp_path / "kernels.json").read_text()
        assert torch.equal(torch.get_rng_state(), before)


def test_loading_a_gguf_file_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """The caller's environment (which its later child processes inherit) is not changed: loading a
    GGUF file reads its local folder only, without putting the process offline."""
    import os

    from layerleap.core import kernels
    from test_gguf_files import write_gguf

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(kernels.KERNEL_ENV, "dense")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    model = layerleap.load(str(write_gguf(tmp_path / "tiny.gguf", "Q8_0")), progress=lambda s: None)
    after = dict(os.environ)
    after.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch's own, set on the first import of its compiler
    before.pop("TORCHINDUCTOR_CACHE_DIR", None)
    assert after == before
    assert model.tokenizer.decode(model.tokenizer.encode("hello world")) == "hello world"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_parallel_ppd_gives_the_caller_its_thread_count_back_on_close():
    """``ParallelPPD`` runs the caller's process at ``threads`` threads from start-up to ``close()``."""
    from tiny_models import random_model

    from layerleap.eval.ppd_parallel import ParallelPPD

    model = random_model("llama-gqa-tied", seed=1)
    torch.set_num_threads(2)
    with ParallelPPD(model, exit_layer=2, k=1, head="shared", threads=1) as ex:
        assert torch.get_num_threads() == 1
        assert ex.generate([1, 2, 3], 2, stop_at_eos=False).token_ids
    assert torch.get_num_threads() == 2


def test_to_hf_draws_nothing_from_the_global_generator(char_model):
    """The `transformers` model starts from random weights that ``to_hf`` replaces: drawn apart from the
    caller's generator, so seeding before a comparison still seeds what the caller samples next."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    hf = layerleap.to_hf(char_model)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(hf.model.embed_tokens.weight, char_model.tok_embeddings.weight)
