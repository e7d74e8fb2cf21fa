"""The early-exit drafter: the first ``E`` layers of the model and an exit head are the small model,
the whole stack the large one, sharing one KV cache (BiLD's early-exit form, PPD, self-speculative
decoding).

``EarlyExit`` keeps the lower layers' cache ahead of the upper ones by the tokens the small model
has produced since the last large pass; their layer-E hidden states wait in ``h_pending``, so the
large model runs only layers ``[E, n_layers)`` for them and no layer is computed twice for a kept
token.  ``EarlyExitDrafter`` is the drafter over it.  ``exit_head`` resolves the ``head=`` option of the methods that use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.run import Run
from ..errors import LayerleapError
from . import exit_heads
from .base import ChainRule, StepDrafter

HEADS = ("auto", "shared", "trained")


class EarlyExit:
    """One model: layers ``[0, E)`` + an exit head are the small model, all layers the large one.
    The cache's lower layers run ahead of the upper ones by the tokens the small model produced since
    the last large pass; their layer-E hidden states wait in ``h_pending``."""

    def __init__(self, run: Run, exit_layer: int, head, extra_slots: int = 1):
        self.run, self.E, self.head = run, exit_layer, head
        self.L = run.n_layers
        self.cache = run.new_cache(extra=extra_slots)  # slots beyond the budget (drafts, PPD candidates)
        self.h_pending: torch.Tensor | None = None  # [1, lower - upper, D]

    @property
    def small_length(self) -> int:
        return int(self.cache.lengths[0, 0])

    @property
    def large_length(self) -> int:
        return int(self.cache.lengths[self.L - 1, 0])

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Run.prefill returns only the last position after its end layer; the upper layers need
        # every prompt position's layer-E state, so the prompt pass is done here (batch 1, no pad)
        # and metered as Run.prefill meters it.
        run, model = self.run, self.run.model
        prompt = run.prompts[0]
        ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
        pos = torch.arange(len(prompt), device=model.device).unsqueeze(0)
        h_exit = model.run_layers(model.embed(ids), 0, self.E, pos, self.cache)
        h = model.run_layers(h_exit, self.E, self.L, pos, self.cache)
        run.model_calls += 1
        run.prompt_layer_evals[0] += self.L * (len(prompt) - 1)
        run.layer_evals[0] += self.L  # the last prompt position predicts the first token (as Run.prefill counts)
        return self.head(h_exit[:, -1:])[0, -1], run.logits(h[:, -1:])[0, -1]

    def small_step(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.run.model.device)
        h = self.run.forward(self.cache, ids, start=0, end=self.E)
        self.h_pending = h if self.h_pending is None else torch.cat([self.h_pending, h], 1)
        return self.head(h[:, -1:])[0, -1]

    def large_pass(self, tokens: list[int]) -> torch.Tensor:
        """``tokens`` = everything after the upper layers' cache.  Those the small model already ran
        continue from their layer-E states; the rest (at most the newest two) run from the embedding.
        One model call."""
        ahead = self.small_length - self.large_length  # tokens with a layer-E state waiting
        parts = [self.h_pending] if ahead else []
        fresh = tokens[ahead:]
        if fresh:
            ids = torch.tensor([fresh], dtype=torch.long, device=self.run.model.device)
            parts.append(self.run.forward(self.cache, ids, start=0, end=self.E))
        h = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        h = self.run.forward(self.cache, h=h, start=self.E, end=self.L, count_call=not fresh)
        self.h_pending = None
        return self.run.logits(h)[0]

    def truncate(self, n: int) -> None:
        upper, lower = self.large_length, self.small_length
        if upper > n:
            self.cache.truncate(n, layers=range(self.E, self.L))
        if lower > n:
            self.cache.truncate(n, layers=range(0, self.E))
            keep = n - min(upper, n)
            self.h_pending = self.h_pending[:, :keep] if keep > 0 and self.h_pending is not None else None


class EarlyExitDrafter(StepDrafter):
    """The drafter over ``EarlyExit``: layers ``[0, E)`` and the exit head write the chain
    (``ChainRule``); the target scores it with layers ``[E, n_layers)`` continuing from the drafts'
    layer-E states (self-speculative decoding, BiLD's early-exit form)."""

    def __init__(self, run: Run, exit_layer: int, head, rule: ChainRule, extra_slots: int = 1):
        self.pair = EarlyExit(run, exit_layer, head, extra_slots=extra_slots)
        super().__init__(run, rule, extra_slots, cache=self.pair.cache)

    def prefill(self) -> torch.Tensor:
        draft, large = self.pair.prefill()
        self.draft_rows, self.first_rows = draft.unsqueeze(0), large.unsqueeze(0)
        return self.first_rows

    def own_length(self, row: int) -> int:
        return self.pair.small_length

    def step_rows(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        return {0: self.pair.small_step(feed[0])}

    def score(self, cands):
        fed = cands[0].fed()  # everything after the upper layers' cache
        return [self._rows(0, cands[0], self.pair.large_pass(fed)) if fed else self.first_rows]

    def update(self, cands, results) -> None:
        self.pair.truncate(len(self.seq()) + len(results[0][0]))  # the root and the accepted drafts stay
        self.update_length(cands, results)


# -- exit heads -----------------------------------------------------------------------------------
def exit_head(model, exit_layer: int, head="auto"):
    """-> (callable ``h [B, S, D] -> logits [B, S, V]``, a label).  ``head``: "auto" (a shipped trained
    head for the layer if there is one, else the shared head), "shared" (the model's final norm and
    unembedding), "trained" (a shipped head, ``layerleap.drafters.exit_heads``), a path to a head file
    (``layerleap align`` writes one), or a callable."""
    if callable(head) and not isinstance(head, (str, Path)):
        return head, "custom"
    if isinstance(head, Path) or (isinstance(head, str) and head not in HEADS):
        return exit_heads.load_exit_head(model, exit_layer, head), str(head)
    if head == "auto":
        head = "trained" if _has_trained(model, exit_layer) else "shared"
    return exit_heads.get_head(model, exit_layer, head=head), head


def _has_trained(model, exit_layer: int) -> bool:
    try:
        exit_heads.get_head(model, exit_layer, head="trained")
        return True
    except (LayerleapError, FileNotFoundError, KeyError, ValueError):
        return False
