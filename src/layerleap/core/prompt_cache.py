"""Prompt (prefix) caching: the KV entries of finished calls, reused by the next call that starts with them.

A ``PromptCache`` holds, per entry, a sequence of token ids (a call's prompt and output) and the model's
keys and values for them (``[n_layers, n_kv_heads, n, head_dim]``).  A call given the cache
(``generate(model, prompt, prompt_cache=pc)``) copies the entries of the longest cached prefix of its
prompt into its own KV cache and runs only the rest of the prompt (always at least its last token: the
first new token is predicted from it), then stores its own prompt and output when it ends.  A multi-turn
chat so prefills each turn's new messages only, as llama.cpp's ``cache_prompt`` and vLLM's automatic prefix
caching do.

Entries belong to one model object, in one dtype and weights format, and one KV dtype and device: another
model (or the same weights loaded twice), or the same one converted (``model.to(torch.bfloat16)``), never
hits. Changing a model's weights in place otherwise (training, loading others) leaves stale entries:
``clear()`` then. The cache is bounded (``max_bytes`` of keys and values, and optionally ``max_tokens``);
storing past the bound evicts the least recently used entries, and an entry that alone exceeds it is not
stored. An entry that is a prefix of a newer one is replaced by it. Thread-safe (one lock around each
operation).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import validate as V

DEFAULT_MB = 256  # the default bound, in MiB of keys and values


class PromptCacheError(V.InputError):
    """A bad argument to ``PromptCache``: the message names the problem and the fix."""


@dataclass
class Entry:
    model: weakref.ref
    form: tuple  # the model's weights' format when stored (``weights_form``)
    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, Hkv, n, hd]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def belongs(self, model, form: tuple, dtype: torch.dtype, device) -> bool:
        return (
            self.model() is model
            and self.form == form
            and self.k.dtype == dtype
            and self.k.device == torch.device(device)
        )


def weights_form(model) -> tuple:
    """What of a model object can change under the same object and change its keys and values: its activations'
    dtype and its weights' format (``model.to(torch.bfloat16)``, a quantization in place)."""
    return (getattr(model, "dtype", None), getattr(model, "dtype_name", None))


def common_prefix(a, b) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """The KV entries of finished calls, reused by calls that start with their tokens (module docstring).

    ``max_bytes``: the most bytes of keys and values held (default 256 MiB; SmolLM2-135M in fp32 takes
    46 KB a token); ``max_tokens``: the most tokens held over all entries (None: no bound of its own).
    ``hits``, ``misses`` and ``reused_tokens`` count the lookups (a hit reuses at least one token)."""

    def __init__(self, max_bytes: int = DEFAULT_MB * 2**20, max_tokens: int | None = None):
        with V.raising(PromptCacheError):
            self.max_bytes = V.integer(max_bytes, "max_bytes", 1, hint=" (the bound on the keys and values held)")
            self.max_tokens = (
                None if max_tokens is None else V.integer(max_tokens, "max_tokens", 1, hint=" (None: no token bound)")
            )
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._serial = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.reused_tokens = 0

    # -- what it holds -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens held over all entries."""
        with self._lock:  # (another thread may store meanwhile: the server's worker)
            return sum(len(e.tokens) for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> list[tuple[int, ...]]:
        """The token ids of each entry, least recently used first."""
        with self._lock:
            return [e.tokens for e in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        return f"PromptCache({len(self)} entries, {self.tokens} tokens, {self.nbytes / 2**20:.1f} MiB)"

    # -- lookup and store ----------------------------------------------------------------------
    def lookup(self, model, ids: list[int], dtype: torch.dtype, device, count: bool = True) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``ids`` for ``model`` (its KV ``dtype`` and
        ``device``), and how many of its tokens may be reused: at most ``len(ids) - 1`` (the last
        prompt token always runs).  ``(None, 0)`` when none shares a token.  Counts a hit or a miss
        (``count=False``: the caller counts what it reuses with ``count``)."""
        form = weights_form(model)
        with self._lock:
            best, n = None, 0
            for key, e in self._entries.items():
                if not e.belongs(model, form, dtype, device):
                    continue
                m = common_prefix(e.tokens, ids)
                if m > n:
                    best, n = key, m
            n = min(n, len(ids) - 1)
            if best is None or n <= 0:
                self.misses += int(count)
                return None, 0
            self._entries.move_to_end(best)
            if count:
                self.hits += 1
                self.reused_tokens += n
            return self._entries[best], n

    def count(self, reused: int) -> None:
        """Count one lookup that reused ``reused`` tokens (0: a miss), for a caller that reuses fewer than
        it found (a batch's rows reuse as many as its one prompt pass allows)."""
        with self._lock:
            if reused > 0:
                self.hits += 1
                self.reused_tokens += reused
            else:
                self.misses += 1

    def store(self, model, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> bool:
        """Keep ``tokens`` with their keys and values ``[L, Hkv, n, hd]`` (copied) for ``model``; entries
        whose tokens are a prefix of ``tokens`` are replaced, and nothing is added when an entry already
        starts with them.  False when the entry alone exceeds the bound (then nothing is stored)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens or k.shape[2] != len(tokens) or v.shape != k.shape:
            raise PromptCacheError(
                f"store {len(tokens)} tokens with keys and values for as many positions, got {tuple(k.shape)}"
            )
        size = 2 * k.numel() * k.element_size()
        if size > self.max_bytes or (self.max_tokens is not None and len(tokens) > self.max_tokens):
            return False
        form = weights_form(model)
        with self._lock:
            for key, e in list(self._entries.items()):
                if not e.belongs(model, form, k.dtype, k.device) or e.model() is None:
                    if e.model() is None:  # its model is gone: it can never hit
                        del self._entries[key]
                    continue
                if e.tokens[: len(tokens)] == tokens:  # already held (as or inside a longer entry)
                    self._entries.move_to_end(key)
                    return True
                if tokens[: len(e.tokens)] == e.tokens:  # the new entry covers it
                    del self._entries[key]
            self._serial += 1
            self._entries[self._serial] = Entry(weakref.ref(model), form, tokens, _copy(k), _copy(v))
            self._evict()
        return True

    def _evict(self) -> None:
        while self._entries and (
            sum(e.nbytes for e in self._entries.values()) > self.max_bytes
            or (self.max_tokens is not None and sum(len(e.tokens) for e in self._entries.values()) > self.max_tokens)
        ):
            self._entries.popitem(last=False)


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def check(value) -> PromptCache | None:
    """``generate``'s ``prompt_cache`` argument: None or a ``PromptCache``."""
    if value is not None and not isinstance(value, PromptCache):
        raise PromptCacheError(
            f"prompt_cache must be a layerleap.PromptCache (PromptCache(max_bytes=...)) or None, got {V.show(value)}"
        )
    return value
