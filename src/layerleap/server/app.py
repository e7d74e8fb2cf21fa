"""The FastAPI app: route handlers over one ``AppState`` (``app.state.layerleap``), an ASGI guard for
the body limit, the request counter and the access log, and OpenAI's response shapes.

Nothing slow runs on the event loop: prompts are tokenized in a thread pool, and the model calls
and the detokenizing run in the scheduler's worker thread (the native layers let go of the GIL
while they compute), so ``/health`` and the streams keep moving while a long prompt prefills.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..core.grammar import Grammar, GrammarError
from ..core.logprobs import TokenLogprob, token_bytes, token_text
from ..core.model import Transformer
from ..core.prompt_cache import DEFAULT_MB, PromptCache
from ..core.run import GenerationConfig, NoTokenLeft, chat_token_ids, row_seed
from ..decoding import METHODS, GenerationError, check_processors, get_method, score
from ..errors import LayerleapError
from ..options import model_options
from ..scheduler import Finish, Job, QueueTimeout, Scheduler, Settings
from .metrics import Metrics, endpoint_label
from .schema import (
    GRAMMAR_FIELDS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    TokenizeRequest,
    _Request,
)
from .tools import ToolError, ToolPlan, ToolStream, conversation, template_reads_tools, tool_calls, tool_plan

access_log = logging.getLogger("layerleap.access")


@dataclass
class ServerConfig:
    model_name: str  # the id clients pass as ``model`` (and /v1/models lists)
    method: str = "auto"  # the default method
    options: dict = field(default_factory=dict)  # the default method's options (models already loaded)
    max_tokens: int = 256  # max_tokens when a request gives none (bounded by the context)
    max_batch: int = 16  # rows decoded together (the pool's rows; a batch's rows for the other methods)
    max_running: int = 2  # batches of the methods the pool does not take, decoding in turn
    max_waiting: int = 256
    loadable: tuple[str, ...] = ()  # model names a request's options may name (loaded on first use)
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413)
    max_prompt_tokens: int | None = None  # a longer prompt is refused (None, or more: the context less one)
    queue_timeout: float = 600.0  # seconds a request may wait for its turn (then 503)
    shadow_share: float = 0.0  # share of lossy-method requests re-decoded greedily when idle (agreement metric)
    continuous: bool = True  # greedy and sample requests join and leave one pool round by round
    prefill_chunk: int = 512  # prompt tokens the pool prefills per round
    prompt_cache_mb: int = DEFAULT_MB  # the prefix cache's bound in MiB of keys and values (0: no cache)


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _sampling_field(body) -> str:
    """The request field that asked for sampling (the error's ``param``): temperature, else top_p, else min_p,
    else typical_p, else top_k."""
    if body.temperature is not None:
        return "temperature"
    if body.top_p is not None and body.top_p < 1:
        return "top_p"
    if body.min_p:
        return "min_p"
    return "typical_p" if body.typical_p is not None and body.typical_p < 1 else "top_k"


def _queue_full(st) -> APIError:
    return APIError(
        429, "the server's queue is full: retry later", code="queue_full", type="rate_limit_error",
        retry_after=st.retry_after(),
    )  # fmt: skip


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over this server's limit of {limit} bytes: send less")


# -- the state ---------------------------------------------------------------------------------------
@dataclass
class AppState:
    """What the handlers share: the model, the config, the scheduler (made at start-up) and the metrics."""

    model: Transformer
    cfg: ServerConfig
    loader: Callable[[str], Transformer] | None = None
    scheduler: Scheduler | None = None
    metrics: Metrics = None  # type: ignore[assignment]
    latency_s: float = 5.0  # a running mean of request latency (for Retry-After)
    shadows: list = field(default_factory=list)  # (method, prompt ids, tokens) waiting for a shadow check
    shadow_run: tuple | None = None  # the shadow check under way: (method, tokens, Decoding, its rounds)
    prompt_cache: PromptCache | None = None  # the prefix cache the requests share (None: off)

    def __post_init__(self):
        self.metrics = Metrics(self.load)
        if self.cfg.prompt_cache_mb > 0:
            self.prompt_cache = PromptCache(max_bytes=self.cfg.prompt_cache_mb * 2**20)

    def load(self) -> tuple[int, int]:
        s = self.scheduler
        return (len(s.waiting), s.running_jobs()) if s else (0, 0)

    def retry_after(self) -> int:
        """Seconds until the queue has room, roughly."""
        waiting, _ = self.load()
        return max(1, min(60, math.ceil(self.latency_s * waiting / max(1, self.cfg.max_batch * self.cfg.max_running))))

    def context(self) -> int:
        return self.model.config.max_position


def state_of(request: Request) -> AppState:
    return request.app.state.layerleap


# -- requests ----------------------------------------------------------------------------------------
def prompt_limit(st: AppState) -> int:
    """The most tokens a prompt may hold: ``--max-prompt-tokens``, and less than the context (a prompt of the
    whole context leaves no room)."""
    context = st.context()
    return min(st.cfg.max_prompt_tokens or context, context - 1)


def truncated(body: _Request, st: AppState, ids: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: as many as the server takes)."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    return ids[-(prompt_limit(st) if k == -1 else k) :]


def _no_request_files(m, asked: dict, served: dict) -> None:
    """A request's options name no file on the server's disk (heads, projections, a corpus, ...): only the
    shipped choices, or the file the server was started with (``--opt``); the server reads what it was told to."""
    for o in m.declared:
        value = asked.get(o.name)
        if o.kind != "weights" or not isinstance(value, str) or value in o.choices or value == served.get(o.name):
            continue
        shipped = f"only {' or '.join(o.choices)}" if o.choices else "none"
        raise _bad(
            f"option {o.name}={value!r} names a file: a request may name {shipped} here; start the server with "
            f"--opt {o.name}=PATH to serve that file",
            f"layerleap.options.{o.name}",
        )


def request_settings(body: _Request, st: AppState, prompt_len: int) -> Settings:
    """The fields of a completion request as ``Settings`` (what ``generate`` gets)."""
    cfg, context = st.cfg, st.context()
    refused = body.refused()
    if refused:
        raise _bad(f"{refused} is not supported by this server: leave it out", refused)
    if isinstance(body, ChatRequest) and body.top_logprobs and not body.logprobs:
        raise _bad("top_logprobs needs logprobs: true: give both, or leave top_logprobs out", "top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise _bad("prompt_logprobs are not sent in a stream: leave out stream or prompt_logprobs", "prompt_logprobs")
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise _bad(f"n={body.n}: this server returns 1 to {MAX_CHOICES} choices per request: give n in that range", "n")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and not (body.n or 1) <= best_of <= MAX_CHOICES:
        raise _bad(f"best_of={best_of}: give best_of from n ({body.n or 1}) to {MAX_CHOICES}", "best_of")
    if best_of is not None and best_of > (body.n or 1) and body.stream:
        raise _bad("best_of picks among whole answers, which are not streamed: leave out stream, or best_of", "best_of")
    limit = prompt_limit(st)
    if prompt_len > limit and body.truncate_prompt_tokens is not None:  # it kept more than the server takes
        raise _bad(
            f"truncate_prompt_tokens={body.truncate_prompt_tokens} keeps {prompt_len} of the prompt's tokens, over "
            f"this server's limit of {limit}: give at most {limit}, or -1 (as many as the server takes)",
            "truncate_prompt_tokens",
            "context_length_exceeded",
        )
    if prompt_len > limit:
        raise _bad(
            f"the prompt has {prompt_len} tokens, over this server's limit of {limit}: shorten it",
            "messages" if isinstance(body, ChatRequest) else "prompt",
            "context_length_exceeded",
        )
    ext = body.layerleap
    method = ext.method or cfg.method
    if method not in METHODS:
        raise _bad(
            f"unknown method {method!r}: choose one of {', '.join(METHODS)}", "layerleap.method", "unknown_method"
        )
    field, grammar = request_grammar(body)
    options = {**cfg.options, **ext.options} if method == cfg.method else dict(ext.options)
    _no_request_files(get_method(method), ext.options, cfg.options if method == cfg.method else {})
    try:  # the method's declarations, before any model an option names is loaded
        get_method(method).check_options(options, st.model.config, partial=True)
    except LayerleapError as e:
        raise _bad(str(e), "layerleap.options") from None
    missing = [o.name for o in get_method(method).declared if o.required and o.name not in options]
    if missing:  # named as a request gives it (the declarations' own message names the command line's --opt)
        raise _bad(
            f"method {method!r} needs the option {missing[0]}: give it in layerleap.options "
            f'({{"layerleap": {{"method": "{method}", "options": {{"{missing[0]}": ...}}}}}})',
            "layerleap.options",
        )
    max_key, max_tokens = _max_tokens(body)
    if max_tokens is None:
        max_tokens = max(1, min(cfg.max_tokens, context - prompt_len))
    if prompt_len + max_tokens > context:
        raise _bad(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            max_key,
            "context_length_exceeded",
        )
    m = get_method(method)
    temperature = body.temperature
    top_k = max(0, body.top_k if body.top_k is not None else ext.top_k or 0)
    top_p = 1.0 if body.top_p is None else body.top_p
    min_p = body.min_p or 0.0
    typical_p = 1.0 if body.typical_p is None else body.typical_p
    if temperature is None and (top_k or top_p < 1 or min_p or typical_p < 1) and not m.default_sample:
        temperature = 1.0  # top_k / top_p / min_p / typical_p ask for sampling, as a temperature does (the CLI's rule)
    if temperature is None:
        do_sample, temperature = m.default_sample, 1.0
    elif temperature == 0:
        do_sample, temperature = False, 1.0
    else:
        do_sample = True
        if not m.sampling:
            if method != "greedy":
                raise _bad(
                    f"method {method!r} decodes greedily and would ignore temperature, top_p, min_p, typical_p and "
                    "top_k: leave them out (or use temperature 0), or a sampling method "
                    f"({', '.join(n for n, x in METHODS.items() if x.sampling)})",
                    _sampling_field(body),
                )
            method, options = "sample", {}  # greedy with a temperature: the same loop, sampled
    if grammar is not None and not METHODS[method].grammar:
        raise _bad(
            f"{field}: method {method!r} cannot follow a grammar: choose one that can in layerleap.method "
            f"({', '.join(n for n, x in METHODS.items() if x.grammar)})",
            field,
        )
    vocab = st.model.config.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise _bad(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
    procs = request_processors(body, METHODS[method], st.model, int(max_tokens), grammar)
    if procs.get("min_tokens") and body.stop_token_ids:  # held off as the end-of-sequence tokens are
        procs["min_tokens_ids"] = tuple(sorted(set(body.stop_token_ids)))
    gen = GenerationConfig(
        int(max_tokens),
        do_sample,
        float(temperature),
        int(top_k),
        float(top_p),
        body.seed,
        not body.ignore_eos,
        grammar=grammar,
        logprobs=body.logprob_count(),
        min_p=float(min_p) if do_sample else 0.0,
        typical_p=float(typical_p) if do_sample else 1.0,
        **procs,
    )
    return Settings(method, options, gen, st.prompt_cache if body.cache_prompt is not False else None)


_TOKEN_ID = re.compile(r"\s*-?[0-9]+\s*")  # a logit_bias key: a token id as int() reads it
MAX_CHOICES = 16  # ``n``: choices per request at most (each a row of its own; greedy ones decode once)


def candidates(body: _Request, settings: Settings) -> int:
    """The answers decoded per prompt: ``best_of`` sampled ones (``n`` of them picked), else ``n``."""
    n = body.n or 1
    sampled = settings.gen.do_sample and settings.gen.max_new_tokens > 0  # (0: echo alone, nothing to pick)
    return max(n, getattr(body, "best_of", None) or n) if sampled else n


def choice_jobs(ids: list[int], settings: Settings, body: _Request) -> tuple[list[Job], list[list[int]]]:
    """The request's jobs and, for each, the choices it answers: greedy choices are all the same answer, decoded
    once; sampled choice ``i`` is a job of its own, seeded with ``seed + i`` when a seed is given (what row ``i``
    of ``generate`` with that seed samples); ``best_of``: that many sampled candidates, with their log
    probabilities (to pick the best by, ``pick_best``)."""
    n, gen = candidates(body, settings), settings.gen
    if n > (body.n or 1) and gen.logprobs is None:
        gen = dataclasses.replace(gen, logprobs=0)
    stops, stop_ids = body.stops(), tuple(body.stop_token_ids or ())
    keep = bool(body.include_stop_str_in_output)
    if n == 1 or not gen.do_sample:
        return [Job(ids, settings, stops, stop_ids, keep)], [list(range(n))]
    jobs = []
    for i in range(n):
        seeded = gen if gen.seed is None else dataclasses.replace(gen, seed=row_seed(gen.seed, i))
        jobs.append(Job(ids, dataclasses.replace(settings, gen=seeded), stops, stop_ids, keep))
    for job in jobs:
        job.group = jobs
    return jobs, [[i] for i in range(n)]


PROCESSOR_FIELDS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "allowed_token_ids",
    "bad_words", "no_repeat_ngram_size",
)  # fmt: skip


def request_processors(body: _Request, m, model: Transformer, max_tokens: int, grammar) -> dict:
    """The request's penalties, biases, token filters and ``min_tokens`` as ``GenerationConfig``'s fields
    (``generate``'s checks; a 400 naming the field): ``repeat_penalty`` is llama.cpp's ``repetition_penalty``, and
    ``logit_bias``'s keys are token ids written as strings (OpenAI's JSON)."""
    given = {k: getattr(body, k) for k in PROCESSOR_FIELDS}
    field = {k: k for k in PROCESSOR_FIELDS}
    if body.repeat_penalty is not None:
        if given["repetition_penalty"] not in (None, body.repeat_penalty):
            raise _bad("repetition_penalty and repeat_penalty disagree: give one of them", "repeat_penalty")
        given["repetition_penalty"], field["repetition_penalty"] = body.repeat_penalty, "repeat_penalty"
    if given["logit_bias"] is not None:
        bias = {}
        for key, value in given["logit_bias"].items():
            if not _TOKEN_ID.fullmatch(key):
                raise _bad(f'logit_bias\'s keys are token ids written as strings ("50256"), got {key!r}', "logit_bias")
            bias[int(key)] = value
        given["logit_bias"] = bias
    try:
        return check_processors(m, model.config.vocab_size, max_tokens, grammar, tokenizer=model.tokenizer, **given)
    except GenerationError as e:
        message = str(e).replace("max_new_tokens", "max_tokens")
        asked = next((k for k in PROCESSOR_FIELDS if k in message), "repetition_penalty")
        raise _bad(message.replace(asked, field[asked]), field[asked]) from None


def request_tools(body: _Request) -> ToolPlan | None:
    """A chat request's ``ToolPlan`` (None: no tools; a 400 naming the field where they do not fit)."""
    if not isinstance(body, ChatRequest):
        return None
    try:
        return tool_plan(body)
    except ToolError as e:
        raise _bad(str(e), e.param) from None


def request_grammar(body: _Request) -> tuple[str | None, Grammar | None]:
    """The structured-output field given and its grammar, (None, None) without one (400s naming the field):
    a forced tool call's (``tool_choice``) is one too."""
    fields = body.grammar_fields()
    plan = request_tools(body)
    if plan is not None and plan.forced:
        fields = [plan.field, *fields]
    if len(fields) > 1:
        raise _bad(f"{' and '.join(fields)} each ask for structured output: give one of them", fields[0])
    if not fields:
        return None, None
    if plan is not None and plan.forced:
        return plan.field, plan.grammar()
    try:
        return fields[0], GRAMMAR_FIELDS[fields[0]](getattr(body, fields[0]))
    except GrammarError as e:
        raise _bad(f"{fields[0]}: {e}", fields[0]) from None


def _max_tokens(body: _Request) -> tuple[str, int | None]:
    """(the field that set it, max_tokens or None for the default): max_completion_tokens, max_tokens or
    llama.cpp's n_predict (-1: the default)."""
    given = [
        (k, v)
        for k, v in (
            ("max_completion_tokens", getattr(body, "max_completion_tokens", None)),
            ("max_tokens", body.max_tokens),
            ("n_predict", None if body.n_predict in (None, -1) else body.n_predict),
        )
        if v is not None
    ]
    if len({v for _, v in given}) > 1:
        raise _bad(f"{' and '.join(k for k, _ in given)} disagree: give one of them", given[0][0])
    if given and given[0][1] < (0 if getattr(body, "echo", None) else 1):
        zero = " (0 with echo: the prompt scored, nothing generated)" if hasattr(body, "echo") else ""
        raise _bad(f"{given[0][0]} must be at least 1{zero}", given[0][0])
    return given[0] if given else ("max_tokens", None)


def chat_prompt_ids(
    messages: list[Message],
    tok,
    plan: ToolPlan | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    instead: str = "use /v1/completions",
) -> list[int]:
    """A chat request's messages (and its tools, ``plan``) as the prompt's token ids, through the model's chat
    template (``instead``: what to do for a model without one)."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise _bad(f"this model has no chat template: {instead}", "messages")
    try:
        plain, tools = conversation(messages, plan, template_reads_tools(tok))
    except ToolError as e:
        raise _bad(str(e), e.param) from None
    kw = {} if tools is None else {"tools": tools}
    if add_special_tokens:  # (a completion's call: without it)
        kw["add_special_tokens"] = True
    try:
        return chat_token_ids(tok, plain, add_generation_prompt=add_generation_prompt, **kw)
    except LayerleapError as e:  # the template does not parse, or its raise_exception ("roles must alternate")
        raise _bad(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001  anything else the template raises on these messages
        raise _bad(f"the model's chat template refused these messages: {e}", "messages") from None


def prompt_ids(body: _Request, model: Transformer, prompt: str | list[int] | None = None) -> list[int]:
    """The request's prompt as token ids (in a worker thread: tokenizing a long prompt takes a while): a chat
    request's conversation, or a text completion's ``prompt`` (one of its ``prompts()``)."""
    tok = model.tokenizer
    if isinstance(body, ChatRequest):
        return chat_prompt_ids(body.messages, tok, request_tools(body))
    if isinstance(prompt, str):
        if tok is None:
            raise _bad("this model has no tokenizer: give the prompt as token ids", "prompt")
        return [int(i) for i in tok(prompt)["input_ids"]]
    vocab = model.config.vocab_size
    if not all(0 <= t < vocab for t in prompt):
        raise _bad(f"prompt token ids must be in [0, {vocab})", "prompt")
    return list(prompt)


async def load_options(st: AppState, settings: Settings) -> Settings:
    """Models the options name, loaded (in the model's worker thread) if the server may load them."""
    options = dict(settings.options)
    for key in model_options(settings.method):
        value = options.get(key)
        if isinstance(value, str):
            if st.loader is None or value not in st.cfg.loadable:
                allowed = f"only {', '.join(st.cfg.loadable)}" if st.cfg.loadable else "no models"
                raise _bad(
                    f"option {key}={value!r}: this server loads {allowed} for {key}=; start it with --opt "
                    f"{key}={value} to serve another",
                    f"layerleap.options.{key}",
                )
            try:
                options[key] = await st.scheduler.run_in_worker(st.loader, value)
            except LayerleapError as e:  # e.g. a packaged model that is not installed
                raise _bad(f"option {key}={value!r}: {e}", f"layerleap.options.{key}") from None
    return dataclasses.replace(settings, options=options)


def check_decoding(model: Transformer, ids: list[int], s: Settings, grammar_field: str | None = None) -> None:
    """What ``generate`` would refuse (option names, values it checks up front, a grammar that does not
    compile), before queueing."""
    try:
        s.decoding(model, ids)
    except GrammarError as e:
        raise _bad(f"{grammar_field}: {e}", grammar_field) from None
    except LayerleapError as e:
        raise _bad(str(e), "layerleap.options") from None


# -- responses ---------------------------------------------------------------------------------------
def _jsonable(x):
    """Stats as JSON: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):  # a dict, or a result's Stats (read flat)
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (int, str, bool)) or x is None else str(x)


def _usage(prompt_len: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; ``cached``: the prompt tokens whose keys and values came from the prompt cache."""
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _cached(fin: Finish | None) -> int:
    """The prompt tokens a choice reused from the prompt cache."""
    return 0 if fin is None else int(fin.result.stats.get("cached_prompt_tokens", 0))


def _cached_prompts(jobs: list, ends: dict[int, Finish]) -> int:
    """The prompt tokens a request reused from the prompt cache, as its usage counts its prompts' tokens: each
    prompt once (the most its choices' jobs reused; they share the prompt's token list), summed over its prompts."""
    most: dict[int, int] = {}
    for k, fin in ends.items():
        key = id(jobs[k].prompt_ids)
        most[key] = max(most.get(key, 0), _cached(fin))
    return sum(most.values())


@dataclass
class Reply:
    """The OpenAI envelope of one request's answer (chat or text completion)."""

    chat: bool
    model: str
    prompt_len: int
    usage: bool = False  # a streamed answer with include_usage: every chunk has "usage" (null but the last)
    tokenizer: object = None  # for the tokens' bytes (chat's logprobs)
    top: bool = False  # legacy completions' logprobs asked for the likeliest tokens (top_logprobs: their dicts)
    offset: int = 0  # legacy completions' text_offset of the next token whose log probability goes out
    echo: str | None = None  # legacy completions' echo: the prompt's text, before the answer's
    echo_first: str = ""  # with echo and logprobs: the text of the prompt's first token (it has no log probability)
    echo_logprobs: list[TokenLogprob] | None = None  # ... and the log probabilities of the prompt's other tokens
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs as they are sent (``vllm_prompt_logprobs``)
    index: int = 0  # the choice this answers (``n``: one ``Reply`` per choice, with the same id)
    tools: ToolPlan | None = None  # chat with tools: the answer's calls are read from its text
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's ``logprobs`` of a choice for ``entries`` (None: not asked for): chat's ``content`` list;
        legacy completions' ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (each token's
        place in the answer's text, counted on across a stream's chunks)."""
        if entries is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": e.text,
                        "logprob": e.logprob,
                        "bytes": token_bytes(self.tokenizer, e.token, e.text),
                        "top_logprobs": [
                            {
                                "token": t.text,
                                "logprob": t.logprob,
                                "bytes": token_bytes(self.tokenizer, t.token, t.text),
                            }
                            for t in e.top
                        ],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries] if self.top else None,
            "text_offset": offsets,
        }

    def _echoed(self) -> dict | None:
        """With echo and logprobs: the prompt's tokens in legacy completions' ``logprobs`` (its first token's
        log probability and likeliest tokens null, as OpenAI sends them); the answer's offsets then count
        from the end of the prompt's text.  A first token that the tokenizer added (a BOS: its text is not
        where the prompt's text begins) takes no room in the text."""
        if self.echo_logprobs is None:
            return None
        first = {
            "tokens": [self.echo_first],
            "token_logprobs": [None],
            "top_logprobs": [None] if self.top else None,
            "text_offset": [0],
        }
        self.offset = len(self.echo_first) if (self.echo or "").startswith(self.echo_first) else 0
        rest = self.logprobs(self.echo_logprobs)
        self.offset = len(self.echo or "")
        return _joined(first, rest)

    def _choice_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's ``logprobs``: the prompt's first (echo), then those of ``entries``."""
        echoed = self._echoed()
        return self.logprobs(entries) if echoed is None else _joined(echoed, self.logprobs(entries or []))

    def choice(self, fin: Finish | None) -> dict:
        """This reply's choice; ``fin`` None: nothing generated (``max_tokens`` 0 with echo)."""
        text = (self.echo or "") + ("" if fin is None else fin.text)
        reason = "length" if fin is None else fin.reason
        if not self.chat:
            choice = {"index": self.index, "text": text}
        else:
            content, calls = (text, []) if self.tools is None or fin is None else self.tools.parse(text)
            choice = {"index": self.index, "message": {"role": "assistant", "content": content}}
            if calls:
                choice["message"].update(self._calls(calls))
                reason = "function_call" if self.tools.legacy else "tool_calls"
        choice.update(
            finish_reason=reason,
            logprobs=self._choice_logprobs(None if fin is None else fin.logprobs),
        )
        if self.prompt_logprobs is not None and not self.chat:  # vLLM's place: the choice's (text completions)
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice

    def full(
        self,
        fin: Finish | None,
        others: list[tuple[Reply, Finish | None]] = (),
        used: int | None = None,
        cached: int | None = None,
    ) -> dict:
        """The whole answer: this choice, then ``others`` (``n``: the other choices' replies and ends); ``fin``
        None: nothing generated (``max_tokens`` 0 with echo).  The usage counts every choice's tokens (``used``:
        the tokens decoded, where more were than the choices hold), the statistics are this choice's;
        ``cached``: the prompt tokens reused over every prompt (``_cached_prompts``; default the choices' most)."""
        if used is None:
            used = sum(0 if f is None else f.completion_tokens for f in [fin] + [f for _, f in others])
        if cached is None:
            cached = max(_cached(f) for f in [fin] + [f for _, f in others])
        out = {
            **self._head(False),
            "choices": [self.choice(fin)] + [r.choice(f) for r, f in others],
            "usage": _usage(self.prompt_len, used, cached),
        }
        if fin is not None:
            out["layerleap"] = {"method": fin.result.stats["method"], "stats": _jsonable(fin.result.stats)}
        if self.prompt_logprobs is not None and self.chat:  # vLLM's place: the answer's (chat)
            out["prompt_logprobs"] = self.prompt_logprobs
        return out

    def _calls(self, calls: list[dict]) -> dict:
        """The calls as a message's (or a delta's) fields: ``tool_calls``, or the legacy ``function_call``."""
        if self.tools is not None and self.tools.legacy:
            return {"function_call": dict(calls[0])}
        return {"tool_calls": tool_calls(calls)}

    def calls_chunk(self, calls: list[dict]) -> dict:
        """A streamed chunk of the answer's calls (each whole: ``tool_calls`` with their ``index``)."""
        delta = self._calls(calls)
        for k, c in enumerate(delta.get("tool_calls", ())):
            c["index"] = k
        choice = {"index": self.index, "delta": delta, "finish_reason": None, "logprobs": None}
        return {**self._head(True), "choices": [choice]} | ({"usage": None} if self.usage else {})

    def echo_chunk(self, reason: str | None = None) -> dict:
        """A stream's first chunk with echo: the prompt's text (and its tokens' log probabilities); ``reason``:
        it is the last one too (nothing generated)."""
        choice = {"index": self.index, "text": self.echo, "finish_reason": reason}
        choice["logprobs"] = self._choice_logprobs(None if self.echo_logprobs is None else [])
        return {**self._head(True), "choices": [choice]} | ({"usage": None} if self.usage else {})

    def chunk(
        self, text: str | None = None, reason: str | None = None, role: bool = False, logprobs: list | None = None
    ) -> dict:
        """A streamed chunk: ``text`` and the log probabilities that came with it (a ``Piece``'s), or the last
        one (``reason``) with those of the answer's tokens not sent yet."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text or ""}
        if logprobs is None:
            logprobs = getattr(text, "logprobs", None)
        choice.update(finish_reason=reason, logprobs=self.logprobs(logprobs))
        return {**self._head(True), "choices": [choice]} | ({"usage": None} if self.usage else {})

    def usage_chunk(self, completion_tokens: int, cached: int = 0) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(self.prompt_len, completion_tokens, cached)}


def _top_dict(e: TokenLogprob) -> dict:
    """Legacy completions' ``top_logprobs`` at one position: the likeliest tokens' texts to their log
    probabilities, and the chosen token's where it is not one of them (OpenAI's and vLLM's "up to logprobs + 1")."""
    top = {t.text: t.logprob for t in e.top}
    top.setdefault(e.text, e.logprob)
    return top


def _joined(a: dict, b: dict) -> dict:
    """Two parts of legacy completions' ``logprobs``, one after the other."""
    return {k: None if a[k] is None else a[k] + b[k] for k in a}


def vllm_prompt_logprobs(scored: list[TokenLogprob], top: int) -> list:
    """vLLM's ``prompt_logprobs``: a list over the prompt's tokens, the first null, then per token a dict of
    token id (a string in JSON) -> ``{"logprob", "rank", "decoded_token"}``: the prompt token's own, then the
    ``top`` likeliest tokens there."""
    out: list = [None]
    for e in scored:
        entry = {str(e.token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.text}}
        for k, t in enumerate(e.top[:top]):
            entry.setdefault(str(t.token), {"logprob": t.logprob, "rank": k + 1, "decoded_token": t.text})
        out.append(entry)
    return out


async def score_prompt(st: AppState, body: _Request, prompt, ids: list[int], reply: Reply, cut: bool = False) -> None:
    """Legacy completions' ``echo`` (the prompt's text, and with ``logprobs`` its tokens' log probabilities)
    and vLLM's ``prompt_logprobs`` on ``reply``: the prompt scored by ``layerleap.score`` in the model's
    worker thread (one more prompt pass), only when log probabilities are asked for; ``prompt``: the
    prompt as the request gave it (its text is echoed), ``ids`` its tokens; ``cut``: ``ids`` are the
    prompt's last tokens (``truncate_prompt_tokens``), whose text is echoed."""
    echo = bool(getattr(body, "echo", None))
    tok = st.model.tokenizer
    if echo:
        text = isinstance(prompt, str) and not cut
        reply.echo = prompt if text else tok.decode(ids, skip_special_tokens=False)
    tops = [n for n in (body.logprobs if echo else None, body.prompt_logprobs) if n is not None]
    if not tops:
        return
    try:
        scored = await st.scheduler.score_in_worker(score, st.model, ids, max(tops))
    except LayerleapError as e:
        raise _bad(str(e), "prompt_logprobs" if body.prompt_logprobs is not None else "echo") from None
    if scored is None:
        raise _queue_full(st)
    if echo and body.logprobs is not None:
        reply.echo_first = token_text(tok, ids[0])
        reply.echo_logprobs = [dataclasses.replace(e, top=e.top[: body.logprobs]) for e in scored]
    if body.prompt_logprobs is not None:
        reply.prompt_logprobs = vllm_prompt_logprobs(scored, body.prompt_logprobs)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# -- handlers ----------------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request):
    """A chat completion (OpenAI's body; ``layerleap`` chooses the method)."""
    return await complete(request, body, chat=True)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request):
    """A text completion (OpenAI's body; ``layerleap`` chooses the method)."""
    return await complete(request, body, chat=False)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "layerleap"}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_card(state_of(request).cfg.model_name)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    name = state_of(request).cfg.model_name
    if model_id != name:
        return _not_found(model_id, name).response()
    return _model_card(name)


