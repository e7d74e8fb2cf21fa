"""``layerleap chat`` on a tiny random model with a character tokenizer and a chat template: turns from a
pipe (stdin) give the answers ``generate`` gives to the same messages, the history carries over, and the
slash commands, conversation files, context overflow, Ctrl-C and exit codes behave as its help says."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys

import pytest
from subprocs import Proc, layerleap_cmd
from tiny_models import random_model, save_char_tokenizer, save_hf_folder

import layerleap
from layerleap.cli import main
from layerleap.commands import chat as chat_cmd


@pytest.fixture(scope="module")
def model(char_model_dir):
    return layerleap.load(str(char_model_dir))


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """The char model with a context of 64 tokens."""
    folder = tmp_path_factory.mktemp("small") / "small"
    save_hf_folder(random_model(dict(vocab_size=128, max_position=64, tie_embeddings=False)), folder)
    save_char_tokenizer(folder)
    return folder


def chat(capsys, monkeypatch, lines: list[str], *argv) -> tuple[int, str, str]:
    """``layerleap chat ARGV`` in-process with ``lines`` piped to stdin -> (exit code, stdout, stderr)."""
    data = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    rc = main(["chat", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def answers(model, turns: list[str], n: int, method: str = "greedy", system: str | None = None) -> list[str]:
    """What ``generate`` answers to each turn of a conversation that keeps its answers."""
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for t in turns:
        messages.append({"role": "user", "content": t})
        text = layerleap.generate(model, messages, method, n).text
        messages.append({"role": "assistant", "content": text})
        out.append(text)
    return out


def test_piped_turns_answer_as_generate_with_the_history(capsys, monkeypatch, char_model_dir, model):
    rc, out, err = chat(
        capsys, monkeypatch, ["Hello there", "", "And then?"], "--model", char_model_dir, "--max-new-tokens", 12
    )
    assert rc == 0, err
    first, second = answers(model, ["Hello there", "And then?"], 12)
    assert out == f"{first}\n{second}\n"
    alone = layerleap.generate(model, [{"role": "user", "content": "And then?"}], "greedy", 12).text
    assert second != alone  # the second turn's prompt held the first exchange
    assert "Traceback" not in err


def test_system_message_flag_and_command(capsys, monkeypatch, char_model_dir, model):
    argv = ("--model", char_model_dir, "--max-new-tokens", 10, "--system", "You are terse.")
    rc, out, _ = chat(capsys, monkeypatch, ["Hi", "/system Be kind.", "Hi again"], *argv)
    assert rc == 0
    first = answers(model, ["Hi"], 10, system="You are terse.")[0]
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Hi again"},
    ]
    assert out == f"{first}\n{layerleap.generate(model, messages, 'greedy', 10).text}\n"


def test_reset_clears_the_history(capsys, monkeypatch, char_model_dir):
    rc, out, err = chat(
        capsys, monkeypatch, ["Hi", "Hi", "/reset", "Hi"], "--model", char_model_dir, "--max-new-tokens", 8
    )
    assert rc == 0
    a, b, c = out.splitlines() if out.count("\n") == 3 else pytest.skip("an answer held a newline")
    assert c == a and b != a
    assert "the conversation is cleared" in err


def test_method_switch_and_stats(capsys, monkeypatch, char_model_dir, model):
    lines = ["Hi", "/stats", "/method prompt-lookup max_ngram=2", "Tell me more", "/stats"]
    rc, out, err = chat(capsys, monkeypatch, lines, "--model", char_model_dir, "--max-new-tokens", 16)
    assert rc == 0, err
    first, second = answers(model, ["Hi", "Tell me more"], 16)  # prompt lookup is exact: greedy's text
    stats = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert stats[0].startswith("[greedy] ") and "tokens/call" in stats[0]
    assert stats[1].startswith("[prompt-lookup] ") and "acceptance" in stats[1]
    # the second turn's prompt pass reused the first turn's keys and values, and its answer is greedy's still
    assert "prompt tokens reused" not in stats[0] and "prompt tokens reused" in stats[1]
    assert out.startswith(f"{first}\n{stats[0]}\n{second}\n")
    assert "method prompt-lookup (max_ngram=2)" in err


@pytest.mark.parametrize(
    "line, flags",
    [
        ("/method nope", ["--method", "nope"]),
        ("/method self-spec exit_layer=99", ["--method", "self-spec", "--opt", "exit_layer=99"]),
        ("/method prompt-lookup bogus=1", ["--method", "prompt-lookup", "--opt", "bogus=1"]),
        ("/method prompt-lookup max_ngram", ["--method", "prompt-lookup", "--opt", "max_ngram"]),
    ],
)
def test_a_bad_method_says_what_generate_says_and_the_chat_goes_on(capsys, monkeypatch, char_model_dir, line, flags):
    assert main(["generate", "--model", str(char_model_dir), "--prompt", "Hi", *flags]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]
    rc, out, err = chat(capsys, monkeypatch, [line, "Hi", "/stats"], "--model", char_model_dir, "--max-new-tokens", 4)
    assert rc == 0
    assert f"layerleap chat: error: {said}" in err.splitlines()
    assert "[greedy] " in out  # the turn after it ran with the method before


def test_a_sampling_flag_refuses_a_greedy_method(capsys, monkeypatch, char_model_dir):
    argv = ("--model", char_model_dir, "--method", "sample", "--temperature", "0.5", "--max-new-tokens", 4)
    rc, out, err = chat(capsys, monkeypatch, ["/method greedy", "Hi", "/stats"], *argv)
    assert rc == 0
    assert "method 'greedy' decodes greedily and would ignore temperature" in err
    assert "[sample] " in out


def test_save_and_load_round_trip(capsys, monkeypatch, char_model_dir, model, tmp_path):
    f = tmp_path / "talk.json"
    argv = ("--model", char_model_dir, "--max-new-tokens", 8, "--system", "Sys.")
    rc, out, _ = chat(capsys, monkeypatch, ["Hi", "More", f"/save {f}"], *argv)
    assert rc == 0
    saved = json.loads(f.read_text())
    first, second = answers(model, ["Hi", "More"], 8, system="Sys.")
    assert saved == [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": second},
    ]
    # /load in a chat and --load at the start continue it: the next answer is generate's on the whole history
    want = layerleap.generate(model, saved + [{"role": "user", "content": "Go on"}], "greedy", 8).text
    rc, out, err = chat(capsys, monkeypatch, [f"/load {f}", "Go on"], "--model", char_model_dir, "--max-new-tokens", 8)
    assert rc == 0 and out == want + "\n" and f"loaded 4 messages from {f}" in err
    rc, out, _ = chat(capsys, monkeypatch, ["Go on"], "--model", char_model_dir, "--max-new-tokens", 8, "--load", f)
    assert rc == 0 and out == want + "\n"
    # a second /save replaces its own file
    rc, _, err = chat(capsys, monkeypatch, ["Hi", f"/save {f}"], "--model", char_model_dir, "--max-new-tokens", 8)
    assert rc == 0 and len(json.loads(f.read_text())) == 2, err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read conversation file"),
        ("not json", "is not valid JSON"),
        ('{"a": 1}', "holds JSON dict, not a list of messages"),
        ('[{"role": "user"}]', "message 0 is not {'role': text, 'content': text}"),
        ('[{"role": "robot", "content": "x"}]', "has role 'robot': a role is one of system, user, assistant"),
        ('[{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]', "only the first message"),
        # the chat keeps user and assistant alternating, as strict chat templates require
        ('[{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]', "role 'user' where 'assistant'"),
        ('[{"role": "system", "content": "s"}, {"role": "assistant", "content": "y"}]', "'assistant' where 'user'"),
        ('[{"role": "user", "content": "x"}]', "ends with a user message, which has no answer"),
    ],
)
def test_a_bad_file_to_load(capsys, monkeypatch, char_model_dir, tmp_path, content, message):
    f = tmp_path / "bad.json"
    if content is not None:
        f.write_text(content)
    rc, out, err = chat(
        capsys, monkeypatch, [f"/load {f}", "Hi", "/stats"], "--model", char_model_dir, "--max-new-tokens", 4
    )
    assert rc == 0 and "[greedy] " in out  # the chat goes on
    assert message in err and "Traceback" not in err
    assert main(["chat", "--model", str(char_model_dir), "--load", str(f)]) == 2  # at the start: exit code 2
    assert message in capsys.readouterr().err


def test_save_refuses_another_file_and_a_bad_name(capsys, monkeypatch, char_model_dir, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    lines = ["Hi", f"/save {notes}", f"/save {tmp_path}", f"/save {tmp_path / 'talk.txt'}", "/save", "/stats"]
    rc, out, err = chat(capsys, monkeypatch, lines, "--model", char_model_dir, "--max-new-tokens", 4)
    assert rc == 0 and "[greedy] " in out
    assert notes.read_text() == '{"mine": true}'
    assert "exists and is not a conversation file" in err
    assert "is a folder: give a file name" in err
    assert "must end in .json" in err
    assert "/save needs a file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]  # no temporaries left


def test_context_overflow_drops_the_oldest_turns(capsys, monkeypatch, small_dir, tmp_path):
    f = tmp_path / "c.json"
    turns = [f"turn {i} words" for i in range(6)]
    argv = ("--model", small_dir, "--max-new-tokens", 12, "--system", "S")
    rc, out, err = chat(capsys, monkeypatch, [*turns, f"/save {f}"], *argv)
    assert rc == 0, err
    assert err.count("the oldest turns are dropped") == 1
    saved = json.loads(f.read_text())
    assert saved[0] == {"role": "system", "content": "S"}  # kept
    users = [m["content"] for m in saved if m["role"] == "user"]
    assert users[-1] == turns[-1] and turns[0] not in users
    assert [m["role"] for m in saved[1:]] == ["user", "assistant"] * (len(saved) // 2)
    # a message that does not fit alone: said, and the chat goes on
    rc, out, err = chat(capsys, monkeypatch, ["x" * 60, "Hi", "/stats"], *argv)
    assert rc == 0 and "exceeds the model's context of 64" in err and "[greedy] " in out


def test_exit_codes_and_ctrl_c(capsys, monkeypatch, char_model_dir):
    argv = ("--model", char_model_dir, "--max-new-tokens", 4)
    assert chat(capsys, monkeypatch, [], *argv)[0] == 0  # end of input
    rc, out, _ = chat(capsys, monkeypatch, ["/quit", "Hi"], *argv)
    assert rc == 0 and out == ""
    rc, out, err = chat(capsys, monkeypatch, ["/help", "/nope"], *argv)
    assert rc == 0 and "/method NAME" in out and "unknown command /nope" in err

    def interrupt(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat_cmd.Chat, "_read", interrupt)  # Ctrl-C at the prompt: the chat ends, no error
    rc, out, err = chat(capsys, monkeypatch, [], *argv)
    assert rc == 0 and "interrupted" not in err and "Traceback" not in err


def test_ctrl_c_while_streaming_keeps_the_text_printed(capsys, monkeypatch, char_model_dir, tmp_path):
    real = chat_cmd.stream
    calls = []

    def cut(*a, **kw):  # the first answer is stopped after two pieces
        s = real(*a, **kw)
        calls.append(a[1])
        if len(calls) > 1:
            return s

        def pieces():
            yield "ab"
            yield "c"
            raise KeyboardInterrupt

        return pieces()

    monkeypatch.setattr(chat_cmd, "stream", cut)
    f = tmp_path / "c.json"
    lines = ["Hi", "/stats", "Next", f"/save {f}"]
    rc, out, err = chat(capsys, monkeypatch, lines, "--model", char_model_dir, "--max-new-tokens", 4)
    assert rc == 0 and "[stopped]" in err and "Traceback" not in err
    assert out.startswith("abc\nthe last answer was stopped")
    assert json.loads(f.read_text())[:2] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "abc"}]
    assert calls[1][:2] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "abc"}]


def test_real_ctrl_c_stops_an_answer_and_the_chat_goes_on(char_model_dir):
    proc = Proc(
        [*layerleap_cmd(), "chat", "--model", str(char_model_dir), "--max-new-tokens", "2000", "--threads", "1"],
        stdin=subprocess.PIPE,
    )
    proc.p.stdin.write(b"Once upon a time\n")
    proc.p.stdin.flush()
    proc.wait_for(r"loaded .* in [\d.]+ s")
    proc.wait_for(r"\S", stream="out")  # the answer streams (2000 tokens take over a second)
    proc.send(signal.SIGINT)
    proc.wait_for(r"\[stopped\]")
    proc.p.stdin.write(b"/stats\n")
    proc.p.stdin.close()
    rc, out, err = proc.finish(60)
    assert rc == 0, err
    assert "Traceback" not in err and "interrupted" not in err
    assert "the last answer was stopped" in out


def test_bad_flags_exit_2(capsys, char_model_dir, tmp_path):
    for argv, message in [
        (["--method", "greedy", "--temperature", "0.5"], "decodes greedily and would ignore temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", "5000"], "beyond tiny's context of 2048 tokens"),
        (["--opt", "x"], "bad option 'x'"),
        (["--load", str(tmp_path / "none.json")], "cannot read conversation file"),
        # token ids beyond the vocabulary: said at the start, not at every turn
        (["--logit-bias", "5000=3"], "--logit-bias's token id 5000 must be an integer in [0, 127]"),
        (["--allowed-token-ids", "999"], "--allowed-token-ids's token id 999 must be an integer in [0, 127]"),
        (["--stop-token-ids", "999"], "--stop-token-ids's token id 999 must be an integer in [0, 127]"),
    ]:
        assert main(["chat", "--model", str(char_model_dir), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_a_handled_ctrl_c_calls_off_the_last_resort(monkeypatch, capsys):
    from layerleap import interrupts

    exits = []
    monkeypatch.setattr(interrupts, "GRACE_S", 0.0)
    monkeypatch.setattr(interrupts.os, "_exit", exits.append)
    monkeypatch.setitem(interrupts._state, "at", 1.0)
    interrupts.handled()
    interrupts._last_resort(1.0)  # the thread of the Ctrl-C that chat handled
    assert exits == [] and not interrupts.interrupted()
    monkeypatch.setitem(interrupts._state, "at", 2.0)
    interrupts._last_resort(2.0)  # one not handled still ends the process
    assert exits == [130]


def test_a_message_too_long_leaves_the_conversation_as_it_was(capsys, monkeypatch, small_dir, tmp_path):
    f = tmp_path / "c.json"
    argv = ("--model", small_dir, "--max-new-tokens", 4, "--system", "S")
    rc, _, err = chat(capsys, monkeypatch, ["Hi", "There", "x" * 60, f"/save {f}"], *argv)
    assert rc == 0 and "exceeds the model's context of 64" in err
    assert "the oldest turns are dropped" not in err  # nothing was dropped: the message was refused
    saved = json.loads(f.read_text())
    assert [m["content"] for m in saved if m["role"] == "user"] == ["Hi", "There"]
    assert len(saved) == 5


def test_a_lossy_methods_budget_note_is_said_once_after_the_answers_line(capsys, monkeypatch, char_model_dir, tmp_path):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))  # no calibration: calm says so
    monkeypatch.setattr(sys, "stderr", sys.stdout)  # one stream, in the order a terminal shows them
    lines = ["Hi", "There", "/method greedy", "/method calm", "Again"]
    rc, out, _ = chat(capsys, monkeypatch, lines, "--model", char_model_dir, "--max-new-tokens", 6, "--method", "calm")
    assert rc == 0, out
    notes = [ln for ln in out.splitlines() if "calm: no calibration for tiny" in ln]
    assert len(notes) == 1 and notes[0].startswith("calm: no calibration"), out


def test_a_ctrl_c_that_a_library_turned_into_an_error_stops_the_answer(capsys, monkeypatch, char_model_dir):
    from layerleap import interrupts

    exits = []
    monkeypatch.setattr(interrupts, "GRACE_S", 0.0)
    monkeypatch.setattr(interrupts.os, "_exit", exits.append)
    real = chat_cmd.stream
    calls = []

    def cut(*a, **kw):  # the Ctrl-C comes during the first answer, and the library raises its own error
        calls.append(a[1])
        if len(calls) > 1:
            return real(*a, **kw)

        def pieces():
            yield "ab"
            monkeypatch.setitem(interrupts._state, "at", 1.0)  # what the SIGINT handler records
            raise layerleap.LayerleapError("the tokenizer was interrupted")

        return pieces()

    monkeypatch.setattr(chat_cmd, "stream", cut)
    rc, out, err = chat(capsys, monkeypatch, ["Hi", "Next"], "--model", char_model_dir, "--max-new-tokens", 4)
    assert rc == 0 and "[stopped]" in err and "interrupted" not in err and "error" not in err, err
    assert calls[1][:2] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ab"}]
    interrupts._last_resort(1.0)  # the Ctrl-C's thread, 15 s later: the chat handled it
    assert exits == []


def test_a_byte_order_mark_before_the_first_piped_line_is_no_text(capsys, monkeypatch, char_model_dir):
    argv = ("--model", char_model_dir, "--max-new-tokens", 4)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeff/stats\r\nHi\r\n".encode()), encoding="utf-8"))
    assert main(["chat", *map(str, argv)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("no answer yet\n"), out  # the first line is the command, not a message


def test_a_draft_model_with_a_shorter_context_drops_the_oldest_turns(capsys, monkeypatch, char_model_dir, small_dir):
    turns = ["turn 0 words and more words", "turn 1 words and more words", "turn 2 words", "/stats"]
    argv = ("--model", char_model_dir, "--max-new-tokens", 20, "--method", "speculative", "--opt", f"draft={small_dir}")
    rc, out, err = chat(capsys, monkeypatch, turns, *argv)
    assert rc == 0 and "error" not in err, err
    assert "beyond the draft model's context of 64 tokens: the oldest turns are dropped" in err
    assert "[speculative] " in out
