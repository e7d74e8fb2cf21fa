"""Plain autoregressive decoding: ``greedy`` and ``sample`` (one full model call per token)."""

from __future__ import annotations

from ..decoding import Run, register


def autoregressive(run: Run) -> None:
    cache = run.new_cache()
    h = run.prefill(cache)  # [B, 1, D]
    while True:
        tok = run.choose(run.logits(h)[:, -1])  # [B]
        if run.emit_all(tok):
            return
        h = run.forward(cache, tok.unsqueeze(1))


@register("greedy", batched=True)
def greedy(run: Run) -> None:
    """Greedy decoding: the argmax token at every step (the reference every lossless method matches)."""
    autoregressive(run)


@register("sample", batched=True, sampling=True, default_sample=True)
def sample(run: Run) -> None:
    """Ancestral sampling with temperature, top-k and top-p (reproducible with a seed)."""
    autoregressive(run)
