"""Prompt lookup decoding (Saxena 2023; `transformers`' ``prompt_lookup_num_tokens``): drafts that
need no draft model and no training.

The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in the prompt
and the output so far; the tokens that followed their latest earlier occurrence are the draft, up to
``draft_len`` of them.  One model call scores the last token and the draft; greedy decoding keeps
the longest prefix the model agrees with plus the model's own next token (output identical to
greedy decoding), sampling keeps each draft token with probability ``p(d)`` and otherwise samples
from ``p`` without ``d`` (lossless: a draft is a one-hot proposal).  Where nothing matches, the call
scores the last token alone, as greedy decoding does.  It pays off where the output copies its
input: summaries, retrieval-augmented answers, code edits.

Stats: ``rounds`` (model calls after the prompt), ``drafted``, ``accepted``, ``acceptance``,
``lookups_hit`` (rounds that found a draft), ``tokens_per_round``.
"""

from __future__ import annotations

import torch

from ..core import sampling, verify
from ..core.run import GenerationError, Run, register

# Defaults per weight format, chosen by replaying recorded greedy outputs of 50 held-out Spec-Bench
# prompts (chat, 128 tokens) against each format's measured call-cost curve (2 threads): the draft
# length that maximises accepted tokens per unit of call cost, not per call.  A 4-bit call over 5+
# tokens costs 1.6x a one-token call, fp32's 1.1x, so fp32 drafts longer and from single-token
# matches.  See docs/BENCHMARKS.md ("Choosing draft lengths") for the command and the table.
DEFAULTS = {  # dtype name -> (draft_len, min_ngram)
    "float32": (4, 1), "bfloat16": (4, 1), "float16": (4, 1), "q4": (3, 2),
}
DEFAULT_DRAFT_LEN, DEFAULT_MIN_NGRAM = DEFAULTS["float32"]
DEFAULT_MAX_NGRAM = 4


class NgramIndex:
    """The latest start of every n-gram (``min_n <= n <= max_n``) of a growing token sequence that
    some token follows: n-grams ending at the last token are indexed once the next one arrives, so a
    lookup of the current suffix finds an earlier occurrence, never the suffix itself."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for t in tokens:
            end = len(seq)  # index the n-grams ending at the current last token: t follows them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest[tuple(seq[end - n:end])] = end - n
            seq.append(int(t))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
        suffix (longest n first); [] when no suffix occurred before."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self.latest.get(tuple(seq[end - n:]))
            if start is not None:
                return seq[start + n:start + n + k]
        return []


def check_options(draft_len, max_ngram, min_ngram) -> None:
    for name, v in (("draft_len", draft_len), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GenerationError(f"{name} must be an integer >= 1, got {v!r}")
    if min_ngram > max_ngram:
        raise GenerationError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
    if draft_len > 64:
        raise GenerationError(f"draft_len must be at most 64 (tokens verified in one call), got {draft_len}")


@register("prompt-lookup", sampling=True, exact=True)
def prompt_lookup(run: Run, *, draft_len: int | None = None, max_ngram: int = DEFAULT_MAX_NGRAM,
                  min_ngram: int | None = None) -> None:
    """Prompt lookup: drafts copied from the prompt and output by n-gram match, verified in one call (greedy-exact; lossless sampling); draft_len and min_ngram none: the dtype's tuned default."""
    tuned = DEFAULTS.get(run.model.dtype_name, DEFAULTS["float32"])
    draft_len = tuned[0] if draft_len is None else draft_len
    if min_ngram is None:  # the dtype's default, never above a max_ngram the caller chose
        min_ngram = tuned[1] if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) else min(tuned[1], max_ngram)
    check_options(draft_len, max_ngram, min_ngram)
    if run.batch != 1:
        raise GenerationError("method 'prompt-lookup' decodes one prompt at a time")
    g = run.gen
    stats = run.extra
    stats.update(rounds=0, drafted=0, accepted=0, lookups_hit=0)
    cache = run.new_cache(extra=draft_len + 1)
    tok = int(run.choose(run.logits(run.prefill(cache))[:, -1])[0])
    index = NgramIndex(run.prompts[0] + [tok], min_ngram, max_ngram)
    if run.emit(0, [tok]):
        return _finish(stats, len(run.out[0]))
    yield
    dev = run.model.device
    while True:
        held = len(index.tokens) - 1  # the cache holds every token but the last
        drafts = index.draft(min(draft_len, run.remaining() - 1))
        ids = torch.tensor([[index.tokens[-1]] + drafts], dtype=torch.long, device=dev)
        rows = run.logits(run.forward(cache, ids))[0]  # [1 + k, V]
        d = torch.tensor(drafts, dtype=torch.long)
        if g.do_sample:
            p = sampling.probs(rows, g.temperature, g.top_k, g.top_p)
            q = torch.nn.functional.one_hot(d, p.shape[-1]).to(p.dtype)  # [k, V]: a draft is certain
            n, nxt = verify.speculative_accept(d, q, p, run.generator)
        else:
            n, nxt = verify.greedy_accept(d, rows)
        cache.truncate(held + 1 + n)  # the last token and the accepted drafts
        stats["rounds"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += n
        stats["lookups_hit"] += int(bool(drafts))
        new = drafts[:n] + [nxt]
        index.extend(new)
        if run.emit(0, new):
            return _finish(stats, len(run.out[0]))
        yield


def _finish(stats: dict, new_tokens: int) -> None:
    stats["acceptance"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
    stats["tokens_per_round"] = new_tokens / stats["rounds"] if stats["rounds"] else None
