"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): BiLD's lossless yardstick.

A smaller draft model with the same tokenizer proposes up to γ tokens autoregressively; the target
model scores the last accepted token and all drafts in ONE call, and ``verify.greedy_accept``
(greedy) or ``verify.speculative_accept`` (sampling) keeps a prefix and adds one token of the
target's own.  Greedy output equals the target's greedy decoding token for token; sampled output is
distributed exactly as the target's sampling (same temperature / top-k / top-p warps on both models).

Options:

Defaults: ``draft_len=20, schedule="constant", min_confidence=0.4``, `transformers`' own defaults for
assisted generation and the fastest setting measured on the Qwen2.5-Coder 1.5B / 0.5B pair
(docs/BILD.md): the confidence stop, not γ, decides how long a round is (in one run fixed γ = 4
without it ran 0.82× of greedy, the heuristic schedule alone 0.81×, these defaults 0.99×).

- ``draft_len``: γ, the most drafts per round (with ``schedule="heuristic"``, the first round's γ).
- ``schedule``: ``"constant"`` keeps γ = ``draft_len``; ``"heuristic"`` is `transformers`'
  ``num_assistant_tokens_schedule="heuristic"``: γ + 2 after a round whose drafts were all
  accepted, max(1, γ − 1) otherwise (no upper limit but the tokens left).
- ``min_confidence``: a round stops drafting after a draft token whose draft distribution has a top
  probability below it (0 = off).  The unsure token is still verified (its draft call is already
  paid), as `transformers`' ``assistant_confidence_threshold`` does.

The draft length never depends on the target's rows of the current round, only on the draft's own
distributions and on earlier rounds, so both stay exact: greedy equals the target's greedy
decoding and sampling stays lossless (every position is verified by the same acceptance rule
whatever γ was).

Both caches roll back exactly: the target keeps its entries for the accepted drafts, the draft
keeps what it computed for them, and neither recomputes an accepted token.

Stats: ``draft_calls``, ``draft_layer_evals`` (the draft's own meters), ``drafted``,
``accepted``, ``acceptance`` (accepted / drafted), ``rounds`` (target calls after the prompt),
``draft_len_mean`` (drafted / rounds: the mean γ used), ``draft_len_max``, ``confidence_stops``
(rounds cut short by ``min_confidence``), ``tokens_per_round``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from ..core import sampling, verify
from ..drafters.companion import Companion, check_pair
from ..core.run import GenerationError, Run, register

SCHEDULES = ("constant", "heuristic")


@dataclass
class DraftLength:
    """γ for the next round and how it moves (`transformers`' constant and heuristic schedules)."""
    gamma: int
    schedule: str = "constant"

    def update(self, drafted: int, accepted: int) -> None:
        if self.schedule == "heuristic":
            self.gamma = self.gamma + 2 if accepted == drafted else max(1, self.gamma - 1)


MAX_DRAFT_LEN = 256  # drafts per round; more only wastes draft calls on rejected tokens


def check_options(draft_len, schedule, min_confidence) -> None:
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise GenerationError(f"draft_len must be an integer in [1, {MAX_DRAFT_LEN}] (γ, the drafted tokens per round), "
                              f"got {draft_len!r}")
    if schedule not in SCHEDULES:
        raise GenerationError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))} (constant: γ = draft_len; "
                              f"heuristic: +2 after a fully accepted round, -1 otherwise), got {schedule!r}")
    if (isinstance(min_confidence, bool) or not isinstance(min_confidence, Real) or math.isnan(min_confidence)
            or not 0 <= min_confidence <= 1):
        raise GenerationError(f"min_confidence must be a probability in [0, 1] (stop drafting after a draft token "
                              f"whose top probability is below it; 0 = off), got {min_confidence!r}")


def _warp(run: Run, logits: torch.Tensor) -> torch.Tensor:
    g = run.gen
    return sampling.probs(logits, g.temperature, g.top_k, g.top_p)


