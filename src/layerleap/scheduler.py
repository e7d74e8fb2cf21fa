"""The server's queue: requests wait, decode one model call at a time, and batch where the method does.

A ``Job`` is one request: its prompt ids, its ``Settings`` and an asyncio queue of events for the
request handler (``("text", piece)`` as tokens are accepted, then ``("done", Finish)``, or
``("refused", exception)`` for a request refused as it joins or by its method's set-up, before any
model call, or ``("error", exception)`` for one that failed after that, while decoding).  The
``Scheduler`` task admits waiting jobs into ``Batch``es (jobs with one batch key, i.e. the same
batching method, options and settings, decode as one ``Decoding``, up to ``max_batch`` rows; up to
``max_running`` batches at once) and advances the running batches one method round each in turn.  The
rounds run in one worker thread, so model calls never overlap and the event loop stays free to take requests.
A job whose client went away is cancelled: dropped while it waits, its row stopped while it runs
(a batch ends when all its rows have); a job that waits longer than ``queue_timeout`` seconds fails.

Text goes out as ``layerleap.core.text.TextPieces`` cuts it (whole characters, joining to the
final text) through a ``StopText`` filter for OpenAI's ``stop`` strings; a row that emits one of its
``stop_token_ids`` ends before that token.  Detokenizing runs in the worker thread, beside the model
calls, so the event loop only moves finished pieces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .core import processors, sampling
from .core.kv_cache import KVCache
from .core.model import Transformer
from .core.prompt_cache import PromptCache
from .core.logprobs import Raw, TokenLogprob, capture, typed
from .core.run import GenerationConfig, GenerationResult, NoTokenLeft, row_generators
from .decoding import Decoding, get_method
from .errors import LayerleapError
from .core.text import StopText, TextPieces, hold_off, tokens_through


@dataclass(frozen=True)
class Settings:
    """What one request decodes with: a method, its options and ``generate``'s other arguments."""

    method: str
    options: dict = field(default_factory=dict)
    gen: GenerationConfig = field(default_factory=GenerationConfig)  # its EOS fields are Decoding's own
    prompt_cache: PromptCache | None = None  # the server's prefix cache, when the request reuses it

    @property
    def max_new_tokens(self) -> int:
        return self.gen.max_new_tokens

    def decoding(self, model: Transformer, prompts) -> Decoding:
        g = self.gen
        sampling = (
            dict(
                temperature=g.temperature,
                top_k=g.top_k,
                top_p=g.top_p,
                min_p=g.min_p,
                typical_p=g.typical_p,
                seed=g.seed,
            )
            if g.do_sample
            else {}
        )
        procs = processors.asked(g)
        if "logit_bias" in procs:
            procs["logit_bias"] = dict(procs["logit_bias"])
        if "bad_words" in procs:
            procs["bad_words"] = [list(w) for w in procs["bad_words"]]  # as their token ids
        d = Decoding(
            model,
            prompts,
            self.method,
            g.max_new_tokens,
            do_sample=g.do_sample,
            stop_at_eos=g.stop_at_eos,
            **sampling,
            grammar=g.grammar,
            logprobs=g.logprobs,
            **procs,
            prompt_cache=self.prompt_cache,
            **self.options,
        )
        if g.min_tokens_ids:  # the server's stop_token_ids, held off by min_tokens as the EOS ones
            d.gen = dataclasses.replace(d.gen, min_tokens_ids=g.min_tokens_ids)
        return d

    def batch_key(self, serial: int) -> tuple:
        """Jobs with equal keys may decode as one batch: a batching method with the same options and
        settings, and no sampling seed (a seeded request decodes alone, as row 0, so that it samples
        what ``generate`` with its seed samples).  A method that does not batch decodes each job alone, as does
        a job whose token filters may leave it no token to choose (its failure ends a batch: it fails alone)."""
        g = self.gen
        filtered = bool(
            g.allowed_token_ids or g.bad_words or g.no_repeat_ngram_size or (g.min_tokens and g.grammar is not None)
        )
        if not get_method(self.method).batched or (g.do_sample and g.seed is not None) or filtered:
            return ("alone", serial)
        sampling = (g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p) if g.do_sample else None
        opts = json.dumps(self.options, sort_keys=True, default=lambda v: f"<{type(v).__name__} {id(v)}>")
        procs = (*processors.asked(g).items(), g.min_tokens_ids)
        cached = self.prompt_cache is not None
        return (
            self.method, opts, g.max_new_tokens, g.do_sample, sampling, g.stop_at_eos, g.grammar, g.logprobs, procs,
            cached,
        )  # fmt: skip


