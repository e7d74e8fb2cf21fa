"""Plain autoregressive decoding: ``greedy`` and ``sample`` (one full model call per token)."""

from __future__ import annotations

from ..core.run import Run, drive, register


def autoregressive_rounds(run: Run):
    """One full model call per token, yielding after each token."""
    cache = run.new_cache()
    h = run.prefill(cache)  # [B, 1, D]
    while True:
        tok = run.choose(run.logits(h)[:, -1])  # [B]
        if run.emit_all(tok):
            return
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            return
        h = run.forward(cache, tok.unsqueeze(1))


def autoregressive(run: Run) -> None:
    """``autoregressive_rounds`` to the end (for methods that call it as a plain function)."""
    drive(autoregressive_rounds, run)


@register("greedy", batched=True, exact=True, grammar=True, prompt_cache=True)
def greedy(run: Run):
    """Greedy decoding: the argmax token at every step (the reference every lossless method matches)."""
    yield from autoregressive_rounds(run)


@register("sample", batched=True, sampling=True, default_sample=True, grammar=True, prompt_cache=True)
def sample(run: Run):
    """Ancestral sampling with temperature, top-k and top-p (reproducible with a seed)."""
    yield from autoregressive_rounds(run)
