"""The server's tokenizer endpoints, ``/tokenize`` and ``/detokenize``, in vLLM's and llama.cpp's shapes: the
tokens a completion's and a chat completion's prompt are, the pieces, and the errors."""

from __future__ import annotations

import pytest

for _module in ("openai", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test]'")

import test_server  # noqa: E402
from test_server import get, post  # noqa: E402

tiny, tiny_server, client = test_server.tiny, test_server.tiny_server, test_server.client  # the server tests' fixtures

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


def test_prompt_tokens_are_the_completions_prompt(tiny_server, tiny, client):
    r = post(tiny_server, {"model": "tiny", "prompt": "The sky is blue"}, "/tokenize")
    assert r.status_code == 200, r.text
    want = tiny.tokenizer("The sky is blue")["input_ids"]
    assert r.json() == {"tokens": want, "count": len(want), "max_model_len": tiny.config.max_position}
    used = client.completions.create(model="tiny", prompt="The sky is blue", max_tokens=1).usage
    assert used.prompt_tokens == len(want)


def test_messages_count_is_the_chat_completions_prompt_tokens(tiny_server, client):
    r = post(tiny_server, {"messages": CHAT}, "/tokenize").json()
    used = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1).usage
    assert r["count"] == len(r["tokens"]) == used.prompt_tokens
    bare = post(tiny_server, {"messages": CHAT, "add_generation_prompt": False}, "/tokenize").json()
    assert bare["count"] < r["count"] and r["tokens"][: bare["count"]] == bare["tokens"]


def test_token_strs_and_pieces(tiny_server, tiny):
    text = "Hi 𝔘 é"
    r = post(tiny_server, {"prompt": text, "return_token_strs": True}, "/tokenize").json()
    assert r["token_strs"] == tiny.tokenizer.convert_ids_to_tokens(r["tokens"])
    llama = post(tiny_server, {"content": text, "with_pieces": True}, "/tokenize").json()["tokens"]
    assert [p["id"] for p in llama] == r["tokens"]
    assert any(isinstance(p["piece"], list) for p in llama)  # a part of 𝔘's bytes is no whole character
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in llama)
    assert joined == text.encode()
    assert post(tiny_server, {"content": text}, "/tokenize").json() == {"tokens": r["tokens"]}


def test_detokenize_gives_the_text_under_both_keys(tiny_server, tiny):
    ids = tiny.tokenizer("The sky is blue")["input_ids"]
    r = post(tiny_server, {"model": "tiny", "tokens": ids}, "/detokenize")
    assert r.status_code == 200 and r.json() == {"prompt": "The sky is blue", "content": "The sky is blue"}


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/detokenize", {"tokens": [5, 49152]}, "tokens", "tokens[1] is 49152"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0] is -1"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]", "integer"),
        ("/tokenize", {}, "prompt", "give the text"),
        ("/tokenize", {"prompt": "a", "content": "b"}, "content", "prompt and content"),
        ("/tokenize", {"prompt": "a", "with_pieces": True}, "with_pieces", "does not go with prompt"),
        ("/tokenize", {"content": "a", "add_special_tokens": True}, "add_special_tokens", "does not go with content"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "does not go"),
        ("/tokenize", {"content": "a", "parse_special": False}, "parse_special", "not supported"),
        ("/tokenize", {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "not a field"),
        ("/tokenize", {"prompt": ["a"]}, "prompt", "string"),
        ("/tokenize", {"messages": []}, "messages", "at least 1"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "tool"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(tiny_server, path, body, param, words):
    r = post(tiny_server, body, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})])
def test_another_model_is_the_completions_404(tiny_server, path, body):
    r = post(tiny_server, {**body, "model": "gpt-4"}, path)
    want = post(tiny_server, {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == want.status_code == 404 and r.json() == want.json()


def test_the_endpoints_are_counted_by_name(tiny_server):
    post(tiny_server, {"prompt": "a"}, "/tokenize")
    post(tiny_server, {"tokens": [1]}, "/detokenize")
    text = get(tiny_server + "/metrics").text
    assert 'endpoint="/tokenize"' in text and 'endpoint="/detokenize"' in text
