"""Big Little Decoder (BiLD; Kim et al. 2023, §3, Algorithm 1, §4.4), for decoder-only models.

A small model generates autoregressively.  **Fallback**: when its top probability is not above
``alpha_fb`` (or it has run ``max_small`` tokens in a row) the large model takes the step: it runs
ONCE, non-autoregressively, over every small-model token it has not seen.  **Rollback**: in that
same pass it scores each pending small token; the first one whose cross-entropy under the large
model, ``-log p_L(token)``, exceeds ``alpha_rb`` is discarded with everything after it, and the
large model's own token takes its place.  With no rollback the large model adds its next token.
Small-model tokens still pending when generation ends (budget or EOS) are checked the same way
before the result is returned, so every emitted small token passed the rollback policy (with
``alpha_rb = inf`` that last pass is skipped: it could not change anything).

Two forms:

- **two models** (``small=``): a small and a large model with the same tokenizer, each with its
  own KV cache; the small model's cost is metered in ``small_calls`` / ``small_layer_evals``.
- **early exit** (``exit_layer=E``, §4.4): ONE model; layers ``[0, E)`` and an exit head are the
  small model.  Small steps write the KV entries of layers ``[0, E)`` and keep their layer-E hidden
  states; when the large model takes over it runs layers ``[E, n_layers)`` from those states (and
  the full stack only for tokens the small model has not run), so the skipped layers' caches hold
  real values, not CALM's copies of the exit state, and no layer is computed twice for a kept token.

Both caches roll back exactly (``KVCache.truncate``): a rejected token and everything after it
leave every layer; kept tokens are never recomputed.  Greedy (``do_sample=False``) or sampling
(both models sample from their distributions warped by temperature / top-k / top-p; the fallback
and rollback tests use those same distributions).

Exact limits (tested): ``alpha_fb=1`` (always fall back) gives the large model's greedy output;
``alpha_rb <= ln 2`` (0.69) keeps only small tokens the large model gives at least half its
probability, i.e. its argmax, and so also gives its greedy output; ``alpha_fb=0, alpha_rb=inf,
max_small=None`` (never fall back, never roll back, no run limit) gives the small model's greedy
output.

Stats: ``small_steps`` (small-model forward steps), ``small_tokens`` (tokens it proposed),
``large_calls`` (large passes after the prompt) = ``fallbacks`` (low confidence) + ``forced``
(run limit) + ``final_checks`` (pending tokens at the end), ``rollbacks``, ``rolled_back`` (small
tokens discarded), ``large_tokens`` (tokens the large model chose), ``fallback_rate`` =
fallbacks / small_steps, ``rollback_rate`` = rollbacks / large_calls, ``exit_layer``, ``head``.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from ..core import sampling, verify
from ..core.run import GenerationError, Run, register
from ..drafters.companion import Companion, check_pair
from ..drafters.early_exit import EarlyExit, exit_head


# -- the two forms: the same five operations ------------------------------------------------------
class TwoModels:
    """A small and a large model, each with its own cache."""

    def __init__(self, run: Run, small):
        self.run = run
        self.cache = run.new_cache(extra=1)
        self.small = Companion(run, small, "small", extra_slots=1)

    @property
    def small_length(self) -> int:
        return self.small.length

    @property
    def large_length(self) -> int:
        return int(self.cache.lengths[0, 0])

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (small logits, large logits) ``[V]`` for the first new position."""
        p_large = self.run.logits(self.run.prefill(self.cache))[0, -1]
        return self.small.prefill(), p_large

    def small_step(self, tokens: list[int]) -> torch.Tensor:
        return self.small.forward(tokens)[-1]

    def large_pass(self, tokens: list[int]) -> torch.Tensor:
        """``tokens`` = everything after the large cache -> logits ``[S, V]`` (one model call)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.run.model.device)
        return self.run.logits(self.run.forward(self.cache, ids))[0]

    def truncate(self, n: int) -> None:
        if self.large_length > n:
            self.cache.truncate(n)
        self.small.truncate(n)


# -- the policy -----------------------------------------------------------------------------------
class BiLD:
    """Algorithm 1 over either form; ``decode()`` fills ``run``."""

    def __init__(self, run: Run, pair, alpha_fb: float, alpha_rb: float, max_small: int | None):
        self.run, self.pair = run, pair
        self.alpha_fb, self.alpha_rb, self.max_small = alpha_fb, alpha_rb, max_small
        self.eos = set(run.gen.eos_ids) if run.gen.stop_at_eos else set()
        self.stats = run.extra
        for k in ("small_steps", "small_tokens", "large_calls", "fallbacks", "forced", "final_checks",
                  "rollbacks", "rolled_back", "large_tokens"):
            self.stats[k] = 0
        self.large_first: torch.Tensor | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        g = self.run.gen
        return sampling.probs(logits, g.temperature, g.top_k, g.top_p) if g.do_sample else logits.float().softmax(-1)

    def pick(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> int:
        if not self.run.gen.do_sample:
            return int(logits.argmax())
        probs = self.probs(logits) if probs is None else probs
        return verify.draw(probs, self.run.generators[0])

    def decode(self) -> None:
        for _ in self.rounds():
            pass

    def rounds(self):
        """Algorithm 1, yielding after each large-model step (whose tokens are then final)."""
        run, pair, st = self.run, self.pair, self.stats
        prompt_len = len(run.prompts[0])
        seq = list(run.prompts[0])
        verified = prompt_len  # seq[:verified] are final (emitted); seq[verified:] are pending small tokens
        small_next, self.large_first = pair.prefill()
        while True:
            pending = len(seq) - verified
            room = run.gen.max_new_tokens - (len(seq) - prompt_len)
            if room <= 0 or (pending and seq[-1] in self.eos):
                kind = "final_checks"
            elif self.max_small and pending >= self.max_small:
                kind = "forced"
            else:
                if pair.small_length < len(seq):
                    small_next = pair.small_step(seq[pair.small_length:])
                st["small_steps"] += 1
                p = self.probs(small_next)
                if float(p.max()) > self.alpha_fb:  # confident: the small model's token
                    seq.append(self.pick(small_next, p))
                    st["small_tokens"] += 1
                    continue
                kind = "fallbacks"
            if kind == "final_checks" and math.isinf(self.alpha_rb):  # nothing can be rolled back
                run.emit(0, seq[verified:])
                break
            st[kind] += 1
            seq, done = self.large_step(seq, verified, final=kind == "final_checks")
            verified = len(seq)
            if done:
                break
            yield
        self.finish()

    def large_step(self, seq: list[int], verified: int, final: bool) -> tuple[list[int], bool]:
        """The large model's pass over everything it has not seen; the rollback policy over the
        pending tokens; then its own token.  -> (new sequence, all of it verified; done)."""
        run, pair, st = self.run, self.pair, self.stats
        start = pair.large_length
        rows = pair.large_pass(seq[start:]) if start < len(seq) else None
        st["large_calls"] += 1
        if self.large_first is not None:  # the prompt pass's prediction for position `start`
            base = start
            rows = self.large_first.unsqueeze(0) if rows is None else torch.cat([self.large_first.unsqueeze(0), rows])
            self.large_first = None
        else:
            base = start + 1  # rows[i] predicts seq[base + i]
        pending = seq[verified:]
        first = verified - base
        m = verify.first_rollback(torch.tensor(pending, dtype=torch.long),
                                  self.probs(rows[first:first + len(pending)]), self.alpha_rb)
        if m is not None:
            at = verified + m
            tok = self.pick(rows[at - base])
            new = seq[:at] + [tok]
            pair.truncate(at)
            st["rollbacks"] += 1
            st["rolled_back"] += len(pending) - m
            st["large_tokens"] += 1
        elif final:
            new = list(seq)
        else:
            new = seq + [self.pick(rows[len(seq) - base])]
            st["large_tokens"] += 1
        done = run.emit(0, new[verified:])
        return new, done

    def finish(self) -> None:
        st = self.stats
        st["fallback_rate"] = st["fallbacks"] / st["small_steps"] if st["small_steps"] else 0.0
        st["rollback_rate"] = st["rollbacks"] / st["large_calls"] if st["large_calls"] else 0.0


def default_exit_layer(model) -> int:
    """Three quarters of the depth (23 of 30 on SmolLM2-135M): what ``bild`` uses on one model when
    given neither ``small`` nor ``exit_layer``."""
    return max(1, min(model.config.n_layers - 1, round(0.75 * model.config.n_layers)))


# -- checks and the registered method -------------------------------------------------------------
def check_thresholds(alpha_fb, alpha_rb, max_small) -> None:
    if isinstance(alpha_fb, bool) or not isinstance(alpha_fb, Real) or not 0 <= alpha_fb <= 1:
        raise GenerationError(f"alpha_fb must be a probability in [0, 1] (the small model's top probability at "
                              f"or below which the large model takes over; 1 = always), got {alpha_fb!r}")
    if isinstance(alpha_rb, bool) or not isinstance(alpha_rb, Real) or math.isnan(alpha_rb) or alpha_rb < 0:
        raise GenerationError(f"alpha_rb must be a cross-entropy >= 0 (roll back a small token the large model "
                              f"gives probability below exp(-alpha_rb); inf = never), got {alpha_rb!r}")
    if max_small is not None and (isinstance(max_small, bool) or not isinstance(max_small, int) or max_small < 1):
        raise GenerationError(f"max_small must be an integer >= 1 (the longest run of small-model tokens before "
                              f"the large model checks them) or None for no limit, got {max_small!r}")


@register("bild", sampling=True, models=("small",))
def bild(run: Run, *, small=None, exit_layer: int | None = None, alpha_fb: float = 0.5, alpha_rb: float = 2.0,
         max_small: int | None = 10, head="auto"):
    """Big Little Decoder: a small model (small= or exit_layer=) with fallback and rollback to the large one."""
    check_thresholds(alpha_fb, alpha_rb, max_small)
    model = run.model
    if small is not None:
        if exit_layer is not None:
            raise GenerationError("give either small= (two models) or exit_layer= (early exit on one model), not both")
        if head != "auto":
            raise GenerationError("head= chooses the exit head of the early-exit form: drop it with small=")
        check_pair(model, small, "small", "small")
        pair = TwoModels(run, small)
        run.extra["exit_layer"] = None
        run.extra["head"] = None
    else:
        E = default_exit_layer(model) if exit_layer is None else exit_layer
        n = model.config.n_layers
        if isinstance(E, bool) or not isinstance(E, int) or not 1 <= E < n:
            raise GenerationError(f"exit_layer must be an integer in [1, {n - 1}] (the small model is layers "
                                  f"[0, exit_layer) of this {n}-layer model), got {exit_layer!r}")
        fn, label = exit_head(model, E, head)
        pair = EarlyExit(run, E, fn)
        run.extra["exit_layer"] = E
        run.extra["head"] = label
    yield from BiLD(run, pair, float(alpha_fb), float(alpha_rb), max_small).rounds()