@router.get("/health")
async def health(request: Request):
    st = state_of(request)
    waiting, running = st.load()
    return {"status": "ok", "model": st.cfg.model_name, "method": st.cfg.method, "waiting": waiting, "running": running}


@router.get("/metrics")
async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state_of(request).metrics.text(), media_type=CONTENT_TYPE_LATEST)


def _not_found(name: str, served: str) -> APIError:
    return APIError(
        404, f"the model {name!r} does not exist here: this server serves {served!r}", "model", "model_not_found"
    )


# -- the tokenizer endpoints (vLLM's and llama.cpp's) -------------------------------------------------------
def tokenize_answer(body: TokenizeRequest, st: AppState) -> dict:
    """``/tokenize``'s answer (in a worker thread): vLLM's ``{"tokens", "count", "max_model_len"}`` for ``prompt``
    and ``messages`` (tokenized as a completion's and a chat completion's prompts are, so ``count`` is their
    ``usage.prompt_tokens``), llama.cpp's ``{"tokens"}`` for ``content``."""
    texts = body.texts()
    if not texts:
        raise _bad(
            "give the text to tokenize in one of prompt (text), messages (a conversation) or content (llama.cpp's)",
            "prompt",
        )
    if len(texts) > 1:
        raise _bad(f"{' and '.join(texts)} each give the text to tokenize: give one of them", texts[1])
    text, wrong = texts[0], body.misfit()
    if wrong is not None:
        raise _bad(f"{wrong} does not go with {text}: leave it out", wrong)
    tok = st.model.tokenizer
    if text == "content":
        if body.parse_special is False:
            raise _bad(
                "parse_special false is not supported: this server reads special tokens' text as those tokens",
                "parse_special",
            )
        ids = [int(i) for i in tok(body.content, add_special_tokens=bool(body.add_special))["input_ids"]]
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece(tok, t)} for t in ids]}
    if text == "messages":
        try:  # the tools as a chat completion that declares them (tool_choice "auto") puts them in its prompt
            plan = tool_plan(SimpleNamespace(tools=body.tools, functions=None, tool_choice=None, function_call=None))
        except ToolError as e:
            raise _bad(str(e), e.param) from None
        ids = chat_prompt_ids(
            body.messages,
            tok,
            plan,
            add_generation_prompt=body.add_generation_prompt is not False,
            add_special_tokens=bool(body.add_special_tokens),
            instead="give the text as prompt",
        )
    else:
        add = body.add_special_tokens is not False
        ids = [int(i) for i in tok(body.prompt, add_special_tokens=add)["input_ids"]]
    out = {"tokens": ids, "count": len(ids), "max_model_len": st.context()}
    if body.return_token_strs:
        out["token_strs"] = list(tok.convert_ids_to_tokens(ids))
    return out


