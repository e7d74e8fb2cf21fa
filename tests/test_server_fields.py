"""Fields of vLLM's and OpenAI's legacy completions the server honours beyond the basics: several prompts in
one request, ``best_of``, ``include_stop_str_in_output``, ``truncate_prompt_tokens`` and
``skip_special_tokens``, against ``generate`` on the server tests' tiny model."""

from __future__ import annotations

import json
import time

import pytest

for _module in ("openai", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test]'")

import test_server  # noqa: E402
from test_server import post  # noqa: E402

tiny, tiny_server, client = test_server.tiny, test_server.tiny_server, test_server.client  # the server tests' fixtures

from layerleap import generate  # noqa: E402

P = "The sky is"


def _stream(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    r = post(url, {**body, "stream": True}, path)
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _texts(chunks: list[dict], n: int) -> list[str]:
    texts = [""] * n
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    return texts


# -- include_stop_str_in_output ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(tiny_server, tiny, stream):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it; the tokens counted
    are the same (through the stop string), and a chat answer keeps it too."""
    full = generate(tiny, P, "greedy", 24, stop_at_eos=False)
    stop = full.text[6:9]
    assert stop and full.text.index(stop) == 6
    body = {"prompt": P, "max_tokens": 24, "ignore_eos": True, "stop": [stop, "zzzz"], "logprobs": 0}
    plain = post(tiny_server, body).json()
    kept_body = {**body, "include_stop_str_in_output": True}
    if stream:
        chunks = _stream(tiny_server, kept_body)
        text = _texts(chunks, 1)[0]
        reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert reasons == ["stop"]
    else:
        kept = post(tiny_server, kept_body).json()
        text = kept["choices"][0]["text"]
        assert kept["choices"][0]["finish_reason"] == "stop"
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the second reuses the first's prompt)
        assert [kept["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
        assert "".join(kept["choices"][0]["logprobs"]["tokens"]).startswith(text)
    assert plain["choices"][0]["text"] == full.text[:6]
    assert text == full.text[:9]
    r = post(tiny_server, {**kept_body, "include_stop_str_in_output": False, "stream": False}).json()
    assert r["choices"][0]["text"] == full.text[:6]
    r = post(tiny_server, {**kept_body, "include_stop_str_in_output": "yes", "stream": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_stop_str_in_output", r.text


# -- truncate_prompt_tokens --------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_server, tiny):
    """vLLM's truncate_prompt_tokens: the answer is the one to the prompt's last k tokens (usage counts them,
    echo gives their text); k over the prompt's length keeps it all; -1 keeps as many as the server takes."""
    ids = tiny.tokenizer("one two three four five six seven eight")["input_ids"]
    want = generate(tiny, ids[-4:], "greedy", 8)
    r = post(tiny_server, {"prompt": ids, "max_tokens": 8, "truncate_prompt_tokens": 4}).json()
    assert r["choices"][0]["text"] == want.text and r["usage"]["prompt_tokens"] == 4, r
    text = "one two three four five six seven eight"
    r = post(tiny_server, {"prompt": text, "max_tokens": 8, "truncate_prompt_tokens": 4, "echo": True}).json()
    assert r["choices"][0]["text"] == tiny.tokenizer.decode(ids[-4:]) + want.text, r
    r = post(tiny_server, {"prompt": ids, "max_tokens": 8, "truncate_prompt_tokens": 400}).json()
    assert r["choices"][0]["text"] == generate(tiny, ids, "greedy", 8).text and r["usage"]["prompt_tokens"] == len(ids)
    context = tiny.config.max_position
    long = (ids * context)[: context + 50]
    r = post(tiny_server, {"prompt": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == context - 1, r.text
    r = post(tiny_server, {"prompt": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = post(tiny_server, {"prompt": long, "truncate_prompt_tokens": context})  # keeps more than the server takes
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "truncate_prompt_tokens", r.text
    assert error["code"] == "context_length_exceeded" and f"give at most {context - 1}, or -1" in error["message"]


@pytest.mark.parametrize("value", [0, -2, "3", 2.5])
def test_bad_truncate_prompt_tokens_is_a_400(tiny_server, value):
    r = post(tiny_server, {"prompt": "a", "max_tokens": 2, "truncate_prompt_tokens": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert value != 0 or "at least 1" in r.json()["error"]["message"]


# -- several prompts (legacy completions) ------------------------------------------------------------
PROMPTS = ["The sky is", "Once upon a time", "1, 2, 3,"]


def _one(url: str, body: dict, prompt) -> dict:
    return post(url, {**body, "prompt": prompt}).json()


@pytest.mark.parametrize("ids", [False, True])
def test_several_prompts_are_each_answered_prompt_major(tiny_server, tiny, ids):
    """A list of prompts (strings, or lists of token ids): each prompt's n choices, index prompt * n + choice,
    each what the prompt alone gets; the usage sums every prompt's and choice's tokens."""
    prompts = [tiny.tokenizer(p)["input_ids"] for p in PROMPTS] if ids else PROMPTS
    body = {"max_tokens": 8, "n": 2}
    r = post(tiny_server, {**body, "prompt": prompts}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6)), r
    alone = [_one(tiny_server, body, p) for p in prompts]
    for p, a in enumerate(alone):
        want = generate(tiny, prompts[p], "greedy", 8).text
        for j in range(2):
            assert r["choices"][2 * p + j]["text"] == a["choices"][j]["text"] == want
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert r["usage"][k] == sum(a["usage"][k] for a in alone), k


def test_several_prompts_sampled_are_what_each_prompt_samples(tiny_server):
    body = {"max_tokens": 8, "n": 2, "temperature": 0.9, "seed": 7}
    r = post(tiny_server, {**body, "prompt": PROMPTS}).json()
    for p, prompt in enumerate(PROMPTS):
        a = _one(tiny_server, body, prompt)
        assert [c["text"] for c in r["choices"][2 * p : 2 * p + 2]] == [c["text"] for c in a["choices"]]


def test_several_prompts_stream_with_their_indexes(tiny_server):
    body = {"max_tokens": 8, "n": 2, "prompt": PROMPTS, "stream_options": {"include_usage": True}}
    post(tiny_server, {**body, "stream_options": None})  # the prompts cached, as the answers below reuse them
    chunks = _stream(tiny_server, body)
    whole = post(tiny_server, {**body, "stream_options": None}).json()
    assert _texts(chunks, 6) == [c["text"] for c in whole["choices"]]
    reasons = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"])
    assert reasons == list(range(6))
    assert chunks[-1]["usage"] == whole["usage"]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1  # one answer: every chunk has its id
    echoed = _stream(tiny_server, {**body, "max_tokens": 0, "echo": True})
    assert len({(c["id"], c["created"]) for c in echoed}) == 1


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_several_prompts_echo_and_score_each_prompt(tiny_server, tiny, max_tokens):
    """lm-evaluation-harness's local-completions with batch_size > 1: echo and logprobs over token-id prompts,
    each choice the prompt's own (echo, log probabilities, prompt_logprobs)."""
    prompts = [tiny.tokenizer(p)["input_ids"] for p in PROMPTS]
    body = {"max_tokens": max_tokens, "echo": True, "logprobs": 1, "prompt_logprobs": 1}
    r = post(tiny_server, {**body, "prompt": prompts}).json()
    for p, prompt in enumerate(prompts):
        a = _one(tiny_server, body, prompt)["choices"][0]
        assert {**r["choices"][p], "index": 0} == a
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))
    chunks = _stream(tiny_server, {**body, "prompt_logprobs": None, "prompt": prompts})
    assert _texts(chunks, 3) == [c["text"] for c in r["choices"]]


def test_several_prompts_through_the_openai_client(client, tiny):
    got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=6)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        generate(tiny, p, "greedy", 6).text for p in PROMPTS
    ]


def test_bad_prompt_lists_are_400s_naming_the_prompt(tiny_server, tiny):
    from layerleap.server.schema import MAX_PROMPTS

    for prompt, words in [
        (["a"] * (MAX_PROMPTS + 1), f"over this server's {MAX_PROMPTS} per request"),
        (["a", ""], "prompt [1] is not"),
        (["a", []], "prompt [1] is not"),
        ([[1, 2], [3, "x"]], "prompt [1] is not"),
        ([], "must be"),
        (["a", ["b"]], "prompt [1] is not"),
    ]:
        r = post(tiny_server, {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
        assert words in r.json()["error"]["message"], (prompt, r.text)
    long = [5] * (tiny.config.max_position + 10)
    r = post(tiny_server, {"prompt": [[5, 6], long], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["message"].startswith("prompt [1]: "), r.text
    r = post(tiny_server, {"prompt": [[5, 6], [10**9]], "max_tokens": 2})
    assert r.status_code == 400 and "prompt [1]: prompt token ids" in r.json()["error"]["message"], r.text


def test_a_request_over_the_queue_is_a_400_not_a_429(tiny):
    from layerleap.server import ServerConfig, ServerThread, create_app

    with ServerThread(create_app(tiny, ServerConfig("tiny", method="greedy", max_waiting=4))) as url:
        r = post(url, {"prompt": PROMPTS, "max_tokens": 2, "n": 2, "temperature": 1.0})
        assert r.status_code == 400 and "--max-waiting" in r.json()["error"]["message"], r.text
        r = post(url, {"prompt": PROMPTS, "max_tokens": 2, "n": 2})  # greedy: one answer per prompt
        assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text
        r = post(url, {"prompt": P, "max_tokens": 2, "best_of": 8, "temperature": 1.0})  # n is 1: best_of asks
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_prompts_being_scored_hold_places_in_the_queue(tiny, monkeypatch):
    """echo / prompt_logprobs score the prompt in the model's worker: those passes count against --max-waiting,
    so a flood of scoring requests is told 429 as decoding requests are, not stacked without bound."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from layerleap.server import ServerConfig, ServerThread, app, create_app

    release, started, real = threading.Event(), threading.Event(), app.score

    def slow(*args):  # the first pass holds the worker until released
        started.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(app, "score", slow)
    body = {"prompt": P, "echo": True, "logprobs": 1, "max_tokens": 0}
    served = create_app(tiny, ServerConfig("tiny", method="greedy", max_waiting=2))
    with ServerThread(served) as url:
        scheduler = served.state.layerleap.scheduler
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, url, body)
            assert started.wait(30)
            second = pool.submit(post, url, body)  # waits for the worker: the queue's second place
            for _ in range(500):
                if scheduler.scoring == 2:
                    break
                time.sleep(0.01)
            assert scheduler.scoring == 2
            third = post(url, body)
            assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full", third.text
            r = post(url, {"prompt": P, "max_tokens": 2})  # a decoding request finds the queue full too
            assert r.status_code == 429, r.text
            release.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert post(url, body).status_code == 200  # the places came back


# -- best_of -----------------------------------------------------------------------------------------
def _mean(choice: dict) -> float:
    lps = choice["logprobs"]["token_logprobs"]
    return sum(lps) / len(lps)


@pytest.mark.parametrize("prompts", [P, PROMPTS[:2]])
def test_best_of_returns_the_n_likeliest_of_its_candidates(tiny_server, prompts):
    """best_of sampled candidates (what n = best_of samples), the n with the highest mean log probability per
    token returned, best first, per prompt; the usage counts every candidate's tokens; log probabilities
    only where asked for."""
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 1.5, "seed": 3, "ignore_eos": True}
    every = post(tiny_server, {**body, "n": 5, "logprobs": 0}).json()
    r = post(tiny_server, {**body, "n": 2, "best_of": 5, "logprobs": 0}).json()
    count = 1 if isinstance(prompts, str) else len(prompts)
    assert [c["index"] for c in r["choices"]] == list(range(2 * count)), r
    for p in range(count):
        ranked = sorted(every["choices"][5 * p : 5 * p + 5], key=_mean, reverse=True)
        assert len({c["text"] for c in ranked}) > 2  # the candidates differ
        assert [c["text"] for c in r["choices"][2 * p : 2 * p + 2]] == [c["text"] for c in ranked[:2]]
    assert r["usage"] == every["usage"]
    quiet = post(tiny_server, {**body, "n": 2, "best_of": 5}).json()
    assert [c["text"] for c in quiet["choices"]] == [c["text"] for c in r["choices"]]
    assert all(c["logprobs"] is None for c in quiet["choices"])


def test_best_of_greedy_is_the_one_answer(tiny_server, tiny):
    r = post(tiny_server, {"prompt": P, "max_tokens": 6, "best_of": 4}).json()
    assert [c["text"] for c in r["choices"]] == [generate(tiny, P, "greedy", 6).text]
    assert r["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"best_of": 1, "n": 2}, "from n (2) to 16"),
        ({"best_of": 17}, "from n (1) to 16"),
        ({"best_of": 0}, "from n (1) to 16"),
        ({"best_of": "2"}, None),
        ({"best_of": 2, "stream": True, "temperature": 1.0}, "not streamed"),
    ],
)
def test_bad_best_of_is_a_400(tiny_server, fields, words):
    r = post(tiny_server, {"prompt": P, "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert words is None or words in r.json()["error"]["message"], r.text