@dataclass
class Finish:
    """How a job ended: its result (tokens, stats) and OpenAI's finish reason."""

    result: GenerationResult
    reason: str  # "stop" (EOS, a stop string or a stop token) or "length"
    text: str  # all the text sent
    completion_tokens: int  # the tokens the answer holds (a stop token's round may have made more)
    logprobs_sent: int = 0  # the tokens whose log probabilities went out with the text (``Piece``)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The answer's tokens' log probabilities (None: not asked for)."""
        lps = self.result.logprobs
        return None if lps is None else lps[: self.completion_tokens]


class Piece(str):
    """Text a job sends, with the log probabilities of the tokens that came with it (``logprobs``: None
    when not asked for)."""

    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, text: str, logprobs: list[TokenLogprob] | None) -> "Piece":
        piece = cls(text)
        piece.logprobs = logprobs
        return piece


_serial = itertools.count()


class Job:
    """One request in the queue (see the module docstring for its events)."""

    def __init__(
        self,
        prompt_ids: list[int],
        settings: Settings,
        stops: list[str] | None = None,
        stop_token_ids: tuple[int, ...] = (),
        keep_stop: bool = False,
    ):
        self.prompt_ids, self.settings = prompt_ids, settings
        self.serial = next(_serial)
        self.key = settings.batch_key(self.serial)
        self.events: asyncio.Queue = asyncio.Queue()
        self.stop = StopText(stops or [], keep_stop)  # keep_stop: the stop string ends the text, in it
        self.stop_token_ids = frozenset(stop_token_ids)
        self.cut: int | None = None  # tokens kept when a stop token ended the row
        self.through: int | None = None  # tokens kept when a stop string ended the row (``take``)
        self.logprobs_sent = 0  # the tokens whose log probabilities have gone out with text (``with_logprobs``)
        self.text: list[str] = []
        self.cancelled = False
        self.finished = False
        self.reason: str | None = None  # OpenAI's finish reason, once done
        self.completion_tokens: int | None = None  # the tokens the answer holds (usage's), once done
        self.t_submit = time.monotonic()
        self.t_start: float | None = None  # when its batch took it
        self.t_first: float | None = None  # when its first text went out
        self.group: list[Job] = [self]  # the jobs of its request (``n``: one per sampled choice)

    def tokens(self, toks: list[int]) -> list[int]:
        """The row's tokens up to (not including) its first stop token."""
        if self.cut is None and self.stop_token_ids:
            self.cut = next((n for n, t in enumerate(toks) if t in self.stop_token_ids), None)
        return toks if self.cut is None else toks[: self.cut]

    def take(self, piece: str, toks: list[int], tokenizer) -> str:
        """``piece``, new text of the row whose tokens (up to its stop token) are ``toks``, through the stop
        strings (in the worker thread, where the text is made): at a stop string, the answer's tokens are
        counted here too, which decodes its text many times over (``tokens_through``)."""
        hold_off(self.stop, self.settings.gen.min_tokens, toks, tokenizer)  # no stop string before min_tokens
        piece = self.stop.push(piece)
        if self.stop.hit and self.through is None and tokenizer is not None:
            self.through = tokens_through(toks, tokenizer, self.stop.end)
        return piece

    def with_logprobs(self, piece: str, toks: list[int], logprobs) -> str:
        """``piece`` (from ``take``) with the log probabilities of the answer's tokens that have not gone out
        (``logprobs(start)`` gives them from token ``start`` on), when asked for and when there is text to
        carry them: the tokens of ``toks`` up to a stop string's end (in the worker thread)."""
        if self.settings.gen.logprobs is None or not piece:
            return piece
        n = len(toks) if self.through is None else min(self.through, len(toks))
        lps = logprobs(self.logprobs_sent)[: max(0, n - self.logprobs_sent)]
        self.logprobs_sent += len(lps)
        return Piece.of(piece, lps)

    def send(self, piece: str) -> None:
        """Send ``piece`` (on the event loop): text already through the stop strings (``take``)."""
        if piece:
            if self.t_first is None:
                self.t_first = time.monotonic()
            self.text.append(piece)
            self.events.put_nowait(("text", piece))

    def done(self, result: GenerationResult) -> None:
        if self.finished:
            return
        self.send_rest()
        toks = result.token_ids
        # a stop string or stop token ends the answer; else the decoding's own reason (EOS or the grammar's end:
        # "stop"; max_new_tokens: "length"), and a row cut short otherwise (a client gone) stopped
        reason = "stop" if self.stop.hit or self.cut is not None else result.finish_reason
        if reason not in ("stop", "length"):
            reason = "stop" if len(toks) < self.settings.max_new_tokens else "length"
        self.finished, self.reason = True, reason
        n = len(toks) if self.cut is None else self.cut
        if self.stop.hit and self.through is not None:  # counted as the text was made (``take``)
            n = self.through
        self.completion_tokens = n
        self.events.put_nowait(("done", Finish(result, reason, "".join(self.text), n, self.logprobs_sent)))

    def send_rest(self) -> None:
        rest = self.stop.finish()
        if rest:
            self.text.append(rest)
            self.events.put_nowait(("text", rest))

    def fail(self, error: BaseException, refused: bool = False) -> None:
        """End the job with ``error``: ``refused``, the request's own (it never began decoding), else a
        failure while decoding."""
        if not self.finished:
            self.finished = True
            self.events.put_nowait(("refused" if refused else "error", error))