def _piece(tok, token: int) -> str | list[int]:
    """llama.cpp's ``piece`` of a token: its text, or its bytes where they are not whole UTF-8 characters."""
    text = token_text(tok, token)
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tok, token, text)
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return raw


def detokenize_answer(body: DetokenizeRequest, st: AppState) -> dict:
    """``/detokenize``'s answer (in a worker thread): the text, under vLLM's key ``prompt`` and llama.cpp's
    ``content``."""
    vocab = st.model.config.vocab_size
    bad = next(((i, t) for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad(f"tokens[{bad[0]}] is {bad[1]}, not a token id of this model: give ids in [0, {vocab})", "tokens")
    text = st.model.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, request: Request):
    """Text or a conversation as token ids (vLLM's and llama.cpp's ``/tokenize``)."""
    return await _tokenizer_call(request, body, tokenize_answer)


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, request: Request):
    """Token ids as text (vLLM's and llama.cpp's ``/detokenize``)."""
    return await _tokenizer_call(request, body, detokenize_answer)


async def _tokenizer_call(request: Request, body, answer: Callable) -> Response:
    st = state_of(request)
    try:
        if body.model is not None and body.model != st.cfg.model_name:
            raise _not_found(body.model, st.cfg.model_name)
        return JSONResponse(await run_in_threadpool(answer, body, st))
    except APIError as e:
        return e.response()


