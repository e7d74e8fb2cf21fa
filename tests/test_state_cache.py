"""The frozen backbone's state cache (``train.state_cache``): Medusa heads and exit heads trained from
cached states get the weights of training with the backbone running, the backbone runs once per item
(counted), another model or other data never reads a cache that is not its own, and an interrupted
write leaves whole shards only."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import random_model

from layerleap.drafters import medusa_transfer as drafters
from layerleap.errors import LayerleapError
from layerleap.train import medusa_transfer as train_drafters
from layerleap.train.exit_heads import HeadTrainConfig, train_heads
from layerleap.train.medusa_transfer import TrainConfig, TrainError
from layerleap.train.state_cache import StateCache, StateCacheError


def _chunks(vocab, n=8, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, seq), generator=g).tolist()


def _counting(model, monkeypatch) -> list:
    """Count the backbone's passes: every ``run_layers`` call from layer 0."""
    calls = []
    run = model.run_layers

    def counted(h, start, *a, **k):
        if start == 0:
            calls.append(h.shape[0])
        return run(h, start, *a, **k)

    monkeypatch.setattr(model, "run_layers", counted)
    return calls


def _cfg(**kw):
    base = dict(kind="medusa", steps_ahead=2, train_steps=10, seq_len=12, batch_size=2, lr=3e-2, save_every=3)
    return TrainConfig(**{**base, **kw})


def _weights(path):
    return drafters.load_drafter(MODEL, path, "medusa").state_dict()


MODEL = random_model("llama-mha-untied", seed=2)


def test_medusa_from_the_cache_matches_the_live_backbone(tmp_path, monkeypatch):
    chunks = _chunks(MODEL.config.vocab_size)  # 8 chunks, 2 a step: 4 steps an epoch, 10 steps = 2.5 epochs
    calls = _counting(MODEL, monkeypatch)
    live = train_drafters.train(MODEL, tmp_path / "live.safetensors", _cfg(), chunks=chunks, progress=False)
    assert len(calls) == 10  # one backbone pass a step
    calls.clear()
    cfg = _cfg(state_cache=str(tmp_path / "sc"), state_dtype="float32")
    fresh = train_drafters.train(MODEL, tmp_path / "fresh.safetensors", cfg, chunks=chunks, progress=False)
    assert len(calls) == 4 and fresh["backbone_chunks"] == 8  # the first epoch only
    calls.clear()
    again = train_drafters.train(MODEL, tmp_path / "again.safetensors", cfg, chunks=chunks, progress=False)
    assert calls == [] and again["backbone_chunks"] == 0  # a later run: never
    torch.testing.assert_close(torch.tensor(fresh["losses"]), torch.tensor(live["losses"]), rtol=0, atol=2e-5)
    assert again["losses"] == fresh["losses"]
    for k, v in _weights(live["out"]).items():
        torch.testing.assert_close(_weights(fresh["out"])[k], v)
        torch.testing.assert_close(_weights(again["out"])[k], v)