class Batch:
    """Jobs decoding together as one ``Decoding`` (one prompt each)."""

    def __init__(self, model: Transformer, jobs: list[Job]):
        self.model, self.jobs = model, jobs
        self.decoding = jobs[0].settings.decoding(model, [j.prompt_ids for j in jobs])
        stops = {j.stop_token_ids for j in jobs}
        if len(stops) == 1 and jobs[0].stop_token_ids:  # the rows end before them, as generate's (a round's
            # path through one goes no further: the token filters may leave no token after it)
            d = self.decoding
            d.gen = dataclasses.replace(d.gen, stop_token_ids=tuple(sorted(jobs[0].stop_token_ids)))
        self.pieces = [TextPieces(model.tokenizer) for _ in jobs]
        self.rounds = iter(self.decoding)
        self.over = False
        self.early: set[int] = set()  # rows that ended before the batch: their text is all sent
        self.answers: dict[int, GenerationResult] = {}  # rows that end now, before the batch: their results
        now = time.monotonic()
        for job in jobs:
            job.t_start = now

    def step(self) -> tuple[list[int] | None, dict[int, str]]:
        """One method round and its text (in the worker thread): (the rows that grew, or None when the
        batch ended; each grown or ended row's new text, the whole rest of it for a row that ended, through
        its stop strings).  A row that a stop string ends stops here; the result of a row that ends before
        its batch-mates is made here too (``answers``: its text is decoded), for ``dispatch`` to send."""
        d, tok = self.decoding, self.model.tokenizer
        self.cancel_gone()  # here, between two rounds: a cancel during the last one (even its set-up) stops the row
        grew = next(self.rounds, None)
        texts, toks = {}, {}
        self.answers = {}
        for i in grew or []:
            job = self.jobs[i]
            if job.finished or job.cancelled:
                continue
            toks[i] = job.tokens(d.tokens(i))
            texts[i] = self.pieces[i].push(toks[i])
            if job.cut is not None:
                d.cancel(i)  # a stop token: the row ends here
            if d.finished(i) and self._others_decode(i):  # it answers now, not when its batch-mates end
                texts[i] += self.pieces[i].finish(job.tokens(d.tokens(i)))
                self.early.add(i)
        if grew is None:
            for i, job in enumerate(self.jobs):
                if d.results[i].stats.batch and not job.finished and i not in self.early:  # batch 0: never ran
                    toks[i] = job.tokens(d.results[i].token_ids)
                    texts[i] = self.pieces[i].finish(toks[i])
        for i, text in texts.items():
            job = self.jobs[i]
            texts[i] = job.with_logprobs(job.take(text, toks[i], tok), toks[i], lambda start, i=i: d.logprobs(i, start))
            if job.stop.hit:
                d.cancel(i)
            if (job.stop.hit or i in self.early) and self._others_decode(i):
                self.answers[i] = d.result_so_far(i)
        return grew, texts

    def dispatch(self, grew: list[int] | None, texts: dict[int, str]) -> None:
        """Send the rows' new text; finish the jobs whose rows ended, each as soon as it ends (on the event
        loop)."""
        d = self.decoding
        for i, text in texts.items():
            job = self.jobs[i]
            if job.finished:
                continue
            job.send(text)
            if i in self.answers and not job.cancelled:
                job.done(self.answers[i])
        self.answers = {}
        if grew is None:
            self.over = True
            for i, job in enumerate(self.jobs):
                if not d.results[i].stats.batch:  # cancelled before it started (it ran in no batch)
                    job.fail(LayerleapError("cancelled"))
                    continue
                job.done(d.results[i])

    def _others_decode(self, i: int) -> bool:
        """Whether a row besides ``i`` still decodes: then ``i``, ended, answers before the batch ends (a
        batch that ends anyway answers its rows at its end, with the method's statistics and metrics)."""
        return any(j != i and not self.decoding.finished(j) for j in range(len(self.jobs)))

    def cancel_gone(self) -> None:
        """Stop the rows whose clients went away (in the worker thread, between two rounds)."""
        for i, job in enumerate(self.jobs):
            if job.cancelled:
                self.decoding.cancel(i)

    def fail(self, error: BaseException) -> None:
        """Fail every job of the batch: refused while the method's set-up had made no model call yet."""
        self.over = True
        refused = not self.decoding.started
        for job in self.jobs:
            job.fail(error, refused)