async def complete(request: Request, body: _Request, chat: bool) -> Response:
    st = state_of(request)
    t0 = time.perf_counter()
    try:
        if body.model is not None and body.model != st.cfg.model_name:
            raise _not_found(body.model, st.cfg.model_name)
        if body.stream_options is not None and not body.stream:
            raise _bad(
                "stream_options applies to streamed answers: give stream: true, or leave it out", "stream_options"
            )
        prompts = [None] if chat else body.prompts()
        replies, jobs, owners, loaded, field, total, best = [], [], [], None, None, 0, body.n or 1
        for p, prompt in enumerate(prompts):
            try:
                ids, settings, reply, field = await _prompt_part(st, body, chat, prompt, loaded)
            except APIError as e:
                if len(prompts) > 1 and e.param == "prompt":
                    e.message = f"prompt [{p}]: {e.message}"
                raise
            loaded, total, best = settings.options, total + len(ids), candidates(body, settings)
            first = len(replies)  # prompt-major: prompt p's choice j is choice p * n + j (best_of: candidates)
            one = {"id": replies[0].id, "created": replies[0].created} if replies else {}  # one answer, one id
            replies += [dataclasses.replace(reply, index=first + i, **one) for i in range(best)]
            if settings.gen.max_new_tokens > 0:  # (0: echo alone)
                part, answers = choice_jobs(ids, settings, body)
                jobs += part
                owners += [[first + i for i in choices] for choices in answers]
        for reply in replies:  # the usage counts every prompt's tokens
            reply.prompt_len = total
        if not jobs:
            _done(st, request, t0)
            if body.stream:
                return StreamingResponse(_echo_events(replies), media_type="text/event-stream")
            return JSONResponse(replies[0].full(None, [(r, None) for r in replies[1:]]))
        if len(prompts) > 1:
            for job in jobs:
                job.group = jobs
        if len(jobs) > st.scheduler.max_waiting:
            raise _bad(
                f"this request decodes {len(jobs)} answers, over the {st.scheduler.max_waiting} this server's queue "
                "holds (--max-waiting): send fewer prompts or choices per request",
                "prompt" if len(prompts) > 1 else "best_of" if best > (body.n or 1) else "n",
            )
        if not st.scheduler.submit(*jobs):
            raise _queue_full(st)
    except APIError as e:
        return e.response()
    watcher = asyncio.create_task(_watch(request, st, jobs))
    events = Events(st, jobs, field)
    try:
        event = first = await events.next()
        ends: dict[int, Finish] = {}
        while not body.stream:
            if event[1][0] == "done":
                ends[event[0]] = event[1][1]
                if len(ends) == len(jobs):
                    break
            event = await events.next()
    except APIError as e:
        _stop(st, jobs, watcher, events)
        return e.response()
    except asyncio.CancelledError:  # the server stops (its drain time is over) before this answer began
        _stop(st, jobs, watcher, events)
        return APIError(
            503, "the server is shutting down: retry later", code="server_shutting_down", type="server_error"
        ).response()
    if not body.stream:
        _stop(st, jobs, watcher, events)
        _done(st, request, t0)
        answers = sorted(((replies[i], ends[k]) for k, choices in enumerate(owners) for i in choices), key=_index)
        used = sum(f.completion_tokens for _, f in answers)  # every answer decoded, best_of's candidates too
        if best > (body.n or 1):
            answers = pick_best(answers, best, body.n or 1, body.logprob_count() is not None)
        return JSONResponse(answers[0][0].full(answers[0][1], answers[1:], used, _cached_prompts(jobs, ends)))
    return StreamingResponse(
        _events(request, st, jobs, owners, replies, events, first, watcher, t0), media_type="text/event-stream"
    )


