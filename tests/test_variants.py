"""Model variants: low-rank deltas trained by ``train.variant`` and merged by ``drafters.variants``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import random_model

from layerleap.drafters import variants, weights
from layerleap.train.variant import (
    Deltas,
    VariantConfig,
    VariantTrainError,
    all_hidden,
    calm_layers,
    train_variant,
)

EXAMPLES = [([1, 2, 3, 4], [5, 6, 7, 8, 9, 10]), ([3, 4, 5], [6, 7, 8, 9]), ([7, 1], [2, 3, 4, 5, 6])] * 2


def _cfg(objective: str, steps: int = 6, **kw) -> VariantConfig:
    return VariantConfig(
        objective=objective,
        rank=2,
        alpha=4.0,
        steps=steps,
        batch_size=2,
        save_every=2,
        lr=1e-2,
        lr_warmup_steps=0,
        gen_len=6,
        min_layer=1,
        target_speedup=2,
        **kw,
    )


def _model():
    return random_model("llama-gqa-tied", n_layers=4)


@pytest.mark.parametrize("objective", ["skipdecode", "calm"])
def test_training_lowers_the_loss_and_writes_a_variant_with_its_budget(tmp_path, objective):
    out = tmp_path / f"{objective}.safetensors"
    res = train_variant(_model(), out, _cfg(objective, steps=12), EXAMPLES, "toy data", "layerleap finetune variant")
    assert res.steps_done == 12 and len(res.losses) == 12
    assert sum(res.losses[-3:]) < sum(res.losses[:3])
    meta = weights.read_meta(out)
    assert meta["kind"] == "variant" and meta["fingerprint"] == _model().fingerprint
    assert meta["steps"] == "12" and meta["data"] == "toy data" and meta["command"] == "layerleap finetune variant"
    assert int(meta["tokens"]) > 0 and float(meta["train_s"]) > 0 and meta["machine"]
    assert meta["objective"] == objective


def test_the_budget_names_the_device_it_trained_on(tmp_path, monkeypatch):
    """A run on a GPU records the GPU (``weights.machine(device)``), not the host's CPU."""
    seen = []
    monkeypatch.setattr(weights, "machine", lambda *a: seen.append(a) or "the device")
    model = _model()
    out = tmp_path / "v.safetensors"
    train_variant(model, out, _cfg("calm", steps=2), EXAMPLES, "toy")
    assert seen and all(a == (model.device,) for a in seen)
    assert weights.read_meta(out)["machine"] == "the device"


def test_a_run_resumed_on_another_machine_records_both(tmp_path, monkeypatch):
    out = tmp_path / "v.safetensors"
    for steps, machine in ((2, "cpu A"), (4, "cpu B"), (6, "cpu B")):
        monkeypatch.setattr(weights, "machine", lambda device, m=machine: m)
        train_variant(_model(), out, _cfg("calm", steps=steps), EXAMPLES, "toy")
        assert weights.read_meta(out)["machine"] == ("cpu A" if steps == 2 else "cpu A; then cpu B")


def test_the_budgets_seconds_are_the_training_time_over_every_call(tmp_path, monkeypatch):
    """The file's train_s is the loop's training time (the state's), over a resume too: not the set-up
    before the loop (here a machine that takes a second to describe) nor a call's time counted twice."""
    import time

    from safetensors import safe_open

    monkeypatch.setattr(weights, "machine", lambda device: time.sleep(1.0) or "slow to describe")
    out = tmp_path / "v.safetensors"
    for steps in (2, 4):
        train_variant(_model(), out, _cfg("calm", steps=steps), EXAMPLES, "toy")
        with safe_open(str(out) + ".state.safetensors", "pt") as f:
            seconds = float(f.metadata()["seconds"])
        assert seconds < 1.0
        assert weights.read_meta(out)["train_s"] == f"{seconds:.1f}"


