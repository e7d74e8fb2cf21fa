"""Scoring a prompt: ``layerleap.score`` (each prompt token's log probability given the tokens before it),
``layerleap score``, and the server's ``echo`` (legacy completions) and ``prompt_logprobs`` (vLLM's), checked
against a full forward pass."""

from __future__ import annotations

import json

import pytest
import torch

import layerleap
from layerleap import generate, score
from layerleap.core.logprobs import TokenLogprob, scores
from layerleap.decoding import GenerationError
from tiny_models import full_logits

PROMPT = "Tell me a story about a cat. A cat"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    """A tiny random model with the real SmolLM2 tokenizer (byte-level BPE)."""
    return layerleap.load_folder(tiny_hf_dir)


def ids_of(model, text: str) -> list[int]:
    return [int(i) for i in model.tokenizer(text)["input_ids"]]


def check_against_a_full_pass(model, ids: list[int], got: list[TokenLogprob], top: int, tol: float = 1e-4) -> None:
    ref = torch.log_softmax(full_logits(model, ids).float(), -1)  # [T, V]: row k predicts token k + 1
    assert [e.token for e in got] == ids[1:]
    for k, e in enumerate(got):
        row = ref[k]
        assert e.logprob == pytest.approx(float(row[ids[k + 1]]), abs=tol), k
        likelier = (int((row > row[ids[k + 1]] + tol).sum()), int((row > row[ids[k + 1]] - tol).sum()))
        assert likelier[0] <= e.rank - 1 <= likelier[1], (k, e.rank, likelier)
        assert len(e.top) == top
        want = row.topk(top)
        assert [t.logprob for t in e.top] == pytest.approx(want.values.tolist(), abs=tol)
        assert e.text == model.tokenizer.decode([e.token])


def test_score_equals_a_full_forward_pass(tiny):
    ids = ids_of(tiny, PROMPT)
    got = score(tiny, PROMPT, top=3)
    assert len(got) == len(ids) - 1 and all(isinstance(e, TokenLogprob) for e in got)
    check_against_a_full_pass(tiny, ids, got, 3)
    assert score(tiny, ids, top=3) == got  # token ids score as their text
    assert [e.logprob for e in score(tiny, PROMPT)] == [e.logprob for e in got] and not score(tiny, PROMPT)[0].top
    assert got[0].to_dict()["rank"] == got[0].rank and layerleap.score is score


def test_a_long_prompt_is_unembedded_in_blocks(tiny):
    ids = [(7 * k + 3) % 49152 for k in range(300)]  # beyond one block of positions
    got = score(tiny, ids, top=2)
    check_against_a_full_pass(tiny, ids, got, 2)
    torch.manual_seed(0)
    h = torch.randn(10, tiny.config.hidden_size)
    with torch.inference_mode():
        blocks, whole = (scores(tiny.logits, h, list(range(10)), 2, tiny.tokenizer, rows=n) for n in (3, 256))
    assert [(e.token, e.rank, [t.token for t in e.top]) for e in blocks] == [
        (e.token, e.rank, [t.token for t in e.top]) for e in whole
    ]
    assert [e.logprob for e in blocks] == pytest.approx([e.logprob for e in whole], abs=1e-5)


def test_a_batch_scores_each_prompt_as_alone(tiny):
    """Prompts of different lengths, left padded in one batch: each scores as it does alone; a conversation
    and chat=True score the ids generate would decode from."""
    from layerleap.core.run import chat_token_ids

    prompts = [PROMPT, "Hi", ids_of(tiny, "A much longer prompt than the others, with more words in it."), CHAT]
    batch = score(tiny, prompts, top=2)
    assert isinstance(batch, list) and len(batch) == 4
    for p, got in zip(prompts, batch):
        alone = score(tiny, p, top=2)
        assert [e.token for e in got] == [e.token for e in alone]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in alone], abs=1e-4)
        assert [[t.token for t in e.top] for e in got] == [[t.token for t in e.top] for e in alone]
    chat_ids = chat_token_ids(tiny.tokenizer, CHAT, add_generation_prompt=True)
    check_against_a_full_pass(tiny, chat_ids, batch[3], 2)
    assert [e.token for e in score(tiny, CHAT[0]["content"], chat=True)] == chat_ids[1:]
    assert score(tiny, [PROMPT]) == [score(tiny, PROMPT)]
    assert score(tiny, [5]) == []  # one token: nothing before it to score it by


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"top": 21}, "top"),
        ({"top": -1}, "top"),
        ({"top": "2"}, "top"),
        ({"chat": 1}, "chat"),
        ({"prompt": ""}, "empty"),
        ({"prompt": [49152]}, "outside the vocabulary"),
        ({"prompt": list(range(2049))}, "context"),
    ],
)
def test_bad_input_is_refused_naming_it(tiny, kw, says):
    prompt = kw.pop("prompt", PROMPT)
    with pytest.raises(GenerationError, match=says):
        score(tiny, prompt, **kw)


