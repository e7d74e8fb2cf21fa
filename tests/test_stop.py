"""Stop strings (``generate(..., stop=)``, ``stream``, ``generate --stop``) and conversations (a list of
messages as one prompt), on a tiny random model with a character tokenizer and a chat template."""

from __future__ import annotations

import json

import pytest

import layerleap
from layerleap import generate, stream
from layerleap.core.run import chat_token_ids
from layerleap.decoding import METHODS, Decoding, GenerationError, Method
from test_cli import cli
from test_streaming import method_options
from tiny_models import random_model, spm_tokenizer

PROMPT = "The sky is"


@pytest.fixture(scope="module")
def char(char_model_dir):
    return layerleap.load_folder(char_model_dir)


@pytest.fixture(scope="module")
def full(char):
    """Greedy's text without a stop string, and a stop string from its middle."""
    out = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False)
    stop = out.text[len(out.text) // 2 : len(out.text) // 2 + 2]
    assert len(out.text) > 10 and stop.strip()
    return out, stop


def _fewest(tok, ids: list[int], stop: str) -> int:
    return next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True))


def test_stop_ends_the_text_and_the_decoding(char, full):
    out, stop = full
    r = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop=stop)
    n = _fewest(char.tokenizer, out.token_ids, stop)
    assert r.text == out.text[: out.text.index(stop)]
    assert r.token_ids == out.token_ids[:n]  # the tokens through the stop string, as the server counts them
    assert r.finish_reason == "stop" and r.stats.stop_string == stop and r.stats["stop_string"] == stop
    assert r.stats.new_tokens == n and r.stats.model_calls == n < out.stats.model_calls  # it stopped there
    assert "stop_string" not in out.stats.to_dict()
    # a list: the one complete first ends the text
    r2 = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop=["@@@never", stop])
    assert (r2.text, r2.token_ids, r2.stats.stop_string) == (r.text, r.token_ids, stop)
    # a stop string that never comes changes nothing
    r3 = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop="@@@never")
    assert (r3.text, r3.token_ids, r3.finish_reason, r3.stats.stop_string) == (out.text, out.token_ids, "length", None)


def test_stop_in_a_batch_ends_its_row_only(char, full):
    out, stop = full
    other = "zzzz"
    alone = generate(char, other, max_new_tokens=40, stop_at_eos=False)
    stop = next(s for s in (stop, out.text[-3:-1], out.text[2:4]) if s not in alone.text)
    a, b = generate(char, [PROMPT, other], max_new_tokens=40, stop_at_eos=False, stop=stop)
    assert a.text == out.text[: out.text.index(stop)] and a.finish_reason == "stop"
    assert (b.text, b.token_ids, b.finish_reason) == (alone.text, alone.token_ids, "length")
    assert a.stats.layer_evals < b.stats.layer_evals  # the stopped row took no part in the later calls


def _lossless_options(model) -> dict[str, dict]:
    """The lossless methods' options on the tiny model (``test_streaming``'s, one place for every method)."""
    return {name: options for name, options in method_options(model).items() if METHODS[name].exact}


LOSSLESS = [name for name, m in METHODS.items() if m.exact]


def test_every_lossless_method_has_options_here(char):
    assert set(_lossless_options(char)) == set(LOSSLESS)


@pytest.mark.filterwarnings("ignore:rest. no corpus ships")
@pytest.mark.parametrize("method", LOSSLESS)
def test_lossless_methods_stop_where_greedy_does(char, full, method):
    """With a stop string a lossless method gives greedy's output cut at the same place: the same text and
    tokens, whatever a drafting round accepted past the stop string."""
    out, _ = full
    options = _lossless_options(char)[method]
    for stop in (out.text[5:7], out.text[len(out.text) // 2 : len(out.text) // 2 + 2], out.text[-2:]):
        want = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop=stop)
        got = generate(char, PROMPT, method, max_new_tokens=40, stop_at_eos=False, stop=stop, **options)
        assert want.text == out.text[: out.text.index(stop)]
        assert (got.text, got.token_ids, got.finish_reason, got.stats.stop_string) == (
            want.text,
            want.token_ids,
            "stop",
            stop,
        ), f"{method} with stop {stop!r}"


def test_a_drafting_methods_figures_count_the_tokens_kept(char):
    """A drafting round that accepts tokens past the stop string: the method's own figures per token
    (``tokens_per_round``) count the tokens kept, as ``new_tokens`` does (they counted the tokens accepted
    past it, which are not output)."""
    prompt = "hello hello hello"  # prompt lookup accepts several tokens a round here
    out = generate(char, prompt, "prompt-lookup", max_new_tokens=40, stop_at_eos=False, draft_len=4)
    cut = 0
    for stop in dict.fromkeys(out.text[k : k + 2] for k in range(2, len(out.text) - 1)):
        r = generate(char, prompt, "prompt-lookup", max_new_tokens=40, stop_at_eos=False, draft_len=4, stop=stop)
        d = r.stats.draft
        assert r.finish_reason == "stop" and r.stats.new_tokens == len(r.token_ids), stop
        assert d.tokens_per_round == pytest.approx(r.stats.new_tokens / d.rounds), stop
        assert r.stats.tokens_per_call == pytest.approx(r.stats.new_tokens / r.stats.model_calls), stop
        cut += d.accepted + d.rounds > r.stats.new_tokens  # a round accepted past the stop string
    assert cut  # the case this holds


def test_stream_with_stop_joins_to_the_result(char, full):
    out, stop = full
    s = stream(char, PROMPT, "prompt-lookup", max_new_tokens=40, stop_at_eos=False, stop=stop)
    pieces = list(s)
    want = generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop=stop)
    assert "".join(pieces) == s.result.text == want.text and s.result.token_ids == want.token_ids
    assert not any(stop in p for p in pieces) and s.result.finish_reason == "stop"


