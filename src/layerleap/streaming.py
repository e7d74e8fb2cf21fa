"""Streaming text as tokens are accepted: ``layerleap.stream`` and the incremental detokenizer.

``stream(model, prompt, method=...)`` drives a ``Decoding`` round by round (no threads) and yields
the text each round added; a drafting method that accepts several tokens in one round yields them
as one piece.  The pieces join to exactly ``result.text``: a piece is cut from the decoding of all
tokens so far, and a trailing incomplete UTF-8 character (which the tokenizer decodes as U+FFFD)
is held back until the tokens that complete it arrive, and so is the text of a trailing run of
byte-fallback tokens (``<0x0A>``), which a later byte can still turn into U+FFFD.
"""

from __future__ import annotations

import re

from .decoding import Decoding
from .core.run import GenerationError, GenerationResult
from .core.model import Transformer

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token (SentencePiece-style vocabularies)


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


class TextStream:
    """An iterable of text pieces for one prompt; ``result`` (a ``GenerationResult``) is set once the
    iteration has ended.  Made by ``stream``."""

    def __init__(self, decoding: Decoding):
        if decoding.many:
            raise GenerationError("stream decodes one prompt: give one prompt, or use generate for a list")
        self.decoding = decoding
        self.pieces = TextPieces(decoding.model.tokenizer)
        self.result: GenerationResult | None = None
        self._pieces = None  # the one iteration: iterating again resumes it

    def __iter__(self):
        """The pieces, as one iterator however often this is called: a loop left with ``break``
        resumes where it stopped, one after the end yields nothing; closing it stops the decoding."""
        if self._pieces is None:
            self._pieces = self._iterate()
        elif self.result is None and self._pieces.gi_frame is None:
            raise GenerationError(
                "this stream stopped before its end (an error, an interrupt or a closed iterator): "
                "start a new one (layerleap.stream again)"
            )
        return self._pieces

    def _iterate(self):
        d = self.decoding
        try:
            for _ in d:
                piece = self.pieces.push(d.tokens(0))
                if piece:
                    yield piece
        except GeneratorExit:
            d.close()
            raise
        self.result = d.results[0]
        rest = self.pieces.finish(self.result.token_ids)
        if rest:
            yield rest


def stream(model: Transformer, prompt, method: str = "greedy", max_new_tokens: int = 64, **kwargs) -> TextStream:
    """Generate like ``generate`` (same arguments) for one prompt and yield the text as it is accepted:

    >>> s = layerleap.stream(model, "Hello", method="self-spec", max_new_tokens=32)
    >>> for piece in s: print(piece, end="", flush=True)
    >>> s.result.stats
    """
    return TextStream(Decoding(model, prompt, method, max_new_tokens, **kwargs))
