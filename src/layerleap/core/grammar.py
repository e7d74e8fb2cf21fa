"""Structured output: a grammar that every chosen token must follow, as a token mask over the logits.

A ``Grammar`` names what the output must be: JSON (any object, or one that a JSON schema describes),
a regular expression, one of a list of strings, or a context-free grammar (llama.cpp's GBNF, or
Lark).  ``Grammar.start`` gives each row of a batch its own ``Constraint``: the grammar's state after
the row's tokens so far (an ``llguidance`` matcher over the model's tokenizer).  Decoding then
chooses every token from the masked logits (``Constraint.mask``: the tokens the grammar forbids get
-inf), so greedy decoding picks the likeliest allowed token and sampling samples from the allowed
tokens renormalised.

Draft-and-verify methods stay lossless under a grammar: verification masks the target's logits
at every node of the candidate tree with the grammar's state after that node's path
(``Constraint.tree_masks``), so greedy acceptance keeps exactly the tokens constrained greedy
decoding picks, and sampling accepts by the masked distributions.  Tokens the grammar forces (the
``": "`` after a key, a closing quote) are known without the model: ``Constraint.draft`` puts them
into a chain's drafts, after the part of the drafter's own chain the grammar allows.

JSON is written on one line, with ``", "`` and ``": "`` between items (a schema's own
``"x-guidance"`` options override that).  ``llguidance`` is an optional dependency
(``pip install 'layerleap[grammar]'``).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..validate import InputError
from .tokenizer import Tokenizer

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
KINDS = ("json", "regex", "choice", "gbnf")
INSTALL = "structured output needs llguidance: pip install 'layerleap[grammar]'"


class GrammarError(InputError):
    """A grammar that cannot be used: the message names the problem and the fix."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise GrammarError(INSTALL) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must be: ``kind`` ("json", "regex", "choice", "gbnf") and its ``text`` (a JSON
    schema as JSON text, "" for any JSON object; a regular expression; the choices as a JSON list; a
    GBNF or Lark grammar).  Make one with ``Grammar.json``, ``regex``, ``choice``, ``gbnf`` or
    ``from_response_format``."""

    kind: str
    text: str

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "Grammar":
        """JSON: any JSON object (``schema`` None), or one that the JSON schema ``schema`` describes."""
        if schema is None:
            return cls("json", "")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:  # RecursionError: brackets nested past the parser's depth
                why = e if isinstance(e, ValueError) else "brackets nested too deep"
                raise GrammarError(f"the JSON schema is not valid JSON ({why}): give a JSON object") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        try:  # key order kept: properties are written in the order given
            return cls("json", json.dumps(schema, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as e:  # a set, bytes, NaN: not JSON; nested too deep
            if isinstance(e, RecursionError):
                raise GrammarError("the JSON schema is nested too deep: give a flatter schema") from None
            raise GrammarError(
                f"the JSON schema holds a value that is not JSON ({e}): use dicts, lists, "
                "strings, finite numbers, booleans and None"
            ) from None

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Text that the regular expression ``pattern`` matches in full (Rust ``regex`` syntax)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regular expression is a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options) -> "Grammar":
        """Exactly one of the strings ``options``."""
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(s, str) for s in options):
            raise GrammarError("the choices are a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def gbnf(cls, grammar: str) -> "Grammar":
        """A context-free grammar in llama.cpp's GBNF (``root ::= ...``) or in Lark (``start: ...``)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("a grammar is a non-empty string of GBNF (root ::= ...) or Lark (start: ...) rules")
        return cls("gbnf", grammar)

    @classmethod
    def from_response_format(cls, response_format: dict) -> "Grammar | None":
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no grammar), ``{"type":
        "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""
        rf = response_format
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json()
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise GrammarError('json_schema must be an object with the schema under "schema"')
            return cls.json(spec.get("schema", {}))
        raise GrammarError(
            'the type must be "text", "json_object" or "json_schema" (with "json_schema": {"name", "schema"})'
        )

    def source(self) -> str:
        """The grammar in llguidance's form."""
        ll = _llguidance()
        try:
            if self.kind == "json":
                schema = json.loads(self.text) if self.text else {"type": "object"}
                return ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return ll.LLMatcher.grammar_from_regex(self.text)
            if self.kind in ("choice", "gbnf"):
                return ll.grammar_from(self.kind, self.text)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"cannot read the {self.kind} grammar: {_first_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {self.kind!r}: choose one of {', '.join(KINDS)}")

    def check(self) -> "Grammar":
        """This grammar, or a GrammarError where llguidance cannot read it: checked without a model (a
        regular expression's syntax, a GBNF rule), so a command refuses it before loading one."""
        error = _llguidance().LLMatcher.validate_grammar(self.source(), None)
        if error:
            raise GrammarError(f"cannot compile the {self.kind} grammar: {_first_line(error)}")
        return self

    def start(self, model, rows: int, eos_ids: tuple[int, ...]) -> list["Constraint"]:
        """One ``Constraint`` per row, at the grammar's start (GrammarError for a grammar that cannot be
        compiled, or a model without a fast tokenizer)."""
        proto = _matcher(model, self, tuple(eos_ids))
        return [Constraint(proto.deep_copy(), model.config.vocab_size) for _ in range(rows)]


