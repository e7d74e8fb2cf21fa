"""Logits processors: the penalties, biases, token filters and end-token floor that read a row's history.

``repetition_penalty`` (`transformers`' and vLLM's rule: the logit of every token of the prompt or the
output so far is divided by the penalty where it is positive, multiplied by it where it is not),
``frequency_penalty`` and ``presence_penalty`` (OpenAI's: subtracted once per occurrence of the token in the
output, and once if it occurs there at all), ``logit_bias`` (OpenAI's: added to the token's logit) and
``min_tokens`` (vLLM's: the end-of-sequence tokens, and the ``stop_token_ids``, are forbidden until
the output holds that many tokens), ``allowed_token_ids`` (vLLM's: every other token is forbidden),
``bad_words`` (vLLM's: token sequences that are never completed: a sequence's last token is forbidden where
the output so far ends with the tokens before it; the prompt is not read) and ``no_repeat_ngram_size``
(`transformers`': no n-gram of that many tokens occurs twice in the prompt and output together: a token is
forbidden where the last n - 1 tokens, the prompt's included, were once followed by it).
Where the filters and ``min_tokens`` (with a grammar's mask) forbid every token a row would choose from,
``none_left`` finds it and the choice is refused by name (``none_left_message``), not made among forbidden tokens.
As vLLM, the filters, the bias and ``min_tokens`` come first, then the repetition, frequency and presence penalties, all
on the raw logits, before a grammar's mask, a temperature and the top-k / top-p / min-p warps.

Every token is chosen from the processed logits, greedy or sampled: ``Run.choose`` processes each row
by its history, and draft-and-verify's ``Exact`` rule processes each node of a candidate tree by the
row's history followed by the node's path (``History.apply`` with ``paths``), as it masks each node by
the grammar, so a lossless method's greedy output equals greedy decoding's with the same settings, token
for token (sampling: lossless for the processed distributions).  Settings that ask for nothing (penalty
1.0, penalties 0.0, no bias, ``min_tokens`` 0) leave the logits untouched and cost nothing: ``Run`` then
keeps no history at all.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

# the settings' fields of ``GenerationConfig`` and the values that ask for nothing
NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": (),
    "min_tokens": 0,
    "allowed_token_ids": (),
    "bad_words": (),
    "no_repeat_ngram_size": 0,
}


def asked(gen) -> dict:
    """The processors ``gen`` (a ``GenerationConfig``) asks for: field -> value, those that change something."""
    return {k: getattr(gen, k) for k, nothing in NEUTRAL.items() if getattr(gen, k) != nothing}


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The draft paths of a candidate tree: ``[]`` for its root (row 0), then the tokens from the root to
    each node ``j`` (``parents``: -1 for the first level, parents first)."""
    paths: list[list[int]] = [[]]
    for j, p in enumerate(parents):
        paths.append(paths[p + 1] + [int(tokens[j])])
    return paths


