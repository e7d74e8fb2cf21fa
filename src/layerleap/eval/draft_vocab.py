"""Choosing a draft vocabulary's size ``K``: how many of the model's own tokens lie in the ``K`` most
frequent ids (coverage) against what scoring ``K`` ids costs a drafter (the draft unembedding and
its top-k), beside one decode step of the whole model.

``coverage`` is measured on tokens the ids were NOT counted from (held-out self-distilled answers,
and greedy answers to Spec-Bench calibration prompts): the share of the model's greedy tokens a
drafter with that vocabulary could draft at all."""

from __future__ import annotations

import time

import torch

from ..core.model import Transformer
from ..drafters.draft_vocab import DraftVocab, coverage


def coverage_by_size(order: torch.Tensor, sizes, token_lists) -> dict[int, float]:
    """Per size ``K``: the share of the tokens of ``token_lists`` among ``order[:K]``."""
    return {k: coverage(order[:k], token_lists) for k in sizes}


def draft_cost(model: Transformer, sizes, rows: int = 1, context: int = 128, reps: int = 30, seed: int = 0) -> dict:
    """Median milliseconds of a drafter's last stage on ``rows`` normalised states: ``[rows, D] @
    W[ids].T`` and the top-3 (all of a size below 3), for each size (the model's full ``unembed`` at the
    vocabulary's size), and of one decode step of the model (one token, KV cache at ``context``);
    interleaved rep by rep."""
    V, D = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, D, generator=g).to(model.device, model.dtype)
    vocabs = {k: None if k >= V else DraftVocab(model, torch.randperm(V, generator=g)[:k]) for k in sizes}
    ids = torch.randint(0, V, (1, context + 1), generator=g).to(model.device)
    cache = model.new_cache(1, context + 2)
    times: dict = {k: [] for k in sizes}
    times["step"] = []
    with torch.inference_mode():
        model(ids[:, :context], cache=cache, logits_from=-1)
        for _ in range(reps + 2):
            t = time.perf_counter()
            model(ids[:, context:], cache=cache)
            times["step"].append(time.perf_counter() - t)
            cache.truncate(context)
            for k, vocab in vocabs.items():
                t = time.perf_counter()
                (model.unembed(z) if vocab is None else vocab.logits(z)).topk(min(3, k), dim=-1)
                times[k].append(time.perf_counter() - t)
    med = {k: 1e3 * sorted(v[2:])[len(v[2:]) // 2] for k, v in times.items()}  # after 2 warm-up reps
    return {"rows": rows, "context": context, "reps": reps, "step_ms": med.pop("step"), "draft_ms": med}


def choose_size(cover: dict[int, float], min_coverage: float) -> int:
    """The smallest size whose coverage reaches ``min_coverage`` (the largest where none does)."""
    ok = [k for k, c in sorted(cover.items()) if c >= min_coverage]
    return ok[0] if ok else max(cover)
