"""Token choice rules shared by every method: greedy, and temperature / top-k / top-p / min-p / typical sampling."""

from __future__ import annotations

import torch


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    typical_p: float = 1.0,
) -> torch.Tensor:
    """Warp ``[..., V]`` logits as `transformers` does (temperature, then top-k, then top-p, then min-p: the
    tokens less likely than ``min_p`` times the likeliest one are dropped, then typical sampling: the tokens
    whose surprisal is nearest the distribution's entropy are kept until they hold ``typical_p`` of the
    probability, the first one past it included)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        logits = logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    if min_p > 0.0:
        p = logits.softmax(-1)
        logits = logits.masked_fill(p < min_p * p.amax(-1, keepdim=True), float("-inf"))  # the likeliest stays
    if typical_p < 1.0:
        logits = _typical(logits, typical_p)
    return logits


def _typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """`transformers`' ``TypicalLogitsWarper`` (one token kept at least) over ``[..., V]`` logits."""
    logp = logits.log_softmax(-1)
    ent = -(logp * logp.exp()).nansum(-1, keepdim=True)  # the entropy (0 * -inf is NaN: left out)
    shifted = (-logp - ent).abs()
    sorted_scores, idx = torch.sort(shifted, descending=False, dim=-1)
    cum = logits.gather(-1, idx).softmax(-1).cumsum(-1)
    last = (cum < mass).sum(-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    remove = sorted_scores > sorted_scores.gather(-1, last)
    remove[..., :1] = False
    return logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))


def probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0) -> torch.Tensor:
    return process_logits(logits, temperature, top_k, top_p, min_p, typical_p).softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``[B, V]`` probabilities (any non-negative weights with a positive
    finite sum; ``[V]`` -> a 0-d tensor) -> ``[B]``, by inverting the cumulative distribution: one
    uniform draw per row from ``generator`` against the row's running sum (fp64), so a token of weight
    zero is never drawn.  ``torch.multinomial`` draws one exponential per vocabulary entry for the same
    distribution: 0.75 ms over 49,152 entries on a Zen 5 EPYC against 0.035 ms here, a fifth of a q4
    decoding step."""
    cum = p.cumsum(-1, dtype=torch.float64)  # [.., V]
    total = cum[..., -1:]
    if not bool(torch.isfinite(total).all() and (total > 0).all() and p.amin() >= 0):
        raise ValueError("sampling needs non-negative, finite probabilities with a positive sum in every row")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=p.device)
    tok = torch.searchsorted(cum, u * total, right=True)  # the first entry whose running sum passes u
    over = tok >= p.shape[-1]
    if bool(over.any()):  # u * total rounded up to the sum: the last entry of positive weight
        last = p.shape[-1] - 1 - (p.flip(-1) > 0).to(torch.uint8).argmax(-1, keepdim=True)
        tok = torch.where(over, last, tok)
    return tok.squeeze(-1)


# dtypes numpy's argmax takes with torch's rule (the first maximum; a NaN counts as the largest)
_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


def top_ids(logits: torch.Tensor):
    """``logits.argmax(-1).tolist()``: the first largest entry of each row (a NaN counting as the largest),
    as Python ints (an int for one row ``[V]``).  On CPU it is numpy's argmax over the same memory, the
    same rule at a twentieth of the cost (2 against 42 us over 49,152 fp32 logits on a Zen 5 EPYC,
    where torch's argmax does not vectorise): greedy decoding takes one a token, a draft-and-verify round
    one per draft and one for the verification."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()
