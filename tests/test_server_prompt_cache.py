"""The server's prompt cache: a chat's next turn reuses the keys and values of the turns before it (the
continuous pool and the batched methods alike), reports them in OpenAI's
``usage.prompt_tokens_details.cached_tokens`` and in /metrics, answers what it answers without them, and
is off per request with llama.cpp's ``cache_prompt: false`` or for the server with ``--prompt-cache-mb 0``."""

from __future__ import annotations

import json

import pytest

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test]'")

from test_server import post  # noqa: E402
from test_server_ops import metrics, total  # noqa: E402

import layerleap  # noqa: E402
from layerleap.server import ServerConfig, ServerThread, create_app  # noqa: E402

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def char_model(char_model_dir):
    return layerleap.load(str(char_model_dir))


def _serve(model, **cfg):
    return ServerThread(create_app(model, ServerConfig("tiny", method="greedy", max_tokens=12, **cfg)))


def _turns(url: str, extra: dict) -> tuple[dict, dict, dict]:
    """Two turns of a chat (the second with and without the cache) -> the three answers."""
    first = [{"role": "user", "content": "abc def"}]
    one = post(url, {"messages": first, **extra}, CHAT).json()
    said = one["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": said}, {"role": "user", "content": "ghi"}]
    two = post(url, {"messages": second, **extra}, CHAT).json()
    plain = post(url, {"messages": second, "cache_prompt": False, **extra}, CHAT).json()
    return one, two, plain


@pytest.mark.parametrize(
    "continuous,extra",
    [
        (True, {}),  # greedy in the continuous pool
        (False, {}),  # greedy as a batch (a Decoding)
        (True, {"layerleap": {"method": "prompt-lookup"}}),
        (True, {"temperature": 0.7, "seed": 3}),  # sampled in the pool
    ],
    ids=["pool", "batch", "prompt-lookup", "sampled"],
)
def test_a_second_turn_reuses_the_first(char_model, continuous, extra):
    with _serve(char_model, continuous=continuous) as url:
        one, two, plain = _turns(url, extra)
        assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert one["usage"]["prompt_tokens"] // 2 < cached < two["usage"]["prompt_tokens"]
        assert two["layerleap"]["stats"]["cached_prompt_tokens"] == cached
        assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert two["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        method = two["layerleap"]["method"]
        assert total(metrics(url), "layerleap_cached_prompt_tokens_total", method=method) == cached


def test_a_streamed_usage_counts_the_cached_tokens(char_model):
    with _serve(char_model) as url:
        body = {"messages": [{"role": "user", "content": "abc def"}], "stream": True}
        post(url, body, CHAT)
        body["stream_options"] = {"include_usage": True}
        text = post(url, body, CHAT).text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_no_cache_with_zero_megabytes(char_model):
    with _serve(char_model, prompt_cache_mb=0) as url:
        _, two, _ = _turns(url, {})
        assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cache_prompt_must_be_a_boolean(char_model):
    with _serve(char_model) as url:
        r = post(url, {"messages": [{"role": "user", "content": "a"}], "cache_prompt": "yes"}, CHAT)
        assert r.status_code == 400 and "cache_prompt" in r.text


TWO = ["abcdefghij klmnop", "qrstuvwxyz 0123"]  # two prompts, each cached by a request of its own first


@pytest.mark.parametrize("continuous", [True, False], ids=["pool", "batch"])
def test_every_prompt_of_a_request_reuses(char_model, continuous):
    """A legacy completion's prompts each reuse the cache, not only the first (the others were given settings
    without it: no reuse, and a batch of their own)."""
    with _serve(char_model, continuous=continuous) as url:
        alone = [post(url, {"prompt": p}, "/v1/completions").json() for p in TWO]
        again = [post(url, {"prompt": p}, "/v1/completions").json() for p in TWO]
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in again]
        assert all(c > 0 for c in cached)
        before = total(metrics(url), "layerleap_cached_prompt_tokens_total", method="greedy")
        both = post(url, {"prompt": TWO}, "/v1/completions").json()
        after = total(metrics(url), "layerleap_cached_prompt_tokens_total", method="greedy")
        assert after - before == sum(cached)
        assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]


@pytest.mark.parametrize("n", [1, 2])
def test_the_usage_counts_every_prompts_cached_tokens(char_model, n):
    """As ``prompt_tokens`` counts every prompt's tokens, ``cached_tokens`` counts every prompt's reused ones
    (each prompt once, whatever its choices), streamed too."""
    with _serve(char_model) as url:
        for p in TWO:
            post(url, {"prompt": p}, "/v1/completions")
        cached = [
            post(url, {"prompt": p}, "/v1/completions").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            for p in TWO
        ]
        body = {"prompt": TWO, "n": n, "temperature": 0.5, "seed": 1}
        usage = post(url, body, "/v1/completions").json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": sum(cached)}
        assert usage["prompt_tokens"] == sum(len(char_model.tokenizer(p)["input_ids"]) for p in TWO)
        text = post(url, {**body, "stream": True, "stream_options": {"include_usage": True}}, "/v1/completions").text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": sum(cached)}
