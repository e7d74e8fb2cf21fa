"""Streaming: ``Decoding`` round by round, ``layerleap.stream`` for every method, incremental
detokenization across multi-byte characters, cancelling, and ``generate --stream``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import layerleap
from layerleap import Decoding, generate, stream
from layerleap.drafters import medusa_transfer as drafters
from layerleap.drafters.companion import truncated
from layerleap.decoding import METHODS, GenerationError, Method
from layerleap.streaming import REPLACEMENT, TextPieces
from tiny_models import spm_tokenizer

MULTIBYTE = "Café 中文 😀 naïve — ok"


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    """A tiny random model with the real SmolLM2 tokenizer (byte-level BPE)."""
    return layerleap.load_folder(tiny_hf_dir)


def method_options(model) -> dict[str, dict]:
    """Every built-in method with options that run on the tiny model (random drafters and heads)."""
    torch.manual_seed(0)
    return {
        "greedy": {},
        "sample": {"seed": 3},
        "skipdecode": {"min_exit_layer": 2, "max_exit_layer": 4},
        "early-exit": {"exit_layer": 2},
        "calm": {"threshold": 0.5, "min_exit_layer": 2},
        "speculative": {"draft": truncated(model, 2), "draft_len": 3, "min_confidence": 0.0},
        "bild": {"exit_layer": 2, "head": "shared", "alpha_fb": 0.0},
        "medusa": {"heads": drafters.new_drafter(model, "medusa", steps=2), "tree": "2,1"},
        "hidden-transfer": {"transfer": drafters.new_drafter(model, "transfer", layers=[1, 2, 3]), "tree": "1,1"},
        "eagle": {"eagle_head": drafters.new_drafter(model, "eagle"), "draft_len": 3, "width": 2},
        "ppd": {"exit_layer": 2, "head": "shared"},
        "self-spec": {"exit_layer": 2, "head": "shared", "draft_len": 3},
        "prompt-lookup": {"draft_len": 4},
        "rest": {"draft_len": 4},
        "auto": {"transfer": drafters.new_drafter(model, "transfer", layers=[1, 2]), "tree": "2,1"},
    }


METHOD_NAMES = [
    "greedy",
    "sample",
    "skipdecode",
    "early-exit",
    "calm",
    "speculative",
    "bild",
    "medusa",
    "hidden-transfer",
    "eagle",
    "ppd",
    "self-spec",
    "prompt-lookup",
    "rest",
    "auto",
]


def test_every_builtin_method_is_covered(tiny):
    layerleap.get_method("greedy")
    assert set(method_options(tiny)) == set(METHODS) == set(METHOD_NAMES)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_stream_joins_to_generate(tiny, method):
    opts = method_options(tiny)[method]
    prompt = "Tell me a story about a cat."
    want = generate(tiny, prompt, method, 24, stop_at_eos=False, **opts)
    s = stream(tiny, prompt, method, 24, stop_at_eos=False, **opts)
    pieces = list(s)
    assert "".join(pieces) == s.result.text == want.text
    assert s.result.token_ids == want.token_ids and len(want.token_ids) == 24
    assert len(pieces) > 1 and all(pieces) and not any(p.endswith(REPLACEMENT) for p in pieces[:-1])


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_finish_reason_of_every_method(tiny, method):
    """A row that reaches max_new_tokens ends for "length", one that emits an end-of-sequence token for
    "stop" (here a token the method emits midway, made the EOS of the decoding)."""
    prompt = "Tell me a story about a cat."
    full = generate(tiny, prompt, method, 12, stop_at_eos=False, **method_options(tiny)[method])
    assert full.finish_reason == "length" and full.to_dict()["finish_reason"] == "length"
    eos = full.token_ids[5]
    d = Decoding(tiny, prompt, method, 12, **method_options(tiny)[method])
    d.gen = dataclasses.replace(d.gen, eos_ids=(eos,))  # before the first round makes the run
    for _ in d:
        pass
    assert d.results[0].token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert d.results[0].finish_reason == "stop"


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_decoding_rounds_add_what_the_method_accepted(tiny, method):
    """Each iteration reports the prompt whose output grew; the rounds add up to the result."""
    opts = method_options(tiny)[method]
    d = Decoding(tiny, "Once upon a time", method, 20, stop_at_eos=False, **opts)
    sizes, seen = [], 0
    for grew in d:
        assert grew == [0]
        now = len(d.tokens(0))
        assert now > seen
        sizes.append(now - seen)
        seen = now
    assert sum(sizes) == 20 == len(d.results[0].token_ids)
    if method in ("greedy", "sample", "skipdecode", "early-exit", "calm", "ppd"):
        assert sizes == [1] * 20  # one token a round


def test_text_pieces_hold_back_incomplete_characters(tiny):
    tok = tiny.tokenizer
    ids = tok(MULTIBYTE)["input_ids"]
    assert any(tok.decode([i]).endswith(REPLACEMENT) for i in ids), "the text should split a character across tokens"
    tp = TextPieces(tok)
    pieces = [tp.push(ids[:n]) for n in range(1, len(ids) + 1)]
    pieces.append(tp.finish(ids))
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert not any(REPLACEMENT in p for p in pieces)
    assert "😀" in pieces or any("😀" in p for p in pieces)  # the emoji arrives whole, in one piece


def _scripted(tokens: list[int], per_round: int):
    """A method that emits ``tokens`` ``per_round`` at a time (the model is not called)."""

    def fn(run):
        for i in range(0, len(tokens), per_round):
            if run.emit(0, tokens[i : i + per_round]):
                return
            yield

    return fn


@pytest.mark.parametrize("per_round", [1, 2, 3])
def test_stream_across_multibyte_characters(tiny, monkeypatch, per_round):
    """A method emitting the bytes of 😀 and 中 in separate rounds: no piece carries a broken character."""
    ids = tiny.tokenizer(MULTIBYTE)["input_ids"]
    layerleap.get_method("greedy")
    monkeypatch.setitem(METHODS, "scripted", Method("scripted", _scripted(ids, per_round), False, False, False, "x"))
    s = stream(tiny, [1, 2, 3], "scripted", len(ids), stop_at_eos=False)
    pieces = list(s)
    assert "".join(pieces) == s.result.text == MULTIBYTE
    assert not any(REPLACEMENT in p for p in pieces)


def test_cancel_stops_a_row_and_the_rest_go_on(tiny):
    prompts = ["one two three", "four five", "six"]
    want = generate(tiny, prompts, "greedy", 12, stop_at_eos=False)
    d = Decoding(tiny, prompts, "greedy", 12, stop_at_eos=False)
    for _grew in d:
        if len(d.tokens(1)) == 3:
            d.cancel(1)
    assert d.results[1].stats["cancelled"] and d.results[1].token_ids == want[1].token_ids[:3]
    assert d.results[1].finish_reason == "cancelled"
    for i in (0, 2):
        assert d.results[i].token_ids == want[i].token_ids and "cancelled" not in d.results[i].stats
        assert d.results[i].finish_reason == "length"


def test_closing_a_stream_early_stops_decoding(tiny):
    s = stream(tiny, "hello there", "greedy", 200, stop_at_eos=False)
    it = iter(s)
    next(it)
    it.close()
    assert s.result is None
    # the same model decodes normally afterwards (no inference mode left switched on)
    assert not torch.is_inference_mode_enabled()
    assert len(generate(tiny, "hello there", "greedy", 5, stop_at_eos=False).token_ids) == 5


def test_a_stream_and_a_decoding_iterate_once(tiny):
    """A loop left with ``break`` resumes where it stopped; iterating after the end yields nothing and
    keeps the result (no second decoding, which with sampling drew other text and failed)."""
    s = stream(tiny, "hello there", "sample", 12, stop_at_eos=False)
    got = []
    for piece in s:
        got.append(piece)
        break
    got += list(s)
    first = s.result
    assert "".join(got) == first.text and len(first.token_ids) == 12
    assert list(s) == [] and s.result is first
    d = Decoding(tiny, ["one two", "three"], "sample", 6, stop_at_eos=False)
    for _ in d:
        pass
    results = list(d.results)
    assert list(d) == [] and d.results == results


def test_an_interrupted_stream_is_refused_and_the_model_goes_on(tiny, monkeypatch):
    """A Ctrl-C inside a round ends the stream: iterating it again says to start a new one (not an
    AttributeError), and the next call decodes as if nothing happened."""
    want = generate(tiny, "hello there", "greedy", 8, stop_at_eos=False)
    s = stream(tiny, "hello there", "greedy", 8, stop_at_eos=False)
    it = iter(s)
    next(it)
    from layerleap.core.run import Run

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Run, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            list(it)
    with pytest.raises(GenerationError, match="stopped before its end"):
        list(s)
    with pytest.raises(GenerationError, match="stopped before its end"):
        list(s.decoding)
    assert generate(tiny, "hello there", "greedy", 8, stop_at_eos=False).token_ids == want.token_ids


def test_cancel_refuses_an_index_that_is_no_prompt(tiny):
    d = Decoding(tiny, ["one", "two"], "greedy", 4)
    for bad in (2, -1, "0", True, 0.0):
        with pytest.raises(GenerationError, match=r"cancel takes a prompt's index, an integer in \[0, 1\]"):
            d.cancel(bad)


def test_stream_refuses_a_list_and_a_model_without_tokenizer(tiny):
    with pytest.raises(GenerationError, match="one prompt"):
        stream(tiny, ["a", "b"], "greedy", 4)
    bare = layerleap.Transformer(layerleap.tiny_config()).eval()
    with pytest.raises(GenerationError, match="tokenizer"):
        stream(bare, [1, 2, 3], "greedy", 4)


def test_cli_generate_stream_prints_the_text(tiny_hf_dir, tiny, capsys):
    from layerleap.cli import main

    rc = main(
        [
            "generate",
            "--model",
            str(tiny_hf_dir),
            "--prompt",
            "Hello there",
            "--max-new-tokens",
            "12",
            "--method",
            "self-spec",
            "--opt",
            "exit_layer=2",
            "--opt",
            "head=shared",
            "--stream",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr().out
    want = generate(tiny, "Hello there", "self-spec", 12, exit_layer=2, head="shared")
    assert rc == 0 and out.startswith(want.text + "\n") and "[self-spec] " in out


@pytest.mark.parametrize(
    "pieces",
    [
        ["▁Hello", "<0x0A>", "<0xF0>"],  # a newline, then an emoji cut by the end: both bytes decode to U+FFFD
        ["▁Hello", "<0x0A>", "<0xF0>", "▁world"],  # ... cut by an ordinary token
        ["▁Hello", "<0x0A>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁a"],  # completed: the newline stays
        ["▁Hello", "<0x0A>", "</s>", "<0xE4>", "<0xB8>"],  # a special token inside the run
        ["<0x0A>", "<0x0A>", "▁a", "<0xC3>", "<0xA9>"],
    ],
)
def test_text_pieces_of_byte_fallback_tokens(pieces):
    """A byte-fallback decoder turns every byte of a broken run into U+FFFD, a newline decoded before
    too: the run's text waits for its end, so no piece is taken back and the pieces join to the text."""
    tok = spm_tokenizer()
    ids = tok.convert_tokens_to_ids(pieces)
    tp = TextPieces(tok)
    got = [tp.push(ids[:n]) for n in range(1, len(ids) + 1)] + [tp.finish(ids)]
    assert "".join(got) == tok.decode(ids, skip_special_tokens=True)
    assert not any(p.endswith(REPLACEMENT) for p in got[:-1])


