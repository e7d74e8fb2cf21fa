"""``layerleap serve``: the OpenAI-compatible server (``layerleap.server``) on one loaded model."""

from __future__ import annotations

from .. import validate as V
from . import command
from ..decoding import METHODS, Decoding, get_method
from ..errors import LayerleapError
from ..core.loading import PACKAGED
from ..options import resolve_models
from .basic import _load, _loader, _method_options, _model_args, _need_tokenizer, _opt_arg, _say, _threads


@command("serve", help="an OpenAI-compatible HTTP server (chat and text completions, streaming, /metrics)")
def _setup(p):
    _model_args(p)
    p.add_argument(
        "--method",
        default="auto",
        help=f"the default decoding method: {', '.join(METHODS)} "
        "(default auto; a request may choose another in its 'layerleap' field)",
    )
    _opt_arg(p, "NAME=VALUE", "an option of the default method (repeatable)")
    p.add_argument(
        "--host", type=V.text_arg, default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=V.int_arg(0, 65535), default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--name", type=V.text_arg, default=None, help="the model id clients pass (default: --model)")
    p.add_argument(
        "--max-tokens",
        type=V.int_arg(1, 1_000_000),
        default=256,
        help="max_tokens of a request that gives none (default 256)",
    )
    p.add_argument(
        "--max-batch",
        type=V.int_arg(1, 4096),
        default=16,
        help="requests decoded together, at most "
        "(greedy and sample: the continuous pool's rows; other batching methods: a batch's; default 16)",
    )
    p.add_argument(
        "--no-continuous",
        action="store_true",
        help="greedy and sample batch like the other methods "
        "(a batch forms from the requests waiting together and takes no new ones) instead of joining the "
        "continuous pool",
    )
    p.add_argument(
        "--prefill-chunk",
        type=V.int_arg(16, 1_000_000),
        default=512,
        help="prompt tokens the pool prefills per round, between decoding rounds (default 512)",
    )
    p.add_argument(
        "--prompt-cache-mb",
        type=V.int_arg(0, 1 << 20, hint=" (0: no prompt cache)"),
        default=256,
        help="MiB of keys and values kept from finished requests, reused by a request whose prompt starts with "
        "their tokens (a chat's earlier turns); least recently used first out (default 256; 0: off; a request "
        'opts out with "cache_prompt": false)',
    )
    p.add_argument(
        "--max-running",
        type=V.int_arg(1, 1024),
        default=2,
        help="batches decoding at once, one model call at a time in turn (default 2)",
    )
    p.add_argument(
        "--max-waiting", type=V.int_arg(1, 1_000_000), default=256, help="queued requests before 429 (default 256)"
    )
    p.add_argument(
        "--max-body",
        type=V.int_arg(1024, 1 << 30),
        default=2 << 20,
        help="request body bytes, at most (default 2 MiB; more is a 413)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=V.int_arg(1, 10_000_000),
        default=None,
        help="prompt tokens, at most (default: the context less one)",
    )
    p.add_argument(
        "--queue-timeout",
        type=V.float_arg(0.1, 86400),
        default=600.0,
        help="seconds a request may wait for its turn before a 503 (default 600)",
    )
    p.add_argument(
        "--drain-seconds",
        type=V.float_arg(0, 86400),
        default=30.0,
        help="on SIGTERM or Ctrl-C, seconds the requests under way get to finish (default 30)",
    )
    p.add_argument(
        "--shadow-share",
        type=V.float_arg(0, 1),
        default=0.0,
        help="share of lossy-method requests "
        "re-decoded greedily when idle, for /metrics' agreement with greedy (default 0: off)",
    )
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request to stderr")


@_setup
def run_serve(args) -> int:
    try:
        import prometheus_client  # noqa: F401  (imported by the app's /metrics once the model has loaded)
        import uvicorn  # noqa: F401

        from ..server import ServerConfig, create_app  # noqa: F401
    except ImportError as e:
        raise LayerleapError(f"layerleap serve needs {e.name}: pip install 'layerleap[serve]'") from None
    options = _method_options(args.method, args.opt)  # the method's declarations, before loading
    with _bind(args.host, args.port) as sock:
        return _serve(args, options, sock)


def _serve(args, options: dict, sock) -> int:
    """Load the model, check the method and its options on it, and serve on ``sock`` (bound before the
    model loads; with --port 0 the port it got is the one printed) until Ctrl-C or SIGTERM."""
    import uvicorn

    from ..server import ServerConfig, create_app

    threads = _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)  # every answer is text (token-id prompts too)
    get_method(args.method).check_options(options, model.config)  # the bounds on the model, before a draft loads
    loader = _loader(args)
    options = resolve_models(args.method, options, loader)
    for _ in Decoding(model, [0], args.method, 1, **options):  # the default method and options run: one token
        pass
    cfg = ServerConfig(
        args.name or args.model,
        args.method,
        options,
        args.max_tokens,
        args.max_batch,
        args.max_running,
        args.max_waiting,
        loadable=tuple(PACKAGED) + tuple(loader.models),
        max_body_bytes=args.max_body,
        max_prompt_tokens=args.max_prompt_tokens,
        queue_timeout=args.queue_timeout,
        shadow_share=args.shadow_share,
        continuous=not args.no_continuous,
        prefill_chunk=args.prefill_chunk,
        prompt_cache_mb=args.prompt_cache_mb,
    )
    if not args.no_access_log:
        _access_log()
    _say(
        f"serving {cfg.model_name} ({args.dtype}, {threads} threads) with {args.method} "
        f"on http://{_url_host(args.host)}:{sock.getsockname()[1]}/v1 (Ctrl-C stops)"
    )
    app = create_app(model, cfg, loader)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.drain_seconds))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _access_log() -> None:
    """One line per request on stderr: client, method and path, status, milliseconds."""
    import logging

    log = logging.getLogger("layerleap.access")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _bind(host: str, port: int):
    """The socket the server listens on, bound to ``host:port`` before loading the model (a bad address
    or a port in use is one line, not a server that dies after start-up; ``--port 0``: a free port)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        except OSError:
            s.close()
            raise
        return s
    except (OSError, UnicodeError) as e:
        raise LayerleapError(
            f"cannot serve on {host}:{port} ({getattr(e, 'strerror', None) or e}): choose another --host or --port"
        ) from None