PLAIN = ("greedy", "sample")  # the methods the pool decodes (one model call per token, any sampling settings)


class _Row:
    """One job in the ``Pool``: its prompt's prefill (a cache of its own, filled chunk by chunk), then a
    row of the pool's cache, one token per round."""

    def __init__(self, model: Transformer, job: Job, eos_ids: tuple[int, ...]):
        self.job, self.gen, self.eos_ids = job, job.settings.gen, eos_ids
        self.generator = row_generators(self.gen, [0], model.device)[0]  # what the job alone would draw
        self.constraint = None  # structured output: its grammar started at the first chunk (in the worker thread)
        self.history = (processors.histories(self.gen, [job.prompt_ids], eos_ids) or [None])[0]  # penalties, biases
        self.cache: KVCache | None = None  # the prefill's, made at its first chunk (in the worker thread)
        self.done_ids = 0  # prompt tokens prefilled
        self.cached = 0  # of them, those whose keys and values came from the prompt cache
        self.out: list[int] = []
        self.logprobs: list[Raw] = []  # with gen.logprobs: one per token of ``out``
        self.pieces = TextPieces(model.tokenizer)
        self.calls = 0
        self.finished = False
        self.reason: str | None = None  # GenerationResult.finish_reason, once it ends by itself
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    def choose(self, logits: torch.Tensor) -> int:
        """``[1, V]`` -> the row's next token, as ``Run.choose`` picks it."""
        g = self.gen
        raw = logits
        if self.history is not None:
            logits = self.history.apply(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits[0]).unsqueeze(0)
        if self.history is not None and self.history.filters and bool(processors.none_left(logits)[0]):
            raise NoTokenLeft(processors.none_left_message(self.history, self.constraint is not None))
        if not g.do_sample:
            token = sampling.top_ids(logits[0])
        else:
            p = sampling.probs(logits, g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p)
            token = int(sampling.sample(p, self.generator)[0])
        if g.logprobs is not None:
            self.logprobs += capture(raw, [token], g.logprobs)
        return token

    def emit(self, token: int) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.out.append(token)
        g = self.gen
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.history is not None:
            self.history.push(token)
        if (g.stop_at_eos and token in self.eos_ids) or (self.constraint is not None and self.constraint.stopped):
            self.finished, self.reason = True, "stop"
        elif len(self.out) >= g.max_new_tokens:
            self.finished, self.reason = True, "length"

    def result(self, model: Transformer, batch: int) -> GenerationResult:
        wall = time.perf_counter() - self.t0
        n = len(self.out)
        stats = {
            "method": self.job.settings.method,
            "new_tokens": n,
            "prompt_tokens": len(self.job.prompt_ids),
            "model_calls": self.calls,
            "tokens_per_call": n / max(1, self.calls),
            "wall_s": wall,
            "tokens_per_s": n / wall if wall > 0 else 0.0,
            "ttft_s": None if self.t_first is None else self.t_first - self.t0,
            "batch": batch,
            "cached_prompt_tokens": self.cached,
        }
        if self.job.cancelled:
            stats["cancelled"] = True
        text = model.tokenizer.decode(self.out, skip_special_tokens=True) if model.tokenizer is not None else ""
        reason = self.reason or ("cancelled" if self.job.cancelled or self.job.cut is not None else None)
        lps = None if self.gen.logprobs is None else typed(self.logprobs, model.tokenizer)
        return GenerationResult(text, list(self.out), stats, list(self.job.prompt_ids), reason, lps)


