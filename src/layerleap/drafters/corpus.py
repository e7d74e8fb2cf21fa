"""A datastore of the model's own answers for drafting (REST, He et al. 2024): where the prompt and
the output so far hold no earlier occurrence of the last tokens, the draft is what followed them in
the datastore, the continuation most of its occurrences share.

A ``Corpus`` holds token sequences (the model's greedy answers to ShareGPT prompts, as ``layerleap
train data --self-distill`` writes them) end to end, ``SEP`` between them, and the start of every
position sorted by its first ``key_tokens`` tokens packed into one integer (``keys``, ``order``): the
occurrences of any n-gram are then a contiguous run of ``order``, found by two binary searches on
the packed prefix and, for n above ``key_tokens``, by comparing the rest of each candidate.  A draft
(``draft``) takes the longest suffix of the context, ``max_n`` down to ``min_n`` tokens long, that
occurs with a continuation, and walks the continuations of up to ``CAP`` occurrences token by token,
keeping at each step the token most of them agree on and the occurrences that have it: a frequency
path through REST's trie of continuations, one chain.  Drafts only propose: verification decides,
so every exact method that drafts from a corpus stays exact.

A corpus file is a safetensors file holding ``tokens`` (uint16 where the vocabulary fits, else
int32; ``SEP`` = the dtype's largest value between sequences) and metadata: ``format``
(``layerleap-corpus-1``), ``fingerprint`` and ``model`` (the model whose answers these are; another
model is refused), ``sequences``, ``tokens``, ``data`` and ``command``.  ``layerleap train corpus``
writes one; the shipped copies live in ``layerleap/data/corpus/`` and are found by fingerprint
(``get_corpus(model, "auto")``).

The methods' option ``corpus``: ``"auto"`` (the shipped corpus for this model, none where none
ships), ``"none"``, a corpus file or a loaded ``Corpus``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import validate as V
from ..core.cpu import released
from ..errors import LayerleapError
from ..files import read_made_for, save_safetensors
from ..loaded import per_model, shipped_or_file

FORMAT = "layerleap-corpus-1"
SHIPPED_DIR = Path(__file__).parent.parent / "data" / "corpus"
CHOICES = ("auto", "none")  # besides a file
COMMAND = "layerleap train corpus"
CAP = 256  # occurrences whose continuations a draft weighs
MAX_N = 8  # the longest n-gram a corpus looks up


class CorpusError(LayerleapError, ValueError):
    """A corpus that cannot be made or loaded: the message names the problem and the fix."""


class CorpusWarning(UserWarning):
    """``corpus="auto"`` on a model no corpus ships for: the method drafts without one."""


class Corpus:
    """Token sequences end to end for n-gram lookups (see the module docstring)."""

    def __init__(self, sequences, vocab_size: int, meta: dict | None = None):
        self.vocab_size = int(vocab_size)
        dtype = np.uint16 if self.vocab_size < np.iinfo(np.uint16).max else np.int32
        self.sep = int(np.iinfo(dtype).max)
        if isinstance(sequences, np.ndarray):  # already end to end, its dtype's largest value between
            arr = sequences.reshape(-1)
            tokens = np.where(arr == np.iinfo(arr.dtype).max, self.sep, arr).astype(dtype)
        else:
            parts = [np.append(np.asarray(s, dtype=np.int64), self.sep) for s in sequences if len(s)]
            tokens = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        real = tokens[tokens != self.sep]
        if len(real) and int(real.max()) >= self.vocab_size:
            raise CorpusError(
                f"the corpus holds token id {int(real.max())}, outside the model's vocabulary of "
                f"{self.vocab_size}: it was made for another model; write one for this model with `{COMMAND}`"
            )
        self.tokens = tokens  # [N]
        self.meta = dict(meta or {})
        self.sequences = int((tokens == self.sep).sum())
        bits = max(1, int(self.sep).bit_length())
        self.bits, self.key_tokens = bits, max(1, 63 // bits)
        self._padded = np.concatenate([tokens.astype(np.int32), np.full(MAX_N + 1, self.sep, np.int32)])
        self.keys, self.order = self._sort()  # [N] packed prefixes, ascending; [N] their positions

    def __len__(self) -> int:
        return len(self.tokens) - self.sequences

    def _pack(self, cols: list[np.ndarray]) -> np.ndarray:
        key = np.zeros_like(cols[0])
        for c in cols:
            key = (key << self.bits) | c
        return key

    def _sort(self) -> tuple[np.ndarray, np.ndarray]:
        n, p = len(self.tokens), self._padded
        cols = [p[j : j + n].astype(np.int64) for j in range(self.key_tokens)]
        # a SEP ends an n-gram: the packed digits after it stay SEP
        for j in range(1, self.key_tokens):
            cols[j] = np.where(cols[j - 1] == self.sep, self.sep, cols[j])
        keys = self._pack(cols)
        if self.bits <= 16:  # a stable radix sort per token, last first (1.3 M tokens, Zen 5: 37-47 against 72-75 ms)
            order = np.arange(n)
            for col in reversed(cols):
                order = order[np.argsort(col.astype(np.uint16)[order], kind="stable")]
            order = order.astype(np.int32)
        else:
            order = np.argsort(keys, kind="stable").astype(np.int32)
        return keys[order], order

    def occurrences(self, gram: list[int]) -> np.ndarray:
        """The start of every occurrence of ``gram`` (1 to ``MAX_N`` tokens) that a token follows, ordered
        by the tokens that follow (for grams of up to ``key_tokens`` tokens)."""
        n, kt = len(gram), self.key_tokens
        head = [int(t) for t in gram[:kt]]
        if any(not 0 <= t < self.vocab_size for t in gram):
            return np.zeros(0, np.int32)
        lo = hi = 0
        for j in range(kt):
            d = head[j] if j < len(head) else None
            lo = (lo << self.bits) | (0 if d is None else d)
            hi = (hi << self.bits) | (self.sep if d is None else d)
        a, b = np.searchsorted(self.keys, lo, "left"), np.searchsorted(self.keys, hi, "right")
        starts = self.order[a:b].astype(np.int64)
        for j in range(kt, n):  # the rest of a longer n-gram, candidate by candidate
            starts = starts[self._padded[starts + j] == gram[j]]
        return starts[self._padded[starts + n] != self.sep]  # a continuation follows

    def draft(self, context: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
        """Up to ``k`` tokens: the frequency path through the continuations of the longest suffix of
        ``context`` (``max_n`` down to ``min_n`` tokens) that occurs; [] when none does."""
        if k < 1 or not len(self.tokens):
            return []
        for n in range(min(max_n, MAX_N, len(context)), min_n - 1, -1):
            starts = self.occurrences(context[len(context) - n :])
            if len(starts):
                step = -(-len(starts) // CAP)  # an even spread of the occurrences, ordered by what follows
                return self._path(starts[::step] + n, k)
        return []

    def _path(self, at: np.ndarray, k: int) -> list[int]:
        cont = self._padded[np.minimum(at[:, None] + np.arange(k), len(self._padded) - 1)]  # [m, k]
        chain: list[int] = []
        for d in range(k):
            col = cont[:, d]
            col = col[col != self.sep]
            if not len(col):
                break
            ids, counts = np.unique(col, return_counts=True)
            tok = int(ids[counts.argmax()])
            chain.append(tok)
            cont = cont[cont[:, d] == tok]
        return chain


# -- files ----------------------------------------------------------------------------------------
def save(path, model, sequences, meta: dict) -> Path:
    """Write a corpus file of ``sequences`` (token id lists) for ``model`` atomically (``meta``: data, command)."""
    import torch

    c = Corpus(sequences, model.config.vocab_size)
    full = {
        **{k: v for k, v in meta.items() if v is not None},
        "format": FORMAT,
        "kind": "corpus",
        "fingerprint": model.fingerprint,
        "model": model.config.name,
        "sequences": str(c.sequences),
        "tokens": str(len(c)),
    }
    return save_safetensors(path, {"tokens": torch.from_numpy(c.tokens)}, full)


def read(model, path) -> Corpus:
    """A corpus from a file written by ``save``; refuses a foreign file or another model's."""
    tokens, meta = read_made_for(path, FORMAT, "tokens", model.fingerprint, "corpus", COMMAND, CorpusError, "np")
    if tokens.dtype not in (np.uint16, np.int32):
        raise CorpusError(f"{path} holds tokens of type {tokens.dtype}, not uint16 or int32: write it with `{COMMAND}`")
    return Corpus(tokens, model.config.vocab_size, meta)


def load(model, path) -> Corpus:
    """``read`` once per model and file."""
    return per_model(model, "corpus", path, lambda: released(read(model, path)))


def get_corpus(model, spec="auto") -> Corpus | None:
    """The ``corpus`` option: "auto" (the shipped corpus for this model, None where none ships),
    "none" (None), a corpus file, or a ``Corpus`` for this vocabulary."""
    if isinstance(spec, Corpus):
        if spec.vocab_size != model.config.vocab_size:
            raise CorpusError(
                f"the given corpus is for a vocabulary of {spec.vocab_size}, this model's is "
                f"{model.config.vocab_size}: make one for this model with `{COMMAND}`"
            )
        return spec
    return shipped_or_file(
        model,
        spec,
        "none",
        SHIPPED_DIR,
        load,
        lambda: CorpusError(f"corpus must be 'auto', 'none', a corpus file or a Corpus, got {V.show(spec)}"),
    )