async def _prompt_part(
    st: AppState, body: _Request, chat: bool, prompt, loaded: dict | None
) -> tuple[list[int], Settings, Reply, str | None]:
    """One prompt of the request: its token ids, its ``Settings`` (``loaded``: the options as an earlier prompt
    loaded them), its ``Reply`` (its echo and prompt log probabilities scored) and the request's
    structured-output field."""
    whole = await run_in_threadpool(prompt_ids, body, st.model, prompt)
    ids = truncated(body, st, whole)
    settings = request_settings(body, st, len(ids))
    field, _ = request_grammar(body)
    if settings.gen.max_new_tokens > 0:  # (0: echo alone)
        if loaded is None:
            settings = await load_options(st, settings)
        else:
            settings = dataclasses.replace(settings, options=loaded)  # (its prompt cache too)
        await run_in_threadpool(check_decoding, st.model, ids, settings, field)
    reply = Reply(chat, st.cfg.model_name, len(ids), tokenizer=st.model.tokenizer, top=bool(settings.gen.logprobs))
    reply.usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    plan = request_tools(body)
    reply.tools = plan if plan is not None and plan.choice != "none" else None
    await score_prompt(st, body, prompt, ids, reply, cut=len(ids) < len(whole))
    return ids, settings, reply, field


def _index(answer: tuple[Reply, Finish]) -> int:
    return answer[0].index