def test_bf16_states_give_one_run_whether_the_cache_was_empty_or_full(tmp_path):
    chunks = _chunks(MODEL.config.vocab_size, seed=1)
    live = train_drafters.train(MODEL, tmp_path / "live.safetensors", _cfg(), chunks=chunks, progress=False)
    cfg = _cfg(state_cache=str(tmp_path / "sc"))  # bf16, the default
    fresh = train_drafters.train(MODEL, tmp_path / "fresh.safetensors", cfg, chunks=chunks, progress=False)
    again = train_drafters.train(MODEL, tmp_path / "again.safetensors", cfg, chunks=chunks, progress=False)
    assert again["losses"] == fresh["losses"]  # the first pass trains on the rounded states too
    for k, v in _weights(fresh["out"]).items():
        assert torch.equal(_weights(again["out"])[k], v)
    torch.testing.assert_close(torch.tensor(fresh["losses"]), torch.tensor(live["losses"]), rtol=2e-2, atol=2e-3)
    shard = next((tmp_path / "sc").rglob("shard-*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        assert f.get_slice(f"layer{MODEL.config.n_layers}").get_dtype() == "BF16"
        assert f.get_tensor("ids").tolist() == sum(chunks, [])  # the token ids beside the states


def test_resume_and_init_with_the_cache(tmp_path):
    chunks = _chunks(MODEL.config.vocab_size, seed=2)
    start = train_drafters.train(
        MODEL, tmp_path / "start.safetensors", _cfg(train_steps=3), chunks=chunks, progress=False
    )
    cfg = _cfg(batch_size=1, state_cache=str(tmp_path / "sc"), init=start["out"])
    full = train_drafters.train(MODEL, tmp_path / "full.safetensors", cfg, chunks=chunks, progress=False)
    # interrupted after 5 steps (a checkpoint at 3, the cache not yet written), then run again
    cut = _cfg(**{**cfg.__dict__, "train_steps": 5, "state_cache": str(tmp_path / "sc2")})
    train_drafters.train(MODEL, tmp_path / "resumed.safetensors", cut, chunks=chunks, progress=False)
    assert not list((tmp_path / "sc2").rglob("shard-*"))
    cfg2 = _cfg(**{**cut.__dict__, "train_steps": 10})
    resumed = train_drafters.train(MODEL, tmp_path / "resumed.safetensors", cfg2, chunks=chunks, progress=False)
    assert resumed["resumed_from"] == 5 and resumed["losses"] == full["losses"]
    for k, v in _weights(full["out"]).items():
        assert torch.equal(_weights(resumed["out"])[k], v)
    meta = drafters.read_meta(full["out"])
    assert int(meta["steps"]) == 3 + 10  # the --init file's budget carried on


def test_another_model_or_data_does_not_read_the_cache(tmp_path, monkeypatch):
    chunks = _chunks(MODEL.config.vocab_size, seed=3)
    cfg = _cfg(train_steps=4, state_cache=str(tmp_path / "sc"))
    train_drafters.train(MODEL, tmp_path / "a.safetensors", cfg, chunks=chunks, progress=False)
    other = random_model("llama-mha-untied", seed=3)  # same shapes, other weights
    for i, (model, data) in enumerate(((other, chunks), (MODEL, _chunks(MODEL.config.vocab_size, seed=4)))):
        calls = _counting(model, monkeypatch)
        train_drafters.train(model, tmp_path / f"o{i}.safetensors", cfg, chunks=data, progress=False)
        assert len(calls) == 4  # built afresh, in a folder of its own
    folders = {p.parent for p in (tmp_path / "sc").rglob("shard-*.safetensors")}
    assert len(folders) == 3
    # a shard that is not this run's (copied over, or a stale key) is refused in one line, never read
    mine = StateCache(tmp_path / "sc", MODEL, [MODEL.config.n_layers], chunks)
    theirs = StateCache(tmp_path / "sc", other, [MODEL.config.n_layers], chunks)
    theirs.shard_path(0).write_bytes(mine.shard_path(0).read_bytes())
    with pytest.raises(StateCacheError, match="written for another model or data: delete"):
        theirs.get(0)
    theirs.shard_path(0).write_bytes(b"\x00" * 40)
    with pytest.raises(LayerleapError, match="cannot be read .*: delete .* to rebuild it"):
        StateCache(tmp_path / "sc", other, [MODEL.config.n_layers], chunks).get(0)


def test_an_interrupted_write_leaves_whole_shards_only(tmp_path, monkeypatch):
    items = _chunks(MODEL.config.vocab_size, n=6, seed=5)
    n = MODEL.config.n_layers
    store = StateCache(tmp_path, MODEL, [n], items, shard_items=4)
    store.states([0, 1, 2, 3, 4])  # shard 0 complete and written; item 4 of shard 1 pending
    assert [p.name for p in store.dir.iterdir()] == ["shard-00000.safetensors"]
    import safetensors.torch

    def half(tensors, filename, metadata=None):  # the process is stopped half way through a shard
        with open(filename, "wb") as f:
            f.write(b"\x01" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", half)
    with pytest.raises(KeyboardInterrupt):
        store.states([5])  # completes shard 1: its write is interrupted
    monkeypatch.undo()
    assert [p.name for p in store.dir.iterdir()] == ["shard-00000.safetensors"]  # no half shard, no temporary
    again = StateCache(tmp_path, MODEL, [n], items, shard_items=4)
    assert again.get(4) is None and again.cached_items() == 4
    torch.testing.assert_close(again.get(2)[n], store.get(2)[n])
    whole = again.fill(progress=False)[n]  # the rest computed, shard 1 written
    assert again.complete() and again.computed == 2 and whole.shape == (6 * 12, MODEL.config.hidden_size)


def test_exit_heads_from_the_state_cache(tmp_path, monkeypatch):
    seqs = [s[: 6 + i] for i, s in enumerate(_chunks(MODEL.config.vocab_size, n=6, seq=12, seed=6))]
    cfg = HeadTrainConfig(layers=(1, 2), tokens=60, epochs=2, batch_tokens=16, lstsq_tokens=60, negatives=8)
    work = train_heads(MODEL, cfg, work=tmp_path / "w1", seqs=seqs, progress=False)
    calls = _counting(MODEL, monkeypatch)
    first = train_heads(MODEL, cfg, work=tmp_path / "w2", seqs=seqs, progress=False, state_cache=tmp_path / "sc")
    assert len(calls) == len(seqs) and not (tmp_path / "w2" / "cache.safetensors").exists()
    calls.clear()
    from layerleap.train import exit_heads

    monkeypatch.setattr(exit_heads, "final_top_ids", None)  # the final layer's top ids are read back too
    second = train_heads(MODEL, cfg, work=tmp_path / "w3", seqs=seqs, progress=False, state_cache=tmp_path / "sc")
    assert calls == []  # the backbone does not run
    assert first.losses == work.losses and second.losses == work.losses
    for layer, head in work.heads.items():
        for k, v in head.state_dict().items():
            assert torch.equal(second.heads[layer].state_dict()[k], v)


def test_transfer_refuses_the_cache(tmp_path):
    chunks = _chunks(MODEL.config.vocab_size)
    cfg = _cfg(kind="transfer", layers=[1, 2], state_cache=str(tmp_path / "sc"))
    with pytest.raises(TrainError, match="cannot train from cached states: drop --state-cache"):
        train_drafters.train(MODEL, tmp_path / "t.safetensors", cfg, chunks=chunks, progress=False)


def test_the_cli_stores_then_reads_the_states(capsys, tmp_path, char_model_dir):
    from safetensors.torch import save_file

    from layerleap.cli import main

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(3, 100, (6, 8), dtype=torch.int32)}, str(chunks), {"kind": "token-chunks"})
    train = ["train", "medusa", "--model", str(char_model_dir), "--threads", "1", "--chunks", str(chunks)]
    train += ["--seq-len", "8", "--batch-size", "2", "--steps", "4", "--state-cache", str(tmp_path / "sc")]
    assert main([*train, "--out", str(tmp_path / "a.safetensors")]) == 0
    assert "none cached for this model and data yet; the first pass stores them" in capsys.readouterr().err
    assert main([*train, "--out", str(tmp_path / "b.safetensors")]) == 0
    out, err = capsys.readouterr()
    assert "all 6 items cached, the backbone does not run" in err and '"backbone_chunks": 0' in out
    heads = ["train", "heads", "--model", str(char_model_dir), "--threads", "1", "--layers", "1", "--tokens", "40"]
    heads += ["--epochs", "1", "--eval-tokens", "0", "--state-cache", str(tmp_path / "sc")]
    assert main([*heads, "--out", str(tmp_path / "h1.safetensors")]) == 0
    assert "none cached for this model and data yet" in capsys.readouterr().err
    assert main([*heads, "--out", str(tmp_path / "h2.safetensors")]) == 0
    assert re.search(r"all \d+ items cached, the backbone does not run", capsys.readouterr().err)


def test_only_a_few_shards_are_held_in_memory(tmp_path):
    from layerleap.train import state_cache

    items = _chunks(MODEL.config.vocab_size, n=2 * state_cache.LOADED + 4, seq=5, seed=7)
    n = MODEL.config.n_layers
    store = StateCache(tmp_path, MODEL, [n], items, shard_items=1)
    whole = store.fill(progress=False)[n]
    assert len(store._shards) == state_cache.LOADED and store.complete()
    again = StateCache(tmp_path, MODEL, [n], items, shard_items=1)
    assert torch.equal(again.fill(progress=False)[n], whole) and again.computed == 0


def test_compute_batches_items_of_other_lengths(tmp_path):
    """``compute`` runs the missing items through the backbone a few at a time, right-padded: each
    item's states are those it has alone (up to the batched products' rounding); shards are written,
    and a second cache of the same data computes nothing."""
    from layerleap.train.state_cache import backbone_states

    items = [s[: 4 + i] for i, s in enumerate(_chunks(MODEL.config.vocab_size, n=7, seq=12, seed=8))]
    n = MODEL.config.n_layers
    store = StateCache(tmp_path, MODEL, [n], items, shard_items=3)
    shards = []
    store.compute(batch=2, report=lambda s, tokens: shards.append((s, tokens)))
    assert store.complete() and store.computed == 7
    assert shards == [(s, sum(len(items[i]) for i in range(3 * s, min(7, 3 * s + 3)))) for s in range(3)]
    again = StateCache(tmp_path, MODEL, [n], items, shard_items=3)
    again.compute(batch=2)
    assert again.computed == 0
    for i, ids in enumerate(items):
        alone = backbone_states(MODEL, torch.tensor([ids]), [n])[n][0].to(store.dtype)
        torch.testing.assert_close(again.get(i)[n], alone, atol=2e-2, rtol=2e-2)