def _draft(run: Run, dm: Companion, d_logits: torch.Tensor, k: int, min_confidence: float, eos: set):
    """Up to ``k`` draft tokens from ``d_logits`` (the draft's row for the next position) on ->
    (tokens, their warped rows when sampling, whether low confidence stopped the round)."""
    sample = run.gen.do_sample
    drafts: list[int] = []
    q_rows = []
    while True:
        if sample:
            q = _warp(run, d_logits)
            tok = verify.draw(q, run.generators[0])
            q_rows.append(q)
        else:
            q = d_logits.float().softmax(-1) if min_confidence > 0 else None
            tok = int(d_logits.argmax())
        drafts.append(tok)
        unsure = min_confidence > 0 and float(q.max()) < min_confidence
        if len(drafts) == k or tok in eos or unsure:
            return drafts, q_rows, unsure and len(drafts) < k
        d_logits = dm.forward([tok])[-1]


@register("speculative", sampling=True, exact=True, models=("draft",))
def speculative(run: Run, *, draft, draft_len: int = 20, schedule: str = "constant",
                min_confidence: float = 0.4):
    """Speculative decoding with a draft model (draft=, γ = draft_len, schedule, min_confidence): greedy-exact or lossless sampling."""
    if draft is None:
        raise GenerationError("method 'speculative' needs a draft model: generate(..., draft=layerleap.load(...))")
    check_options(draft_len, schedule, min_confidence)
    check_pair(run.model, draft, "draft", "draft")
    sample = run.gen.do_sample
    eos = set(run.gen.eos_ids) if run.gen.stop_at_eos else set()
    stats = run.extra
    stats.update(drafted=0, accepted=0, rounds=0, draft_len_max=0, confidence_stops=0)
    gamma = DraftLength(draft_len, schedule)

    cache = run.new_cache(extra=draft_len + 1)
    t_next = run.logits(run.prefill(cache))[0, -1]  # the prompt pass's prediction for the first token
    dm = Companion(run, draft, "draft", extra_slots=draft_len + 1)
    d_logits = dm.prefill()
    seq = list(run.prompts[0])
    while True:
        # the target's cache holds seq, or (after the first round) seq[:-1], seq[-1] being its own token
        k = min(gamma.gamma, run.remaining() - 1)
        drafts, q_rows, stopped = [], [], False
        if k > 0:
            if dm.length < len(seq):
                d_logits = dm.forward(seq[dm.length:])[-1]
            drafts, q_rows, stopped = _draft(run, dm, d_logits, k, min_confidence, eos)
        if t_next is not None:  # first round: the prompt pass scored the first position
            rows = [t_next.unsqueeze(0)]
            if drafts:
                ids = torch.tensor([drafts], dtype=torch.long, device=run.model.device)
                rows.append(run.logits(run.forward(cache, ids))[0])
            rows = torch.cat(rows)
            t_next = None
        else:
            ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=run.model.device)
            rows = run.logits(run.forward(cache, ids))[0]  # [k+1, V]
        d = torch.tensor(drafts, dtype=torch.long)
        if sample:
            p = _warp(run, rows)
            q = torch.stack(q_rows) if q_rows else p.new_zeros((0, p.shape[-1]))
            n, nxt = verify.speculative_accept(d, q, p, run.generators[0])
        else:
            n, nxt = verify.greedy_accept(d, rows)
        _count(stats, len(drafts), n, stopped)
        gamma.update(len(drafts), n)
        cache.truncate(min(int(cache.lengths[0, 0]), len(seq) + n))  # seq and the accepted drafts
        dm.truncate(len(seq) + n)
        new = drafts[:n] + [nxt]
        seq.extend(new)
        if run.emit(0, new):
            return _finish(stats, len(run.out[0]))
        yield


def _count(stats: dict, drafted: int, accepted: int, stopped: bool) -> None:
    stats["rounds"] += 1
    stats["drafted"] += drafted
    stats["accepted"] += accepted
    stats["draft_len_max"] = max(stats["draft_len_max"], drafted)
    stats["confidence_stops"] += int(stopped)


def _finish(stats: dict, new_tokens: int) -> None:
    stats["acceptance"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
    stats["draft_len_mean"] = stats["drafted"] / stats["rounds"] if stats["rounds"] else None
    stats["tokens_per_round"] = new_tokens / stats["rounds"] if stats["rounds"] else None