def test_a_finished_run_writes_its_variant_file_again_when_it_is_missing(tmp_path):
    """Rerunning a finished run whose variant file was removed trains no step, so no checkpoint writes
    the file: the call writes it from the state (it said it wrote it)."""
    out = tmp_path / "v.safetensors"
    train_variant(_model(), out, _cfg("calm", steps=2), EXAMPLES, "toy")
    before = load_file(str(out))
    out.unlink()
    res = train_variant(_model(), out, _cfg("calm", steps=2), EXAMPLES, "toy")
    assert res.resumed_from == 2 and out.is_file()
    assert weights.read_meta(out)["steps"] == "2"
    after = load_file(str(out))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_merged_model_computes_what_the_trained_deltas_do(tmp_path):
    out = tmp_path / "v.safetensors"
    train_variant(_model(), out, _cfg("skipdecode"), EXAMPLES, "toy")
    stored = load_file(str(out))
    hooked = _model()
    deltas = Deltas(hooked, 2, 4.0, 0)
    with torch.no_grad():
        for k, v in deltas.tensors.items():
            v.copy_(stored[k].float())
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = hooked.logits(all_hidden(hooked, ids)[-1])
    merged = variants.apply(_model(), out)
    with torch.no_grad():
        got = merged(ids)
    assert (got - want).abs().max() < 1e-3
    assert (got - _model()(ids)).abs().max() > 1e-3  # the deltas changed something
    assert merged.fingerprint != _model().fingerprint and merged.variant == "v"