def test_stream_of_a_byte_fallback_tokenizer(monkeypatch):
    """``stream`` ending on a broken byte run (max_new_tokens cut an emoji after a newline) gives the
    text ``generate`` gives, not an error."""
    from tiny_models import random_model

    tok = spm_tokenizer()
    model = random_model(dict(vocab_size=len(tok), max_position=64))
    model.tokenizer = tok
    ids = tok.convert_tokens_to_ids(["▁Hello", "<0x0A>", "<0xF0>"])
    layerleap.get_method("greedy")
    monkeypatch.setitem(METHODS, "scripted", Method("scripted", _scripted(ids, 1), False, False, False, "x"))
    want = generate(model, [1, 2], "scripted", len(ids), stop_at_eos=False)
    s = stream(model, [1, 2], "scripted", len(ids), stop_at_eos=False)
    assert "".join(s) == s.result.text == want.text == "Hello" + REPLACEMENT * 2


def test_cancelling_a_prompt_that_has_ended_leaves_its_result_as_it_ended(tiny, monkeypatch):
    """``cancel(i)`` after prompt i's end-of-sequence token: its result keeps finish_reason "stop" and its
    stats do not say cancelled (they said cancelled beside "stop")."""
    eos = tiny.config.eos_token_ids[0]

    def two_rows(run):  # row 0 ends at once with its end-of-sequence token, row 1 runs 4 rounds
        run.emit(0, [5, eos])
        for t in (6, 7, 8, 9):
            if run.emit(1, [t]):
                return
            yield

    layerleap.get_method("greedy")
    monkeypatch.setitem(METHODS, "two-rows", Method("two-rows", two_rows, True, False, False, "x"))
    d = Decoding(tiny, [[1, 2], [3, 4]], "two-rows", 4)
    for n, _grew in enumerate(d):
        if n == 1:
            assert d.finished(0)
            d.cancel(0)
            d.cancel(1)
    assert d.results[0].token_ids == [5, eos] and d.results[0].finish_reason == "stop"
    assert "cancelled" not in d.results[0].stats and not d.results[0].stats.cancelled
    assert d.results[1].finish_reason == "cancelled" and d.results[1].stats["cancelled"]