def _first_line(e: BaseException | str) -> str:
    """An error's text on one line (at most 300 characters)."""
    text = " ".join(str(e).split())
    return (text[:299] + "…" if len(text) > 300 else text) or type(e).__name__


# -- llguidance's tokenizer and compiled grammars, kept per model ------------------------------------
class _Compiled:
    """One model's llguidance objects: its tokenizer's view per set of end-of-sequence ids, and its
    compiled grammars (the last ``MAX_COMPILED`` used).  Kept beside the model, so they go with it;
    ``source`` is the tokenizer object they were built from (another one assigned to the model
    starts anew)."""

    def __init__(self, source):
        self.source = source
        self.tokenizers: dict[tuple[int, ...], object] = {}
        self.matchers: "OrderedDict[tuple, object]" = OrderedDict()  # (eos ids, grammar) -> start matcher


_LOCK = threading.Lock()
_MODELS: "weakref.WeakKeyDictionary[object, _Compiled]" = weakref.WeakKeyDictionary()
MAX_COMPILED = 64  # compiled grammars kept per model


def _cache(model) -> _Compiled:
    """The model's llguidance objects (call under ``_LOCK``), for the tokenizer it has now."""
    kept = _MODELS.get(model)
    if kept is None or kept.source is not model.tokenizer:
        kept = _MODELS[model] = _Compiled(model.tokenizer)
    return kept


def _tokenizer(model, eos_ids: tuple[int, ...]):
    """llguidance's view of the model's tokenizer (about a second to build; kept per model)."""
    ll = _llguidance()
    with _LOCK:
        kept = _cache(model)
        if eos_ids not in kept.tokenizers:
            tok = model.tokenizer
            if tok is None:
                raise GrammarError("this model has no tokenizer: structured output needs one")
            tok = tok.hf if isinstance(tok, Tokenizer) else tok  # llguidance reads `transformers`' object
            vocab = model.config.vocab_size
            size = len(tok) if hasattr(tok, "__len__") else 0  # with its added tokens
            if size > vocab:
                raise GrammarError(
                    f"the tokenizer holds {size} tokens but the model's vocabulary only {vocab}: structured "
                    "output needs a tokenizer whose tokens the model can all produce (one without the added "
                    "tokens past the model's vocabulary)"
                )
            try:
                eos = list(eos_ids) or None
                kept.tokenizers[eos_ids] = ll.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
            except (ValueError, RuntimeError, TypeError) as e:
                raise GrammarError(
                    f"structured output needs a fast (Rust) Hugging Face tokenizer: {_first_line(e)}"
                ) from None
        return kept, kept.tokenizers[eos_ids]


def _matcher(model, grammar: Grammar, eos_ids: tuple[int, ...]):
    ll = _llguidance()
    kept, tok = _tokenizer(model, eos_ids)
    key = (eos_ids, grammar)
    with _LOCK:
        if key in kept.matchers:
            kept.matchers.move_to_end(key)
            return kept.matchers[key]
    source = grammar.source()
    try:
        m = ll.LLMatcher(tok, source, log_level=0)
    except (ValueError, RuntimeError, TypeError) as e:
        raise GrammarError(f"cannot compile the {grammar.kind} grammar: {_first_line(e)}") from None
    if m.is_error():
        raise GrammarError(f"cannot compile the {grammar.kind} grammar: {_first_line(m.get_error())}")
    probe = Constraint(m.deep_copy(), model.config.vocab_size)
    try:  # the first mask: a grammar that no text matches fails here, not while decoding
        probe.allowed()
    except RuntimeError:
        raise GrammarError(
            f"the {grammar.kind} grammar matches no text: no token can start it (a rule that only refers to "
            "itself, a pattern that matches nothing, a schema that refers only to itself)"
        ) from None
    with _LOCK:
        kept.matchers[key] = m
        while len(kept.matchers) > MAX_COMPILED:
            kept.matchers.popitem(last=False)
    return m


