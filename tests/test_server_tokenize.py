"""The server's tokenizer endpoints, ``/tokenize`` and ``/detokenize``, in vLLM's and llama.cpp's shapes: the
tokens a completion's and a chat completion's prompt are, the pieces, and the errors."""

from __future__ import annotations

import json

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


def test_messages_with_tools_count_as_the_chat_completion_with_them(tiny_server, client):
    """Tools and tool turns are in a chat completion's prompt (its template's, or the Hermes form): /tokenize
    takes vLLM's tools and counts them the same."""
    from test_server_tools import ROUND_TRIP, TOOLS

    r = post(tiny_server, {"messages": ROUND_TRIP, "tools": TOOLS}, "/tokenize").json()
    used = client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS, max_tokens=1).usage
    assert r["count"] == used.prompt_tokens
    assert r["count"] > post(tiny_server, {"messages": ROUND_TRIP}, "/tokenize").json()["count"]


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
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "input should be"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
        ("/tokenize", {"prompt": "a", "tools": []}, "tools", "does not go with prompt"),
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


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """A character model whose tokenizer adds <s> (id 1) before a text."""
    from tiny_models import save_char_model
    from tokenizers import Tokenizer, processors

    import layerleap
    from layerleap.server import ServerConfig, ServerThread, create_app

    folder = tmp_path_factory.mktemp("bos") / "tiny"
    save_char_model(folder)
    core = Tokenizer.from_file(str(folder / "tokenizer.json"))
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    core.save(str(folder / "tokenizer.json"))
    model = layerleap.load_folder(folder)
    with ServerThread(create_app(model, ServerConfig("tiny", method="greedy", max_tokens=4))) as url:
        yield url


def test_special_tokens_as_each_server_adds_them(bos_server):
    def tokens(body):
        r = post(bos_server, body, "/tokenize")
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    plain = tokens({"content": "ab"})  # llama.cpp's add_special: false by default
    assert tokens({"content": "ab", "add_special": True}) == [1] + plain
    assert tokens({"prompt": "ab"}) == [1] + plain  # vLLM's add_special_tokens: true by default, as completions
    assert tokens({"prompt": "ab", "add_special_tokens": False}) == plain
    used = post(bos_server, {"prompt": "ab", "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == len(plain) + 1
    chat = {"messages": [{"role": "user", "content": "ab"}]}
    templated = tokens(chat)  # vLLM's add_special_tokens: false with messages (the template has its <s>)
    assert templated == [1] + plain + [2, 1] and tokens({**chat, "add_special_tokens": True}) == [1] + templated


def test_a_model_without_a_chat_template_tokenizes_prompts_only(char_model_dir):
    import layerleap
    from layerleap.server import ServerConfig, ServerThread, create_app

    model = layerleap.load_folder(char_model_dir)
    model.tokenizer.chat_template = None
    with ServerThread(create_app(model, ServerConfig("tiny", method="greedy", max_tokens=4))) as url:
        r = post(url, {"messages": [{"role": "user", "content": "ab"}]}, "/tokenize")
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "no chat template: give the text as prompt" in r.json()["error"]["message"]
        assert post(url, {"prompt": "ab"}, "/tokenize").json()["count"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_index_the_text_past_a_bos_the_tokenizer_added(bos_server, stream):
    """Legacy completions' echo with logprobs: text_offset indexes the echoed text, so <s>, which the tokenizer
    added before a text prompt and which the text does not hold, takes no room, and the offsets never go back."""
    body = {"prompt": "ab", "max_tokens": 3, "echo": True, "logprobs": 0, "ignore_eos": True, "stream": stream}
    r = post(bos_server, body)
    assert r.status_code == 200, r.text
    if stream:
        choices = [json.loads(e[6:])["choices"][0] for e in r.text.split("\n\n") if e.startswith("data: {")]
    else:
        choices = r.json()["choices"]
    text = "".join(c["text"] for c in choices)
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert tokens[:3] == ["<s>", "a", "b"] and offsets[:3] == [0, 0, 1] and text.startswith("ab")
    assert offsets == sorted(offsets) and offsets[3] == 2
    if not stream:  # a token-id prompt echoes <s>'s text: it takes its room
        plain = post(bos_server, {"content": "ab"}, "/tokenize").json()["tokens"]
        r = post(bos_server, {**body, "prompt": [1, *plain]}).json()["choices"][0]
        assert r["text"].startswith("<s>ab") and r["logprobs"]["text_offset"][:4] == [0, 3, 4, 5]
