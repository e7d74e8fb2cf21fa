"""Atomic writes: an interrupted or failed write leaves the old file (or none) and no temporary."""

import json
import re

import pytest
import torch

from layerleap.errors import LayerleapError
from layerleap.files import (
    atomic_write,
    number,
    read_json,
    read_report,
    read_safetensors_meta,
    replace_dir,
    save_figure,
    save_safetensors,
    write_json,
)


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    write_json(path, {"a": 1})

    def half_then_fail(p):
        p.write_text('{"a": ')
        raise KeyboardInterrupt  # as a Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half_then_fail)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_unwritable_target_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LayerleapError, match="cannot write"):
        write_json(blocker / "sub" / "r.json", {})


def test_safetensors_round_trip_with_string_metadata(tmp_path):
    from safetensors.torch import load_file

    path = save_safetensors(tmp_path / "d" / "w.safetensors", {"w": torch.arange(6.0).view(2, 3).t()}, {"step": 3})
    assert torch.equal(load_file(str(path))["w"], torch.arange(6.0).view(2, 3).t())
    assert read_safetensors_meta(path) == {"step": "3"}
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError):
        read_safetensors_meta(tmp_path / "bad.safetensors")


def test_safetensors_metadata_reads_the_header_as_safetensors_does(tmp_path):
    """A load reads the metadata from the header itself (``weight_files.safetensors_metadata``): the
    same as `safetensors` gives, and a file without a readable header is a ``ModelFileError``."""
    from layerleap.core.weight_files import ModelFileError, safetensors_metadata

    path = save_safetensors(tmp_path / "w.safetensors", {"w": torch.ones(3)}, {"format": "x", "n": 2})
    assert safetensors_metadata(path) == read_safetensors_meta(path) == {"format": "x", "n": "2"}
    assert safetensors_metadata(save_safetensors(tmp_path / "plain.safetensors", {"w": torch.ones(1)})) == {}
    for bad in (b"not a file", path.read_bytes()[:20]):
        (tmp_path / "bad.safetensors").write_bytes(bad)
        with pytest.raises(ModelFileError, match="bad.safetensors"):
            safetensors_metadata(tmp_path / "bad.safetensors")


