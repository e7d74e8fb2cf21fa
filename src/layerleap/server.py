"""``layerleap serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one loaded model.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus text).  The server's ``--method`` and ``--opt`` are the defaults; a
request chooses another method and its options in a ``layerleap`` field of its body (the ``openai``
client's ``extra_body``): ``{"layerleap": {"method": "self-spec", "options": {"draft_len": 4}}}``.
``max_tokens`` (or ``max_completion_tokens``), ``temperature`` (0: greedy; > 0: sampling, which a
greedy-only method refuses, except that ``greedy`` then runs as ``sample``), ``top_p``, ``seed``,
``stop`` and ``n=1`` mean what they mean to OpenAI; ``stream: true`` answers with server-sent events
in OpenAI's chunk format, ending with ``data: [DONE]``.

Requests queue in a ``scheduler.Scheduler``: one model call at a time; requests that wait together
with one batching method and the same settings decode as one batch; a client that disconnects is
cancelled.  Bad requests get OpenAI-style error bodies (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx status, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .core.run import GenerationConfig, chat_token_ids
from .decoding import METHODS, get_method
from .errors import LayerleapError
from .core.model import Transformer
from .options import model_options
from .scheduler import Finish, Job, Scheduler, Settings

MAX_STOPS = 4  # OpenAI's limit on stop strings
UNSUPPORTED = {  # request fields we cannot honour -> the value that asks for nothing
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}


@dataclass
class ServerConfig:
    model_name: str  # the id clients pass as ``model`` (and /v1/models lists)
    method: str = "greedy"  # the default method
    options: dict = field(default_factory=dict)  # the default method's options (models already loaded)
    max_tokens: int = 256  # max_tokens when a request gives none (clipped to the context)
    max_batch: int = 8
    max_running: int = 2
    max_waiting: int = 256
    loadable: tuple[str, ...] = ()  # model names a request's options may name (loaded on first use)


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# -- request fields ----------------------------------------------------------------------------------
def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or not lo <= v <= hi or (isinstance(v, float) and math.isnan(v)):
        what = "an integer" if integer else "a number"
        raise _bad(f"{name} must be {what} in [{lo}, {hi}], got {v!r}", name)
    return v


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOPS} strings, got {stop!r}", "stop")
    return stops


def _check_unsupported(body: dict) -> None:
    for name, nothing in UNSUPPORTED.items():
        if name in body and body[name] not in nothing:
            raise _bad(f"{name} is not supported by this server: leave it out", name)
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise _bad(f"n={n!r}: this server returns one choice per request: leave n out or set n=1", "n")


def _method_choice(body: dict, cfg: ServerConfig) -> tuple[str, dict, int]:
    """The ``layerleap`` field: (method, options, top_k)."""
    ll = body.get("layerleap") or {}
    if not isinstance(ll, dict):
        raise _bad('layerleap must be an object: {"method": NAME, "options": {...}}', "layerleap")
    unknown = sorted(set(ll) - {"method", "options", "top_k"})
    if unknown:
        raise _bad(f"layerleap has no field {', '.join(unknown)}: use method, options and top_k", "layerleap")
    method = ll.get("method", cfg.method)
    if not isinstance(method, str) or method not in METHODS:
        raise _bad(f"unknown method {method!r}: choose one of {', '.join(METHODS)}", "layerleap.method",
                   "unknown_method")
    options = ll.get("options") or {}
    if not isinstance(options, dict):
        raise _bad("layerleap.options must be an object of method options", "layerleap.options")
    if method == cfg.method:
        options = {**cfg.options, **options}
    top_k = _number(ll, "top_k", 0, 0, 1 << 30, integer=True)
    return method, options, top_k


def request_settings(body: dict, cfg: ServerConfig, context: int, prompt_len: int) -> Settings:
    """The OpenAI fields and the ``layerleap`` field of a completion request as ``Settings``."""
    _check_unsupported(body)
    method, options, top_k = _method_choice(body, cfg)
    default_max = max(1, min(cfg.max_tokens, context - prompt_len))
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, max_key, default_max, 1, 1 << 30, integer=True)
    if prompt_len + max_tokens > context:
        raise _bad(f"This model's maximum context length is {context} tokens. However, you requested "
                   f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                   "Please reduce the length of the prompt or max_tokens.", max_key, "context_length_exceeded")
    temperature = _number(body, "temperature", None, 0, 2)
    m = get_method(method)
    if temperature is None:
        do_sample, temperature = m.default_sample, 1.0
    elif temperature == 0:
        do_sample, temperature = False, 1.0
    else:
        do_sample = True
        if not m.sampling:
            if method != "greedy":
                raise _bad(f"method {method!r} decodes greedily: use temperature 0 (or leave it out), or a sampling "
                           f"method ({', '.join(n for n, x in METHODS.items() if x.sampling)})", "temperature")
            method, options = "sample", {}  # greedy with a temperature: the same loop, sampled
    top_p = _number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise _bad("top_p must be > 0 (1 keeps every token)", "top_p")
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    return Settings(method, options, GenerationConfig(int(max_tokens), do_sample, float(temperature), int(top_k),
                                                      float(top_p), seed))


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """``messages`` -> prompt ids through the chat template (text parts only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise _bad(f"messages[{i}] must be an object with role system, user or assistant", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        plain.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise _bad("this model has no chat template: use /v1/completions", "messages")
    return chat_token_ids(tokenizer, plain, add_generation_prompt=True)


def text_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """``prompt`` (one string, or one list of token ids) -> prompt ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt.strip():
        if tokenizer is None:
            raise _bad("this model has no tokenizer: give the prompt as token ids", "prompt")
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise _bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
    raise _bad("prompt must be one non-empty string (or one list of token ids): send one prompt per request",
               "prompt")


# -- responses ---------------------------------------------------------------------------------------
def _jsonable(x):
    """Stats as JSON: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (int, str, bool)) or x is None else str(x)


def _usage(prompt_len: int, completion: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}


@dataclass
class Reply:
    """The OpenAI envelope of one request's answer (chat or text completion)."""
    chat: bool
    model: str
    prompt_len: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model}

    def full(self, fin: Finish) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": fin.text}} if self.chat
                  else {"index": 0, "text": fin.text})
        choice.update(finish_reason=fin.reason, logprobs=None)
        return {**self._head(False), "choices": [choice], "usage": _usage(self.prompt_len, len(fin.result.token_ids)),
                "layerleap": {"method": fin.result.stats["method"], "stats": _jsonable(fin.result.stats.to_dict())}}

    def chunk(self, text: str | None = None, reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(finish_reason=reason, logprobs=None)
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, fin: Finish) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(self.prompt_len, len(fin.result.token_ids))}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# -- metrics -----------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics in a registry of their own (several servers in one process stay apart)."""

    def __init__(self, scheduler_state: Callable[[], tuple[int, int]]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
        disable_created_metrics()  # no *_created series beside each counter
        r = self.registry = CollectorRegistry()
        self.requests = Counter("layerleap_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.completions = Counter("layerleap_completions", "finished completions by method", ["method"], registry=r)
        self.cancelled = Counter("layerleap_cancelled", "completions stopped because the client went away, by method",
                                 ["method"], registry=r)
        self.tokens = Counter("layerleap_generated_tokens", "generated tokens by method", ["method"], registry=r)
        self.prompt_tokens = Counter("layerleap_prompt_tokens", "prompt tokens by method", ["method"], registry=r)
        self.model_calls = Counter("layerleap_model_calls", "model calls (whole or partial) by method", ["method"],
                                   registry=r)
        self.drafted = Counter("layerleap_draft_tokens", "draft tokens proposed by method", ["method"], registry=r)
        self.accepted = Counter("layerleap_accepted_draft_tokens", "draft tokens accepted by method", ["method"],
                                registry=r)
        self.acceptance = Gauge("layerleap_acceptance", "accepted / proposed draft tokens so far, by method",
                                ["method"], registry=r)
        self.tokens_per_s = Gauge("layerleap_tokens_per_second", "generated tokens per second of the last finished "
                                  "batch, by method", ["method"], registry=r)
        self.tokens_per_call = Gauge("layerleap_tokens_per_call", "generated tokens per model call so far, by method",
                                     ["method"], registry=r)
        self.batch_size = Histogram("layerleap_batch_size", "requests per decoded batch", buckets=(1, 2, 4, 8, 16, 32),
                                    registry=r)
        self.latency = Histogram("layerleap_request_seconds", "completion request latency", ["endpoint"], registry=r)
        waiting = Gauge("layerleap_waiting_requests", "requests waiting in the queue", registry=r)
        running = Gauge("layerleap_running_batches", "batches decoding", registry=r)
        waiting.set_function(lambda: scheduler_state()[0])
        running.set_function(lambda: scheduler_state()[1])
        self._sums: dict[str, list[int]] = {}  # method -> [tokens, calls, drafted, accepted]

    def batch_done(self, batch) -> None:
        from .eval.bench import draft_counts
        results = [r for r in batch.decoding.results if r is not None]
        if not results:
            return
        method = results[0].stats["method"]
        s = self._sums.setdefault(method, [0, 0, 0, 0])
        tokens = sum(len(r.token_ids) for r in results)
        calls = results[0].stats["model_calls"]  # one Run: its calls serve every row
        self.batch_size.observe(len(results))
        self.completions.labels(method).inc(len(results))
        self.cancelled.labels(method).inc(sum(bool(r.stats.get("cancelled")) for r in results))
        self.tokens.labels(method).inc(tokens)
        self.prompt_tokens.labels(method).inc(sum(len(r.prompt_ids) for r in results))
        self.model_calls.labels(method).inc(calls)
        wall = max(r.stats["wall_s"] for r in results)
        if wall > 0:
            self.tokens_per_s.labels(method).set(tokens / wall)
        s[0] += tokens
        s[1] += calls
        if s[1]:
            self.tokens_per_call.labels(method).set(s[0] / s[1])
        for r in results:
            counts = draft_counts(r.stats)
            if counts:
                self.drafted.labels(method).inc(counts[0])
                self.accepted.labels(method).inc(counts[1])
                s[2] += counts[0]
                s[3] += counts[1]
        if s[2]:
            self.acceptance.labels(method).set(s[3] / s[2])

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


# -- the app -----------------------------------------------------------------------------------------
def create_app(model: Transformer, cfg: ServerConfig, loader: Callable[[str], Transformer] | None = None):
    """The FastAPI app serving ``model``; ``loader(name)`` loads a model a request's option names (only
    names in ``cfg.loadable``)."""
    holder: dict = {}

    def state() -> tuple[int, int]:
        s = holder.get("scheduler")
        return (len(s.waiting), len(s.running)) if s else (0, 0)

    metrics = Metrics(state)

    @asynccontextmanager
    async def lifespan(app):
        s = holder["scheduler"] = Scheduler(model, cfg.max_batch, cfg.max_running, cfg.max_waiting,
                                            on_batch_done=metrics.batch_done)
        s.start()
        yield
        await s.stop()

    app = FastAPI(title="layerleap", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return error(_bad(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):
        return error(APIError(500, f"internal error ({type(exc).__name__}): the server could not answer this "
                              "request", type="server_error"))

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON ({e}): send a JSON object") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != cfg.model_name:
            raise APIError(404, f"the model {name!r} does not exist here: this server serves {cfg.model_name!r}",
                           "model", "model_not_found")
        return body

    async def load_options(settings: Settings) -> Settings:
        options = dict(settings.options)
        for key in model_options(settings.method):
            value = options.get(key)
            if isinstance(value, str):
                if loader is None or value not in cfg.loadable:
                    allowed = f"only {', '.join(cfg.loadable)}" if cfg.loadable else "no models"
                    raise _bad(f"option {key}={value!r}: this server loads {allowed} for {key}=; start it with --opt "
                               f"{key}={value} to serve another", f"layerleap.options.{key}")
                options[key] = await holder["scheduler"].run_in_worker(loader, value)
        return Settings(settings.method, options, settings.gen)

    def check(ids: list[int], s: Settings) -> None:
        """What ``generate`` would refuse (option names, values it checks up front), before queueing."""
        try:
            s.decoding(model, ids)
        except LayerleapError as e:
            raise _bad(str(e), "layerleap.options") from None

    async def watch(request: Request, job: Job) -> None:
        while not job.finished:
            if await request.is_disconnected():
                holder["scheduler"].cancel(job)
                return
            await asyncio.sleep(0.1)

    async def next_event(job: Job):
        kind, value = await job.events.get()
        if kind == "error":
            raise value if isinstance(value, APIError) else _bad(str(value)) if isinstance(value, LayerleapError) \
                else APIError(500, f"internal error ({type(value).__name__}) while decoding", type="server_error")
        return kind, value

    async def completion(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        endpoint = request.url.path
        try:
            body = await body_of(request)
            ids = chat_prompt(body, model.tokenizer) if chat else text_prompt(body, model.tokenizer,
                                                                              model.config.vocab_size)
            settings = await load_options(request_settings(body, cfg, model.config.max_position, len(ids)))
            check(ids, settings)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise _bad("stream must be true or false", "stream")
            usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
            job = Job(ids, settings, _stops(body))
            if not holder["scheduler"].submit(job):
                raise APIError(429, "the server's queue is full: retry later", code="queue_full",
                               type="rate_limit_error")
        except APIError as e:
            return error(e)
        reply = Reply(chat, cfg.model_name, len(ids))
        watcher = asyncio.create_task(watch(request, job))
        try:
            first = await next_event(job)
        except APIError as e:
            watcher.cancel()
            return error(e)
        if not stream:
            try:
                event = first
                while event[0] != "done":
                    event = await next_event(job)
            except APIError as e:
                return error(e)
            finally:
                watcher.cancel()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
            return JSONResponse(reply.full(event[1]))
        return StreamingResponse(sse(job, reply, first, usage, watcher, endpoint, t0), media_type="text/event-stream")

    async def sse(job: Job, reply: Reply, event, usage: bool, watcher, endpoint: str, t0: float):
        try:
            if reply.chat:
                yield _sse(reply.chunk(role=True))
            while True:
                kind, value = event
                if kind == "text":
                    yield _sse(reply.chunk(value))
                else:
                    yield _sse(reply.chunk(None, value.reason))
                    if usage:
                        yield _sse(reply.usage_chunk(value))
                    break
                try:
                    event = await next_event(job)
                except APIError as e:
                    yield _sse(e.body())
                    break
            yield b"data: [DONE]\n\n"
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        finally:
            watcher.cancel()
            if not job.finished:
                holder["scheduler"].cancel(job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "layerleap"}]}

    @app.get("/health")
    async def health():
        waiting, running = state()
        return {"status": "ok", "model": cfg.model_name, "method": cfg.method, "waiting": waiting, "running": running}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app


class ServerThread:
    """Run ``app`` with uvicorn in a background thread (tests, notebooks): ``with ServerThread(app) as url:``
    gives ``http://127.0.0.1:PORT``; leaving the block stops the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
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
