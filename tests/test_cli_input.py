"""``generate``'s prompt sources and its streamed output: a byte-order mark is no part of a prompt,
and the streamed text ends its line when a Ctrl-C or an error cuts it."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

import layerleap
from layerleap.cli import main
from layerleap.commands import basic

BOM = b"\xef\xbb\xbf"


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


def _prompt_ids(out: str) -> list[int]:
    return [json.loads(line)["stats"]["prompt_tokens"] for line in out.splitlines()]


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.txt"])
def test_a_prompts_file_with_a_byte_order_mark(capsys, tmp_path, tiny_hf_dir, tiny, name):
    f = tmp_path / name
    f.write_bytes(BOM + (b'"Hello"\n' if name.endswith(".jsonl") else b"Hello\n"))
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", f, "--max-new-tokens", 2, "--json")
    assert rc == 0, err
    assert _prompt_ids(out) == [len(tiny.tokenizer.encode("Hello"))]


def test_a_prompt_on_stdin_with_a_byte_order_mark(capsys, monkeypatch, tiny_hf_dir, tiny):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(BOM + b"Hello")))
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompt", "-", "--max-new-tokens", 2, "--json")
    assert rc == 0, err
    assert _prompt_ids(out) == [len(tiny.tokenizer.encode("Hello"))]


@pytest.mark.parametrize("cut", [KeyboardInterrupt, layerleap.LayerleapError])
def test_a_cut_stream_ends_its_line(capsys, monkeypatch, tiny_hf_dir, cut):
    def stream(*args, **kwargs):
        yield "some text"
        raise cut("cut")

    monkeypatch.setattr(basic, "stream", stream)
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompt", "Hi", "--max-new-tokens", 4, "--stream")
    assert rc == (130 if cut is KeyboardInterrupt else 2)
    assert out == "some text\n"
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("layerleap generate: ")


def test_a_spec_bench_file_with_a_byte_order_mark(tmp_path):
    """A question.jsonl saved with a byte-order mark (as some editors do) reads as the same prompts."""
    from layerleap.datasets import SHIPPED_SPEC_BENCH, spec_bench

    lines = SHIPPED_SPEC_BENCH.read_bytes().splitlines(keepends=True)[:3]
    f = tmp_path / "question.jsonl"
    f.write_bytes(BOM + b"".join(lines))
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(b"".join(lines))
    assert spec_bench(f) == spec_bench(plain) and len(spec_bench(f)) == 3


@pytest.mark.parametrize("given,prompt", [(b"Hello\n", "Hello"), (b"Hello\r\n", "Hello"), (b"Hello\n\n", "Hello\n")])
def test_a_prompt_on_stdin_ends_before_its_final_newline(capsys, monkeypatch, tiny_hf_dir, tiny, given, prompt):
    """``echo Hello | layerleap generate --prompt -`` decodes "Hello": the newline that ends the input's last
    line is no part of the prompt (one more is)."""
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(given)))
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompt", "-", "--max-new-tokens", 2, "--json")
    assert rc == 0, err
    assert _prompt_ids(out) == [len(tiny.tokenizer.encode(prompt))]


def test_a_prompts_file_that_is_a_pipe(capsys, tmp_path, tiny_hf_dir, tiny):
    """A FIFO (the shell's ``<(...)``) is read as a file is, once."""
    import os
    import threading

    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "wb") as f:
            f.write(b"Hello\nSecond prompt\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    rc, out, err = cli(
        capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", fifo, "--max-new-tokens", 2, "--json"
    )
    writer.join(5)
    assert rc == 0, err
    assert _prompt_ids(out) == [len(tiny.tokenizer.encode(p)) for p in ("Hello", "Second prompt")]


@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", 2], ["score"]])
def test_a_batch_past_the_limit_is_refused_before_loading(capsys, monkeypatch, tmp_path, tiny_hf_dir, command):
    from layerleap.decoding import MAX_BATCH

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(basic, "_load", load)
    f = tmp_path / "many.txt"
    f.write_text("".join(f"prompt {i}\n" for i in range(MAX_BATCH + 1)))
    rc, _, err = cli(capsys, *command, "--model", tiny_hf_dir, "--prompts-file", f)
    assert rc == 2 and "Traceback" not in err
    assert f"holds {MAX_BATCH + 1:,} prompts, beyond the {MAX_BATCH:,}" in err and "split the file" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["match-rate", "--layers", "1", "--k", "1", "--heads", "shared", "--category", "qa", "--plot", "{tmp}/m.png"],
        ["theory", "ppd", "--measure", "--exit-layers", "1", "--ks", "1", "--categories", "qa", "--out", "{tmp}/d"],
    ],
    ids=["--plot", "theory --out"],
)
def test_a_plot_without_matplotlib_is_refused_before_the_run(capsys, monkeypatch, tmp_path, char_model_dir, argv):
    """matplotlib is an extra: a command asked for a plot says so before measuring anything, not after."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    args = [*argv, "--model", str(char_model_dir), "--prompts", "1", "--max-new-tokens", "4", "--threads", "1"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs matplotlib to draw plots (not installed): pip install 'layerleap[plot]'" in err
    assert "Traceback" not in err and not (tmp_path / "d" / "match_rates.json").exists()