def test_a_stop_string_inside_a_token_keeps_that_token(tiny_hf_dir):
    """Byte-level BPE (SmolLM2's tokenizer): a stop string that ends inside a token keeps the token, and the
    text ends before the stop string."""
    model = layerleap.load_folder(tiny_hf_dir)
    out = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False)
    tok = model.tokenizer
    k, piece = next(
        (k, p) for k, t in enumerate(out.token_ids) if k > 2 and len(p := tok.decode([t])) >= 3 and p.isprintable()
    )
    start = len(tok.decode(out.token_ids[:k]))
    stop = piece[1:2]  # inside token k
    r = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, stop=stop)
    assert r.text == out.text[: out.text.index(stop)] and out.text.index(stop) <= start + 1
    assert r.token_ids == out.token_ids[: _fewest(tok, out.token_ids, stop)]


def _spm_model(monkeypatch, tokens: list[str], per_round: int = 1):
    """A tiny model with the byte-fallback tokenizer and a method "scripted" that emits ``tokens``
    ``per_round`` at a time, then returns (the model is not called)."""
    tok = spm_tokenizer()
    model = random_model(dict(vocab_size=len(tok), max_position=64))
    model.tokenizer = tok
    ids = tok.convert_tokens_to_ids(tokens)

    def scripted(run):
        for k in range(0, len(ids), per_round):
            if run.emit(0, ids[k : k + per_round]):
                return
            yield

    layerleap.get_method("greedy")
    monkeypatch.setitem(METHODS, "scripted", Method("scripted", scripted, False, False, False, "x"))
    return model, ids


@pytest.mark.parametrize("per_round", [1, 2])
def test_a_stop_string_in_the_held_tail_of_a_row_its_method_left_unfinished(monkeypatch, per_round):
    """A row whose text ends in a byte-fallback run (``<0x0A>``, held back while a later byte could still
    turn it into U+FFFD) and that its method leaves short of its budget: the stop string in that tail ends
    the text (it was returned, with no stop_string, while ``stream`` cut it)."""
    model, ids = _spm_model(monkeypatch, ["▁Hello", "<0x0A>"], per_round)
    r = generate(model, [1, 2], "scripted", 8, stop_at_eos=False, stop="\n")
    assert (r.text, r.token_ids, r.finish_reason, r.stats.stop_string) == ("Hello", ids, "stop", "\n")
    s = stream(model, [1, 2], "scripted", 8, stop_at_eos=False, stop="\n")
    assert "".join(s) == s.result.text == "Hello"


def test_a_row_cancelled_after_its_stop_string_ends_at_it(monkeypatch):
    """``cancel`` after a round whose text holds the stop string in its held tail (a byte-fallback newline):
    the result ends at the stop string, as the text held it before the cancel."""
    model, ids = _spm_model(monkeypatch, ["▁Hello", "<0x0A>", "▁world", "▁a"])
    d = Decoding(model, [1, 2], "scripted", 4, stop_at_eos=False, stop="\n")
    for n, _ in enumerate(d):
        if n == 1:  # "Hello" and the newline
            assert d.tokens(0) == ids[:2]
            d.cancel(0)
    r = d.results[0]
    assert (r.text, r.token_ids, r.finish_reason, r.stats.stop_string) == ("Hello", ids[:2], "stop", "\n")
    assert not r.stats.cancelled