def test_figure_is_written_by_suffix(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "p.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and len(list(tmp_path.iterdir())) == 1


def _check_out(path: str) -> str:
    from layerleap import validate as V

    V.output_file(path, "out", (".safetensors",))
    return "ok"


def test_processes_checking_one_new_path_at_once_all_pass(tmp_path):
    """Ranks of one torchrun job check the same output path at once, each making and removing its
    missing folder: none of them sees the others' folder come or go as an error, and no probe file
    is left (a folder one process made while another was inside it may stay, empty)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for i in range(20):
        path = str(tmp_path / f"run{i}" / "deep" / "m.safetensors")
        with ctx.Pool(4) as pool:
            assert pool.map(_check_out, [path] * 8) == ["ok"] * 8
        assert not [f for f in (tmp_path / f"run{i}").rglob("*") if f.is_file()]


def test_a_safetensors_write_that_fails_is_a_clear_error_and_keeps_the_old_file(tmp_path):
    """A full disk or a file size limit makes safetensors raise its own ``SafetensorError``, not an OSError."""
    import resource
    import signal

    path = save_safetensors(tmp_path / "w.safetensors", {"w": torch.zeros(4)}, {"kind": "medusa"})
    before = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # writes past 4 kB fail (EFBIG)
        with pytest.raises(LayerleapError, match=r"cannot write .*w.safetensors: .*File too large"):
            save_safetensors(path, {"w": torch.zeros(10_000)}, {"kind": "medusa"})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


# -- folders: replace_dir ----------------------------------------------------------------------------
def _folder(path):
    return {p.name: p.read_text() for p in path.iterdir()}


@pytest.mark.parametrize("keep", [None, lambda p: False], ids=["replace", "keep-nothing"])
def test_a_folder_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path, keep):
    out = tmp_path / "out"
    replace_dir(out, lambda t: (t / "config.json").write_text("old"))
    replace_dir(out, lambda t: (t / "new.txt").write_text("new"), keep=keep)
    assert _folder(out) == {"new.txt": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_folder_that_keep_accepts_stays_and_the_new_copy_is_dropped(tmp_path):
    out = tmp_path / "out"
    replace_dir(out, lambda t: (t / "config.json").write_text("first"))
    replace_dir(out, lambda t: (t / "config.json").write_text("second"), keep=lambda p: (p / "config.json").is_file())
    assert _folder(out) == {"config.json": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_interrupted_folder_write_keeps_the_old_folder(tmp_path):
    out = tmp_path / "out"
    replace_dir(out, lambda t: (t / "a").write_text("old"))

    def half_then_stop(t):
        (t / "a").write_text("half")
        raise KeyboardInterrupt

    for keep in (None, lambda p: True):
        with pytest.raises(KeyboardInterrupt):
            replace_dir(out, half_then_stop, keep=keep)
        assert _folder(out) == {"a": "old"}
        assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_folder_that_cannot_be_written_is_a_clear_error_with_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LayerleapError) as e:
        replace_dir(blocker / "out", lambda t: None, fix="choose another folder")
    assert str(e.value) == f"cannot write {blocker / 'out'}: File exists; choose another folder"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_killed_writers_temporary_is_removed_and_a_running_ones_kept(tmp_path):
    import os

    from layerleap.files import remove_stale_temporaries

    path = tmp_path / "packed-x.safetensors"
    dead, alive = _dead_pid(), os.getppid()
    names = [f".packed-x.{pid}-{u}.tmp.safetensors" for pid in (dead, alive, os.getpid()) for u in ("1f2e", "9a")]
    older = [f".packed-x.{pid}.tmp.safetensors" for pid in (dead, alive)]  # an older layerleap's names
    others = [".packed-x.abc.tmp.safetensors", ".other.123.tmp.safetensors", "packed-x.safetensors"]
    others += [f".packed-x.{dead}-.tmp.safetensors", f".packed-x.{dead}-a.b.tmp.safetensors"]
    for name in names + older + others:
        (tmp_path / name).write_bytes(b"half")
    remove_stale_temporaries(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:] + older[1:] + others)
    remove_stale_temporaries(tmp_path / "missing" / "packed-x.safetensors")  # a missing folder: nothing to do


def test_threads_writing_one_path_at_once_each_leave_a_complete_file(tmp_path):
    """Each write has a temporary of its own: one thread's rename never publishes another's half-written
    file or takes it away from under it."""
    import threading

    from layerleap.files import atomic_write

    path, failures, torn = tmp_path / "out.txt", [], []

    def writer(i: int) -> None:
        def write(p):
            with open(p, "w") as f:
                for _ in range(100):
                    f.write(f"{i}\n")
                    f.flush()

        try:
            for _ in range(15):
                atomic_write(path, write)
                lines = path.read_text().splitlines()
                if len(lines) != 100 or len(set(lines)) != 1:
                    torn.append(len(lines))
        except Exception as e:
            failures.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and torn == []
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


# -- locked: read-modify-write of a file several processes update --------------------------------------
def test_a_lock_held_too_long_or_a_folder_not_writable_is_a_clear_error(tmp_path):
    from filelock import FileLock

    from layerleap.files import locked

    path = tmp_path / "known.json"
    with FileLock(str(tmp_path / ".known.json.lock")):  # another holder (a process, as far as filelock goes)
        with pytest.raises(LayerleapError, match=r"cannot write .*known.json: another process held its lock"):
            with locked(path, wait=0.1):
                pass
    with locked(path):  # released: had at once
        pass
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LayerleapError, match=r"cannot write .*a-file/known.json: "):
        with locked(tmp_path / "a-file" / "known.json"):
            pass


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_folder_gets_the_umasks_permissions_as_mkdir_gives(tmp_path, umask):
    """A cache entry (a converted model) or a written model folder is readable by whom the umask lets read
    it, as a folder ``mkdir`` makes: not the owner's alone (a team's shared ``$LAYERLEAP_CACHE``)."""
    import os
    import stat

    old = os.umask(umask)
    try:
        out = replace_dir(tmp_path / "out", lambda t: (t / "config.json").write_text("x"))
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o777 & ~umask


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_weights_file_gets_the_umasks_permissions_as_open_gives(tmp_path, umask):
    """safetensors makes its files the owner's only (0600): a heads or weights file written in a shared cache
    or a team's folder is readable by whom the umask lets read it, as a file ``open`` makes."""
    import os
    import stat

    import torch

    from layerleap.files import save_safetensors

    old = os.umask(umask)
    try:
        save_safetensors(tmp_path / "w.safetensors", {"a": torch.zeros(2)})
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert want == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == want


def test_json_files_are_strict_json_and_read_back_what_was_written(tmp_path):
    """JSON has no Infinity or NaN (browsers' JSON.parse and jq refuse them): a float that is not finite
    is written as its text, which ``number`` reads back."""
    path = tmp_path / "report.json"
    obj = {"alpha_rb": float("inf"), "low": -float("inf"), "ppl": float("nan"), "rows": [(1.5, float("inf"))]}
    write_json(path, obj)
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    back = read_json(path)
    assert back == {"alpha_rb": "inf", "low": "-inf", "ppl": "nan", "rows": [[1.5, "inf"]]}
    assert number(back["alpha_rb"]) == float("inf") and number(back["low"]) == -float("inf")
    assert number(back["ppl"]) != number(back["ppl"]) and number("text") == "text" and number(2.0) == 2.0


@pytest.mark.parametrize(
    "content, why",
    [
        (b'{"config": ', "JSONDecodeError"),
        (b"[" * 100_000, "RecursionError"),
        (b'{"a": "\xff\xfe\xff"}', "UnicodeDecodeError"),
        (b"[1, 2]", "holds JSON list, not an object"),
    ],
)
def test_a_bad_json_file_is_a_clear_error_naming_it_or_a_cache_miss(tmp_path, content, why):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(LayerleapError, match=f"calibration file {re.escape(str(path))}.*{why}.*: run it again") as e:
        read_json(path, "calibration file", "run it again")
    assert "Traceback" not in str(e.value)
    assert read_json(path, cache=True) is None
    assert read_json(tmp_path / "missing.json", cache=True) is None


def test_a_report_nested_past_the_parsers_depth_is_not_a_report_of_ours(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    with pytest.raises(LayerleapError, match="exists and is not a sweep report: choose another --json"):
        read_report(path, "a sweep report")


def test_a_json_output_nested_past_the_parsers_depth_is_refused_as_no_report_of_ours(tmp_path):
    from layerleap import validate as V

    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    with pytest.raises(LayerleapError, match="--json .*deep.json exists and is not a layerleap report"):
        V.report_file(str(path), "--json")
