"""The request bodies as pydantic models: OpenAI's fields, the answer-changing fields of vLLM and
llama.cpp that the server implements (sampling, penalties and biases, stops, structured output:
``GRAMMAR_FIELDS``), and the ``layerleap`` extension as a typed sub-model.

Types are strict (``"5"`` is not a number, ``"yes"`` is not a boolean) and unknown fields are refused,
so a wrong type or a misspelt field is a 400 naming the field, and nothing a client sends is
silently ignored.  A field that would change the answer and that the server cannot honour is
declared (it shows in ``/docs``) and refused when it asks for anything (``REFUSED``: the value that
asks for nothing).  Fields that do not change the answer (``user``, ``metadata``, ``store``, …) are
taken and left unused.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.grammar import Grammar
from ..core.logprobs import MAX_TOP
from ..core.text import MAX_STOPS
from ..validate import SEED_MAX

# answer-changing fields the server cannot honour -> the values that ask for nothing (accepted)
REFUSED: dict[str, tuple] = {
    # OpenAI
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    # vLLM
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "skip_special_tokens": (None, True),
    # llama.cpp
    "mirostat": (None, 0),
    "n_probs": (None, 0),
    "dynatemp_range": (None, 0, 0.0),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0),
    "n_keep": (None, 0),
}

Id = int  # a token id; the vocabulary bound is checked against the model

# structured output: the field -> how its value becomes a ``Grammar`` (a request gives one of them)
GRAMMAR_FIELDS = {
    "response_format": Grammar.from_response_format,  # OpenAI
    "guided_json": Grammar.json,  # vLLM
    "guided_regex": Grammar.regex,
    "guided_choice": Grammar.choice,
    "guided_grammar": Grammar.gbnf,
    "grammar": Grammar.gbnf,  # llama.cpp ("" asks for nothing)
    "json_schema": Grammar.json,
}


class LayerleapOptions(BaseModel):
    """The ``layerleap`` field: the decoding method and its options for this request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    method: str | None = Field(None, description="a layerleap method (`layerleap methods`); default: the server's")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the method's options, merged over the server's --opt when the method is the server's",
    )
    top_k: int | None = Field(
        None, ge=0, description="sample from the k likeliest tokens (0: all); the same as the top-level top_k"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = Field(False, description="a last chunk with the usage")
    include_obfuscation: bool | None = Field(None, description="taken and unused: no chunk is padded")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDef(BaseModel):
    """A function a tool calls: its name, what it does, and its arguments as a JSON schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=TOOL_NAME, description="letters, digits, _ and -, 64 at most")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (absent: none)")
    strict: bool | None = Field(None, description="taken: a forced call follows the schema exactly anyway")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    """A call an assistant turn made: the function's name and its arguments as JSON text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _unique_names(tools: list, name) -> None:
    seen = set()
    for i, t in enumerate(tools):
        n = name(t)
        if n in seen:
            raise ValueError(f"two tools are named {n!r} (the second at [{i}]): give each tool its own name")
        seen.add(n)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None  # None: an assistant's turn without text (OpenAI's shape)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (replayed)
    function_call: FunctionCall | None = None  # the legacy form of one call
    tool_call_id: str | None = None  # a tool message: the call it answers
    # the other fields of an answer's message (an answer replayed as it came, with ``message.model_dump()``):
    # taken when they hold nothing, refused otherwise
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        """A part that is not text (an image, audio, a file) is named, not met by "input should be a valid string"."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"part {i} is of type {kind!r}: this server takes text only, "
                        'as a string or parts {"type": "text", "text": ...}'
                    )
                if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError(f'part {i} is not a text part: give {{"type": "text", "text": "..."}} only')
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f'got {type(content).__name__}: give text, as a string or parts {{"type": "text", "text": ...}}'
            )
        return content

    @model_validator(mode="after")
    def _nothing_else(self):
        for k in ("tool_calls", "function_call"):
            if getattr(self, k) not in (None, []) and self.role != "assistant":
                raise ValueError(
                    f"{k} belongs to assistant turns (the calls they made): leave it out of a {self.role} message"
                )
        if self.tool_calls and self.function_call is not None:
            raise ValueError("tool_calls and function_call both give calls: give tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the call (in tool_calls) it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id belongs to tool messages: leave it out")
        if self.role == "function" and self.name is None:
            raise ValueError("a function message needs the function's name: give name")
        for k in ("refusal", "audio", "annotations"):
            if getattr(self, k) not in (None, []):
                raise ValueError(f"{k} is not supported by this server: leave it out (or null)")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content: give its text")
        return self

    def text(self) -> str:
        if self.content is None:  # an assistant's turn without text
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def calls(self) -> list[ToolCall]:
        """The calls this (assistant) turn made: its tool_calls, or its legacy function_call."""
        if self.function_call is not None:
            return [ToolCall(id=f"call_{self.function_call.name}", function=self.function_call)]
        return list(self.tool_calls or ())


class _Request(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="tokens to generate at most (default: the server's --max-tokens, bounded by the context; "
        "0 with echo: the prompt scored, nothing generated)",
    )
    n_predict: int | None = Field(None, ge=-1, description="llama.cpp's name for max_tokens (-1: the default)")
    temperature: float | None = Field(
        None, ge=0, le=2, description="0: greedy; above 0: sampling; absent: the method's own default"
    )
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="sample from the k likeliest tokens (0 or -1: all)")
    min_p: float | None = Field(
        None, ge=0, le=1, description="sample from the tokens at least min_p times as likely as the likeliest (0: all)"
    )
    typical_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="llama.cpp's and transformers' typical sampling: the tokens whose surprisal is nearest the "
        "entropy, up to this much probability (1: all)",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        description="vLLM's: a positive logit of every token of the prompt and the answer so far is divided by it, "
        "another multiplied (1: off)",
    )
    repeat_penalty: float | None = Field(None, gt=0, description="llama.cpp's name for repetition_penalty")
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtracted from the logit of every token the answer holds so far"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtracted from a token's logit once per time the answer holds it so far"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description='token id (as a string) -> a bias in [-100, 100] added to its logit: {"50256": -100}'
    )
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM's: no end-of-sequence token, stop token or stop string before this many tokens"
    )
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's: only these token ids may be chosen")
    bad_words: list[str] | None = Field(
        None, description="vLLM's: words the answer never completes (their tokens, with and without a leading space)"
    )
    no_repeat_ngram_size: int | None = Field(
        None,
        ge=0,
        description="transformers': no n-gram of this many tokens occurs twice in the prompt and answer (0: off)",
    )
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="a seeded sample is reproducible")
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOPS} strings; the text ends before the first one"
    )
    stop_token_ids: list[int] | None = Field(None, description="token ids that end the answer (not returned)")
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's: the stop string that ended the text is kept at its end (null: false)"
    )
    ignore_eos: bool = Field(False, description="go on past the end-of-sequence token, up to max_tokens")
    n: int | None = Field(
        1, description="choices per request, 1 to 16 (null: 1): greedy ones are one answer, sampled ones differ"
    )
    stream: bool | None = Field(False, description="server-sent events (null: false)")
    stream_options: StreamOptions | None = None
    layerleap: LayerleapOptions = Field(default_factory=LayerleapOptions)
    cache_prompt: bool | None = Field(
        None, description="llama.cpp's: reuse the server's prompt cache (null: true; false: run the whole prompt)"
    )
    # taken and unused: they do not change the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prediction: dict | None = None
    parallel_tool_calls: bool | None = None
    # structured output (one of them): the answer follows a grammar
    response_format: dict[str, Any] | None = Field(
        None,
        description='OpenAI\'s: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema"}}',
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression the answer matches")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the answer is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: a context-free grammar (GBNF or Lark)")
    grammar: str | None = Field(None, description="llama.cpp's: a GBNF grammar")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp's: a JSON schema")
    # refused unless they ask for nothing (REFUSED)
    mirostat: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP,
        description="vLLM's: each prompt token's log probability, rank and the likeliest tokens there, this many "
        "(a list, the first token's null; not with stream)",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="vLLM's: the prompt's last this many tokens are kept (-1: as many as this server takes in a "
        "prompt; null: all)",
    )
    skip_special_tokens: Any = None
    n_probs: Any = None
    dynatemp_range: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    n_keep: Any = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("0 would keep no prompt: give at least 1, or -1 for as many as this server takes")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > MAX_STOPS:
            raise ValueError(f"must be a string or a list of at most {MAX_STOPS} strings")
        return v

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def grammar_fields(self) -> list[str]:
        """The structured-output fields given (that ask for a grammar)."""
        nothing = (None, "", {"type": "text"})
        return [k for k in GRAMMAR_FIELDS if getattr(self, k) not in nothing]

    _asks_nothing: ClassVar[dict[str, tuple]] = {}  # this endpoint's own values that ask for nothing (over REFUSED's)

    def refused(self) -> str | None:
        """The first field given that asks for what the server cannot do."""
        given = self.model_dump(exclude_unset=True)
        refused = REFUSED | self._asks_nothing
        return next((k for k, nothing in refused.items() if k in given and given[k] not in nothing), None)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool | None = Field(
        None, description="each answer token's log probability (the model's own, before sampling's warps)"
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP, description="with logprobs: the likeliest tokens at each position, this many"
    )
    tools: list[ToolDef] | None = Field(None, description="functions the model may call (OpenAI's shape)")
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = Field(
        None,
        description='"none", "auto" (the default with tools: calls read from the text), "required" (one call), '
        'or {"type": "function", "function": {"name": ...}} (a call of that function)',
    )
    functions: list[FunctionDef] | None = Field(None, description="the older form of tools")
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="the older form of tool_choice (with functions)"
    )
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, tools):
        _unique_names(tools or [], lambda t: t.function.name)
        return tools

    @field_validator("functions")
    @classmethod
    def _function_names(cls, functions):
        _unique_names(functions or [], lambda f: f.name)
        return functions

    def logprob_count(self) -> int | None:
        """The likeliest tokens each answer token reports with its log probability (None: no log
        probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_PROMPTS = 64  # legacy completions' prompts in one request at most


def _one_prompt(p) -> bool:
    """Whether ``p`` is one prompt: a non-empty string, or a non-empty list of token ids."""
    if isinstance(p, str):
        return bool(p.strip())
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    _asks_nothing: ClassVar[dict[str, tuple]] = {"top_logprobs": (None, 0)}  # chat's: here logprobs is the count
    prompt: str | list[int] | list[str | list[int]] = Field(
        description=f"a string or a list of token ids, or a list of up to {MAX_PROMPTS} of them (each answered: "
        "choices prompt by prompt, index = prompt's place * n + choice)"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP,
        description="each answer token's log probability and the likeliest tokens at its position, this many",
    )
    top_logprobs: Any = None
    best_of: int | None = Field(
        None,
        description="sampled answers to pick the n best of (the highest mean log probability per token), n to 16 "
        "(default n; greedy ones are one answer; not with stream)",
    )
    echo: bool | None = Field(
        None, description="the prompt before the answer's text (and with logprobs, its tokens' before the answer's)"
    )
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        one = "a non-empty string or a non-empty list of token ids"
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):  # several prompts
            if len(v) > MAX_PROMPTS:
                raise ValueError(
                    f"holds {len(v)} prompts, over this server's {MAX_PROMPTS} per request: send them in several"
                )
            bad = next((i for i, p in enumerate(v) if not _one_prompt(p)), None)
            if bad is not None:
                raise ValueError(f"prompt [{bad}] is not {one}: give each prompt as one")
            return v
        if _one_prompt(v):
            return v
        raise ValueError(f"must be {one}, or a list of up to {MAX_PROMPTS} of them")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or several in a list)."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    def logprob_count(self) -> int | None:
        """Legacy completions' ``logprobs`` is the count (0: the chosen tokens' log probabilities alone)."""
        return self.logprobs


