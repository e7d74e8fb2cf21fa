"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): BiLD's lossless yardstick.

A smaller draft model with the same tokenizer proposes ``draft_len`` (γ) tokens autoregressively;
the target model scores the last accepted token and all γ drafts in ONE call, and
``verify.greedy_accept`` (greedy) or ``verify.speculative_accept`` (sampling) keeps a prefix and
adds one token of the target's own.  Greedy output equals the target's greedy decoding token for
token; sampled output is distributed exactly as the target's sampling (same temperature / top-k /
top-p warps on both models).

Both caches roll back exactly: the target keeps its entries for the accepted drafts, the draft
keeps what it computed for them, and neither recomputes an accepted token.

Stats: ``draft_calls``, ``draft_layer_evals`` (the draft's own meters), ``drafted``,
``accepted``, ``acceptance`` (accepted / drafted), ``rounds`` (target calls after the prompt).
"""

from __future__ import annotations

import torch

from .. import sampling, verify
from ..companion import Companion, check_pair
from ..decoding import GenerationError, Run, register


def _warp(run: Run, logits: torch.Tensor) -> torch.Tensor:
    g = run.gen
    return sampling.probs(logits, g.temperature, g.top_k, g.top_p)


@register("speculative", sampling=True)
def speculative(run: Run, *, draft, draft_len: int = 4) -> None:
    """Speculative decoding with a draft model (draft=, γ = draft_len): greedy-exact or lossless sampling."""
    if draft is None:
        raise GenerationError("method 'speculative' needs a draft model: generate(..., draft=layerleap.load(...))")
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise GenerationError(f"draft_len must be an integer >= 1 (γ, the drafted tokens per round), got {draft_len!r}")
    check_pair(run.model, draft, "draft", "draft")
    if run.batch != 1:
        raise GenerationError("method 'speculative' decodes one prompt at a time")
    sample = run.gen.do_sample
    eos = set(run.gen.eos_ids) if run.gen.stop_at_eos else set()
    stats = run.extra
    stats.update(drafted=0, accepted=0, rounds=0)

    cache = run.new_cache(extra=draft_len + 1)
    t_next = run.logits(run.prefill(cache))[0, -1]  # the prompt pass's prediction for the first token
    dm = Companion(run, draft, "draft", extra_slots=draft_len + 1)
    d_logits = dm.prefill()
    seq = list(run.prompts[0])
    while True:
        # the target's cache holds seq, or (after the first round) seq[:-1], seq[-1] being its own token
        k = min(draft_len, run.remaining() - 1)
        drafts: list[int] = []
        q_rows = []
        if k > 0:
            if dm.length < len(seq):
                d_logits = dm.forward(seq[dm.length:])[-1]
            while True:
                if sample:
                    q = _warp(run, d_logits)
                    tok = verify.draw(q, run.generator)
                    q_rows.append(q)
                else:
                    tok = int(d_logits.argmax())
                drafts.append(tok)
                if len(drafts) == k or tok in eos:
                    break
                d_logits = dm.forward([tok])[-1]
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
            n, nxt = verify.speculative_accept(d, q, p, run.generator)
        else:
            n, nxt = verify.greedy_accept(d, rows)
        stats["rounds"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += n
        cache.truncate(min(int(cache.lengths[0, 0]), len(seq) + n))  # seq and the accepted drafts
        dm.truncate(len(seq) + n)
        new = drafts[:n] + [nxt]
        seq.extend(new)
        if run.emit(0, new):
            return _finish(stats)


def _finish(stats: dict) -> None:
    stats["acceptance"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