@pytest.mark.parametrize("objective", ["skipdecode", "calm"])
def test_the_anchor_keeps_the_full_models_output(tmp_path, objective):
    """With ``anchor`` the full-depth distributions of the trained variant stay nearer the base model's
    than without it, on the same data and steps; a negative anchor is refused."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 1, 2, 3, 4, 5, 6, 3, 4, 5]])
    with torch.no_grad():
        base = torch.log_softmax(_model()(ids), -1)

    def drift(anchor: float) -> float:
        out = tmp_path / f"{objective}-{anchor}.safetensors"
        train_variant(_model(), out, _cfg(objective, steps=12, anchor=anchor), EXAMPLES, "toy")
        with torch.no_grad():
            got = torch.log_softmax(variants.apply(_model(), out)(ids), -1)
        return torch.nn.functional.kl_div(got, base, log_target=True, reduction="batchmean").item()

    assert drift(20.0) < 0.5 * drift(0.0)
    with pytest.raises(VariantTrainError, match="anchor"):
        _cfg(objective, anchor=-1.0).check(4)


def test_resume_gives_the_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    train_variant(_model(), a, _cfg("calm", steps=4), EXAMPLES, "toy")
    train_variant(_model(), b, _cfg("calm", steps=2), EXAMPLES, "toy")
    res = train_variant(_model(), b, _cfg("calm", steps=4), EXAMPLES, "toy")
    assert res.resumed_from == 2 and res.steps_done == 4
    ta, tb = load_file(str(a)), load_file(str(b))
    assert all(torch.allclose(ta[k].float(), tb[k].float(), atol=1e-2) for k in ta)
    with pytest.raises(VariantTrainError, match="other settings"):
        train_variant(_model(), b, _cfg("calm", steps=6, layers_per_step=3), EXAMPLES, "toy")


def test_resume_refuses_another_model_or_other_examples(tmp_path):
    out = tmp_path / "v.safetensors"
    train_variant(_model(), out, _cfg("calm", steps=2), EXAMPLES, "toy")
    with pytest.raises(VariantTrainError, match="other training examples"):
        train_variant(_model(), out, _cfg("calm", steps=4), EXAMPLES[:3] + [([9, 9], [8, 8, 8])], "toy")
    other = random_model("llama-gqa-tied", n_layers=4, seed=1)
    with pytest.raises(VariantTrainError, match="another model"):
        train_variant(other, out, _cfg("calm", steps=4), EXAMPLES, "toy")
    assert train_variant(_model(), out, _cfg("calm", steps=4), EXAMPLES, "toy").resumed_from == 2


def test_a_variant_refuses_another_model_and_unknown_names(tmp_path):
    out = tmp_path / "v.safetensors"
    train_variant(_model(), out, _cfg("calm", steps=2), EXAMPLES, "toy")
    other = random_model("llama-gqa-tied", n_layers=4, seed=1)
    with pytest.raises(variants.VariantError, match="another model"):
        variants.apply(other, out)
    with pytest.raises(
        variants.VariantError,
        match="no variant 'nope' for smollm2-135m: none ships with the package: give a .safetensors file",
    ):
        variants.variant_file("smollm2-135m", "nope")
    upper = out.rename(tmp_path / "V.SAFETENSORS")  # a suffix in any case
    assert variants.variant_file("smollm2-135m", str(upper)) == upper
    with pytest.raises(VariantTrainError, match="objective"):
        train_variant(_model(), out, _cfg("medusa"), EXAMPLES, "toy")


def test_a_model_folder_ships_no_variants(tmp_path):
    """A model given by its folder's path has no shipped variants: the folder's own weights file is not
    offered (nor taken) as one."""
    folder = tmp_path / "mymodel"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    assert variants.shipped_variants(str(folder)) == []
    with pytest.raises(variants.VariantError, match="none ships with the package: give a .safetensors file"):
        variants.variant_file(str(folder), "model")


@pytest.mark.parametrize("kernel", ["blocks", "torch"])
def test_a_variant_refuses_a_q4_model_on_either_kernel(tmp_path, monkeypatch, kernel):
    from layerleap.core import kernels
    from layerleap.core.loading import quantize_model

    if kernel == "blocks" and not kernels.blocks_available() or kernel == "torch" and not kernels.int4_supported():
        pytest.skip(f"no {kernel} 4-bit kernel here")
    out = tmp_path / "v.safetensors"
    train_variant(_model(), out, _cfg("calm", steps=2), EXAMPLES, "toy")
    monkeypatch.setenv(kernels.Q4_ENV, kernel)
    q4 = quantize_model(_model())
    with pytest.raises(variants.VariantError, match="not q4"):
        variants.apply(q4, out)


def test_calm_layers_are_drawn_by_weight():
    import random

    draws = calm_layers(30, 4, 20000, random.Random(0))
    assert min(draws) >= 4 and max(draws) <= 30
    share30 = draws.count(30) / len(draws)
    assert abs(share30 - 30 / sum(range(4, 31))) < 0.01
    assert draws.count(30) > 5 * draws.count(5)


def test_a_variant_file_whose_deltas_do_not_fit_is_refused_by_name(tmp_path):
    """Deltas that hold NaN (which would make every logit NaN) or integers, a build naming a layer or
    projection the model lacks, and deltas of another shape: each a ``VariantError`` naming the file,
    raised before the model's weights change."""

    model = _model()
    build = {"rank": 2, "alpha": 4.0, "layers": [0], "projections": ["attn.o"]}
    a, b = variants.delta_names(0, "attn.o")
    D = model.config.hidden_size
    good = {a: torch.randn(2, D) * 0.01, b: torch.randn(D, 2) * 0.01}
    cases = {
        "nan": (build, {a: good[a] * torch.nan, b: good[b]}, "holds NaN or infinite values"),
        "ints": (build, {a: good[a].to(torch.int32), b: good[b]}, "int32"),
        "layer": ({**build, "layers": [99]}, good, "no layer or projection 99"),
        "projection": ({**build, "projections": ["attn.z"]}, good, "no layer or projection 'attn.z'"),
        "shape": (build, {a: good[a][:, :-1].contiguous(), b: good[b]}, "not \\[2, "),
    }
    want = model(torch.tensor([[1, 2, 3]]))
    for name, (bld, tensors, why) in cases.items():
        path = weights.write(tmp_path / f"{name}.safetensors", model, variants.KIND, bld, tensors)
        with pytest.raises(variants.VariantError, match=f"{name}.safetensors do not fit this model: .*{why}"):
            variants.apply(model, path)
        assert torch.equal(model(torch.tensor([[1, 2, 3]])), want)  # untouched
    variants.apply(model, weights.write(tmp_path / "good.safetensors", model, variants.KIND, build, good))
    assert bool(torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all())


def test_finetune_variant_refuses_a_variant_to_train_on(tmp_path, char_model_dir, capsys):
    """Deltas trained on a variant fit that merged model alone, which load(MODEL, variant=FILE) (one
    variant) never gives: `finetune variant --variant` is refused before the model loads."""
    from layerleap.cli import main

    vbase = tmp_path / "base.safetensors"
    train_variant(
        random_model(dict(vocab_size=128, max_position=2048, tie_embeddings=False)),
        vbase,
        _cfg("calm", steps=1),
        EXAMPLES,
        "toy",
    )
    argv = ["finetune", "variant", "--model", str(char_model_dir), "--threads", "1", "--objective", "calm"]
    argv += ["--variant", str(vbase), "--out", str(tmp_path / "v.safetensors"), "--data", str(tmp_path / "d.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "drop --variant" in err and "Traceback" not in err and "loaded" not in err
    assert not (tmp_path / "v.safetensors").exists()