class Pool:
    """Continuous batching of plain decoding (``greedy`` and ``sample``, each row with its own sampling
    settings and generator): a job joins at the next round and leaves when it ends.  A round is one
    chunk (``chunk`` tokens at most) of the oldest joining prompt's prefill, in a cache of its own, then
    one model call that gives every decoding row its next token.  A prefilled prompt moves into a
    row of the pool's cache; the decoding rows are kept in rows ``[0, n)`` (a row that leaves takes the
    last row's place), each at its own length.  A row decodes what the job alone decodes: the same
    prefill (for a prompt of at most ``chunk`` tokens), the same per-row attention and token choice."""

    def __init__(self, model: Transformer, rows: int, chunk: int = 512):
        self.model, self.rows, self.chunk = model, rows, chunk
        self.cache: KVCache | None = None
        self.decoding: list[_Row] = []  # row i of the cache
        self.joining: list[_Row] = []  # prefilling, oldest first
        self.widest = 0  # most rows decoded in one call since the last report
        self.passes: dict[str, int] = {}  # method -> model calls its rows took part in, since the last report
        self.failed: list[tuple[Job, Exception]] = []  # the jobs of this step whose own work failed
        self.eos_ids = model.eos_ids()  # as generate's

    @staticmethod
    def takes(job: Job) -> bool:
        return job.settings.method in PLAIN and not job.settings.options

    def free(self) -> int:
        return self.rows - len(self.decoding) - len(self.joining)

    def jobs(self) -> list[Job]:
        return [r.job for r in self.joining + self.decoding]

    def add(self, job: Job) -> None:
        job.t_start = time.monotonic()
        self.joining.append(_Row(self.model, job, self.eos_ids))

    def _room(self, need: int) -> None:
        """Make the pool's cache ``need`` slots long at least (copying the rows it holds)."""
        if self.cache is not None and self.cache.max_len >= need:
            return
        old = self.cache
        size = min(self.model.config.max_position + 1, max(need, 2 * old.max_len if old else 512))
        self.cache = self.model.new_cache(self.rows, max(size, need))
        if old is not None:
            for i, _ in enumerate(self.decoding):
                n = int(old.lengths[0, i])
                self.cache.k[:, i, :, :n] = old.k[:, i, :, :n]
                self.cache.v[:, i, :, :n] = old.v[:, i, :, :n]
                self.cache.lengths[:, i] = n

    def _view(self, n: int) -> KVCache:
        """Rows ``[0, n)`` of the pool's cache as a cache (views: writes land in the pool's)."""
        c, view = self.cache, KVCache.__new__(KVCache)
        view.k, view.v, view.lengths, view.pad, view.max_len = (
            c.k[:, :n],
            c.v[:, :n],
            c.lengths[:, :n],
            c.pad[:n],
            c.max_len,
        )
        return view

    def _prefill(self, r: _Row) -> None:
        """One chunk of ``r``'s prompt; at the end, its first token and its move into the pool."""
        ids = r.job.prompt_ids
        part = ids[r.done_ids : r.done_ids + self.chunk]
        m = self.model
        if r.cache is None:  # here, not as the row joins on the event loop: a long prompt's cache takes a while,
            if r.gen.grammar is not None:  # and a grammar compiled anew (the tokenizer's view, a second to build)
                r.constraint = r.gen.grammar.start(m, 1, r.eos_ids)[0]
            r.cache = m.new_cache(1, len(ids) + 1)
            r.done_ids = r.cached = self._reuse(r)
            part = ids[r.done_ids : r.done_ids + self.chunk]
        x = torch.tensor([part], dtype=torch.long, device=m.device)
        positions = torch.arange(r.done_ids, r.done_ids + len(part), device=m.device).unsqueeze(0)  # [1, S]
        h = m.run_layers(m.embed(x), 0, m.config.n_layers, positions, r.cache)  # [1, S, D]
        r.done_ids += len(part)
        r.calls += 1
        self._passed([r])
        if r.done_ids < len(ids):
            return
        r.emit(r.choose(m.logits(h[:, -1:])[:, -1]))
        if r.finished:
            self._keep(r, r.cache, 0)
            self.joining.remove(r)
            return
        n = len(ids)
        self._room(n + r.gen.max_new_tokens + 1)  # the rows it holds stay as they are if this fails
        i = len(self.decoding)
        self.cache.k[:, i, :, :n] = r.cache.k[:, 0, :, :n]
        self.cache.v[:, i, :, :n] = r.cache.v[:, 0, :, :n]
        self.cache.lengths[:, i] = n
        self.cache.pad[i] = 0
        r.cache = None
        self.joining.remove(r)  # last: until it is placed, a failure finds it among the joining rows
        self.decoding.append(r)

    def _decode(self) -> None:
        """One token for every decoding row (one model call)."""
        m, n = self.model, len(self.decoding)
        view = self._view(n)
        x = torch.tensor([[r.out[-1]] for r in self.decoding], dtype=torch.long, device=m.device)  # [n, 1]
        positions = (view.lengths[0] - view.pad).unsqueeze(1).to(m.device)  # [n, 1]
        logits = m.logits(m.run_layers(m.embed(x), 0, m.config.n_layers, positions, view))[:, -1]  # [n, V]
        self.widest = max(self.widest, n)
        self._passed(self.decoding)
        stuck = []
        for i, r in enumerate(self.decoding):
            r.calls += 1
            try:
                token = r.choose(logits[i : i + 1])
            except NoTokenLeft as e:  # its settings leave no token: this request fails, not the others
                self.failed.append((r.job, e))
                stuck.append(r)
                continue
            r.emit(token)
        for r in stuck:
            self._leave(r)

    def _passed(self, rows: list[_Row]) -> None:
        """One model call over ``rows``: counted once for each method among them."""
        for method in {r.job.settings.method for r in rows}:
            self.passes[method] = self.passes.get(method, 0) + 1

    def _reuse(self, r: _Row) -> int:
        """Copy the keys and values of the longest cached prefix of ``r``'s prompt (the prompt cache, when its
        request reuses one) into its prefill's cache -> the prompt tokens they cover (the last one always runs)."""
        pc, ids = r.job.settings.prompt_cache, r.job.prompt_ids
        if pc is None:
            return 0
        entry, n = pc.lookup(self.model, ids, r.cache.k.dtype, r.cache.k.device)
        if n:
            r.cache.k[:, 0, :, :n] = entry.k[:, :, :n]
            r.cache.v[:, 0, :, :n] = entry.v[:, :, :n]
            r.cache.lengths[:, 0] = n
        return n

    def _keep(self, r: _Row, cache: KVCache, i: int) -> None:
        """Store ``r``'s prompt and output with their keys and values (row ``i`` of ``cache``) in the prompt cache."""
        pc = r.job.settings.prompt_cache
        if pc is None or cache is None:
            return
        tokens = r.job.prompt_ids + r.out
        n = min(len(tokens), int(cache.lengths[:, i].min()) - int(cache.pad[i]))
        if n > 0:
            pc.store(self.model, tokens[:n], cache.k[:, i, :, :n], cache.v[:, i, :, :n])

    def _leave(self, r: _Row) -> None:
        """``r``'s row is taken by the last decoding row (its tokens go to the prompt cache first)."""
        i, last = self.decoding.index(r), len(self.decoding) - 1
        self._keep(r, self.cache, i)
        if i != last:
            n = int(self.cache.lengths[0, last])
            self.cache.k[:, i, :, :n] = self.cache.k[:, last, :, :n]
            self.cache.v[:, i, :, :n] = self.cache.v[:, last, :, :n]
            self.cache.lengths[:, i] = n
            self.decoding[i] = self.decoding[last]
        self.decoding.pop()

    def step(self) -> tuple[dict[Job, str], list[tuple[Job, GenerationResult]], list[tuple[Job, Exception]]]:
        """One round (in the worker thread): (each job's new text, the jobs that ended with their results,
        the jobs that failed with their errors)."""
        with torch.inference_mode():
            return self._step()

    def _step(self) -> tuple[dict[Job, str], list[tuple[Job, GenerationResult]], list[tuple[Job, Exception]]]:
        ended: list[_Row] = []
        self.failed = failed = []  # kept until the step returns: a later failure of the step fails them too
        for r in [r for r in self.joining if r.job.cancelled]:
            self.joining.remove(r)
            ended.append(r)
        for r in [r for r in self.decoding if r.job.cancelled or r.job.stop.hit]:
            self._leave(r)
            ended.append(r)
        if self.joining:
            r = self.joining[0]
            try:
                self._prefill(r)
            except Exception as e:  # noqa: BLE001  this prompt's failure (e.g. no memory for it) is its own
                self.joining.remove(r)
                failed.append((r.job, e))
            else:
                if r.finished:
                    ended.append(r)
        if self.decoding:
            self._decode()
        texts, toks = {}, {}
        for r in self.decoding + ended:
            if r.job.finished or r.job.cancelled or not r.out:
                continue
            toks[r.job] = r.job.tokens(r.out)
            if r.job.cut is not None:
                r.finished = True
            texts[r.job] = r.pieces.push(toks[r.job])
        for r in [r for r in self.decoding if r.finished]:
            self._leave(r)
            ended.append(r)
        done = []
        for r in ended:
            res = r.result(self.model, max(1, self.widest))
            if not r.job.finished and not r.job.cancelled:
                toks[r.job] = r.job.tokens(res.token_ids)
                texts[r.job] = texts.get(r.job, "") + r.pieces.finish(toks[r.job])
            done.append((r.job, res))
        rows = {r.job: r for r in self.decoding + ended}
        tok = self.model.tokenizer
        texts = {
            job: job.with_logprobs(
                job.take(text, toks[job], tok), toks[job], lambda start, r=rows[job]: typed(r.logprobs[start:], tok)
            )
            for job, text in texts.items()
        }
        return texts, done, failed

    def dispatch(
        self, texts: dict[Job, str], done: list[tuple[Job, GenerationResult]], failed: list[tuple[Job, Exception]]
    ) -> None:
        """On the event loop: send the text, finish the jobs that ended, fail those that failed."""
        for job, error in failed:
            job.fail(error)
        self.failed = []
        for job, text in texts.items():
            if not job.finished:
                job.send(text)
        for job, res in done:
            if job.cancelled and not job.finished:
                job.fail(LayerleapError("cancelled"))
            job.done(res)


