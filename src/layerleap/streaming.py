"""Streaming text as tokens are accepted: ``layerleap.stream`` and the incremental detokenizer.

``stream(model, prompt, method=...)`` drives a ``Decoding`` round by round (no threads) and yields
the text each round added; a drafting method that accepts several tokens in one round yields them
as one piece.  The pieces join to exactly ``result.text``: a piece is cut from the decoding of all
tokens so far, and a trailing incomplete UTF-8 character (which the tokenizer decodes as U+FFFD)
is held back until the tokens that complete it arrive, and so is the text of a trailing run of
byte-fallback tokens (``<0x0A>``), which a later byte can still turn into U+FFFD.
"""

from __future__ import annotations

from .decoding import Decoding
from .core.run import GenerationError, GenerationResult
from .core.logprobs import TokenLogprob
from .core.model import Transformer
from .core.text import BYTE_TOKEN, REPLACEMENT, StopText, TextPieces, hold_off  # noqa: F401  (re-exported)


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

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With ``logprobs=N``: the log probabilities of the tokens decoded so far (``result.logprobs`` once
        the iteration has ended; a piece's tokens are those added since the last piece, though a piece's text
        can wait for a later token); None without."""
        return self.result.logprobs if self.result is not None else self.decoding.logprobs(0)

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
        stop = StopText(d.stops)  # the text before a stop string (a tail that may start one waits)
        tokenizer = d.model.tokenizer
        try:
            for _ in d:
                toks = d.tokens(0)
                hold_off(stop, d.gen.min_tokens, toks, tokenizer)  # no stop string before min_tokens, as generate's
                piece = stop.push(self.pieces.push(toks))
                if piece:
                    yield piece
        except GeneratorExit:
            d.close()
            raise
        self.result = d.results[0]
        hold_off(stop, d.gen.min_tokens, self.result.token_ids, tokenizer)
        rest = stop.push(self.pieces.finish(self.result.token_ids)) + stop.finish()
        if rest:
            yield rest


def stream(model: Transformer, prompt, method: str = "greedy", max_new_tokens: int = 64, **kwargs) -> TextStream:
    """Generate like ``generate`` (same arguments) for one prompt and yield the text as it is accepted:

    >>> s = layerleap.stream(model, "Hello", method="self-spec", max_new_tokens=32)
    >>> for piece in s: print(piece, end="", flush=True)
    >>> s.result.stats
    """
    return TextStream(Decoding(model, prompt, method, max_new_tokens, **kwargs))
