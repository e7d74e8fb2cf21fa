"""``layerleap serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one loaded model.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``/v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /docs`` (the
request schema).  The server's ``--method`` and ``--opt`` are the defaults; a request chooses another
method and its options in a ``layerleap`` field of its body (the ``openai`` client's ``extra_body``):
``{"layerleap": {"method": "self-spec", "options": {"draft_len": 4}}}``.

``schema`` declares the request bodies (pydantic; a wrong type or an unknown field is a 400 naming
the field), ``app`` the handlers over one ``AppState``, ``metrics`` the Prometheus series; the queue,
batching and cancelling are ``layerleap.scheduler``'s.  Bad requests get OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status, never a traceback.
"""

from .app import (
    APIError,
    AppState,
    ServerConfig,
    ServerThread,
    create_app,
    request_settings,
)

__all__ = ["APIError", "AppState", "ServerConfig", "ServerThread", "create_app", "request_settings"]
