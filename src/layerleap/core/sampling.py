"""Token choice rules shared by every method: greedy, and temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Warp ``[..., V]`` logits as `transformers` does (temperature, then top-k, then top-p)."""
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
    return logits


def probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    return process_logits(logits, temperature, top_k, top_p).softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``[B, V]`` probabilities -> ``[B]``."""
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)
