"""Text of a growing token list: the incremental detokenizer (``TextPieces``) and stop strings
(``StopText``, ``tokens_through``), shared by ``generate``'s ``stop=``, ``layerleap.stream`` and the
server's ``stop``.

A stop string ends the text before it (it is not returned, as OpenAI does), at the match that is
complete first; the tokens kept are the fewest whose text holds the whole stop string, which is what
decoding token by token makes before it stops, whatever a drafting round accepted past it.  A stop
string that ends inside a token keeps that token; one that ends in a character of several tokens keeps
the tokens through the one that completes it.
"""

from __future__ import annotations

import math

import re

from .. import validate as V
from .run import GenerationError

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token (SentencePiece-style vocabularies)
MAX_STOPS = 4  # stop strings in one call or request (OpenAI's limit)


class TextPieces:
    """Incremental detokenization of one growing token list: ``push(tokens)`` returns the text the
    new tokens completed ("" while a character is incomplete), ``finish(tokens)`` the rest; the
    pieces join to ``tokenizer.decode(tokens, skip_special_tokens=True)``."""

    def __init__(self, tokenizer):
        if tokenizer is None:
            raise GenerationError("this model has no tokenizer: streaming needs one to decode text")
        self.tokenizer = tokenizer
        self.sent = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        text = self._decode(tokens[: len(tokens) - self._unsettled(tokens)])
        if text.endswith(REPLACEMENT) or not text.startswith(self.sent):
            return ""  # an incomplete character (or a tokenizer that rewrote the tail): wait for more
        return self._take(text)

    def _unsettled(self, tokens: list[int]) -> int:
        """How many of the last ``tokens`` may still decode otherwise: a run of byte-fallback tokens (and
        the tokens without text among them, special ones).  A byte-fallback decoder joins such a run
        into one UTF-8 sequence and, when it is broken (a character cut by the end, or by the next
        ordinary token), turns every byte of it into U+FFFD: a newline ``<0x0A>`` followed by the
        first byte of an emoji decodes to two U+FFFD, not to the newline already decoded."""
        n = len(tokens)
        while n:
            piece = self.tokenizer.convert_ids_to_tokens(int(tokens[n - 1]))
            if not (isinstance(piece, str) and BYTE_TOKEN.fullmatch(piece)) and self._decode(tokens[n - 1 : n]):
                break
            n -= 1
        return len(tokens) - n

    def finish(self, tokens: list[int]) -> str:
        text = self._decode(tokens)
        if not text.startswith(self.sent):
            raise GenerationError(
                "the tokenizer decoded a token sequence to text that does not extend the "
                "text already streamed: this tokenizer cannot be streamed"
            )
        return self._take(text)

    def _take(self, text: str) -> str:
        piece, self.sent = text[len(self.sent) :], text
        return piece


class StopText:
    """Stop strings: text passes through until one of ``stops`` appears, which ends the text
    (the stop string itself is not returned, unless ``keep``: vLLM's ``include_stop_str_in_output``).
    A tail that could start a stop string is held back until the next piece tells."""

    def __init__(self, stops: list[str], keep: bool = False):
        self.stops = [s for s in stops if s]
        self.keep = keep
        self.held = ""
        self.hit = False
        self.seen = 0  # characters pushed so far
        self.end: int | None = None  # once hit: where the stop string ends in all the text pushed
        self.string: str | None = None  # once hit: the stop string found
        # a stop string that ends at or before this character of all the text pushed does not count (the
        # server's min_tokens: the text of the tokens before the min_tokens-th; None: every one counts)
        self.floor: float | None = None

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self.held + piece
        self.seen += len(piece)
        # the match that ends first (the longer one where two end together), as text pushed character by
        # character would find it: the cut does not depend on how the text came in pieces
        base = self.seen - len(text)  # where ``text`` starts in all the text pushed
        found = [(i + len(s), i, s) for s in self.stops for i in self._matches(text, s, base)]
        if found:
            end, at, self.string = min(found, key=lambda f: (f[0], f[1]))
            self.hit, self.held = True, ""
            self.end = base + end
            return text[:end] if self.keep else text[:at]
        keep = max((j for s in self.stops for j in range(1, len(s)) if text.endswith(s[:j])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _matches(self, text: str, s: str, base: int):
        """Where ``s`` first occurs in ``text`` ending past the floor (none, or one place)."""
        i = text.find(s)
        while i >= 0 and self.floor is not None and base + i + len(s) <= self.floor:
            i = text.find(s, i + 1)
        return (i,) if i >= 0 else ()

    def finish(self) -> str:
        out, self.held = self.held, ""
        return "" if self.hit else out


def hold_off(stop: StopText, least: int, toks: list[int], tokenizer) -> None:
    """vLLM's ``min_tokens`` rule for stop strings: none counts before ``least`` tokens, so one that ends in
    the text of the tokens before the ``least``-th does not (all the text so far, until there are that
    many): sets ``stop.floor`` once the row has those tokens."""
    if least > 1 and stop.stops and (stop.floor is None or stop.floor == math.inf):
        enough = len(toks) >= least - 1 and tokenizer is not None
        stop.floor = len(tokenizer.decode(toks[: least - 1], skip_special_tokens=True)) if enough else math.inf


def tokens_through(toks: list[int], tokenizer, end: int) -> int:
    """The fewest of ``toks`` whose text holds its first ``end`` characters (a stop string that ends
    there, ``StopText.end``): what decoding token by token would have made (a drafting round may have
    accepted tokens past it).  A stop string that ends in a character of several tokens is held through
    the token that completes it."""
    through = tokenizer.decode(toks, skip_special_tokens=True)[:end]  # the text through the stop

    def holds(n: int) -> bool:
        return tokenizer.decode(toks[:n], skip_special_tokens=True).startswith(through)

    lo, hi = 1, len(toks)
    while lo < hi:  # the text only grows with the tokens: the first length whose text holds it all
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    # but not inside a run of byte-fallback tokens, which decodes to U+FFFD while it is broken (a newline
    # <0x0A> followed by an emoji's first byte): the fewest may be earlier in the run that ends at hi
    start = hi - 1
    while start > 0 and BYTE_TOKEN.fullmatch(str(tokenizer.convert_ids_to_tokens(int(toks[start - 1])))):
        start -= 1
    return next((n for n in range(start + 1, hi) if holds(n)), hi)


def check_stops(stop) -> list[str]:
    """``generate``'s ``stop``: None, a string or a list of at most ``MAX_STOPS`` non-empty strings -> the list."""
    fix = f"give a non-empty string or a list of at most {MAX_STOPS} of them"
    if stop is None:
        return []
    one = isinstance(stop, str)
    if one:
        stop = [stop]
    elif not isinstance(stop, (list, tuple)):
        raise GenerationError(f"stop must be a string or a list of strings, got {V.show(stop)}: {fix}")
    if len(stop) > MAX_STOPS:
        raise GenerationError(f"stop holds {len(stop)} strings, more than {MAX_STOPS}: {fix}")
    for i, s in enumerate(stop):
        name = "stop" if one else f"stop[{i}]"
        with V.raising(GenerationError):
            V.text(s, name)
        if not s:
            raise GenerationError(f"{name} is empty, which would end every text before it starts: {fix}")
    return list(dict.fromkeys(stop))
