"""What one generated token costs on this machine, beyond its layer passes: the prices ``layerleap
calibrate`` models a lossy setting's speed with.

A lossy method saves layer passes, but a token that runs its layers in several model calls pays each
call's fixed cost (the attention mask, the rotary tables, the native call and its thread team: in q4
on one thread of a Zen 4 EPYC one more call costs 0.09 ms, 60% of a layer pass), and CALM reads a
cosine back after each layer it may exit at.  So a setting is priced by what it does per token,
against greedy's one-token step::

    ms = step + (passes - n_layers) * layer + (calls - 1) * call + checks * check
            + (heads - 1) * head + filled * fill + rows * row + drafts * draft
    modelled speed-up = step / ms          (greedy: passes = n_layers, calls = heads = 1: exactly 1)

``passes``: layer passes per token (a call over several positions counts once per layer);
``calls``: model calls over a range of layers (``Stats.layer_calls``); ``checks``: CALM's saturation
checks; ``heads``: LM heads evaluated (BiLD's small steps each predict); ``filled``: layers whose KV
entries CALM filled from an exit state; ``rows``: draft tokens a call scores beside its own (a call
over ``1 + r`` positions costs ``r * row`` more than a one-token call's layers and LM head); ``drafts``:
small-model steps of a drafter that is not the model's own layers (BiLD's EAGLE head).
``measure`` times the parts on this model, dtype and thread
count: one token after ``context`` cached tokens, each variant the best of ``rounds`` taken round-robin
so that a burst of other work hits every variant alike.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of the parts of one generated token (one new token after ``context`` cached ones)."""

    n_layers: int
    step: float  # greedy's step: embedding, every layer in one call, the LM head and the choice
    layer: float  # one layer pass
    call: float  # one more model call over a range of layers
    check: float  # one saturation check: the cosine of consecutive hidden states, read on the host
    head: float  # one more LM head: final norm, unembedding, the choice
    fill: float  # one layer's KV entries computed from an exit state
    context: int = 256
    row: float = 0.0  # one more position in a call (its layers and LM head), from a call over ROWS
    draft: float = 0.0  # one step of the drafter's own small model (0: none measured)

    def token_ms(
        self,
        passes: float,
        calls: float = 1.0,
        checks: float = 0.0,
        heads: float = 1.0,
        filled: float = 0.0,
        rows: float = 0.0,
        drafts: float = 0.0,
    ) -> float:
        """The modelled milliseconds of a token with these per-token counts (see the module doc)."""
        return (
            self.step
            + (passes - self.n_layers) * self.layer
            + (calls - 1) * self.call
            + checks * self.check
            + (heads - 1) * self.head
            + filled * self.fill
            + rows * self.row
            + drafts * self.draft
        )

    def speedup(self, passes: float, **counts) -> float:
        """Greedy's step over the token's modelled time (``counts`` as ``token_ms``'s)."""
        return self.step / max(1e-9, self.token_ms(passes, **counts))

    def to_dict(self) -> dict:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def layers_only(n_layers: int) -> StepCost:
    """The layer-pass model (no call, check, head or fill costs): what a setting saves in layers only."""
    return StepCost(n_layers, float(n_layers), 1.0, 0.0, 0.0, 0.0, 0.0)


ROWS = 4  # the positions of the call that prices ``row``


def _variants(model, cache, context: int) -> dict:
    """One-token steps after ``context`` cached tokens: every layer in one call or one call per layer,
    with and without the LM head and CALM's checks, and KV filled for every layer from one state."""
    n = model.config.n_layers
    ids = torch.tensor([[1]], device=model.device)  # [1, 1]
    pos = torch.tensor([[context]], device=model.device)  # [1, 1]

    def one_call(head: bool) -> None:
        h = model.run_layers(model.embed(ids), 0, n, pos, cache)  # [1, 1, D]
        if head:
            int(model.logits(h)[:, -1].argmax())
        cache.truncate(context)

    def per_layer(check: bool) -> None:
        h = model.embed(ids)  # [1, 1, D]
        for layer in range(n):
            prev, h = h, model.run_layers(h, layer, layer + 1, pos, cache)
            if check:
                float(F.cosine_similarity(h[0, -1].float(), prev[0, -1].float(), dim=0))  # as calm checks
        cache.truncate(context)

    def fill() -> None:
        model.fill_kv(model.embed(ids), 0, n, pos, cache)
        cache.truncate(context)

    def rows() -> None:
        many = ids.repeat(1, ROWS)  # [1, ROWS]
        h = model.run_layers(model.embed(many), 0, n, pos + torch.arange(ROWS, device=model.device), cache)
        int(model.logits(h)[0].argmax(-1)[-1])
        cache.truncate(context)

    return {
        "step": lambda: one_call(True),
        "rows": rows,
        "layers": lambda: one_call(False),
        "split": lambda: per_layer(False),
        "checked": lambda: per_layer(True),
        "fill": fill,
    }


def measure(model, context: int = 256, rounds: int = 20, draft_step=None) -> StepCost:
    """Time the parts of a token on ``model`` here (module doc); every price is at least 0.
    ``draft_step``: one step of a drafter's own small model, timed with the rest (else ``draft`` is 0)."""
    n = model.config.n_layers
    context = max(1, min(context, model.config.max_position - 1))
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        cache = model.new_cache(1, context + ROWS)
        model(torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(model.device), cache=cache)
        fns = _variants(model, cache, context)
        if draft_step is not None:
            fns["draft"] = draft_step
        for f in fns.values():  # warm-up
            f()
            f()
        best = {k: float("inf") for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                sync()
                best[k] = min(best[k], (time.perf_counter() - t) * 1e3)
    call = max(0.0, (best["split"] - best["layers"]) / max(1, n - 1))
    return StepCost(
        n_layers=n,
        step=best["step"],
        layer=max(0.0, best["layers"] - call) / n,
        call=call,
        check=max(0.0, best["checked"] - best["split"]) / n,
        head=max(0.0, best["step"] - best["layers"]),
        fill=best["fill"] / n,
        context=context,
        row=max(0.0, best["rows"] - best["step"]) / (ROWS - 1),
        draft=best.get("draft", 0.0),
    )