def _mean_logprob(fin: Finish) -> float:
    lps = fin.logprobs or []
    return sum(e.logprob for e in lps) / len(lps) if lps else -math.inf


def pick_best(answers: list[tuple[Reply, Finish]], best: int, n: int, logprobs: bool) -> list[tuple[Reply, Finish]]:
    """``best_of``: each prompt's ``best`` candidates (in turn in ``answers``) -> its ``n`` with the highest mean
    log probability per token, best first, indexed prompt by prompt (``logprobs``: the client asked for them;
    else they are left out)."""
    out = []
    for p in range(0, len(answers), best):
        ranked = sorted(answers[p : p + best], key=lambda a: _mean_logprob(a[1]), reverse=True)[:n]
        for reply, fin in ranked:
            if not logprobs:
                fin = dataclasses.replace(fin, result=dataclasses.replace(fin.result, logprobs=None))
            out.append((dataclasses.replace(reply, index=len(out)), fin))
    return out


def _done(st: AppState, request: Request, t0: float) -> None:
    dt = time.perf_counter() - t0
    st.metrics.latency.labels(endpoint_label(request.url.path)).observe(dt)
    st.latency_s += 0.1 * (dt - st.latency_s)


def _stop(st: AppState, jobs: list[Job], watcher, events: Events, gone: bool = False) -> None:
    """The request's answer is out or failed: stop watching it, and its choices still decoding (``gone``: its
    client went away, a cancelled request in the metrics; else one of them failed, or the server stops)."""
    watcher.cancel()
    events.close()
    for job in jobs:
        if not job.finished:
            st.scheduler.cancel(job, gone)


