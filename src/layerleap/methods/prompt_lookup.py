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

A list of prompts decodes as one batch: each row keeps its own n-gram index and draft, one call
scores every row's last token and draft (shorter drafts padded with filler tokens that nothing
attends to; finished rows ride along), and each row keeps what it accepts: the cache rolls back to
a length per row.  Each row's output is what it decodes alone (greedy; sampling with
``seed + row``).

Stats, per row: ``rounds`` (model calls after the prompt while the row ran), ``drafted``,
``accepted``, ``acceptance``, ``lookups_hit`` (rounds that found a draft), ``tokens_per_round``.
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


@register("prompt-lookup", batched=True, sampling=True, exact=True)
def prompt_lookup(run: Run, *, draft_len: int | None = None, max_ngram: int = DEFAULT_MAX_NGRAM,
                  min_ngram: int | None = None) -> None:
    """Prompt lookup: drafts copied from the prompt and output by n-gram match, verified in one call (greedy-exact; lossless sampling); draft_len and min_ngram none: the dtype's tuned default."""
    tuned = DEFAULTS.get(run.model.dtype_name, DEFAULTS["float32"])
    draft_len = tuned[0] if draft_len is None else draft_len
    if min_ngram is None:  # the dtype's default, never above a max_ngram the caller chose
        min_ngram = tuned[1] if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) else min(tuned[1], max_ngram)
    check_options(draft_len, max_ngram, min_ngram)
    B = run.batch
    counts = {k: [0] * B for k in ("rounds", "drafted", "accepted", "lookups_hit")}
    cache = run.new_cache(extra=draft_len + 1)
    first = run.choose(run.logits(run.prefill(cache))[:, -1]).tolist()  # [B]
    index = [NgramIndex(run.prompts[b] + [first[b]], min_ngram, max_ngram) for b in range(B)]
    if not run.emit_all(torch.tensor(first)):
        yield
        while not _round(run, cache, index, draft_len, counts):
            yield
    _finish(run, counts)


def _round(run: Run, cache, index: list[NgramIndex], draft_len: int, counts: dict) -> bool:
    """One call: each unfinished row scores its last token and its draft (rows with shorter drafts
    are padded with filler tokens that nothing attends to and that are rolled back); True when every
    row is done."""
    B, g = run.batch, run.gen
    live = [b for b in range(B) if not run.finished[b]]
    keep = cache.lengths[0].clone()  # [B] the cache holds every token of a row but its last
    drafts = [index[b].draft(min(draft_len, run.remaining(b) - 1)) if b in live else [] for b in range(B)]
    S = 1 + max(len(d) for d in drafts)
    ids = torch.tensor([[ix.tokens[-1]] + d + [ix.tokens[-1]] * (S - 1 - len(d)) for ix, d in zip(index, drafts)],
                       dtype=torch.long, device=run.model.device)  # [B, S]
    pos = run.positions(cache, S).clamp(max=run.model.config.max_position - 1)  # [B, S]: fillers may pass the end
    logits = run.logits(run.forward(cache, ids, positions=pos))  # [B, S, V]
    for b in live:
        d = torch.tensor(drafts[b], dtype=torch.long)
        rows = logits[b, :len(drafts[b]) + 1]  # [1 + k, V]
        if g.do_sample:
            p = sampling.probs(rows, g.temperature, g.top_k, g.top_p)
            q = torch.nn.functional.one_hot(d, p.shape[-1]).to(p.dtype)  # [k, V]: a draft is certain
            n, nxt = verify.speculative_accept(d, q, p, run.generators[b])
        else:
            n, nxt = verify.greedy_accept(d, rows)
        keep[b] += 1 + n  # the last token and the accepted drafts
        k = len(drafts[b])
        for key, v in (("rounds", 1), ("drafted", k), ("accepted", n), ("lookups_hit", int(k > 0))):
            counts[key][b] += v
        new = drafts[b][:n] + [nxt]
        index[b].extend(new)
        run.emit(b, new)
    cache.truncate(keep)
    return run.done


def _finish(run: Run, counts: dict) -> None:
    """Per-row stats (a list per key for a batch, a number for one row)."""
    acceptance = [a / d if d else None for a, d in zip(counts["accepted"], counts["drafted"])]
    per_round = [len(out) / r if r else None for out, r in zip(run.out, counts["rounds"])]
    for key, values in (*counts.items(), ("acceptance", acceptance), ("tokens_per_round", per_round)):
        run.extra[key] = values if run.batch > 1 else values[0]