def test_prompts_cancelled_before_the_decoding_began_have_a_result(tiny):
    """``cancel(i)`` before the first round: once the iteration ends, ``results[i]`` is a result with no
    tokens and finish_reason "cancelled" (it was None, so ``results[i].text`` raised), the others decode
    as they do alone; every prompt cancelled leaves a result each; ``result_so_far`` before the first round
    reads an empty result (it raised KeyError)."""
    prompts = [[1, 2, 3], [4, 5], [6]]
    want = generate(tiny, prompts, "greedy", 5, stop_at_eos=False)
    d = Decoding(tiny, prompts, "greedy", 5, stop_at_eos=False)
    first = d.result_so_far(0)
    assert first.token_ids == [] and first.finish_reason is None and first.prompt_ids == [1, 2, 3]
    d.cancel(1)
    assert d.result_so_far(1).finish_reason == "cancelled"
    for _ in d:
        pass
    r = d.results[1]
    assert r.token_ids == [] and r.text == "" and r.finish_reason == "cancelled" and r.prompt_ids == [4, 5]
    assert r.stats.cancelled and r.stats["new_tokens"] == 0 and r.stats["model_calls"] == 0 and r.stats.batch == 0
    for i in (0, 2):
        assert d.results[i].token_ids == want[i].token_ids and d.results[i].finish_reason == "length"
    d = Decoding(tiny, "hello", "greedy", 5)
    d.cancel(0)
    assert list(d) == [] and d.results[0].finish_reason == "cancelled" and d.results[0].text == ""
    assert json.loads(json.dumps(d.results[0].to_dict()))["stats"]["cancelled"] is True
    s = stream(tiny, "hello", "greedy", 5)
    s.decoding.cancel(0)
    assert list(s) == [] and s.result.finish_reason == "cancelled"


