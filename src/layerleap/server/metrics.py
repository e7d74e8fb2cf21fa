"""The server's Prometheus metrics, in a registry of their own (several servers in one process stay apart).

Every label takes a bounded set of values: ``endpoint`` the served routes (anything else is
``other``), ``method`` the registered methods, ``status`` HTTP codes, ``reason`` and ``stage`` a few
words each.  Latency buckets reach ten minutes.
"""

from __future__ import annotations

from collections.abc import Callable

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{id}",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/docs",
    "/openapi.json",
)
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)  # request, first token, queue wait
PER_PASS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)  # tokens a row gains per verification pass


def endpoint_label(path: str) -> str:
    """A request path as a bounded label."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


class Metrics:
    """``layerleap_*`` series; ``state()`` gives (waiting requests, running batches)."""

    def __init__(self, state: Callable[[], tuple[int, int]]):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )

        disable_created_metrics()  # no *_created series beside each counter
        r = self.registry = CollectorRegistry()

        def counter(name, doc, labels=()):
            return Counter(f"layerleap_{name}", doc, list(labels), registry=r)

        self.requests = counter("requests", "HTTP requests by endpoint and status", ("endpoint", "status"))
        self.completions = counter(
            "completions", "completions that ended (not cancelled), by method and finish reason", ("method", "reason")
        )
        self.cancelled = counter(
            "cancelled",
            "requests whose client went away, by method and where they were (waiting or running)",
            ("method", "stage"),
        )
        self.timeouts = counter("queue_timeouts", "requests that waited past the queue timeout")
        self.tokens = counter("generated_tokens", "generated tokens by method", ("method",))
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens by method", ("method",))
        self.cached_prompt_tokens = counter(
            "cached_prompt_tokens", "prompt tokens reused from the prompt cache (not run) by method", ("method",)
        )
        self.passes = counter("verification_passes", "model calls (target-model passes) by method", ("method",))
        self.drafted = counter("draft_tokens", "draft tokens proposed by method", ("method",))
        self.accepted = counter("accepted_draft_tokens", "draft tokens accepted by method", ("method",))
        self.acceptance = Gauge(
            "layerleap_acceptance", "accepted / proposed draft tokens so far, by method", ["method"], registry=r
        )
        self.batch_size = Histogram(
            "layerleap_batch_size", "requests per decoded batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.latency = Histogram(
            "layerleap_request_seconds",
            "completion latency, request to last token",
            ["endpoint"],
            buckets=SECONDS,
            registry=r,
        )
        self.ttft = Histogram(
            "layerleap_time_to_first_token_seconds",
            "request to its first text, by method",
            ["method"],
            buckets=SECONDS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "layerleap_queue_wait_seconds", "request to the start of its decoding", buckets=SECONDS, registry=r
        )
        self.per_pass = Histogram(
            "layerleap_tokens_per_pass",
            "tokens a request gained per verification pass (1 for plain decoding), by method",
            ["method"],
            buckets=PER_PASS,
            registry=r,
        )
        share = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1)
        self.shadow_agreement = Histogram(
            "layerleap_shadow_agreement",
            "lossy methods: share of a sampled answer's tokens equal to greedy's at the same position (shadow checks)",
            ["method"],
            buckets=share,
            registry=r,
        )
        self.shadow_prefix = Histogram(
            "layerleap_shadow_prefix",
            "lossy methods: share of greedy's tokens before a sampled answer first differs (shadow checks)",
            ["method"],
            buckets=share,
            registry=r,
        )
        waiting = Gauge("layerleap_waiting_requests", "requests waiting in the queue", registry=r)
        running = Gauge("layerleap_running_requests", "requests decoding (prefilling or generating)", registry=r)
        waiting.set_function(lambda: state()[0])
        running.set_function(lambda: state()[1])
        self._drafts: dict[str, list[int]] = {}  # method -> [proposed, accepted]

    def cancel(self, job, stage: str) -> None:
        """A request's client went away: counted once, at the first of its jobs (``n``: one per choice)."""
        if not any(j.cancelled for j in job.group if j is not job):
            self.cancelled.labels(job.settings.method, stage).inc()

    def batch_done(self, batch) -> None:
        """A batch ended: its rows' tokens, passes, acceptance, first-token times and queue waits."""
        rows = [(job, r) for job, r in zip(batch.jobs, batch.decoding.results) if r is not None and r.stats.batch]
        if rows:
            self.passes.labels(rows[0][1].stats["method"]).inc(rows[0][1].stats["model_calls"])  # shared calls
            self.rows_done(rows, len(rows))

    def pool_passes(self, counts: dict[str, int]) -> None:
        """The continuous pool's model calls: method -> calls its rows took part in."""
        for method, n in counts.items():
            self.passes.labels(method).inc(n)

    def rows_done(self, rows: list, width: int) -> None:
        """Requests that ended: (job, GenerationResult) pairs of one method; ``width`` rows decoded together."""
        from ..eval.bench import draft_counts

        self.batch_size.observe(width)
        for job, r in rows:
            method = r.stats["method"]
            d = self._drafts.setdefault(method, [0, 0])
            n = len(r.token_ids)  # decoded, a stop's round's tokens past it too
            # the answer's tokens (usage.completion_tokens); a request cancelled while running: those it decoded
            self.tokens.labels(method).inc(n if job.completion_tokens is None else job.completion_tokens)
            self.prompt_tokens.labels(method).inc(len(r.prompt_ids))
            self.cached_prompt_tokens.labels(method).inc(r.stats.get("cached_prompt_tokens", 0))
            if job.t_start is not None:
                self.queue_wait.observe(job.t_start - job.t_submit)
            if job.t_first is not None:
                self.ttft.labels(method).observe(job.t_first - job.t_submit)
            if not job.cancelled and job.reason:
                self.completions.labels(method, job.reason).inc()
            if n and r.stats["model_calls"]:
                self.per_pass.labels(method).observe(n / r.stats["model_calls"])
            counts = draft_counts(r.stats)
            if counts:
                self.drafted.labels(method).inc(counts[0])
                self.accepted.labels(method).inc(counts[1])
                d[0] += counts[0]
                d[1] += counts[1]
            if d[0]:
                self.acceptance.labels(method).set(d[1] / d[0])

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
