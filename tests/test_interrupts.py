"""Ctrl-C at several moments, as real SIGINTs to the ``layerleap`` command in a subprocess: during
start-up (importing torch), decoding, a sweep, training and PPD on two processes (the signal to the
whole process group, as a terminal sends it).  Each ends with one line on stderr and exit code 130,
no traceback; files are complete or absent, and training resumes from its checkpoint.  (Ctrl-C
during a model conversion: test_cache.py.)  Each test waits for a marker on stderr before the signal."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch
from subprocs import Proc, last_line, layerleap_cmd

layerleap_bin = layerleap_cmd()


def interrupted(proc: Proc, line: str, timeout: float = 120.0) -> tuple[str, str]:
    rc, out, err = proc.finish(timeout)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in out + err and "Error" not in err, err[-3000:]
    assert last_line(err) == line, err[-3000:]
    return out, err


def test_during_start_up():
    proc = Proc([*layerleap_bin, "info", "--buffer-mb", "8"])
    if os.path.exists("/proc/self/maps"):  # importing torch, however loaded the machine is
        proc.wait_for_library("libtorch")
    else:
        time.sleep(0.3)
    proc.send()
    _, err = interrupted(proc, "layerleap: interrupted", 60)
    assert err.count("interrupted") == 1


def test_during_decoding(char_model_dir):
    proc = Proc(
        [
            *layerleap_bin,
            "generate",
            "--model",
            str(char_model_dir),
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "2000",
            "--threads",
            "1",
        ]
    )
    proc.wait_for(r"loaded .* in [\d.]+ s")
    time.sleep(0.1)  # 2000 tokens take over a second
    proc.send()
    out, _ = interrupted(proc, "layerleap generate: interrupted")
    assert out == ""


def test_during_a_sweep(tmp_path, char_model_dir):
    report = tmp_path / "s.json"
    proc = Proc(
        [
            *layerleap_bin,
            "sweep",
            "bild",
            "--model",
            str(char_model_dir),
            "--exit-layer",
            "2",
            "--head",
            "shared",
            "--alpha-fb",
            "0.5",
            "--alpha-rb",
            "1",
            "--draft-lens",
            "2",
            "--categories",
            "qa,writing",
            "--prompts",
            "12",
            "--max-new-tokens",
            "48",
            "--threads",
            "1",
            "--json",
            str(report),
            "--plot",
            str(tmp_path / "s.png"),
        ]
    )
    proc.wait_for(r"sweep bild: +\d+%.*\| *[3-9]/")  # the first prompt is done (3 points a prompt)
    proc.send()
    rc, out, err = proc.finish(120)
    assert rc == 130 and "Traceback" not in err and last_line(err).startswith("interrupted: "), err[-2000:]
    done = json.loads(report.read_text())  # complete JSON, with the finished prompts
    n = done["config"]["n_prompts"]
    assert done["interrupted"] and 1 <= done["prompts_done"] < n
    assert f"interrupted: {done['prompts_done']} of {n} prompts finished" == last_line(err)


def test_during_training_then_resume(tmp_path, char_model_dir):
    from safetensors.torch import save_file

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))}, str(chunks))
    out = tmp_path / "medusa.safetensors"
    argv = [
        *layerleap_bin,
        "train",
        "medusa",
        "--model",
        str(char_model_dir),
        "--chunks",
        str(chunks),
        "--seq-len",
        "16",
        "--heads",
        "2",
        "--steps",
        "60",
        "--save-every",
        "3",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    proc = Proc(argv)
    proc.wait_for(r"train medusa: +\d+%.*\| *([7-9]|\d\d+)/60")
    proc.send()
    interrupted(proc, "layerleap train medusa: interrupted")
    assert not out.exists()  # written only at the end
    ckpt = out.with_name(out.name + ".ckpt.safetensors")
    from safetensors import safe_open

    with safe_open(str(ckpt), "pt") as f:
        saved = int(f.metadata()["step"])
    assert saved >= 6  # every 3 steps, and at the Ctrl-C unless it came during an update
    rc, stdout, err = Proc(argv).finish(300)
    assert rc == 0, err[-2000:]
    rep = json.loads(stdout)
    assert rep["resumed_from"] == saved and rep["train_steps"] == 60 and out.is_file()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
@pytest.mark.parametrize("moment", ["start-up", "decoding"])
def test_ppd_processes(tmp_path, char_model_dir, moment):
    proc = Proc(
        [
            *layerleap_bin,
            "eval",
            "ppd-parallel",
            "--model",
            str(char_model_dir),
            "--exit-layer",
            "2",
            "--head",
            "shared",
            "--categories",
            "qa",
            "--prompts",
            "2",
            "--max-new-tokens",
            "600",
            "--json",
            str(tmp_path / "p.json"),
        ],
        group=True,
    )
    if moment == "start-up":
        proc.wait_for(r"\$ layerleap eval ppd-parallel", stream="out")
        time.sleep(1.0)  # the sub-process is importing torch and loading the model
    else:
        proc.wait_for(r"ppd-parallel: +\d+%")
        time.sleep(1.0)
    proc.signal_group()  # as a terminal: the main process and its sub-process
    _, err = interrupted(proc, "layerleap eval ppd-parallel: interrupted")
    assert "sub-process" not in err and not (tmp_path / "p.json").exists()
    end = time.monotonic() + 20
    while time.monotonic() < end:  # and no sub-process is left behind
        try:
            os.killpg(proc.p.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError("a process of the group is still running")


_HALF_IMPORT = """
from layerleap import interrupts
from layerleap.eval import quality
interrupts.install()
try:
    quality._library("slowpkg", "slowpkg", "a metric")  # Ctrl-C between its two submodules
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after the import")
print(quality._library("slowpkg", "slowpkg", "a metric").second.VALUE)  # the clean-up scores again
"""


def test_during_a_metric_import(tmp_path):
    """A Ctrl-C half way through a metric library's import (rouge-score's nltk takes a second) waits
    for the import to end, and the report written after it can still use the library."""
    pkg = tmp_path / "slowpkg"
    pkg.mkdir()
    (pkg / "first.py").write_text("VALUE = 1\n")
    (pkg / "second.py").write_text("from . import first\nVALUE = first.VALUE + 1\n")
    (pkg / "__init__.py").write_text(
        "import os, signal\nfrom . import first\nos.kill(os.getpid(), signal.SIGINT)\nfrom . import second\n"
    )
    proc = Proc([sys.executable, "-c", _HALF_IMPORT], env={"PYTHONPATH": str(tmp_path)})
    rc, out, err = proc.finish(60)
    assert rc == 0 and out.split() == ["interrupted", "after", "the", "import", "2"], err[-2000:]


def test_a_heavy_import_is_never_cut(tmp_path):
    """A Ctrl-C during the first import of a heavy library (matplotlib under ``match-rate --plot``)
    waits until the import is done, then interrupts: the module ran to its end, and no traceback of
    the library's comes out.  Here the library interrupts itself half way."""
    (tmp_path / "fakeheavy.py").write_text(
        "import os, signal, time, builtins\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "builtins.fakeheavy_done = True\n"
    )
    code = (
        "import sys, builtins\n"
        "from layerleap import interrupts\n"
        "interrupts.install()\n"
        "interrupts.HEAVY = interrupts.HEAVY | {'fakeheavy'}\n"
        "try:\n"
        "    import fakeheavy\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', getattr(builtins, 'fakeheavy_done', False))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = __import__("subprocess").run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal, even from a background job
    )
    assert p.stdout.strip() == "interrupted True", p.stdout + p.stderr
    assert "Traceback" not in p.stderr