def test_reading_a_prompt_that_does_not_exist_is_refused(tiny):
    """``tokens``, ``finished``, ``grammar_done`` and ``result_so_far`` check the index as ``cancel`` does (an
    index past the batch read as an empty prompt that had not finished, a negative one as the last)."""
    d = Decoding(tiny, ["one", "two"], "greedy", 4)
    for read in (d.tokens, d.finished, d.grammar_done, d.result_so_far):
        for bad in (2, -1, "0", True):
            with pytest.raises(GenerationError, match=r"takes a prompt's index, an integer in \[0, 1\]"):
                read(bad)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_cancelling_every_prompt_keeps_the_methods_statistics(tiny, method):
    """Cancelling the one prompt between two rounds (a stop string on a one-row batch): the method ends at
    its next step with no further model call, and the result keeps the method's own statistics (the
    acceptance of a drafting method, the budgets of an early-exit one), which it dropped before."""
    opts = method_options(tiny)[method]
    full = generate(tiny, "Once upon a time there was", method, 12, stop_at_eos=False, **opts)
    d = Decoding(tiny, "Once upon a time there was", method, 12, stop_at_eos=False, **opts)
    for n, _grew in enumerate(d):
        if n == 1:
            calls = d.result_so_far(0).stats.model_calls
            d.cancel(0)
    r = d.results[0]
    assert r.finish_reason == "cancelled" and r.stats.cancelled and r.stats.model_calls == calls
    assert set(r.stats.to_dict()) == set(full.stats.to_dict()) | {"cancelled"}
    if r.stats.draft is not None:
        assert r.stats.draft.rounds <= r.stats.model_calls and r.stats.draft.accepted <= r.stats.draft.drafted


