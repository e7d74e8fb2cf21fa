"""Exit heads: the three kinds agree with the model at initialisation, files round-trip and refuse
another model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model

from layerleap import heads


@pytest.mark.parametrize("kind", heads.KINDS)
@pytest.mark.parametrize("layer", [1, 2, 4])
def test_untrained_heads_equal_the_shared_head(kind, layer):
    model = random_model()
    h = torch.randn(2, 3, model.config.hidden_size)
    head = heads.new_head(model, layer, kind)
    torch.testing.assert_close(head(h), model.logits(h), rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_and_fingerprint(tmp_path):
    model = random_model()
    lens, full = heads.new_head(model, 1, "lens"), heads.new_head(model, 3, "full")
    with torch.no_grad():
        lens.proj.weight.normal_(std=0.1)
        full.lm_head.weight.mul_(1.5)
    path = heads.save_heads([lens, full], tmp_path / "h.safetensors", meta={"tokens": 10})
    got = heads.load_heads(model, path)
    assert sorted(got) == [1, 3] and got[1].kind == "lens" and got[3].kind == "full"
    h = torch.randn(1, 2, model.config.hidden_size)
    torch.testing.assert_close(got[1](h), lens(h))
    torch.testing.assert_close(got[3](h), full(h))
    assert heads.read_meta(path)["tokens"] == "10"
    assert heads.get_head(model, 3, path).kind == "full"
    with pytest.raises(heads.HeadError, match="not 2"):
        heads.get_head(model, 2, path)
    with pytest.raises(heads.HeadError, match="another model"):
        heads.load_heads(random_model(seed=1), path)
    assert not list(tmp_path.glob(".*tmp"))


def test_bad_layers_kinds_and_files(tmp_path):
    model = random_model()
    n = model.config.n_layers
    for layer in (0, n + 1, 1.5, True):
        with pytest.raises(heads.HeadError, match="integer in"):
            heads.new_head(model, layer)
    with pytest.raises(heads.HeadError, match="unknown head kind"):
        heads.new_head(model, 1, "medium")
    with pytest.raises(heads.HeadError, match="no such"):
        heads.get_head(model, 1, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(heads.HeadError, match="cannot read"):
        heads.get_head(model, 1, tmp_path / "junk.safetensors")
    with pytest.raises(heads.HeadError, match="none ship"):
        heads.get_head(model, 1, "trained")
    assert heads.get_head(model, 1, "auto").kind == "shared"