# -- one row's state ---------------------------------------------------------------------------------
class Constraint:
    """One row's grammar state: the tokens it allows next (``allowed``, ``mask``), the tokens it
    forces, and ``advance`` as tokens are chosen.  ``stopped`` once nothing but the end of the output
    can follow (the row then ends, with or without its end-of-sequence token)."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)  # one bit per token

    def allowed(self) -> torch.Tensor:
        """``[V]`` bool: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        if self.matcher.is_error():
            raise self._failure("the grammar matcher failed")
        bits = np.unpackbits(self.bits.numpy().view(np.uint8), bitorder="little")[: self.vocab]  # [V] 0/1
        return torch.from_numpy(bits.view(np.bool_))

    def _failure(self, what: str) -> Exception:
        """The matcher's error: a GrammarError naming the grammar's problem where its parser outgrew
        llguidance's limit (a grammar that nests without end), else a RuntimeError (a fault here)."""
        error = self.matcher.get_error() or ""
        if "Too many items" in error or str(self.matcher.stop_reason()) == "ParserTooComplex":
            return GrammarError(
                "the grammar grew past llguidance's parser limit while decoding: it nests without end, as a JSON "
                'schema does whose required properties lead back to the object itself (a "$ref" cycle through '
                '"required", or through an array with "minItems"), which no finite text matches: make a property '
                "on that cycle optional"
            )
        return RuntimeError(f"{what}: {error}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``[V]`` logits with the tokens the grammar forbids at -inf (a new tensor)."""
        return torch.where(self.allowed().to(logits.device), logits, float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise self._failure(f"token {int(token)} breaks the grammar")

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` tokens ``advance`` took."""
        if n:
            self.matcher.rollback(n)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def valid(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (from the current state) the grammar allows, in a row."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced_after(self, tokens: list[int]) -> list[int]:
        """The tokens the grammar forces after ``tokens`` (which it must allow)."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise self._failure("draft tokens break the grammar")
        try:
            return list(self.matcher.compute_ff_tokens())
        finally:
            if tokens:
                self.matcher.rollback(len(tokens))

    def draft(self, drafts: list[int], limit: int) -> list[int]:
        """A chain's drafts under the grammar: the longest prefix of ``drafts`` it allows, then the tokens
        it forces after that, ``limit`` at most."""
        kept = list(drafts[: self.valid(drafts[:limit])])
        if len(kept) < limit and not self.stopped:
            kept += self.forced_after(kept)
        return kept[:limit]

    def tree_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """``[1 + k, V]`` bool: row 0 the tokens allowed now, row ``1 + j`` those allowed after the path
        to draft ``j`` (``parents``: -1 for the first level, parents first).  A path the grammar
        breaks, or one after which nothing may follow, gets an all-True row: no token after it is ever
        kept, as the path's own token is forbidden at its parent, or ends the output."""
        rows = [self.allowed()]
        paths: list[list[int]] = []
        for j, p in enumerate(parents):
            path = (paths[p] if p >= 0 else []) + [int(tokens[j])]
            paths.append(path)
            n = self.matcher.try_consume_tokens(path)
            row = self.allowed() if n == len(path) else None
            if n:
                self.matcher.rollback(n)
            rows.append(row if row is not None and bool(row.any()) else torch.ones(self.vocab, dtype=torch.bool))
        return torch.stack(rows)  # [1 + k, V]


def mask_rows(constraints: list[Constraint | None], logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits with each constrained row masked by its grammar (unconstrained rows as given)."""
    if not any(c is not None for c in constraints):
        return logits
    return torch.stack([row if c is None else c.mask(row) for c, row in zip(constraints, logits)])