@pytest.mark.parametrize(
    "stop,message",
    [
        ("", "stop is empty"),
        (["a", ""], "stop[1] is empty"),
        (["a", "b", "c", "d", "e"], "stop holds 5 strings, more than 4"),
        ([1], "stop[0] must be text"),
        (b"\n", "stop must be a string or a list of strings"),
        ({"a"}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_stop_is_refused(char, stop, message):
    with pytest.raises(GenerationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        generate(char, PROMPT, max_new_tokens=4, stop=stop)


def test_stop_needs_a_tokenizer_and_stop_strings_names_stop():
    model = random_model()
    with pytest.raises(GenerationError, match="no tokenizer"):
        generate(model, [1, 2, 3], max_new_tokens=4, stop="x")
    with pytest.raises(GenerationError, match="stop="):
        generate(model, [1, 2, 3], max_new_tokens=4, stop_strings=["x"])


# -- conversations ------------------------------------------------------------------------------------------
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]


def test_a_list_of_messages_is_one_conversation(char):
    want = chat_token_ids(char.tokenizer, CHAT, add_generation_prompt=True)
    r = generate(char, CHAT, max_new_tokens=6)
    assert isinstance(r, layerleap.GenerationResult) and r.prompt_ids == want
    assert r.token_ids == generate(char, want, max_new_tokens=6).token_ids
    # one user message says what chat=True says of its text
    one = [{"role": "user", "content": PROMPT}]
    said = generate(char, PROMPT, max_new_tokens=4, chat=True)
    assert generate(char, one, max_new_tokens=4).prompt_ids == said.prompt_ids
    # a method that decodes one prompt at a time takes a conversation
    assert generate(char, CHAT, "calm", max_new_tokens=4, threshold=0.5).prompt_ids == want
    s = stream(char, CHAT, max_new_tokens=6)
    assert "".join(s) == r.text


def test_a_list_of_conversations_is_a_batch(char):
    other = [{"role": "user", "content": "hi"}]
    rows = generate(char, [CHAT, other, PROMPT], max_new_tokens=5)
    assert [r.prompt_ids for r in rows] == [
        chat_token_ids(char.tokenizer, CHAT, add_generation_prompt=True),
        chat_token_ids(char.tokenizer, other, add_generation_prompt=True),
        char.tokenizer(PROMPT)["input_ids"],
    ]
    assert rows[1].token_ids == generate(char, other, max_new_tokens=5).token_ids


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([{"role": "user"}], "message 0 has no 'content'"),
        ([{"content": "hi"}], "message 0 has no 'role'"),
        ([{"role": "user", "content": "hi"}, "more"], "item 1 is 'more'"),
        ([{"role": "user", "content": ["hi"]}], "message 0's content must be text"),
        ([{"role": " ", "content": "hi"}], "message 0's role is empty"),
        ([[{"role": "user", "content": "hi"}], [{"role": "user"}]], "prompt 1 of the batch: message 0 has no"),
    ],
)
def test_bad_messages_are_refused(char, prompt, message):
    with pytest.raises(GenerationError, match=message):
        generate(char, prompt, max_new_tokens=4)


def test_a_conversation_needs_a_chat_template(char_model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(char_model_dir, tmp_path / "nochat")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for f in folder.glob("chat_template.*"):
        f.unlink()
    model = layerleap.load_folder(folder)
    assert not getattr(model.tokenizer, "chat_template", None)
    with pytest.raises(GenerationError, match="no chat template: a conversation"):
        generate(model, CHAT, max_new_tokens=4)
    with pytest.raises(GenerationError, match="no tokenizer .*: a conversation"):
        generate(random_model(), CHAT, max_new_tokens=4)


# -- the command line ---------------------------------------------------------------------------------------
def test_generate_stop_on_the_command_line(capsys, char_model_dir, char, full):
    out, stop = full
    base = ["generate", "--model", char_model_dir, "--prompt", PROMPT, "--max-new-tokens", 40]
    rc, text, _ = cli(capsys, *base, "--stop", "@@@never", "--stop", stop, "--json")
    got = json.loads(text)
    assert rc == 0 and got["finish_reason"] == "stop" and got["stats"]["stop_string"] == stop
    want = generate(char, PROMPT, max_new_tokens=40, stop=stop)
    assert got["text"] == want.text and got["token_ids"] == want.token_ids
    rc, text, _ = cli(capsys, *base, "--stop", stop, "--stream")
    assert rc == 0 and text.splitlines()[0] == want.text


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--stop", ""], "argument --stop: is empty"),
        ([x for s in "abcde" for x in ("--stop", s)], "--stop is given 5 times, more than 4"),
    ],
)
def test_generate_bad_stop_exits_2(capsys, char_model_dir, extra, message):
    rc, _, err = cli(capsys, "generate", "--model", char_model_dir, "--prompt", PROMPT, *extra)
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
def test_min_tokens_holds_off_a_stop_string_as_the_server_does(char, full, method):
    """vLLM's rule, in generate as in the server: a stop string that ends in the text of the tokens before the
    min_tokens-th does not count; the first one that ends later stops the text."""
    out, _ = full
    text = out.text
    stop = next(c for i, c in enumerate(text[:4]) if c.strip() and c in text[i + 1 :] and text.index(c) == i)
    assert generate(char, PROMPT, max_new_tokens=40, stop_at_eos=False, stop=stop).text == text[: text.index(stop)]
    least = _fewest(char.tokenizer, out.token_ids, stop) + 1  # the first one ends in the tokens before the least-th
    floor = len(char.tokenizer.decode(out.token_ids[: least - 1], skip_special_tokens=True))
    later = next(i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > floor)
    r = generate(
        char,
        PROMPT,
        method,
        max_new_tokens=40,
        stop_at_eos=False,
        stop=stop,
        min_tokens=least,
        **method_options(char)[method],
    )
    assert r.text == text[:later] and r.finish_reason == "stop" and r.stats.stop_string == stop
