"""The server's several choices per request (``n``), vLLM's token filters (``allowed_token_ids``,
``bad_words``) and ``min_tokens`` over the request's own stops, against ``generate``."""

from __future__ import annotations

import json

import pytest

for _module in ("openai", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test]'")

import test_server  # noqa: E402
from test_server import post  # noqa: E402

tiny, tiny_server = test_server.tiny, test_server.tiny_server  # the fixtures of the server tests' model and server

from layerleap import generate  # noqa: E402
from layerleap.server import ServerConfig, ServerThread, create_app  # noqa: E402

P = "The sky is"


def test_min_tokens_holds_off_the_stop_token_ids(tiny_server, tiny):
    """A stop token the answer would end at first is forbidden until min_tokens tokens are out, as the
    end-of-sequence tokens are; then it ends the answer as before."""
    plain = generate(tiny, P, "greedy", 24, stop_at_eos=False).token_ids
    stop = plain[1]
    r = post(tiny_server, {"prompt": P, "max_tokens": 24, "stop_token_ids": [stop]}).json()
    assert r["usage"]["completion_tokens"] == 1
    r = post(tiny_server, {"prompt": P, "max_tokens": 24, "stop_token_ids": [stop], "min_tokens": 6}).json()
    held = generate(tiny, P, "greedy", 5, stop_at_eos=False, logit_bias={stop: -100}).token_ids
    ids = tiny.tokenizer(P)["input_ids"] + held
    rest = generate(tiny, ids, "greedy", 19, stop_at_eos=False).token_ids
    rest = rest[: rest.index(stop)] if stop in rest else rest
    assert r["choices"][0]["text"] == tiny.tokenizer.decode(held + rest, skip_special_tokens=True)
    assert r["usage"]["completion_tokens"] == len(held + rest) >= 6


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_the_stop_strings(tiny_server, tiny, stream):
    """vLLM's rule: a stop string that ends in the text of the tokens before the min_tokens-th does not count;
    a later one does."""
    full = generate(tiny, P, "greedy", 24, stop_at_eos=False, min_tokens=6)
    first = tiny.tokenizer.decode(full.token_ids[:1], skip_special_tokens=True)
    stop = first.strip()[:2]
    floor = len(tiny.tokenizer.decode(full.token_ids[:5], skip_special_tokens=True))
    later = [i for i in range(len(full.text)) if full.text.startswith(stop, i) and i + len(stop) > floor]
    want = full.text[: later[0]] if later else full.text
    body = {"prompt": P, "max_tokens": 24, "stop": [stop], "min_tokens": 6, "ignore_eos": True, "stream": stream}
    r = post(tiny_server, body)
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        text = r.json()["choices"][0]["text"]
    assert text == want and len(text) > len(first)
    r = post(tiny_server, {**body, "min_tokens": 0, "stream": False}).json()
    assert r["choices"][0]["text"] == full.text[: full.text.index(stop)]


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
def test_allowed_token_ids_and_bad_words_are_honoured(tiny_server, tiny, method):
    plain = generate(tiny, P, "greedy", 16).token_ids
    allowed = sorted(set(plain[3:10]) | {13, 30, 1000})
    body = {"prompt": P, "max_tokens": 16, "layerleap": {"method": method}}
    r = post(tiny_server, {**body, "allowed_token_ids": allowed})
    want = generate(tiny, P, "greedy", 16, allowed_token_ids=allowed)
    assert r.json()["choices"][0]["text"] == want.text and set(want.token_ids) <= set(allowed), r.text
    tok = tiny.tokenizer  # a word the answer holds after a space, one token with the space and one without
    word = next(
        w.strip()
        for w in map(lambda t: tok.decode([t]), plain)
        if w.startswith(" ") and len(tok.encode(w, add_special_tokens=False)) == 1 == len(tok.encode(w.strip()))
    )
    r = post(tiny_server, {**body, "bad_words": [word]})
    want = generate(tiny, P, "greedy", 16, bad_words=[word])
    assert r.json()["choices"][0]["text"] == want.text != generate(tiny, P, "greedy", 16).text, r.text


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
        ({"allowed_token_ids": [99999]}, "allowed_token_ids", "a token id of this model"),
        ({"allowed_token_ids": [3], "layerleap": {"method": "ppd"}}, "allowed_token_ids", "cannot apply"),
        ({"bad_words": [""]}, "bad_words", "bad_words must be a list of words"),
        ({"bad_words": "x"}, "bad_words", None),
    ],
)
def test_bad_filters_are_400s_naming_the_field(tiny_server, fields, param, words):
    r = post(tiny_server, {"prompt": "a", "max_tokens": 3, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words is None or words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("fields", [{}, {"temperature": 1.0, "seed": 1}, {"layerleap": {"method": "prompt-lookup"}}])
def test_filters_that_leave_no_token_are_400s_naming_them(tiny_server, tiny, fields):
    """``allowed_token_ids`` that ``min_tokens`` forbids every one of (the end-of-sequence token) leaves the
    answer nothing to choose: a 400 naming them, pooled or batched, greedy or sampled, not a token no one allowed
    or a 500."""
    body = {"prompt": P, "max_tokens": 6, "allowed_token_ids": list(tiny.eos_ids()), "min_tokens": 2, **fields}
    r = post(tiny_server, body)
    assert r.status_code == 400, r.text
    assert "no token is left to choose after 0 output tokens: allowed_token_ids and min_tokens" in r.text
    assert post(tiny_server, {"prompt": P, "max_tokens": 4}).status_code == 200  # the server goes on


def test_a_request_whose_filters_leave_no_token_fails_alone_beside_batch_mates(tiny):
    """Under load, a batching method's request whose token filters leave it no token fails alone: a request
    waiting beside it with the same settings, which decodes alone, answers as alone (its filters are no 400)."""
    import threading

    from test_server import get

    there, here = (tiny.tokenizer(w)["input_ids"][0] for w in (" there", " here"))
    first = {generate(tiny, p, max_new_tokens=1, allowed_token_ids=[there, here]).token_ids[0]: p for p in "abcd"}
    method = {"layerleap": {"method": "prompt-lookup"}}
    body = {"max_tokens": 2, "allowed_token_ids": [there, here], "bad_words": [" there there", " there here"], **method}
    cfg = ServerConfig("tiny", max_tokens=32, max_batch=4, max_running=1)
    with ServerThread(create_app(tiny, cfg)) as url:
        assert post(url, {**body, "prompt": first[there]}).status_code == 400  # " there", then nothing is left
        assert post(url, {**body, "prompt": first[here]}).status_code == 200
        blocker = {"prompt": "z", "max_tokens": 1000, "ignore_eos": True, **method}
        got = {}
        threads = [threading.Thread(target=lambda: post(url, blocker))] + [
            threading.Thread(target=lambda w=w: got.update({w: post(url, {**body, "prompt": first[w]}).status_code}))
            for w in (there, here)
        ]
        threads[0].start()
        while not get(url + "/health").json()["running"]:
            pass
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        assert got == {there: 400, here: 200}


def test_no_repeat_ngram_size_that_leaves_no_token_fails_alone_beside_batch_mates(tiny):
    """``no_repeat_ngram_size`` is a token filter too: with a grammar it can leave no token, so a batching
    method's request with it decodes in a batch of its own, and its failure leaves the request beside it (the
    same settings, another prompt) to answer as alone."""
    import threading

    from test_server import get

    ab = [i for i in range(tiny.config.vocab_size) if set(tiny.tokenizer.decode([i])) <= {"a", "b"}]
    method = {"layerleap": {"method": "prompt-lookup"}}
    body = {"max_tokens": 8, "guided_regex": "[ab]{4}", "no_repeat_ngram_size": 1, **method}
    cfg = ServerConfig("tiny", max_tokens=32, max_batch=4, max_running=1)
    with ServerThread(create_app(tiny, cfg)) as url:
        prompts = {"stuck": ab, "free": "z"}  # every token of a and b in the prompt: none may follow it
        alone = {k: post(url, {**body, "prompt": p}).status_code for k, p in prompts.items()}
        assert alone == {"stuck": 400, "free": 200}
        blocker = {"prompt": "z", "max_tokens": 1000, "ignore_eos": True, **method}
        got = {}
        threads = [threading.Thread(target=lambda: post(url, blocker))] + [
            threading.Thread(target=lambda k=k, p=p: got.update({k: post(url, {**body, "prompt": p}).status_code}))
            for k, p in prompts.items()
        ]
        threads[0].start()
        while not get(url + "/health").json()["running"]:
            pass
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        assert got == alone


# -- n: several choices per request -------------------------------------------------------------------
def _stream(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    r = post(url, {**body, "stream": True}, path)
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _joined(chunks: list[dict], n: int, chat: bool = False) -> tuple[list[str], list[str | None]]:
    """Each choice's streamed text and finish reason."""
    texts, reasons = [""] * n, [None] * n
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += (ch["delta"].get("content") or "") if chat else ch["text"]
            if ch["finish_reason"]:
                assert reasons[ch["index"]] is None
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
def test_greedy_choices_are_all_the_answer(tiny_server, tiny, method):
    want = generate(tiny, P, "greedy", 12)
    body = {"prompt": P, "max_tokens": 12, "n": 3, "layerleap": {"method": method}}
    r = post(tiny_server, body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [want.text] * 3
    assert r["usage"]["completion_tokens"] == 3 * len(want.token_ids)
    chunks = _stream(tiny_server, {**body, "stream_options": {"include_usage": True}})
    assert _joined(chunks, 3) == ([want.text] * 3, [want.finish_reason] * 3)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 * len(want.token_ids)


@pytest.mark.parametrize("method", ["sample", "prompt-lookup"])
def test_seeded_sampled_choices_are_the_rows_of_generate(tiny_server, tiny, method):
    """Choice i samples what a request with seed + i samples, and what row i of ``generate`` with the seed
    samples: reproducible, and different from one another."""
    sampling = {"temperature": 1.0, "seed": 40}
    body = {"prompt": P, "max_tokens": 10, "n": 4, "layerleap": {"method": method}, **sampling}
    want = generate(tiny, [P] * 4, method, 10, **sampling)
    r = post(tiny_server, body).json()
    texts = [c["text"] for c in r["choices"]]
    assert texts == [w.text for w in want] and len(set(texts)) == 4, texts
    assert r["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    alone = [post(tiny_server, {**body, "n": 1, "seed": 40 + i}).json()["choices"][0]["text"] for i in range(4)]
    assert alone == texts
    chunks = _stream(tiny_server, body)
    assert _joined(chunks, 4) == (texts, [w.finish_reason for w in want])


def test_chat_choices_stream_with_their_index(tiny_server, tiny):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "n": 2, "temperature": 0.9}
    r = post(tiny_server, body, "/v1/chat/completions").json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and all(c["message"]["content"] for c in r["choices"])
    chunks = _stream(tiny_server, {**body, "seed": 3}, "/v1/chat/completions")
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    texts, reasons = _joined(chunks, 2, chat=True)
    full = post(tiny_server, {**body, "seed": 3}, "/v1/chat/completions").json()
    assert texts == [c["message"]["content"] for c in full["choices"]] and None not in reasons


def test_choices_with_logprobs_each_count_their_offsets(tiny_server):
    body = {"prompt": P, "max_tokens": 6, "n": 2, "logprobs": 1, "temperature": 1.0, "seed": 5}
    r = post(tiny_server, body).json()
    for c in r["choices"]:
        lp = c["logprobs"]
        assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == c["text"]
    chunks = _stream(tiny_server, body)
    offsets = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            if ch["logprobs"]:
                offsets[ch["index"]] += ch["logprobs"]["text_offset"]
    assert offsets == {c["index"]: c["logprobs"]["text_offset"] for c in r["choices"]}


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_out_of_bounds_is_a_400(tiny_server, n):
    r = post(tiny_server, {"prompt": P, "max_tokens": 3, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "1 to 16" in r.text, r.text


def test_choices_of_one_request_fail_together_past_the_queue(tiny):
    """The queue takes a request's choices all or none: a request with more choices than the queue holds is a
    400 (a retry would never fit; a full queue is a 429), and queues nothing."""
    cfg = ServerConfig("tiny", method="greedy", max_tokens=4, max_waiting=3)
    app = create_app(tiny, cfg)
    with ServerThread(app) as url:
        r = post(url, {"prompt": P, "max_tokens": 4, "n": 4, "temperature": 1.0})
        assert r.status_code == 400 and "--max-waiting" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "n" and app.state.layerleap.scheduler.waiting == []
        r = post(url, {"prompt": P, "max_tokens": 4, "n": 3, "temperature": 1.0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        r = post(url, {"prompt": P, "max_tokens": 4, "n": 16})  # greedy choices: one answer, one place
        assert r.status_code == 200 and len(r.json()["choices"]) == 16


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_every_choice(tiny, stream):
    """Streamed or not, every choice of a request whose client went away stops, counted as one cancelled
    request."""
    import socket
    import time

    from test_server import _metric, get

    cfg = ServerConfig("tiny", max_tokens=32, max_batch=8)
    with ServerThread(create_app(tiny, cfg)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = {"prompt": "Go on and on", "max_tokens": 1900, "n": 3, "temperature": 1.0, "stream": stream}
        body = json.dumps(body)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            if stream:
                got = b""
                while b"data: " not in got:
                    assert b" 200 OK" in got or not got, got
                    got += sock.recv(4096)
            else:
                deadline = time.monotonic() + 30
                while get(url + "/health").json()["running"] < 3 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert get(url + "/health").json()["running"] == 3
        deadline = time.monotonic() + 30
        while get(url + "/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(url + "/health").json()["running"] == 0
        m = get(url + "/metrics").text
        assert 0 < _metric(m, "layerleap_generated_tokens_total") < 3 * 1900
        assert _metric(m, "layerleap_cancelled_total") == 1
        assert post(url, {"prompt": "hi", "max_tokens": 3, "n": 2}).status_code == 200


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_fails_stops_its_siblings_uncounted_as_cancelled(tiny, method, stream):
    """One prompt of several failing while it decodes (its token filters leave no token) fails the request
    once, stops its sibling prompts, and counts no cancelled request: its client did not go away."""
    import time

    from test_server import _metric, get

    there = tiny.tokenizer(" there")["input_ids"]
    cfg = ServerConfig("tiny", method=method, max_tokens=32, max_batch=4, prefill_chunk=4)
    with ServerThread(create_app(tiny, cfg)) as url:
        body = {
            "prompt": ["Bye", "Bye now " * 60],  # the long one prefills 4 tokens a round: the short one fails first
            "max_tokens": 300,
            "allowed_token_ids": there,
            "bad_words": [" there there there"],
            "ignore_eos": True,
            "stream": stream,
            "layerleap": {"method": method},
        }
        r = post(url, body)
        assert ("no token is left to choose" in r.text) and r.text.count("no token is left") == 1, r.text
        assert r.status_code == (200 if stream else 400)
        deadline = time.monotonic() + 30
        while get(url + "/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        m = get(url + "/metrics").text
        assert _metric(m, "layerleap_running_requests") == 0 and _metric(m, "layerleap_waiting_requests") == 0
        assert _metric(m, "layerleap_cancelled_total") == 0, m


def test_a_request_past_the_queue_timeout_counts_once(tiny):
    """A request of several prompts and choices that waits past the queue timeout is a 503, one queue timeout
    in /metrics, and no cancelled request."""
    import threading

    from test_server import _metric, get

    cfg = ServerConfig("tiny", method="greedy", max_tokens=32, max_batch=1, max_running=1, queue_timeout=0.2)
    with ServerThread(create_app(tiny, cfg)) as url:
        busy = threading.Thread(target=post, args=(url, {"prompt": "x", "max_tokens": 800, "ignore_eos": True}))
        busy.start()
        try:
            while not get(url + "/health").json()["running"]:
                pass
            r = post(url, {"prompt": ["a", "b", "c"], "n": 2, "temperature": 1.0, "max_tokens": 5})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
            m = get(url + "/metrics").text
            assert _metric(m, "layerleap_queue_timeouts_total") == 1, m
            assert _metric(m, "layerleap_cancelled_total") == 0 and _metric(m, "layerleap_waiting_requests") == 0
        finally:
            busy.join()


def test_unseeded_sampled_choices_decode_as_one_batch(tiny_server):
    """Sampled choices without a seed share their batch key: a batching method decodes them as rows of one
    batch, each drawing from a generator of its own."""
    body = {"prompt": P, "max_tokens": 10, "n": 3, "temperature": 1.0, "layerleap": {"method": "prompt-lookup"}}
    r = post(tiny_server, body).json()
    assert r["layerleap"]["stats"]["batch"] == 3 and len({c["text"] for c in r["choices"]}) == 3, r


@pytest.mark.parametrize(
    "pieces,floor,want",
    [
        (["abXYcdXYe"], 4, "abXYcd"),  # the first ends at the floor: passed over
        (["abX", "YcdXYe"], 4, "abXYcd"),
        (["abXYcdXYe"], 3, "ab"),  # ends past it
        (["abXYcd"], 9, "abXYcd"),
    ],
)
def test_stop_text_passes_over_the_stops_that_end_by_the_floor(pieces, floor, want):
    from layerleap.core.text import StopText

    st = StopText(["XY"])
    st.floor = floor
    assert "".join(st.push(p) for p in pieces) + st.finish() == want


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_choices_each_echo_the_prompt(tiny_server, max_tokens):
    body = {"prompt": P, "max_tokens": max_tokens, "n": 2, "echo": True, "temperature": 1.0, "seed": 1}
    r = post(tiny_server, body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and all(c["text"].startswith(P) for c in r["choices"]), r
    chunks = _stream(tiny_server, body)
    assert _joined(chunks, 2)[0] == [c["text"] for c in r["choices"]]


def test_a_stop_token_ends_a_drafted_round_as_generate_ends_there(tiny):
    """A draft-and-verify round's path goes no further than a stop token, as ``generate``'s: the token filters that
    leave nothing after it are no 400, and the answer is the library's."""
    ids = tiny.tokenizer(P)["input_ids"]
    stop = generate(tiny, P, "greedy", 4, stop_at_eos=False).token_ids[0]
    args = dict(no_repeat_ngram_size=1, allowed_token_ids=sorted({*ids, stop}), stop_token_ids=[stop])
    want = generate(tiny, P, "speculative", 8, stop_at_eos=False, draft=tiny, **args)
    assert want.token_ids == [] and want.finish_reason == "stop"
    cfg = ServerConfig("tiny", method="speculative", options={"draft": tiny}, max_tokens=32)
    with ServerThread(create_app(tiny, cfg)) as url:
        r = post(url, {"prompt": P, "max_tokens": 8, "ignore_eos": True, **args})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and choice["finish_reason"] == "stop"
