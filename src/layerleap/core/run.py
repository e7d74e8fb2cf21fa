"""What one decoding call runs on: the ``Run`` context, the method registry and the round driver.

A method is one function ``fn(run, **options)`` registered under a name (``register``).  It reads the
prompts, configuration and model from ``run``, makes model calls through ``run.forward`` (which
counts model calls and token-layer evaluations), chooses tokens with ``run.choose`` and hands them
over with ``run.emit``; with ``logprobs`` asked for, ``run.choose`` takes the chosen tokens' log
probabilities too, and a method that chooses tokens another way gives them to ``run.capture`` before
``run.emit`` (``core.logprobs``).  A method written as a generator ``yield``s after each round that emitted
tokens: ``rounds`` drives it round by round, so accepted tokens can be streamed and a request can be
dropped between rounds, with no threads.  After a ``yield`` it ends once ``run.done`` (a cancel between
rounds can end every row), recording its statistics as at any end.

This module knows no method: the built-in ones register themselves when ``layerleap.methods`` is
imported, and ``layerleap.decoding`` (``generate``, ``Decoding``) imports them.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import validate as V
from . import sampling
from . import options as O
from .cpu import release_freed_memory
from .grammar import Grammar, mask_rows
from .processors import apply_rows, histories, none_left, none_left_message
from .kv_cache import KVCache
from .prompt_cache import PromptCache
from .logprobs import Raw, TokenLogprob, capture
from .model import Transformer
from .stats import RECORD_FIELDS, Record, Stats

LONG_PROMPT_PASS = 256  # prompt tokens in a call after which its freed buffers go back to the OS


class GenerationError(V.InputError):
    """Bad input to ``generate``: the message names the problem and the fix."""


class NoTokenLeft(GenerationError):
    """While decoding: the token filters (``allowed_token_ids``, ``bad_words``, ``no_repeat_ngram_size``,
    ``min_tokens``), with a grammar,
    forbid every token where a row chooses its next one (``core.processors.none_left_message`` says which)."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True
    eos_ids: tuple[int, ...] = ()
    grammar: Grammar | None = None  # structured output: every token follows it (``core.grammar``)
    logprobs: int | None = None  # report each token's log probability and this many likeliest (None: off)
    min_p: float = 0.0  # sampling: drop the tokens less likely than min_p times the likeliest
    # logits processors over each row's history (``core.processors``; the defaults ask for nothing)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()  # only these may be chosen (ids ascending; empty: all)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    min_tokens_ids: tuple[int, ...] = ()  # tokens min_tokens holds off besides the EOS ones (the stop tokens)
    no_repeat_ngram_size: int = 0  # no n-gram of this size occurs twice in the prompt and output (0: off)
    typical_p: float = 1.0  # sampling: typical sampling's mass (1.0: off)
    stop_token_ids: tuple[int, ...] = ()  # a row that chooses one ends before it (the token is not kept)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)
    # why the row ended: "stop" (an end-of-sequence token, the end of its grammar or a stop string: then
    # ``stats.stop_string`` names it), "length" (max_new_tokens),
    # "cancelled" (``Decoding.cancel``); None while it decodes
    finish_reason: str | None = None
    # with ``logprobs=N``: one ``core.logprobs.TokenLogprob`` per token of ``token_ids``; None without
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [t.to_dict() for t in self.logprobs]
        return out


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable
    batched: bool  # decodes a list of prompts as one batch
    sampling: bool  # supports do_sample=True
    default_sample: bool  # samples unless told otherwise
    description: str
    exact: bool = False  # its greedy output equals plain greedy decoding token for token
    declared: tuple[O.Option, ...] | None = None  # its options (``core.options``); None: read from ``fn``
    grammar: bool = False  # follows a grammar (structured output): every token it keeps is chosen masked
    # reuses a prompt cache (``core.prompt_cache``): its prompt pass reads the last position's state alone (or
    # asks for every position's: ``prefill_at(whole=True)``), and its KV cache ends holding exactly the keys and
    # values of the prompt and output
    prompt_cache: bool = False

    def __post_init__(self):
        if self.declared is None:
            object.__setattr__(self, "declared", O.infer(self.fn))

    @property
    def models(self) -> tuple[str, ...]:
        """The options that take a second model (a loaded model, or its name on the CLI)."""
        return tuple(o.name for o in self.declared if o.kind == "model")

    def options(self) -> dict[str, object]:
        """Option name -> default (``core.options.REQUIRED`` where there is none)."""
        return {o.name: o.default for o in self.declared}

    def check_options(self, options: dict, config=None, cli: str = "", partial: bool = False) -> dict:
        """``options`` checked against the declarations (``core.options.check``); model-dependent
        bounds only with the model's ``config``."""
        return O.check(self.name, self.declared, options, config, cli, partial)


