"""Tool calling in chat completions: the request's tools and ``tool_choice`` (or the legacy ``functions`` and
``function_call``) as a ``ToolPlan``, the conversation with its tool turns as the chat template gets it, the
grammar that forces a call, and the answer's text parsed back into calls.

The tools reach the prompt through the chat template when it reads a ``tools`` variable (``tools=`` to
``apply_chat_template``, as `transformers` and vLLM pass them); a template that does not (the embedded
SmolLM2's) gets them written into the system message in the Hermes / Qwen2.5 form, and the tool turns as
text: an assistant's calls as ``<tool_call>`` blocks after its text, the tools' results as a user turn of
``<tool_response>`` blocks.

``tool_choice`` ``"required"`` or a named function forces one call with a grammar: the answer is the JSON
object ``{"name": ..., "arguments": ...}``, its arguments following the function's ``parameters`` schema.
``"auto"`` decodes freely and reads the Hermes blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
out of the text; a block that is not such a call to a declared function leaves the whole text as content.
``"none"`` (the default without tools) renders the tools and reads nothing back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..core.grammar import Grammar, GrammarError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)  # the last block may be left open
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters given
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolError(ValueError):
    """A request whose tools or tool turns do not fit together: the message and the field (``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """The request's tools (OpenAI's ``{"type": "function", "function": {...}}``) and what it asks of them:
    ``choice`` "none", "auto", "required" or "named" (``name``: the function); ``legacy``: asked with
    ``functions`` / ``function_call`` (the answer's ``message.function_call``); ``field``: the field that
    chose (for errors)."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None
    legacy: bool = False
    field: str = "tool_choice"

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """Whether the answer must be one call (a grammar forces it)."""
        return self.choice in ("required", "named")

    def grammar(self) -> Grammar | None:
        """The grammar of a forced call: ``{"name": <a tool's name>, "arguments": <its parameters>}``."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        shapes = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    # the arguments sit below the root: their schema's own references ("#/$defs/...") move there
                    "arguments": _moved(_an_object(parameters(t)), _at(k, len(chosen))),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for k, t in enumerate(chosen)
        ]
        return Grammar.json(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(the content, the calls ``{"name", "arguments": JSON text}``) the answer's text holds: a forced
        call's JSON object, or the Hermes blocks (``auto``); the text as content and no calls where it
        holds none or cannot be read as calls; no calls with ``none``."""
        if self.choice == "none":
            return text, []
        if self.forced:
            call = _call(text, self.names)
            return (None, [call]) if call else (text, [])
        return parse_hermes(text, self.names)


def parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return NO_PARAMETERS if params is None else params


def _an_object(schema: dict) -> dict:
    """A parameters schema that does not say its type (``{}``, properties alone) as an object's: a call's arguments
    are a JSON object (read back as nothing else)."""
    return schema if "type" in schema else {"type": "object", **schema}


def _at(k: int, shapes: int) -> str:
    """The JSON pointer of the arguments' schema of shape ``k`` of ``shapes`` in a forced call's grammar."""
    return ("" if shapes == 1 else f"/anyOf/{k}") + "/properties/arguments"


_DATA = ("const", "enum", "default", "examples")  # keywords whose values are JSON data, not schemas
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _moved(schema, at: str):
    """``schema`` with its local references (``"#"``, ``"#/$defs/x"``) pointing below ``at``, the JSON pointer
    of the place it takes in a larger schema."""
    if isinstance(schema, list):
        return [_moved(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):  # (not an anchor: "#name")
            out[k] = "#" + at + v[1:]
        elif k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: _moved(s, at) for name, s in v.items()}
        else:
            out[k] = _moved(v, at)
    return out


def _call(text: str, names: list[str]) -> dict | None:
    """``{"name", "arguments"}`` of one call written as JSON, or None when it is not a call of a declared tool."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments given as JSON text already
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_hermes(text: str, names: list[str]) -> tuple[str | None, list[dict]]:
    """The Hermes / Qwen2.5 tool calls in ``text``: (the text outside the ``<tool_call>`` blocks, stripped, or
    None when empty; the calls ``{"name", "arguments": JSON text}``).  Without blocks, or with a block that is
    not a call of one of ``names`` (not JSON, another name), the whole text is the content and there are no
    calls."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for b in blocks:
        call = _call(b.group(1).strip(), names)
        if call is None:
            return text, []
        calls.append(call)
    rest = _BLOCK.sub("", text).strip()
    return rest or None, calls


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(calls: list[dict]) -> list[dict]:
    """The calls as OpenAI's ``message.tool_calls``."""
    return [{"id": call_id(), "type": "function", "function": dict(c)} for c in calls]


# -- the request ---------------------------------------------------------------------------------------
def tool_plan(body) -> ToolPlan | None:
    """The chat request's ``ToolPlan`` (None: no tools, and nothing asked of them); a ``ToolError`` naming the
    field where the tools and the choice do not fit."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    functions = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions or ()]
    if tools and functions:
        raise ToolError("tools and functions both declare tools: give tools (functions is its older form)", "tools")
    if body.tool_choice is not None and body.function_call is not None:
        raise ToolError(
            "tool_choice and function_call both choose: give tool_choice (function_call is its older form)",
            "function_call",
        )
    legacy = bool(functions) or body.function_call is not None
    field = "function_call" if legacy else "tool_choice"
    if legacy and (tools or body.tool_choice is not None):
        raise ToolError("function_call goes with functions, tool_choice with tools: use tools and tool_choice", field)
    declared = functions or tools
    choice = body.function_call if legacy else body.tool_choice
    name = None
    if choice is not None and not isinstance(choice, str):  # {"type": "function", "function": {"name"}}, {"name"}
        name = choice.name if legacy else choice.function.name
        choice = "named"
    if choice is None:
        choice = "auto" if declared else "none"
    if choice in ("required", "named") and not declared:
        asked = "required" if choice == "required" else f"the function {name!r}"
        what = "functions" if legacy else "tools"
        raise ToolError(f"{field} asks for {asked}, but the request declares no tools: declare them in {what}", field)
    if name is not None and name not in [t["function"]["name"] for t in declared]:
        declared_names = ", ".join(t["function"]["name"] for t in declared)
        raise ToolError(f"{field} names {name!r}, which is not declared: choose one of {declared_names}", field)
    if not declared:
        return None
    for i, t in enumerate(declared):
        kind = parameters(t).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            at = f"functions[{i}].parameters" if legacy else f"tools[{i}].function.parameters"
            raise ToolError(
                f"{at} describes {json.dumps(kind)}, not an object: a call's arguments are a JSON object; give "
                '{"type": "object", "properties": {...}} (or leave parameters out for a function without arguments)',
                at,
            )
    plan = ToolPlan(tuple(declared), choice, name, legacy, field)
    try:
        plan.grammar()
    except GrammarError as e:  # a parameters schema that is not JSON
        raise ToolError(f"{'functions' if legacy else 'tools'}: {e}", "functions" if legacy else "tools") from None
    return plan


def template_reads_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a ``tools`` variable (one template, or any of several)."""
    import jinja2
    import jinja2.meta

    source = getattr(tokenizer, "chat_template", None)
    sources = list(source.values()) if isinstance(source, dict) else [source]
    for s in sources:
        if not isinstance(s, str):
            continue
        try:
            if "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(s)):
                return True
        except jinja2.TemplateSyntaxError:
            if re.search(r"\btools\b", s):
                return True
    return False


def _arguments(text: str):
    """A replayed call's arguments as the template gets them: the object its JSON text holds (the text
    itself when it is not a JSON object)."""
    try:
        args = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return args if isinstance(args, dict) else text


def conversation(messages, plan: ToolPlan | None, reads_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template gets them, and the tools to pass it (None: none, or they are written
    into the system message).  A tool's result must answer a call of the assistant turn before it (a
    ``ToolError`` naming it otherwise)."""
    out: list[dict] = []
    calls: dict[str, str] = {}  # the open calls' ids -> their function's names
    pending: list[str] = []  # the Hermes fallback: tool results waiting to become one user turn
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role in ("tool", "function"):
            if role == "function":  # legacy: the result names its function, not a call (the id: Message.calls()'s)
                name, cid = m.name, next((c for c, n in calls.items() if n == m.name), None) or f"call_{m.name}"
            else:
                if m.tool_call_id not in calls:
                    raise ToolError(
                        f"messages[{i}] is a tool result for {m.tool_call_id!r}, which no assistant turn before it "
                        "calls: a tool message answers a tool_calls entry of the assistant turn before it (by id)",
                        f"messages[{i}].tool_call_id",
                    )
                name, cid = calls[m.tool_call_id], m.tool_call_id
            if reads_tools:
                out.append({"role": "tool", "tool_call_id": cid, "name": name, "content": m.text()})
            else:
                pending.append(f"<tool_response>\n{m.text()}\n</tool_response>")
            continue
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
            pending = []
        msg = {"role": role, "content": m.text()} | ({} if m.name is None else {"name": m.name})
        replayed = m.calls()
        if role != "assistant" or not replayed:
            calls = {}
            out.append(msg)
            continue
        calls = {c.id: c.function.name for c in replayed}
        if reads_tools:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in replayed
            ]
        else:
            written = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in replayed]
            blocks = [f"{CALL_OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CALL_CLOSE}" for c in written]
            msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + blocks)
        out.append(msg)
    if pending:
        out.append({"role": "user", "content": "\n".join(pending)})
    if plan is None:
        return out, None
    if reads_tools:
        return out, [dict(t) for t in plan.tools]
    listed = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
    if out and out[0]["role"] == "system":
        out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{listed}" if out[0]["content"] else listed}
    else:
        out.insert(0, {"role": "system", "content": listed})
    return out, None


# -- a streamed answer ---------------------------------------------------------------------------------
class ToolStream:
    """One streamed choice's text under a ``ToolPlan``: the text before a ``<tool_call>`` goes out as it comes
    (``feed``); from the first ``<tool_call>`` on (from the start, for a forced call) it is held, and read at
    the end (``finish``): its calls, or the held text as content when it holds none.  The log probabilities of
    held text go out with the next text sent."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.holding = plan.forced
        self.logprobs: list | None = None

    def _take_logprobs(self) -> list | None:
        lps, self.logprobs = self.logprobs, None
        return lps

    def feed(self, piece: str) -> tuple[str, list | None]:
        """The text (and the log probabilities) to send now, for ``piece`` (a ``Piece``)."""
        lps = getattr(piece, "logprobs", None)
        if lps is not None:
            self.logprobs = (self.logprobs or []) + list(lps)
        if self.plan.choice == "none":
            return str(piece), self._take_logprobs()
        self.held += piece
        if self.holding:
            return "", None
        at = self.held.find(CALL_OPEN)
        if at >= 0:
            self.holding = True
            send, self.held = self.held[:at], self.held[at:]
        else:  # keep a tail that may be the start of "<tool_call>"
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                         if CALL_OPEN.startswith(self.held[-k:])), 0)  # fmt: skip
            send, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return (send, self._take_logprobs()) if send else ("", None)

    def finish(self) -> tuple[str, list | None, list[dict]]:
        """(the held text to send as content, the log probabilities held, the calls) at the answer's end."""
        held, self.held = self.held, ""
        if self.holding:
            content, calls = self.plan.parse(held)
            if calls:
                return content or "", self._take_logprobs(), calls
        return held, self._take_logprobs(), []