def test_cli_score(capsys, tiny_hf_dir, tiny, tmp_path):
    from test_cli import cli

    want = score(tiny, PROMPT, top=2)
    rc, out, err = cli(capsys, "score", "--model", tiny_hf_dir, "--prompt", PROMPT, "--top", 2)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == len(want) + 1, err
    for line, e in zip(lines, want):
        assert line.split()[0] == f"{e.logprob:.4f}" and repr(e.text) in line and f"rank {e.rank}" in line
    assert f"{sum(e.logprob for e in want):.4f}" in lines[-1]
    f = tmp_path / "p.txt"
    f.write_text(PROMPT + "\nHi there\n")
    rc, out, _ = cli(capsys, "score", "--model", tiny_hf_dir, "--prompts-file", f, "--json")
    got = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(got) == 2
    assert [e["logprob"] for e in got[0]["logprobs"]] == pytest.approx([e.logprob for e in want], abs=1e-4)
    assert got[0]["logprob"] == pytest.approx(sum(e.logprob for e in want), abs=1e-3)
    for bad in (("--top", 21), ("--top", "x"), ("--prompt", "")):
        args = ("score", "--model", tiny_hf_dir, "--prompt", PROMPT, *bad)
        rc, out, err = cli(capsys, *args)
        assert rc == 2 and "Traceback" not in err and err.strip(), bad


# -- the server ------------------------------------------------------------------------------------------
import test_logprobs  # noqa: E402

server, client = test_logprobs.server, test_logprobs.client  # a server of this module's model, its openai client


def post(url: str, body: dict, path: str = "/v1/completions"):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _check_echoed(tiny, lp, ids: list[int], top: int, n_prompt: int) -> None:
    """The prompt's entries of legacy completions' logprobs with echo: the first token's null, then score's."""
    want = score(tiny, ids, top=top)
    assert lp.tokens[:n_prompt] == [tiny.tokenizer.decode([ids[0]])] + [e.text for e in want]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([e.logprob for e in want], abs=1e-4)
    if top:
        assert lp.top_logprobs[0] is None
        # the likeliest tokens' texts, and the token's own where it is not one of them (OpenAI's "up to N + 1")
        tops = [list(dict.fromkeys([*(t.text for t in e.top), e.text])) for e in want]
        assert [list(d) for d in lp.top_logprobs[1:n_prompt]] == tops
    else:
        assert lp.top_logprobs is None
    texts = lp.tokens
    assert lp.text_offset == [len("".join(texts[:k])) for k in range(len(texts))]


def test_echo_with_max_tokens_0_scores_the_prompt(tiny, client):
    """OpenAI's legacy scoring request (echo, logprobs, max_tokens 0): the prompt's text, its tokens' log
    probabilities (the first null), nothing generated; streamed, one chunk."""
    ids = ids_of(tiny, PROMPT)
    for top in (0, 2):
        r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=top, max_tokens=0)
        c = r.choices[0]
        assert c.text == PROMPT and c.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
        assert len(c.logprobs.tokens) == len(ids)
        _check_echoed(tiny, c.logprobs, ids, top, len(ids))
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert len(chunks) == 2 and chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].finish_reason == "length"
    _check_echoed(tiny, chunks[0].choices[0].logprobs, ids, 1, len(ids))
    assert chunks[1].usage.completion_tokens == 0 and chunks[1].usage.prompt_tokens == len(ids)