def test_a_method_that_goes_on_past_every_rows_end_is_stopped(tiny, monkeypatch):
    """A registered method that does not look at ``run.done`` after a ``yield`` runs one more round at
    most once every prompt is cancelled."""
    steps = []

    def endless(run):
        while True:
            steps.append(len(steps))
            run.emit(0, [5])
            yield

    layerleap.get_method("greedy")
    monkeypatch.setitem(METHODS, "endless", Method("endless", endless, False, False, False, "x"))
    d = Decoding(tiny, [1, 2], "endless", 50, stop_at_eos=False)
    for _grew in d:
        d.cancel(0)
    assert d.results[0].token_ids == [5] and d.results[0].finish_reason == "cancelled" and len(steps) == 2


def test_tokens_is_a_copy_of_the_output_so_far(tiny):
    """``tokens(i)`` read before a round keeps what it held (it was the decoding's own list: it grew with the
    rounds, so ``tokens(i)[len(before):]`` was always empty), and changing it leaves the output alone."""
    want = generate(tiny, ["one two", "three"], "greedy", 6, stop_at_eos=False)
    d = Decoding(tiny, ["one two", "three"], "greedy", 6, stop_at_eos=False)
    before, new = [], []
    for _grew in d:
        now = d.tokens(0)
        new.append(now[len(before) :])
        before = now
        d.tokens(0).append(-1)
        d.tokens(1).clear()
    assert [len(n) for n in new] == [1] * 6 and sum(new, []) == want[0].token_ids
    assert [r.token_ids for r in d.results] == [r.token_ids for r in want]


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
def test_stream_holds_off_stop_strings_under_min_tokens_as_generate(char_model_dir, method):
    """A stop string that ends in the text of the tokens before the ``min_tokens``-th does not count: the
    stream goes on past it to the next one, its pieces joining to ``result.text`` and to ``generate``'s text."""
    model = layerleap.load_folder(char_model_dir)
    least = 12
    full = generate(model, "abcabcabc", "greedy", 30, stop_at_eos=False, min_tokens=least)
    early = model.tokenizer.decode(full.token_ids[: least - 1], skip_special_tokens=True)
    stop = full.text[4:7]
    later = full.text.find(stop, 5)
    assert stop in early and later + len(stop) > len(early)  # one that does not count, then one that does
    s = stream(model, "abcabcabc", method, 30, stop_at_eos=False, stop=stop, min_tokens=least)
    text = "".join(s)
    assert text == s.result.text == full.text[:later]
    assert text == generate(model, "abcabcabc", method, 30, stop_at_eos=False, stop=stop, min_tokens=least).text
