"""The early-exit drafter: the first ``E`` layers of the model and an exit head are the small model,
the whole stack the large one, sharing one KV cache (BiLD's early-exit form, PPD, self-speculative
decoding).

``EarlyExit`` keeps the lower layers' cache ahead of the upper ones by the tokens the small model
has produced since the last large pass; their layer-E hidden states wait in ``h_pending``, so the
large model runs only layers ``[E, n_layers)`` for them and no layer is computed twice for a kept
token.  ``EarlyExitDrafter`` is the drafter over it.  ``exit_head`` resolves the ``head=`` option of the
methods that use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.kv_cache import KVCache
from ..core.options import HEADS  # noqa: F401  (the exit heads a method may name)
from ..core.run import GenerationError, Run
from ..errors import LayerleapError
from . import exit_heads
from .base import ChainRule, StepDrafter


class EarlyExit:
    """One model: layers ``[0, E)`` + an exit head are the small model, all layers the large one.
    The cache's lower layers run ahead of the upper ones by the tokens the small model produced since
    the last large pass; their layer-E hidden states wait in ``h_pending`` (one ``[n, D]`` tensor per
    row).  Rows of a batch are left padded by ``Run.prefill_at``; lengths below count a row's
    tokens, padding excluded.  ``cache``: the drafter's (sized by its ``round_tokens``), or a new one
    with ``round_tokens`` slots beyond the budget (PPD's candidates)."""

    def __init__(self, run: Run, exit_layer: int, head, cache: KVCache | None = None, round_tokens: int = 1):
        self.run, self.E, self.head = run, exit_layer, head
        self.L = run.n_layers
        if self.L < 2:
            raise GenerationError(
                "this model has one layer, and an early exit needs layers above it to verify: use greedy"
            )
        if not 1 <= exit_layer < self.L:
            raise GenerationError(f"exit_layer={exit_layer} must be in [1, {self.L - 1}] (n_layers-1) on this model")
        self.cache = run.new_cache(extra=round_tokens) if cache is None else cache
        self.h_pending: list[torch.Tensor | None] = [None] * run.batch  # per row [lower - upper, D]

    def small_length(self, row: int = 0) -> int:
        return int(self.cache.lengths[0, row] - self.cache.pad[row])

    def large_length(self, row: int = 0) -> int:
        return int(self.cache.lengths[self.L - 1, row] - self.cache.pad[row])

    def lengths(self, row: int = 0) -> tuple[int, int, int]:
        """``(small_length, large_length, padding)`` of ``row`` from one read of the cache's lengths."""
        col, pad = self.cache.lengths[:, row].tolist(), int(self.cache.pad[row])
        return col[0] - pad, col[self.L - 1] - pad, pad

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts through every layer -> (the exit head's logits, the model's logits) ``[B, V]``
        for the first new position."""
        h_exit, h = self.run.prefill_at(self.cache, (self.E, self.L))  # [B, T, D] after layers E and L
        return self.head(h_exit[:, -1:])[:, -1], self.run.logits(h[:, -1:])[:, -1]

    def _layers(
        self, states: dict[int, torch.Tensor], start: int, end: int, count_call: bool
    ) -> dict[int, torch.Tensor]:
        """Layers ``[start, end)`` over each listed row's states ``[S_row, D]`` in ONE call (other rows
        and shorter lists padded with zero states, rolled back) -> the listed rows' outputs."""
        B, S = self.run.batch, max(int(x.shape[0]) for x in states.values())
        if len(states) == B and all(x.shape[0] == S for x in states.values()):  # nothing padded: nothing to roll back
            h = states[0].unsqueeze(0) if B == 1 else torch.stack([states[row] for row in range(B)])
            h = self.run.forward(self.cache, h=h, start=start, end=end, count_call=count_call)
            return {row: h[row] for row in states}
        D = next(iter(states.values())).shape[-1]
        h = next(iter(states.values())).new_zeros(B, S, D)
        for row, x in states.items():
            h[row, : x.shape[0]] = x
        layers = range(start, end)
        keep = self.cache.lengths[start].clone()
        # a padded slot may sit past the context's last position (a row near its end beside a longer
        # one): it is rolled back below, so any position in range serves it
        pos = self.run.positions(self.cache, S, start).clamp(max=self.run.model.config.max_position - 1)
        h = self.run.forward(
            self.cache, h=h, start=start, end=end, positions=pos, count_call=count_call, rows=list(states)
        )
        for row, x in states.items():
            keep[row] += x.shape[0]
        self.cache.truncate(keep, layers=layers)
        return {row: h[row, : x.shape[0]] for row, x in states.items()}

    def _embed(self, tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        model = self.run.model
        return {
            row: model.embed(torch.tensor([t], dtype=torch.long, device=model.device))[0] for row, t in tokens.items()
        }

    def small_steps(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Layers ``[0, E)`` of each listed row's tokens (one call) -> the exit head's logits ``[V]``
        after the row's last token; their layer-E states wait for the large pass."""
        out = self._layers(self._embed(feed), 0, self.E, count_call=True)
        logits = {}
        for row, h in out.items():
            self.h_pending[row] = h if self.h_pending[row] is None else torch.cat([self.h_pending[row], h])
            logits[row] = self.head(h[-1:].unsqueeze(0))[0, -1]
        return logits

    def small_step(self, tokens: list[int]) -> torch.Tensor:
        return self.small_steps({0: tokens})[0]

    def large_passes(self, fed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """``fed[row]`` = everything after the row's upper layers' cache.  Tokens the small model
        already ran continue from their layer-E states; the rest (at most the newest two) run from
        the embedding.  One model call -> logits ``[len(fed[row]), V]`` per row."""
        fresh = {}
        for row, tokens in fed.items():
            small, large, _ = self.lengths(row)
            ahead = small - large  # tokens with a layer-E state waiting
            if tokens[ahead:]:
                fresh[row] = tokens[ahead:]
        low = self._layers(self._embed(fresh), 0, self.E, count_call=True) if fresh else {}
        states = {}
        for row in fed:
            parts = [x for x in (self.h_pending[row], low.get(row)) if x is not None]
            states[row] = torch.cat(parts) if len(parts) > 1 else parts[0]
            self.h_pending[row] = None
        out = self._layers(states, self.E, self.L, count_call=not fresh)
        return {row: self.run.logits(h.unsqueeze(0))[0] for row, h in out.items()}

    def large_pass(self, tokens: list[int]) -> torch.Tensor:
        return self.large_passes({0: tokens})[0]

    def truncate(self, n: int, row: int = 0) -> None:
        """Roll ``row`` back to its first ``n`` tokens in every layer (no-op where it holds fewer)."""
        lower, upper, pad = self.lengths(row)
        for layers, length in ((range(self.E, self.L), upper), (range(0, self.E), lower)):
            if length > n and self.run.batch == 1:
                self.cache.truncate(n + pad, layers=layers)
            elif length > n:
                new = self.cache.lengths[layers.start].clone()
                new[row] = n + pad
                self.cache.truncate(new, layers=layers)
        if lower > n:
            keep = n - min(upper, n)
            pending = self.h_pending[row]
            self.h_pending[row] = pending[:keep] if keep > 0 and pending is not None else None


class EarlyExitDrafter(StepDrafter):
    """The drafter over ``EarlyExit``: layers ``[0, E)`` and the exit head write the chains
    (``ChainRule``); the target scores them with layers ``[E, n_layers)`` continuing from the drafts'
    layer-E states (self-speculative decoding, BiLD's early-exit form).  Every row of a batch drafts
    in the same steps and is scored in one call."""

    batched = True

    def __init__(self, run: Run, exit_layer: int, head, rule: ChainRule, draft_first: bool = False):
        self.draft_first = draft_first  # BiLD: the small model proposes the first token too
        super().__init__(run, rule)
        self.pair = EarlyExit(run, exit_layer, head, cache=self.cache)

    def prefill(self) -> torch.Tensor:
        self.draft_logits, self.first_logits = self.pair.prefill()
        return self.first_logits

    def own_length(self, row: int) -> int:
        return self.pair.small_length(row)

    def step_logits(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        return self.pair.small_steps(feed)

    def score(self, cands):
        fed = {row: c.fed() for row, c in enumerate(cands) if c is not None and c.fed()}  # after the upper cache
        logits = self.pair.large_passes(fed) if fed else {}
        return [
            None
            if c is None
            else self._with_first(row, c, logits[row])
            if row in logits
            else self.first_logits[row : row + 1]
            for row, c in enumerate(cands)
        ]

    def update(self, cands, results) -> None:
        for row, r in enumerate(results):
            if r is not None:
                self.pair.truncate(len(self.seq(row)) + len(r[0]), row)  # the root and the accepted drafts stay
        self.update_length(cands, results)


# -- exit heads -----------------------------------------------------------------------------------
def exit_head(model, exit_layer: int, head="auto"):
    """-> (callable ``h [B, S, D] -> logits [B, S, V]``, a label).  ``head``: "auto" (a shipped trained
    head for the layer if there is one, else the shared head), "shared" (the model's final norm and
    unembedding), "trained" (a shipped head, ``layerleap.drafters.exit_heads``), a path to a head file
    (``layerleap align`` writes one), or a callable."""
    if isinstance(head, exit_heads.ExitHead):  # checked as the other early-exit methods check it: its layer and model
        return exit_heads.get_head(model, exit_layer, head), "custom"
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