async def _watch(request: Request, st: AppState, jobs: list[Job]) -> None:
    """Cancel ``jobs`` (a request's choices) when their client goes away (waiting or running, streamed or not)."""
    while not all(job.finished for job in jobs):
        if await request.is_disconnected():
            for job in jobs:
                st.scheduler.cancel(job)
            return
        await asyncio.sleep(0.1)


async def _next_event(st: AppState, job: Job, grammar_field: str | None = None):
    """The job's next event; its end by an error as an ``APIError``: a ``LayerleapError`` that refused the
    request (as it joined, or in its method's set-up) is a 400, as is the request's grammar failing while
    decoding (``grammar_field``, the field that gave it: a schema that nests without end) or its token filters
    leaving no token to choose; another one raised while decoding a 500 with its message."""
    kind, value = await job.events.get()
    if job.cancelled:  # its client went away: no one reads this answer (499 in the request counts and the log)
        raise APIError(499, "the client closed the request before its answer", code="client_closed_request")
    if kind in ("error", "refused"):
        if isinstance(value, QueueTimeout):
            raise APIError(503, str(value), code="queue_timeout", type="server_error", retry_after=st.retry_after())
        if isinstance(value, APIError):
            raise value
        if isinstance(value, GrammarError):
            raise _bad(f"{grammar_field}: {value}" if grammar_field else str(value), grammar_field)
        if isinstance(value, NoTokenLeft):  # the request's token filters forbid every token where it chooses one
            raise _bad(str(value))
        if isinstance(value, LayerleapError):
            if kind == "refused":
                raise _bad(str(value))
            raise APIError(500, f"the request failed while decoding: {value}", type="server_error")
        raise APIError(500, f"internal error ({type(value).__name__}) while decoding", type="server_error")
    return kind, value


class Events:
    """The events of a request's jobs (``n``: several), merged in the order they come: ``next()`` gives
    (the job's place, its event) and raises a job's error as ``_next_event`` does."""

    def __init__(self, st: AppState, jobs: list[Job], grammar_field: str | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pumps = [asyncio.create_task(self._pump(st, k, job, grammar_field)) for k, job in enumerate(jobs)]

    async def _pump(self, st: AppState, k: int, job: Job, grammar_field: str | None) -> None:
        while True:
            try:
                event = await _next_event(st, job, grammar_field)
            except APIError as e:
                self.queue.put_nowait((k, e))
                return
            self.queue.put_nowait((k, event))
            if event[0] == "done":
                return

    async def next(self) -> tuple[int, tuple]:
        k, event = await self.queue.get()
        if isinstance(event, APIError):
            raise event
        return k, event

    def close(self) -> None:
        for pump in self.pumps:
            pump.cancel()


async def _events(
    request: Request,
    st: AppState,
    jobs: list[Job],
    owners: list[list[int]],
    replies: list[Reply],
    events: Events,
    event,
    watcher,
    t0: float,
):
    """The server-sent events of a streamed answer: each job's text as chunks of the choices it answers
    (``owners``), each choice's last chunk as its job ends, then the usage of them all."""
    try:
        for reply in replies:
            if reply.chat:
                yield _sse(reply.chunk(role=True))
            if reply.echo is not None:
                yield _sse(reply.echo_chunk())
        ends: dict[int, Finish] = {}
        held = [None if r.tools is None else ToolStream(r.tools) for r in replies]  # text read for tool calls
        over = False  # the answer ended (or failed) before its client went away
        while True:
            k, (kind, value) = event
            if kind == "text":
                for i in owners[k]:
                    if held[i] is None:
                        yield _sse(replies[i].chunk(value))
                        continue
                    text, lps = held[i].feed(value)
                    if text:
                        yield _sse(replies[i].chunk(text, logprobs=lps))
            else:
                rest = None if value.logprobs is None else value.logprobs[value.logprobs_sent :]
                for i in owners[k]:
                    reason = value.reason
                    if held[i] is not None:
                        text, lps, calls = held[i].finish()
                        if text or lps:
                            yield _sse(replies[i].chunk(text, logprobs=lps or None))
                        if calls:
                            yield _sse(replies[i].calls_chunk(calls))
                            reason = "function_call" if replies[i].tools.legacy else "tool_calls"
                    yield _sse(replies[i].chunk(None, reason, logprobs=rest))
                ends[k] = value
                if len(ends) == len(jobs):
                    if replies[0].usage:
                        used = sum(f.completion_tokens * len(owners[j]) for j, f in ends.items())
                        yield _sse(replies[0].usage_chunk(used, _cached_prompts(jobs, ends)))
                    break
            try:
                event = await events.next()
            except APIError as e:
                over = True
                yield _sse(e.body())
                break
        over = True
        yield b"data: [DONE]\n\n"
        _done(st, request, t0)
    finally:
        _stop(st, jobs, watcher, events, gone=not over)


async def _echo_events(replies: list[Reply]):
    """The server-sent events of an answer that is its echo alone (``max_tokens`` 0), each choice's."""
    for reply in replies:
        yield _sse(reply.echo_chunk("length"))
    if replies[0].usage:
        yield _sse(replies[0].usage_chunk(0))
    yield b"data: [DONE]\n\n"


# -- errors ------------------------------------------------------------------------------------------
def _param(loc) -> str:
    """A pydantic error location as OpenAI's ``param`` (``messages[0].content``), union branches left out."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            out += ("." if out else "") + part
        else:
            break  # a union branch ("list[TextPart]", "function-after[...]"): the field is named already
    return out


def _json_type(content_type: str | None) -> bool:
    """Whether a Content-Type is one whose body FastAPI reads as JSON (``application/json``, ``…+json``)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None = "application/json") -> APIError:
    e = exc.errors()[0]
    param = _param(e.get("loc", ()))
    if e["type"] == "json_invalid":
        return _bad(
            f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])}): send a JSON object"
        )
    if not param and not _json_type(content_type):  # curl -d sends form data; a bare body has no type
        sent = f"Content-Type {content_type}" if content_type else "no Content-Type"
        return _bad(f"the request body was sent with {sent}: send it as JSON, with Content-Type: application/json")
    if not param:
        return _bad("the request body must be a JSON object with OpenAI's fields (see /docs)")
    if e["type"] == "extra_forbidden":
        return _bad(f"{param} is not a field this server knows: leave it out (the fields: /docs)", param)
    msg = e["msg"].removeprefix("Value error, ")
    return _bad(f"{param}: {msg[0].lower() + msg[1:]}", param)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        if isinstance(exc.__cause__, ClientDisconnect):  # gone while it sent its body: not a bad request
            return APIError(
                499, "the client closed the request before its answer", code="client_closed_request"
            ).response()
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):
        return APIError(
            500, f"internal error ({type(exc).__name__}): the server could not answer this request", type="server_error"
        ).response()


