"""One weights-file format for every trained drafter (drafters/weights.py): what it records, that
older files still read, that each reader refuses the wrong kind or model, and ``layerleap heads info``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import cli
from tiny_models import random_model

from layerleap.drafters import exit_heads, medusa_transfer, weights

DATA = Path(__file__).resolve().parent.parent / "src" / "layerleap" / "data"
LEGACY = {DATA / "heads" / "smollm2-135m-lens.safetensors": "exit-heads",
          DATA / "medusa" / "smollm2-135m.safetensors": "medusa",
          DATA / "transfer" / "smollm2-135m.safetensors": "transfer",
          Path(__file__).resolve().parent.parent / "docs" / "bild" / "head-e8.safetensors": "adapter-head"}


def _files(model, tmp_path) -> dict[str, Path]:
    """One file of every kind, written by the library's own writers."""
    h = exit_heads.new_head(model, 1, "lens")
    a = exit_heads.AdapterHead(model, 2, rank=4)
    return {
        "exit-heads": exit_heads.save_heads([h], tmp_path / "h.safetensors", {"tokens": 100, "steps": 3}),
        "adapter-head": exit_heads.save_adapter_head(a, tmp_path / "a.safetensors", {"tokens": 7}),
        "medusa": medusa_transfer.save_drafter(medusa_transfer.new_drafter(model, "medusa", steps=2),
                                               tmp_path / "m.safetensors", {"tokens": 5, "data": "test"}),
        "transfer": medusa_transfer.save_drafter(medusa_transfer.new_drafter(model, "transfer", layers=[1, 2]),
                                                 tmp_path / "t.safetensors", {"steps": 9}),
    }


def test_every_kind_records_model_config_and_provenance(tmp_path):
    model = random_model(seed=3)
    for kind, path in _files(model, tmp_path).items():
        d = weights.describe(path)
        assert d["format"] == weights.FORMAT and d["kind"] == kind
        assert d["fingerprint"] == model.fingerprint and d["model"] == model.config.name
        assert d["config"] and d["provenance"]["command"] and d["provenance"]["created"]
    assert weights.describe(tmp_path / "h.safetensors")["provenance"]["tokens"] == 100
    assert weights.describe(tmp_path / "a.safetensors")["config"] == {"exit_layer": 2, "rank": 4}
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary file left


def test_each_reader_loads_its_kind_and_refuses_the_others(tmp_path):
    model = random_model(seed=3)
    files = _files(model, tmp_path)
    assert list(exit_heads.load_heads(model, files["exit-heads"])) == [1]
    assert exit_heads.load_exit_head(model, 2, files["adapter-head"]).layer == 2
    assert medusa_transfer.load_drafter(model, files["medusa"], "medusa").steps == 2
    assert medusa_transfer.load_drafter(model, files["transfer"], "transfer").layers == [1, 2]
    with pytest.raises(medusa_transfer.DrafterError, match="is not a medusa weights file"):
        medusa_transfer.load_drafter(model, files["transfer"], "medusa")
    with pytest.raises(exit_heads.HeadError, match="is not a exit heads file"):
        exit_heads.load_heads(model, files["medusa"])
    other = random_model(seed=4)
    with pytest.raises(medusa_transfer.DrafterError, match="another model"):
        medusa_transfer.load_drafter(other, files["medusa"], "medusa")
    with pytest.raises(exit_heads.HeadError, match="another model"):
        exit_heads.load_heads(other, files["exit-heads"])


@pytest.mark.parametrize("path,kind", list(LEGACY.items()), ids=list(LEGACY.values()))
def test_files_written_before_this_format_still_read(path, kind):
    d = weights.describe(path)
    assert d["kind"] == kind and d["fingerprint"] and d["config"]
    if kind in ("medusa", "transfer"):
        assert d["provenance"]["tokens"] and d["provenance"]["steps"]  # the older names mapped


def test_heads_info_prints_what_a_file_holds(capsys, tmp_path):
    model = random_model(seed=3)
    files = _files(model, tmp_path)
    rc, out, err = cli(capsys, "heads", "info", files["medusa"], *LEGACY)
    assert rc == 0, err
    assert "kind medusa" in out and "tokens        5" in out and "data          test" in out
    rc, out, _ = cli(capsys, "heads", "info", "--json", files["transfer"])
    assert rc == 0 and json.loads(out)["config"] == {"layers": [1, 2]}
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    rc, _, err = cli(capsys, "heads", "info", bad)
    assert rc == 2 and "cannot read weights" in err and "Traceback" not in err
    rc, _, err = cli(capsys, "heads", "info", tmp_path / "none.safetensors")
    assert rc == 2 and "no such weights file" in err