_SLOW_FIFTH_STEP = """
import sys, time
import layerleap.train.loop as loop
from layerleap.__main__ import run

calls, backward = [], loop.backward


def slow(out):  # the 5th step's backward pass waits for the signal, so steps 1-4 are done
    value = backward(out)
    calls.append(value)
    if len(calls) == 5:
        print("fifth step", file=sys.stderr, flush=True)
        time.sleep(60)
    return value


loop.backward = slow
sys.argv = ["layerleap", *sys.argv[1:]]
run()
"""


def test_sigterm_during_training_saves_the_last_step_as_ctrl_c_does(tmp_path, char_model_dir):
    """torchrun, job schedulers and ``timeout`` stop a run with SIGTERM: it ends as a Ctrl-C does, the
    checkpoint holding the last finished step (not only the one of the last --save-every), exit code
    130, one line, and no temporary file left."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))}, str(chunks))
    out = tmp_path / "medusa.safetensors"
    args = ["train", "medusa", "--model", str(char_model_dir), "--chunks", str(chunks), "--seq-len", "16"]
    args += ["--heads", "2", "--steps", "60", "--save-every", "50", "--threads", "1", "--out", str(out)]
    proc = Proc([sys.executable, "-c", _SLOW_FIFTH_STEP, *args])
    proc.wait_for("fifth step")
    proc.send(signal.SIGTERM)
    interrupted(proc, "layerleap train medusa: interrupted")
    with safe_open(str(out.with_name(out.name + ".ckpt.safetensors")), "pt") as f:
        assert int(f.metadata()["step"]) == 4
    assert not out.exists() and not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_sigterm_raises_keyboard_interrupt_only_inside_the_block_and_only_in_place_of_its_default():
    from layerleap.interrupts import terminate_as_interrupt

    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs before this ends
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored

    came = []

    def own(signum, frame):
        came.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with terminate_as_interrupt():  # a handler of the caller's own is left as it is
            assert signal.getsignal(signal.SIGTERM) is own
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert came == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)

    import threading

    seen = []

    def in_a_thread():  # signal.signal cannot be called there: nothing is changed
        with terminate_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen == [signal.SIG_DFL]