# -- the tokenizer endpoints -------------------------------------------------------------------------
class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's body (``prompt``, or ``messages`` through the chat template) or llama.cpp's
    (``content``); which one is told by the field that gives the text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    # vLLM's
    prompt: str | None = Field(None, description="vLLM's: text, tokenized as a completion's prompt is")
    messages: list[Message] | None = Field(
        None, min_length=1, description="vLLM's: a conversation, tokenized as a chat completion's prompt is"
    )
    add_generation_prompt: bool | None = Field(
        None, description="vLLM's, with messages: the template's opening of the assistant's turn (default true)"
    )
    tools: list[ToolDef] | None = Field(
        None, description="vLLM's, with messages: the tools a chat completion would declare (they are in its prompt)"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="vLLM's: the tokenizer's special tokens (a BOS) added (default: true with prompt, as a "
        "completion's prompt is tokenized; false with messages, whose template adds its own)",
    )
    return_token_strs: bool | None = Field(None, description="vLLM's: token_strs, each token's piece")
    # llama.cpp's
    content: str | None = Field(None, description="llama.cpp's: text")
    add_special: bool | None = Field(None, description="llama.cpp's: the tokenizer's special tokens added (false)")
    with_pieces: bool | None = Field(None, description='llama.cpp\'s: tokens as {"id", "piece"}')
    parse_special: bool | None = Field(
        None, description="llama.cpp's: special tokens' text read as those tokens (true; false is not supported)"
    )

    VLLM: ClassVar[tuple[str, ...]] = ("add_special_tokens", "return_token_strs")

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, tools):
        _unique_names(tools or [], lambda t: t.function.name)
        return tools

    LLAMA: ClassVar[tuple[str, ...]] = ("add_special", "with_pieces", "parse_special")

    def texts(self) -> list[str]:
        """The fields given that give the text (one of them is right)."""
        return [k for k in ("prompt", "messages", "content") if getattr(self, k) is not None]

    def misfit(self) -> str | None:
        """The first field given that does not go with the one field that gives the text."""
        text = self.texts()[0]
        chat = ("add_generation_prompt", "tools")
        others = self.VLLM + chat if text == "content" else self.LLAMA
        if text == "prompt":
            others += chat
        return next((k for k in others if getattr(self, k) is not None), None)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: vLLM's and llama.cpp's body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    tokens: list[int] = Field(description="token ids")