class QueueTimeout(LayerleapError):
    """A job waited in the queue longer than the server's ``queue_timeout``."""


class Scheduler:
    """Waiting jobs, running batches, and the task that serves them (``start()`` on the event loop).
    ``on_cancel(job, stage)`` hears of each client that went away ("waiting" or "running");
    ``on_batch_done(batch)`` of each batch that ended, ``on_timeout()`` of each job that waited too long,
    ``on_rows_done(rows, width)`` of the pool's requests that ended, ``on_passes(counts)`` of the pool's
    model calls (method -> calls).
    ``idle()``, while ``has_idle_work()``, runs one short step of background work (in the worker thread)
    whenever no request waits or runs."""

    def __init__(
        self,
        model: Transformer,
        max_batch: int = 8,
        max_running: int = 2,
        max_waiting: int = 256,
        on_batch_done: Callable[[Batch], None] | None = None,
        queue_timeout: float = 600.0,
        on_cancel: Callable[[Job, str], None] | None = None,
        on_timeout: Callable[[], None] | None = None,
        idle: Callable[[], None] | None = None,
        has_idle_work: Callable[[], bool] = lambda: False,
        on_rows_done: Callable[[list, int], None] | None = None,
        on_passes: Callable[[dict[str, int]], None] | None = None,
        pool_rows: int = 0,
        prefill_chunk: int = 512,
    ):
        self.model, self.max_batch, self.max_running, self.max_waiting = model, max_batch, max_running, max_waiting
        self.queue_timeout = queue_timeout
        self.on_batch_done = on_batch_done or (lambda batch: None)
        self.on_rows_done = on_rows_done or (lambda rows, width: None)
        self.on_passes = on_passes or (lambda counts: None)
        self.pool = Pool(model, pool_rows, prefill_chunk) if pool_rows > 0 else None
        self.on_cancel = on_cancel or (lambda job, stage: None)
        self.on_timeout = on_timeout or (lambda: None)
        self.idle, self.has_idle_work = idle, has_idle_work
        self.waiting: list[Job] = []
        self.scoring = 0  # prompt passes waiting for or in the worker (``score_in_worker``): places in the queue too
        self.running: list[Batch] = []
        self.admitting: list[Job] = []  # the jobs of the batch being made (in the worker thread)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="layerleap-model")
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.serve())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        pooled = self.pool.jobs() if self.pool is not None else []
        for job in self.waiting + self.admitting + [j for b in self.running for j in b.jobs] + pooled:
            job.fail(LayerleapError("the server is shutting down"))
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def run_in_worker(self, fn, *args):
        """``fn(*args)`` in the model thread (between rounds): e.g. loading a model an option names."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def score_in_worker(self, fn, *args):
        """``fn(*args)`` in the model thread, holding a place in the queue while it waits and runs (a prompt
        scored for echo or prompt_logprobs); None, running nothing, when the queue has no room."""
        if len(self.waiting) + self.scoring + 1 > self.max_waiting:
            return None
        self.scoring += 1
        try:
            return await self.run_in_worker(fn, *args)
        finally:
            self.scoring -= 1

    def submit(self, *jobs: Job) -> bool:
        """Queue ``jobs`` (a request's, several for several choices) all or none; False when the queue has no room
        for them all (prompts being scored hold places too)."""
        if len(self.waiting) + self.scoring + len(jobs) > self.max_waiting:
            return False
        self.waiting += jobs
        self.wake.set()
        return True

    def running_jobs(self) -> int:
        pooled = len(self.pool.jobs()) if self.pool else 0
        return len(self.admitting) + sum(len(b.jobs) for b in self.running) + pooled

    def cancel(self, job: Job, gone: bool = True) -> None:
        """The client of ``job`` went away: drop it if it waits, stop its row if it runs (the pool drops it
        at its next round).  ``gone`` False: its request ended otherwise (another of its jobs failed, the server
        stops), and ``on_cancel`` does not hear of it."""
        if job.finished or job.cancelled:
            return
        job.cancelled = True
        report = self.on_cancel if gone else (lambda job, stage: None)
        if self.pool is not None and job in self.pool.jobs():
            report(job, "running")
            return
        if job in self.admitting:  # its batch is being made: its row stops at the batch's first round
            report(job, "running")
            return
        if job in self.waiting:
            self.waiting.remove(job)
            report(job, "waiting")
            job.fail(LayerleapError("cancelled"))
            return
        for batch in self.running:
            if job in batch.jobs:  # its row stops at the batch's next round (in the worker thread)
                report(job, "running")

    def _expire(self) -> None:
        """Fail the jobs that waited longer than ``queue_timeout``, each with the other jobs of its request that
        still wait (its request fails: one timeout in ``on_timeout``)."""
        now = time.monotonic()
        for job in [j for j in self.waiting if now - j.t_submit > self.queue_timeout]:
            if job not in self.waiting:  # failed with an earlier job of its request
                continue
            self.on_timeout()
            error = QueueTimeout(
                f"the request waited {now - job.t_submit:.0f} s in the queue, over the server's "
                f"limit of {self.queue_timeout:g} s: retry later"
            )
            for j in [j for j in job.group if j in self.waiting]:
                self.waiting.remove(j)
                j.fail(error)

    async def _admit(self) -> None:
        """Plain-decoding jobs join the pool while it has free rows; of the others, while fewer than
        ``max_running`` batches run, the oldest waiting job and the waiting jobs with its batch key (up to
        ``max_batch``) become a new batch (made in the worker thread: ``admitting`` meanwhile)."""
        self._expire()
        if self.pool is not None:
            for job in [j for j in self.waiting if Pool.takes(j)][: self.pool.free()]:
                self.waiting.remove(job)
                try:
                    self.pool.add(job)
                except Exception as e:  # noqa: BLE001  (its row failed to set up: this request fails, not the server)
                    job.fail(e, refused=True)
        while len(self.running) < self.max_running:
            rest = [j for j in self.waiting if not self._pooled(j)]
            if not rest:
                break
            jobs = [j for j in rest if j.key == rest[0].key][: self.max_batch]
            self.waiting = [j for j in self.waiting if j not in jobs]
            self.admitting = jobs
            try:  # in the worker thread: a decoding's set-up (a grammar compiled, its options checked) takes a while
                batch = await asyncio.get_running_loop().run_in_executor(self.executor, Batch, self.model, jobs)
            except Exception as e:  # noqa: BLE001  checked when the requests came in; a late refusal still answers
                self.admitting = []
                together = len(jobs) > 1 and isinstance(e, LayerleapError)  # refused together (their KV cache)
                for job in [j for j in jobs if j.cancelled]:  # its client went away meanwhile
                    job.fail(LayerleapError("cancelled"))
                jobs = [j for j in jobs if not j.cancelled]
                if together:  # one by one
                    for job in jobs:
                        job.key = ("alone", job.serial)
                    self.waiting = jobs + self.waiting
                    continue
                for job in jobs:
                    job.fail(e, refused=True)
            else:
                self.admitting = []
                self.running.append(batch)

    def _pooled(self, job: Job) -> bool:
        return self.pool is not None and Pool.takes(job)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running and not (self.pool and self.pool.jobs()):
                if self.idle is not None and self.has_idle_work():
                    try:
                        await loop.run_in_executor(self.executor, self.idle)
                    except Exception:
                        logging.getLogger("layerleap.server").exception("background work failed")
                    continue
                self.wake.clear()
                await self.wake.wait()
            await self._admit()
            if self.pool is not None and self.pool.jobs():
                try:
                    texts, done, failed = await loop.run_in_executor(self.executor, self.pool.step)
                    self.pool.dispatch(texts, done, failed)
                except Exception as e:  # noqa: BLE001  a decoding call failed: every pooled request with it
                    for job in self.pool.jobs() + [job for job, _ in self.pool.failed]:
                        job.fail(e)
                    self.pool.joining, self.pool.decoding, self.pool.failed, done = [], [], [], []
                ran = [(job, r) for job, r in done if r.stats["model_calls"]]  # not one cancelled before its prefill
                if ran:
                    self._report(self.on_rows_done, ran, max(1, self.pool.widest))
                    self.pool.widest = 0
                if self.pool.passes:
                    self._report(self.on_passes, self.pool.passes)
                    self.pool.passes = {}
            for batch in list(self.running):
                try:
                    grew, texts = await loop.run_in_executor(self.executor, batch.step)
                    batch.dispatch(grew, texts)
                except Exception as e:  # noqa: BLE001  (a failed batch answers its requests; the server goes on)
                    batch.fail(e)
                if batch.over:
                    self.running.remove(batch)
                    self._report(self.on_batch_done, batch)

    @staticmethod
    def _report(callback: Callable, *args) -> None:
        """A metrics callback: one that fails is logged; the requests it reports on have their answers."""
        try:
            callback(*args)
        except Exception:  # noqa: BLE001
            logging.getLogger("layerleap.server").exception("reporting a finished request failed")