def test_echo_with_an_answer_puts_the_prompt_first(tiny, client):
    """echo with max_tokens: the prompt's text then the answer's, the prompt's log probabilities then the
    answer's (as generate gives them), offsets into the whole text; streamed, the echo is the first chunk."""
    ids = ids_of(tiny, PROMPT)
    want = generate(tiny, PROMPT, max_new_tokens=5, stop_at_eos=False, logprobs=2)
    kw = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=5, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == PROMPT + want.text
    n = len(ids)
    _check_echoed(tiny, c.logprobs, ids, 2, n)
    assert c.logprobs.tokens[n:] == [e.text for e in want.logprobs]
    assert c.logprobs.token_logprobs[n:] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert c.logprobs.text_offset[n] == len(PROMPT)
    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].logprobs.tokens == c.logprobs.tokens[:n]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [t for ch in chunks for t in (ch.choices[0].logprobs.text_offset if ch.choices[0].logprobs else [])]
    assert streamed == c.logprobs.text_offset
    plain = client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].text == PROMPT + want.text and plain.choices[0].logprobs is None


def test_an_evaluation_harness_loglikelihood_request(tiny, client):
    """lm-evaluation-harness's local-completions: token ids in a list, echo, max_tokens 1, logprobs 1,
    temperature 0; the sum of the continuation's token_logprobs (less the generated one) is score's."""
    ctx, cont = ids_of(tiny, "The capital of France is"), ids_of(tiny, " Paris")
    r = client.completions.create(model="tiny", prompt=[ctx + cont], echo=True, max_tokens=1, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ctx) + len(cont) + 1
    want = score(tiny, ctx + cont, top=1)[len(ctx) - 1 :]
    assert sum(lp.token_logprobs[len(ctx) : -1]) == pytest.approx(sum(e.logprob for e in want), abs=1e-3)
    greedy = all(
        t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx) : -1], lp.top_logprobs[len(ctx) : -1])
    )
    assert greedy == all(e.rank == 1 for e in want)


def test_prompt_logprobs_have_vllms_shape(tiny, client):
    """vLLM's prompt_logprobs: a list over the prompt's tokens, the first null, then token id -> {logprob,
    rank, decoded_token} (the prompt token's own, then the likeliest); the choice's in text completions,
    the answer's in chat."""
    from layerleap.core.run import chat_token_ids

    ids = ids_of(tiny, PROMPT)
    want = score(tiny, ids, top=2)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for entry, e in zip(got[1:], want):
        own = entry[str(e.token)]
        assert own["logprob"] == pytest.approx(e.logprob, abs=1e-4) and own["rank"] == e.rank
        assert own["decoded_token"] == e.text
        for k, t in enumerate(e.top):
            assert entry[str(t.token)]["rank"] == (e.rank if t.token == e.token else k + 1)
        assert set(entry) == {str(e.token)} | {str(t.token) for t in e.top}
    assert r.choices[0].text == generate(tiny, PROMPT, max_new_tokens=2).text
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_ids = chat_token_ids(tiny.tokenizer, CHAT, add_generation_prompt=True)
    got = r.model_extra["prompt_logprobs"]
    assert len(got) == len(chat_ids) and got[0] is None
    assert [list(e) for e in got[1:]] == [[str(t)] for t in chat_ids[1:]]
    assert [e[str(t)]["logprob"] for e, t in zip(got[1:], chat_ids[1:])] == pytest.approx(
        [e.logprob for e in score(tiny, chat_ids)], abs=1e-4
    )


def test_scoring_refusals_name_the_field(server):
    chat, text = "/v1/chat/completions", "/v1/completions"
    for body, path, param in (
        ({"prompt": PROMPT, "max_tokens": 0}, text, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0, "echo": False}, text, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 0}, chat, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 2, "echo": True}, chat, "echo"),
        ({"prompt": PROMPT, "max_tokens": 2, "echo": "yes"}, text, "echo"),
        ({"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 21}, text, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": -1}, text, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, text, "prompt_logprobs"),
        ({"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, chat, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 1}, text, "min_tokens"),
    ):
        status, got = post(server, body, path)
        assert status == 400 and json.loads(got)["error"]["param"] == param, (body, got)
        assert param in json.loads(got)["error"]["message"], got