class UnknownMethod(GenerationError, KeyError):
    """A method name that is not registered: the message names the known ones."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(dict):
    """Method name -> ``Method``; an unknown name raises ``UnknownMethod`` naming the known ones."""

    def __missing__(self, name):
        raise UnknownMethod(f"unknown method {name!r}: choose one of {', '.join(sorted(self))}")


METHODS: Registry = Registry()


def register(
    name: str,
    *,
    batched: bool = False,
    sampling: bool = False,
    default_sample: bool = False,
    exact: bool = False,
    options: tuple[O.Option, ...] = (),
    grammar: bool = False,
    prompt_cache: bool = False,
):
    """Register ``fn(run, **options)`` under ``name``; ``options`` declares every keyword option of
    ``fn`` with the same name and default (checked here, so the declarations cannot drift).  Without
    ``options``, they are read from the signature (``core.options.infer``: types from the defaults)."""

    def deco(fn):
        declared = options or O.infer(fn)
        _match_signature(name, fn, declared)
        summary = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, one line
        METHODS[name] = Method(
            name, fn, batched, sampling, default_sample, summary, exact, tuple(declared), grammar, prompt_cache
        )
        return fn

    return deco


def _match_signature(name: str, fn: Callable, options: tuple[O.Option, ...]) -> None:
    params = list(inspect.signature(fn).parameters.values())[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):  # no declaration can name what they take
            star = "*" if p.kind == p.VAR_POSITIONAL else "**"
            raise TypeError(
                f"method {name!r}: options are named keyword parameters, and {star}{p.name} names none: write each "
                f"option as a keyword parameter with its default (def {fn.__name__}(run, *, n=2)), declared with "
                "options=(...) or read from the signature"
            )
    have = {p.name: p.default for p in params}
    want = {o.name: o.default for o in options}
    if have != want:
        raise TypeError(f"method {name!r}: its declared options {want} differ from its signature's {have}")


def row_seed(seed: int, i: int) -> int:
    """The seed of the row of prompt index ``i`` in a call seeded with ``seed``: ``seed + i``, wrapped
    into ``[0, 2**32)`` (every value a valid ``seed``)."""
    return (seed + i) % 2**32


def row_generators(gen: GenerationConfig, indices, device) -> list[torch.Generator | None]:
    """One generator per row when sampling: the row of prompt index ``i`` (``indices[row]``) is seeded with
    ``row_seed(seed, i)``, so a row samples what its prompt decoded alone with that seed samples,
    whatever its batch-mates (``auto`` with more than one kind of call excepted: its rows share each
    round's kind, so a row can draw other drafts than its prompt alone, and sample other tokens from the
    same distribution).  Without a seed, the base seed is drawn from torch's global generator
    (``torch.manual_seed`` still makes a call reproducible).  Greedy decoding draws nothing."""
    if not gen.do_sample:
        return [None for _ in indices]
    seed = gen.seed
    if seed is None:
        seed = int(torch.randint(0, 2**32, (1,)))
    return [torch.Generator(device=device).manual_seed(row_seed(seed, i)) for i in indices]


class Run:
    """One ``generate`` call: the model, prompts, configuration, and the meters.  ``indices`` are the
    prompt indices of the rows (default ``0..B-1``); they seed the rows' generators (``row_generators``)."""

    def __init__(
        self,
        model: Transformer,
        prompts: list[list[int]],
        gen: GenerationConfig,
        indices: list[int] | None = None,
        prompt_cache: PromptCache | None = None,
    ):
        self.model = model
        self.prompts = prompts
        self.gen = gen
        self.batch = len(prompts)
        self.generators = row_generators(gen, range(self.batch) if indices is None else indices, model.device)
        # structured output: each row's grammar state (None: unconstrained)
        self.constraints = gen.grammar.start(model, self.batch, gen.eos_ids) if gen.grammar is not None else None
        # logits processors (penalties, biases): each row's history (None: none asked for)
        self.histories = histories(gen, prompts, gen.eos_ids)
        self.out: list[list[int]] = [[] for _ in prompts]
        # with gen.logprobs: each row's tokens' log probabilities (one per token of ``out``), and those of
        # the tokens chosen and not yet emitted (``capture``)
        self.logprobs: list[list[Raw]] | None = None if gen.logprobs is None else [[] for _ in prompts]
        self.captured: list[list[Raw]] = [[] for _ in prompts]
        self.finished = [False] * self.batch
        self.reasons: list[str | None] = [None] * self.batch  # why each row ended (GenerationResult.finish_reason)
        self.model_calls = 0
        self.layer_evals = [0] * self.batch
        self.layer_calls = [0] * self.batch  # model calls over a layer range each row took part in
        self.prompt_layer_evals = [0] * self.batch
        self.records: dict[type, list[Record]] = {}  # a method's own statistics: kind -> one record per row
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        # prompt caching (``core.prompt_cache``): the cache the first prompt pass reuses from, each row's
        # prompt tokens it reused, and the KV cache that pass filled (whose entries ``keep_prompts`` stores)
        self.prompt_cache = prompt_cache
        self.cached = [0] * self.batch
        self.kv: KVCache | None = None

    def record(self, per_row: list[Record]) -> None:
        """A method's own statistics: one record per row, all of one kind (``core.stats``)."""
        kinds = {type(r) for r in per_row}
        if len(per_row) != self.batch or len(kinds) != 1 or not kinds <= set(RECORD_FIELDS):
            raise ValueError(f"record one core.stats record of one kind per row ({self.batch}), got {per_row!r}")
        self.records[type(per_row[0])] = list(per_row)

    def record_all(self, record: Record) -> None:
        """A record the whole batch shares (a second model's meters)."""
        self.record([record] * self.batch)

    # -- model access (counted) --------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.model.config.n_layers

    def new_cache(self, extra: int = 0) -> KVCache:
        """A cache for the prompts plus ``max_new_tokens`` plus ``extra`` slots (drafts, trees)."""
        longest = max(len(p) for p in self.prompts)
        return self.model.new_cache(self.batch, longest + self.gen.max_new_tokens + extra + 1)

    def positions(self, cache: KVCache, n_new: int, layer: int = 0) -> torch.Tensor:
        """Rotary positions ``[B, S]`` for ``n_new`` tokens appended to ``layer``."""
        base = cache.lengths[layer] - cache.pad  # [B]
        return (base.unsqueeze(1) + torch.arange(n_new)).to(self.model.device)

    def forward(
        self,
        cache: KVCache | None,
        ids: torch.Tensor | None = None,
        h: torch.Tensor | None = None,
        start: int = 0,
        end: int | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        count_call: bool = True,
        rows=None,
    ) -> torch.Tensor:
        """One model call over layers ``[start, end)`` from ``ids`` (embedded) or hidden ``h``.
        Returns the hidden state after layer ``end - 1``.  ``rows``: the rows with work in the call (the
        others ride along padded; default every row), whose ``layer_calls`` it counts."""
        end = self.n_layers if end is None else end
        if h is None:
            h = self.model.embed(ids)
        S = h.shape[1]
        if positions is None:
            positions = self.positions(cache, S, start)
        h = self.model.run_layers(h, start, end, positions, cache, mask)
        self.count(end - start, S, call=count_call)
        for row in range(self.batch) if rows is None else rows:
            if end > start and not self.finished[row]:
                self.layer_calls[row] += 1
        return h

    def count(self, n_layers: int, n_positions: int, call: bool = True) -> None:
        """Record ``n_layers`` layers applied to ``n_positions`` positions of every unfinished row."""
        self.model_calls += int(call)
        for row in range(self.batch):
            if not self.finished[row]:
                self.layer_evals[row] += n_layers * n_positions

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.logits(h)

    def padded_prompts(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left padded to the longest (with EOS, never attended to) -> (token ids
        ``[B, T]``, rotary positions ``[B, T]``) on the model's device; sets ``cache.pad``."""
        longest = max(len(p) for p in self.prompts)
        eos = self.model.config.eos_token_ids
        ids = torch.full((self.batch, longest), eos[0] if eos else 0, dtype=torch.long)
        for row, p in enumerate(self.prompts):
            ids[row, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
            cache.pad[row] = longest - len(p)
        positions = (torch.arange(longest).unsqueeze(0) - cache.pad.unsqueeze(1)).clamp(min=0)
        return ids.to(self.model.device), positions.to(self.model.device)

    def prefill(self, cache: KVCache, end: int | None = None) -> torch.Tensor:
        """Run the (left-padded) prompts through layers ``[0, end)``; returns the hidden state of the
        last prompt position ``[B, 1, D]`` (``prefill_at`` for states at more layers)."""
        return self.prefill_at(cache, (self.n_layers if end is None else end,))[-1][:, -1:]

    def prefill_at(self, cache: KVCache, stops: tuple[int, ...], whole: bool = False) -> list[torch.Tensor]:
        """Run the (left-padded) prompts through layers ``[0, stops[-1])``; -> the hidden states of
        every prompt position ``[B, T, D]`` after each layer of ``stops`` (ascending).  Counted as one
        model call; the layer evaluations of all but the last prompt position are reported apart
        (``prompt_layer_evals``), the last one's count towards the first new token, so greedy costs
        exactly ``n_layers`` per token.

        With a ``prompt_cache``, the first prompt pass of the run reuses the cached keys and values of
        the prompts' prefixes (``reuse_prompts``) and runs only the last ``S <= T`` positions: the states
        returned are then ``[B, S, D]``, the last position's the same.  ``whole``: the caller reads every
        prompt position's state, so nothing is reused."""
        ids, positions = self.padded_prompts(cache)
        skip = 0
        if self.prompt_cache is not None and self.kv is None:
            self.kv = cache
            if not whole:
                skip = self.reuse_prompts(cache)
        if skip:
            ids, positions = ids[:, skip:], positions[:, skip:]
        h, start, states = self.model.embed(ids), 0, []
        for stop in stops:
            h = self.model.run_layers(h, start, stop, positions, cache)  # [B, T, D]
            states.append(h)
            start = stop
        self.model_calls += 1
        for row, p in enumerate(self.prompts):
            # the last prompt position predicts the first new token: its layers count as generation
            self.prompt_layer_evals[row] += start * (len(p) - 1 - self.cached[row])
            self.layer_evals[row] += start
            self.layer_calls[row] += 1  # (one call per token for greedy)
        if sum(map(len, self.prompts)) >= LONG_PROMPT_PASS:
            release_freed_memory()  # else the pass's freed buffers stay resident while decoding (~1 ms)
        return states

    def reuse_prompts(self, cache: KVCache) -> int:
        """Fill ``cache`` (left padded by ``padded_prompts``, ``T`` slots wide) with the cached keys and
        values of each row's longest cached prefix, as far as one prompt pass over the last ``S`` slots of
        every row allows: ``S`` is the largest number of tokens any row has left to run, so a row reuses
        ``len(prompt) - S`` tokens (a row without a cached prefix makes every row run its whole prompt).
        Sets ``cached`` and the cache's lengths; -> ``T - S``, the slots the pass skips."""
        pc, T = self.prompt_cache, max(len(p) for p in self.prompts)
        found = [pc.lookup(self.model, p, cache.k.dtype, cache.k.device, count=False) for p in self.prompts]
        S = max(len(p) - n for p, (_, n) in zip(self.prompts, found))
        for row, (p, (entry, _)) in enumerate(zip(self.prompts, found)):
            n, pad = max(0, len(p) - S), int(cache.pad[row])
            if n:
                cache.k[:, row, :, pad : pad + n].copy_(entry.k[:, :, :n])
                cache.v[:, row, :, pad : pad + n].copy_(entry.v[:, :, :n])
            self.cached[row] = n
            pc.count(n)  # what the row reuses: a row may find more than the pass lets it
        if S >= T:
            return 0
        cache.lengths.fill_(T - S)
        return T - S

    def keep_prompts(self, rows: list[int] | None = None) -> None:
        """Store each row's prompt and output with their keys and values in the ``prompt_cache`` (the
        slots of the KV cache the first prompt pass filled that hold them in every layer), then lets that cache
        go.  Only a method whose cache then holds exactly those tokens' keys and values calls for it
        (``Method.prompt_cache``)."""
        cache, self.kv = self.kv, None  # (a Decoding kept after its end keeps its run, not the whole KV cache)
        if self.prompt_cache is None or cache is None:
            return
        for row in range(self.batch) if rows is None else rows:
            tokens = self.prompts[row] + self.out[row]
            pad = int(cache.pad[row])
            n = min(len(tokens), int(cache.lengths[:, row].min()) - pad)
            if n > 0:
                k, v = cache.k[:, row, :, pad : pad + n], cache.v[:, row, :, pad : pad + n]
                self.prompt_cache.store(self.model, tokens[:n], k, v)

    # -- token choice and output ---------------------------------------------------------------
    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits -> ``[B]`` tokens, greedy or sampled as configured (after the logits processors
        over each row's history, ``core.processors``, and from the tokens each row's grammar allows, under one)."""
        g = self.gen
        raw = logits
        if self.histories is not None:
            logits = apply_rows(self.histories, logits)
        if self.constraints is not None:
            logits = mask_rows(self.constraints, logits)
        if self.histories is not None and self.histories[0].filters:
            logits = self.check_left(logits)
        if not g.do_sample:
            tokens = torch.tensor(sampling.top_ids(logits), device=logits.device)  # argmax's ids, numpy's speed
        else:
            p = sampling.probs(logits, g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p)  # [B, V]
            tokens = torch.cat([sampling.sample(p[row : row + 1], gen) for row, gen in enumerate(self.generators)])
        if self.logprobs is not None:
            for row, t in enumerate(tokens.tolist()):
                self.capture(row, raw[row : row + 1], [t])
        return tokens

    def check_left(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` processed (and masked) logits, refused where the token filters (with the grammar) leave an
        unfinished row no token; a finished row's (its token is dropped) made finite, so that sampling draws no NaN."""
        empty = none_left(logits)
        if not bool(empty.any()):
            return logits
        for row in empty.nonzero().flatten().tolist():
            if not self.finished[row]:
                raise NoTokenLeft(none_left_message(self.histories[row], self.constraints is not None))
        return logits.masked_fill(empty.unsqueeze(1), 0.0)

    def capture(self, row: int, logits: torch.Tensor, tokens: list[int]) -> None:
        """With ``gen.logprobs``: the log probabilities of ``tokens``, chosen for ``row`` from ``logits``
        ``[n, V]`` (the model's own, before any processor, warp or mask: ``core.logprobs``), for its next
        ``emit``."""
        if self.logprobs is not None and not self.finished[row]:
            self.captured[row] = capture(logits, tokens, self.gen.logprobs)

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append accepted tokens to ``row`` (stopping at EOS, the budget, or the end of the row's grammar; before
        a stop token); True when the row is done."""
        if self.finished[row]:
            return True
        if self.t_first is None and tokens:
            self.t_first = time.perf_counter()
        out = self.out[row]
        before = len(out)
        grammar = None if self.constraints is None else self.constraints[row]
        history = None if self.histories is None else self.histories[row]
        for t in tokens:
            if int(t) in self.gen.stop_token_ids:  # ends before it
                self.finished[row], self.reasons[row] = True, "stop"
                break
            if grammar is not None:
                grammar.advance(t)
            if history is not None:
                history.push(t)
            out.append(int(t))
            if (self.gen.stop_at_eos and int(t) in self.gen.eos_ids) or (grammar is not None and grammar.stopped):
                self.finished[row], self.reasons[row] = True, "stop"
                break
            if len(out) >= self.gen.max_new_tokens:
                self.finished[row], self.reasons[row] = True, "length"
                break
        if self.logprobs is not None:
            self._keep_logprobs(row, out[before:])
        return self.finished[row]

    def _keep_logprobs(self, row: int, tokens: list[int]) -> None:
        """The captured log probabilities of the ``tokens`` just emitted (a method that emits tokens it did
        not ``capture``, a registered one that chooses them itself, is refused: it would report wrong numbers)."""
        got, self.captured[row] = self.captured[row], []
        if [t for t, _, _ in got[: len(tokens)]] != tokens:
            raise GenerationError(
                f"this method emitted tokens {tokens} without their log probabilities: a method reports them "
                "where it chooses its tokens (Run.choose, or Run.capture before Run.emit); leave logprobs out"
            )
        self.logprobs[row].extend(got[: len(tokens)])

    def emit_all(self, tokens: torch.Tensor) -> bool:
        """Append one token per row ``[B]``; True when every row is done."""
        for row, t in enumerate(tokens.tolist()):
            self.emit(row, [t])
        return all(self.finished)

    def cancel(self, row: int) -> None:
        """Stop ``row``: it keeps the tokens it has, and the method stops once every row is done."""
        if not self.finished[row]:
            self.finished[row], self.reasons[row] = True, "cancelled"

    def remaining(self, row: int = 0) -> int:
        return self.gen.max_new_tokens - len(self.out[row])

    @property
    def done(self) -> bool:
        return all(self.finished)


def chat_token_ids(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}, ...]``) under the tokenizer's chat template, with
    ``tools`` (OpenAI's tool definitions) passed to it when given (newer `transformers` return a mapping with
    ``input_ids``, older ones a list); ``add_special_tokens``: the template's text tokenized with the tokenizer's
    special tokens (a BOS) on top of the template's own, as vLLM's field of that name.  A template that does not
    parse, or refuses the messages (its ``raise_exception``), is a ``GenerationError`` saying so."""
    import jinja2

    kw = {} if tools is None else {"tools": tools}
    try:
        if add_special_tokens:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
            )
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kw
            )
    except jinja2.TemplateSyntaxError as e:
        raise GenerationError(
            f"the model's chat template does not parse (line {e.lineno}: {e.message}): repair its chat template "
            "(tokenizer.chat_template), or give the prompt as it is, without chat=True (--chat)"
        ) from None
    except jinja2.TemplateError as e:
        raise GenerationError(f"the model's chat template refused the messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def rounds(fn: Callable, run: Run, options: dict):
    """Run the method function ``fn``, yielding after each of its rounds (a plain function is one
    round).  Only the method's own code runs under ``torch.inference_mode``, not the caller's
    between rounds."""
    with torch.inference_mode():
        steps = fn(run, **options)
    if not inspect.isgenerator(steps):
        return
    try:
        while True:
            with torch.inference_mode():
                try:
                    next(steps)
                except StopIteration:
                    return
            yield
    finally:
        steps.close()


def drive(fn: Callable, run: Run, **options) -> None:
    """Run the method function ``fn`` on ``run`` to the end."""
    for _ in rounds(fn, run, options):
        pass