class Guard:
    """Pure ASGI middleware (it leaves ``receive`` to the handlers, so they see a client go away): the
    body limit (413), the request counter and the access log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st: AppState = scope["app"].state.layerleap
        limit, t0, status, size, begun = st.cfg.max_body_bytes, time.perf_counter(), [500], [0], [False]
        length = dict(scope["headers"]).get(b"content-length", b"0")

        async def limited():
            message = await receive()
            if message["type"] == "http.request":
                size[0] += len(message.get("body", b""))
                if size[0] > limit:
                    raise BodyTooLarge(limit)
            return message

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0], begun[0] = message["status"], True
            await send(message)

        try:
            if length.isdigit() and int(length) > limit:
                await APIError(413, str(BodyTooLarge(limit).detail), code="body_too_large").response()(
                    scope, receive, counted
                )
            else:
                await self.app(scope, limited, counted)
        except asyncio.CancelledError:
            # the server stops and its drain time is over: an answer not begun got its 503 from its handler;
            # a stream under way ends here, cut short (no `data: [DONE]`), which is no error of the application
            if not begun[0]:
                raise
        finally:
            path = scope.get("path", "")
            st.metrics.requests.labels(endpoint_label(path), str(status[0])).inc()
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s "%s %s" %d %.0fms',
                client[0],
                scope.get("method"),
                path,
                status[0],
                1000 * (time.perf_counter() - t0),
            )


# -- shadow checks -----------------------------------------------------------------------------------
def shadow_pick(st: AppState, batch) -> None:
    """Keep a sampled share of a lossy method's finished rows for a greedy re-decode when idle."""
    if st.cfg.shadow_share <= 0:
        return
    for job, r in zip(batch.jobs, batch.decoding.results):
        m = get_method(job.settings.method)
        if r is None or job.cancelled or m.exact or job.settings.gen.do_sample or not r.token_ids:
            continue
        if random.random() < st.cfg.shadow_share and len(st.shadows) < 64:
            st.shadows.append((m.name, job.prompt_ids, list(r.token_ids)))


def shadow_step(st: AppState) -> None:
    """One round of the greedy re-decode of a kept row (in the worker thread, when idle); at its end,
    the row's agreement with greedy: the share of positions with greedy's token, and the share of
    greedy's tokens before the first difference."""
    from ..decoding import Decoding
    from ..eval.quality import common_prefix

    if st.shadow_run is None:
        method, ids, toks = st.shadows.pop(0)
        d = Decoding(st.model, ids, "greedy", len(toks))
        st.shadow_run = (method, toks, d, iter(d))
    method, toks, d, rounds = st.shadow_run
    if next(rounds, None) is not None:
        return
    st.shadow_run = None
    want = d.results[0].token_ids
    st.metrics.shadow_agreement.labels(method).observe(sum(a == b for a, b in zip(toks, want)) / len(want))
    st.metrics.shadow_prefix.labels(method).observe(common_prefix(toks, want) / len(want))


# -- the app -----------------------------------------------------------------------------------------
def create_app(model: Transformer, cfg: ServerConfig, loader: Callable[[str], Transformer] | None = None) -> FastAPI:
    """The FastAPI app serving ``model``; ``loader(name)`` loads a model a request's option names (only
    names in ``cfg.loadable``).  The model needs its tokenizer: every answer is text."""
    if model.tokenizer is None:
        raise LayerleapError(
            "this model has no tokenizer: the server answers in text, token-id prompts too; load a model with its "
            "tokenizer files"
        )
    st = AppState(model, cfg, loader)

    def batch_done(batch) -> None:
        st.metrics.batch_done(batch)
        shadow_pick(st, batch)

    @asynccontextmanager
    async def lifespan(app):
        st.scheduler = Scheduler(
            model,
            cfg.max_batch,
            cfg.max_running,
            cfg.max_waiting,
            on_batch_done=batch_done,
            queue_timeout=cfg.queue_timeout,
            on_cancel=st.metrics.cancel,
            on_timeout=st.metrics.timeouts.inc,
            idle=(lambda: shadow_step(st)) if cfg.shadow_share > 0 else None,
            has_idle_work=lambda: bool(st.shadows) or st.shadow_run is not None,
            on_rows_done=st.metrics.rows_done,
            on_passes=st.metrics.pool_passes,
            pool_rows=cfg.max_batch if cfg.continuous else 0,
            prefill_chunk=cfg.prefill_chunk,
        )
        st.scheduler.start()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.001))  # the event loop gets the GIL back within 1 ms of asking
        try:
            yield
        finally:
            sys.setswitchinterval(switch)
            await st.scheduler.stop()

    app = FastAPI(
        title="layerleap",
        summary="an OpenAI-compatible server over one layerleap model",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.layerleap = st
    _handlers(app)
    app.add_middleware(Guard)
    app.include_router(router)
    return app


class ServerThread:
    """Run ``app`` with uvicorn in a background thread (tests, notebooks): ``with ServerThread(app) as url:``
    gives ``http://127.0.0.1:PORT``; leaving the block stops the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 30):
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=drain_seconds
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise LayerleapError("the server did not start (is the port free?)")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