class History:
    """One row's tokens as the processors read them: the prompt's and the output's so far (``push`` each
    emitted token), and ``apply`` to process logits after them."""

    def __init__(self, gen, prompt: list[int], eos_ids: tuple[int, ...]):
        self.rep = float(gen.repetition_penalty)
        self.presence = float(gen.presence_penalty)
        self.frequency = float(gen.frequency_penalty)
        self.min_tokens = int(gen.min_tokens)
        self.eos = sorted(set(int(t) for t in eos_ids) | set(int(t) for t in gen.min_tokens_ids))
        self.allowed = torch.tensor(sorted(set(gen.allowed_token_ids)), dtype=torch.long)
        self.bad_words = [(list(w[:-1]), int(w[-1])) for w in gen.bad_words]  # (the tokens before, the last)
        self.bias_ids = torch.tensor([int(t) for t, _ in gen.logit_bias], dtype=torch.long)
        self.bias = torch.tensor([float(b) for _, b in gen.logit_bias], dtype=torch.float32)
        self.prompt = set(int(t) for t in prompt) if self.rep != 1.0 else set()
        self.counts: Counter = Counter()  # the output's tokens
        self.n_out = 0
        # the tokens the penalties read (the prompt's, with repetition_penalty, then the output's new ones), kept
        # as tokens come (a long prompt's hundreds of tokens are not gone over again for every token and node):
        # their columns (``at``: token -> column), and in arrays grown as needed, the columns' token ids, which
        # are the prompt's, and how often the output holds each (``_base``: the first ``len(at)`` of them)
        cols = sorted(self.prompt)
        self.at: dict[int, int] = {t: i for i, t in enumerate(cols)}
        size = len(cols) + 64
        self._ids = np.zeros(size, dtype=np.int64)
        self._ids[: len(cols)] = cols
        self._in_prompt = np.zeros(size, dtype=np.bool_)
        self._in_prompt[: len(cols)] = True
        self._count = np.zeros(size, dtype=np.float32)
        self.out: list[int] = []  # the output's tokens in order (bad_words read its end)
        # no_repeat_ngram_size n: the prompt's and output's tokens, and each (n - 1)-gram -> the tokens that followed it
        self.ngram = int(gen.no_repeat_ngram_size)
        self.seq: list[int] = []
        self.follows: dict[tuple[int, ...], set[int]] = {}
        if self.ngram:
            for t in prompt:
                self._add(int(t))
        # the filters that can forbid every token (with each other or a grammar): the choice is then checked
        self.filters = [
            name
            for name, on in (
                ("allowed_token_ids", self.allowed.numel()),
                ("bad_words", self.bad_words),
                ("no_repeat_ngram_size", self.ngram),
                ("min_tokens", self.min_tokens and self.eos),
            )
            if on
        ]

    def _add(self, t: int) -> None:
        """``t`` after the tokens so far (``no_repeat_ngram_size``): the n-gram it ends is seen."""
        self.seq.append(t)
        n = self.ngram
        if len(self.seq) >= n:
            self.follows.setdefault(tuple(self.seq[len(self.seq) - n : -1]), set()).add(t)

    def _repeats(self, path: list[int]) -> set[int]:
        """The tokens that would repeat an n-gram after the history and then ``path``."""
        n = self.ngram
        seq = self.seq[max(0, len(self.seq) - n + 1) :] + list(path)  # the tail the path's n-grams can start in
        if len(self.seq) + len(path) < n - 1:
            return set()
        key = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
        out = set(self.follows.get(key, ()))
        for i in range(len(seq) - n + 1):  # the n-grams that end in the path
            if tuple(seq[i : i + n - 1]) == key:
                out.add(seq[i + n - 1])
        return out

    def push(self, token: int) -> None:
        t = int(token)
        if self.ngram:
            self._add(t)
        self.counts[t] += 1
        self.n_out += 1
        if self.bad_words:
            self.out.append(t)
        col = self.at.get(t)
        if col is None:
            col = self.at[t] = len(self.at)
            if col == len(self._ids):  # full: twice the room
                self._ids, self._in_prompt, self._count = (
                    np.concatenate([a, np.zeros_like(a)]) for a in (self._ids, self._in_prompt, self._count)
                )
            self._ids[col] = t
        self._count[col] += 1

    def _base(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[C]`` each column's token in the prompt, ``[C]`` how often the output holds it, ``[C]`` the columns'
        token ids (views of the arrays ``push`` keeps: copy before changing them)."""
        c = len(self.at)
        return tuple(torch.from_numpy(a[:c]) for a in (self._in_prompt, self._count, self._ids))

    def apply(self, logits: torch.Tensor, paths: list[list[int]] | None = None) -> torch.Tensor:
        """``[n, V]`` logits -> processed fp32 logits (a new tensor); row ``i`` follows the history and then
        ``paths[i]`` (default: every row at the history itself)."""
        n = logits.shape[0]
        paths = paths if paths is not None else [[] for _ in range(n)]
        out = logits.float().clone()
        if self.allowed.numel():
            keep = out[:, self.allowed.to(out.device)]
            out.fill_(float("-inf"))
            out[:, self.allowed.to(out.device)] = keep
        if self.bad_words:
            for i, path in enumerate(paths):
                seq = self.out + list(path)
                for before, last in self.bad_words:
                    if not before or (len(before) <= len(seq) and seq[len(seq) - len(before) :] == before):
                        out[i, last] = float("-inf")
        if self.ngram:
            for i, path in enumerate(paths):
                banned = self._repeats(path)
                if banned:
                    out[i, torch.tensor(sorted(banned), dtype=torch.long, device=out.device)] = float("-inf")
        if self.bias_ids.numel():
            out[:, self.bias_ids.to(out.device)] += self.bias.to(out.device)
        if self.min_tokens and self.eos:
            short = [i for i, path in enumerate(paths) if self.n_out + len(path) < self.min_tokens]
            if short:
                rows = torch.tensor(short, dtype=torch.long, device=out.device)
                out[rows.unsqueeze(1), torch.tensor(self.eos, dtype=torch.long, device=out.device)] = float("-inf")
        if self.rep != 1.0 or self.presence or self.frequency:
            at = self.at
            seen, count, idx = self._base()
            extra = sorted({t for path in paths for t in path} - at.keys())  # path tokens the history lacks
            if extra:
                at = {**at, **{t: len(at) + i for i, t in enumerate(extra)}}
                idx = torch.cat([idx, torch.tensor(extra, dtype=torch.long)])
                seen = torch.cat([seen, torch.zeros(len(extra), dtype=torch.bool)])
                count = torch.cat([count, torch.zeros(len(extra))])
            count, seen = count.repeat(n, 1), seen.repeat(n, 1)  # [n, C]: in the output, in the prompt
            cells = [(i, at[t]) for i, path in enumerate(paths) for t in path]  # each path token once per row
            if cells:
                rows, at_cols = torch.tensor(cells, dtype=torch.long).T
                count.index_put_((rows, at_cols), torch.ones(len(cells)), accumulate=True)
            idx = idx.to(out.device)
            x = out[:, idx]  # [n, C]
            count, seen = count.to(out.device), seen.to(out.device)
            if self.rep != 1.0:  # over the prompt and the output (with the row's path)
                x = torch.where(seen | (count > 0), torch.where(x > 0, x / self.rep, x * self.rep), x)
            if self.frequency:
                x = torch.where(count > 0, x - self.frequency * count, x)
            if self.presence:
                x = torch.where(count > 0, x - self.presence, x)
            out[:, idx] = x
        return out


def none_left(logits: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` processed (and masked) logits -> ``[n]`` bool: the rows where every token is forbidden."""
    return logits.amax(-1) == float("-inf")


def none_left_message(h: History, grammar: bool = False) -> str:
    """Why a row of ``h`` has no token to choose, and the fix (a ``GenerationError``'s message)."""
    names = h.filters + (["the grammar"] if grammar else [])
    what = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return (
        f"no token is left to choose after {h.n_out} output tokens: {what} forbid every token there: allow more "
        "tokens or forbid fewer"
    )


def histories(gen, prompts: list[list[int]], eos_ids: tuple[int, ...]) -> list[History] | None:
    """One ``History`` per row where ``gen`` asks for a processor, else None (nothing to keep)."""
    if not asked(gen):
        return None
    return [History(gen, p, eos_ids) for p in prompts]


def apply_rows(hist: list[History], logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits, each row processed by its history."""
    return torch.cat([h.apply(logits[row : row + 1]) for row, h in enumerate(hist)])
