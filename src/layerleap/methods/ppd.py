"""Predictive Pipelined Decoding (PPD; Yang et al. 2023, Algorithms 1 and 2, Theorem 4.1), emulated on
one device with the paper's clock.

The main process runs layers ``[0, d̄)`` of the newest token ``x_t``, takes the exit head's top-k
tokens as candidates for ``x_{t+1}`` and hands one to each of ``k`` sub-processes; while the main
process runs layers ``[d̄, d)`` of ``x_t`` (``d - d̄`` time units), every sub-process runs its
candidate through layers ``[0, d - d̄)`` at the next position.  When the full model's token equals a
candidate, that sub-process's hidden state after layer ``d - d̄`` and its KV entries are taken over
and the main process continues ``x_{t+1}`` from layer ``d - d̄`` (Algorithm 2; with ``d̄ = d/2``
it continues at ``d̄`` directly, Algorithm 1); otherwise they are dropped and ``x_{t+1}`` starts at
layer 0.  Every emitted token is the full model's argmax, so the output is greedy decoding, exactly.

Here the "processes" run one after another on one device: the candidates of all ``k`` sub-processes
go through their layers in ONE batched pass (siblings at the same position, each seeing the cache
and itself), and the cache keeps the matched candidate's entries (``KVCache.compact``) or drops
them (``truncate``).  The time the algorithm WOULD take on ``k + 1`` compute units is measured on
the paper's clock (one time unit = one layer; the prompt pass counts as one pass of ``d`` layers):
a clock for the main process advances by the layers it runs and waits for a sub-process's result
when it takes one over; compute is every layer any unit runs.  ``layerleap/ppd_parallel.py`` runs the
same algorithm on real processes.

Only ``d̄ >= d/2`` is defined (the paper's Appendix C): below it a sub-process would need layers
the main process has not finished for the previous token.

Stats: ``exit_layer`` (d̄), ``k``, ``head``; ``trials`` (tokens whose processing could start early:
all but the last), ``matches``, ``p_correct`` (matches / trials, the realised p̂), ``runs`` (N),
``run_lengths``; ``latency_units`` / ``compute_units`` (the clock; ``greedy_units`` = d·ℓ),
``theorem_latency_units`` / ``theorem_compute_units`` (Theorem 4.1 at the realised p̂),
``latency_per_token`` / ``compute_per_token`` / ``compute_per_time_unit`` (in layers and units).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core import sampling, verify
from ..core import options as O
from ..core.run import GenerationError, Run, register
from ..core.stats import PPDStats
from ..drafters.early_exit import EarlyExit


# -- Theorem 4.1: the expected cost each run reports beside its measured one -----------------------
def theorem_latency(d: int, dbar: int, n_tokens: int, p: float) -> float:
    """Theorem 4.1: expected latency d·ℓ − (d − d̄)(ℓ − 1)p of ℓ tokens (time units)."""
    return d * n_tokens - (d - dbar) * (n_tokens - 1) * p


def theorem_compute(d: int, dbar: int, k: int, n_tokens: int, p: float) -> float:
    """Theorem 4.1: expected total compute d·ℓ − (d − d̄)(ℓ − 1)p + k(d − d̄)ℓ."""
    return theorem_latency(d, dbar, n_tokens, p) + k * (d - dbar) * n_tokens


def min_exit_layer(n_layers: int) -> int:
    """The smallest d̄ the algorithm is defined for: ceil(d / 2)."""
    return (n_layers + 1) // 2


@dataclass
class Clock:
    """The paper's time units on ``k + 1`` compute units (one unit of time = one layer)."""

    main: int = 0  # when the main process finishes what it was given
    compute: int = 0  # layer-units run on every unit
    sub_done: int = 0  # when the sub-processes finish their candidates

    def run_main(self, layers: int, after: int = 0) -> None:
        self.main = max(self.main, after) + layers
        self.compute += layers

    def run_subs(self, k: int, layers: int) -> None:
        self.sub_done = self.main + layers  # they start when the candidates are handed out
        self.compute += k * layers


@dataclass
class Runs:
    """Runs of consecutively generated tokens: a token whose early candidate matched continues the run."""

    lengths: list[int] = field(default_factory=lambda: [1])
    matches: int = 0
    trials: int = 0

    def add(self, matched: bool) -> None:
        self.trials += 1
        if matched:
            self.matches += 1
            self.lengths[-1] += 1
        else:
            self.lengths.append(1)

    @property
    def p_correct(self) -> float | None:
        return self.matches / self.trials if self.trials else None


def stats(d: int, dbar: int, k: int, n_tokens: int, runs: Runs, clock: Clock, head: str | None = None) -> PPDStats:
    """The statistics every PPD executor reports (this emulation and the multi-process one)."""
    p = runs.p_correct
    return PPDStats(
        exit_layer=dbar,
        k=k,
        trials=runs.trials,
        matches=runs.matches,
        p_correct=p,
        runs=len(runs.lengths),
        run_lengths=list(runs.lengths),
        latency_units=clock.main,
        compute_units=clock.compute,
        greedy_units=d * n_tokens,
        theorem_latency_units=theorem_latency(d, dbar, n_tokens, p or 0.0) if n_tokens else 0.0,
        theorem_compute_units=theorem_compute(d, dbar, k, n_tokens, p or 0.0) if n_tokens else 0.0,
        latency_per_token=clock.main / n_tokens if n_tokens else None,
        compute_per_token=clock.compute / n_tokens if n_tokens else None,
        normalised_latency=clock.main / (d * n_tokens) if n_tokens else None,
        compute_per_time_unit=clock.compute / clock.main if clock.main else None,
        head=head,
    )


def top_candidates(head_logits: torch.Tensor, k: int) -> torch.Tensor:
    """The early top-k ``[k]`` of one logits row ``[V]`` (best first; for k = 1 the argmax by
    ``sampling.top_ids``, 3 against 58 us for ``topk`` over 49,152 logits)."""
    if k == 1:
        return torch.tensor([sampling.top_ids(head_logits)])
    return head_logits.topk(k).indices.cpu()


EXIT_LAYER = O.EXIT_LAYER.but(
    lo=O.HALF_DEPTH,
    none="ceil(n_layers/2)",
    help="d̄, the early-prediction layer: PPD is defined for d̄ >= d/2 (the paper's Algorithm 2)",
)
OPTIONS = (EXIT_LAYER, O.K, O.HEAD, O.DRAFT_VOCAB)


@register("ppd", exact=True, options=OPTIONS)
def ppd(run: Run, *, exit_layer: int | None = None, k: int = 1, head="auto", draft_vocab="auto"):
    """Predictive Pipelined Decoding (exact greedy): early top-k at layer exit_layer (default d/2) start k
    pipelined sub-passes (clock in layer units).  draft_vocab: the exit head scores only a shipped set
    of frequent tokens ('auto'), all tokens ('full'), or a draft-vocabulary file's."""
    from ..drafters.draft_vocab import get_draft_vocab, with_draft_vocab
    from ..drafters.exit_heads import get_head

    model = run.model
    d = run.n_layers
    dbar = min_exit_layer(d) if exit_layer is None else exit_layer
    vocab = get_draft_vocab(model, draft_vocab)
    if vocab is not None and k > vocab.size:
        raise GenerationError(f"k={k} is more than the draft vocabulary ({vocab.size} tokens): lower k")
    exit_head = with_draft_vocab(get_head(model, dbar, head), vocab)
    lo = d - dbar  # the layers a sub-process runs before the main process needs its result
    pair = EarlyExit(run, dbar, exit_head, round_tokens=k + 1)
    cache = pair.cache
    head_logits, logits = (both[0] for both in pair.prefill())  # the prompt: all layers; the exit head at its end
    clock, runs = Clock(), Runs()
    h_mid: torch.Tensor | None = None  # [1, 1, D] x_t after layer d̄ (set from the second token on)
    clock.run_main(dbar)
    dev = model.device
    pos = len(run.prompts[0])  # position (= cache slot) of x_{t+1}
    # candidates see the cache and themselves, not each other (one candidate: every slot, no mask to build)
    sibling = torch.eye(k, dtype=torch.bool) if k > 1 else None
    while True:
        cand = top_candidates(head_logits, k)  # [k]
        # the k sub-processes: candidates for x_{t+1} through layers [0, d - d̄), one batched pass
        h_cand = run.forward(
            cache,
            cand.view(1, k).to(dev),
            start=0,
            end=lo,
            positions=torch.full((1, k), pos, dtype=torch.long, device=dev),
            mask=sibling,
            count_call=False,
        )  # [1, k, D]
        clock.run_subs(k, lo)
        if logits is None:  # the main process: layers [d̄, d) of x_t
            logits = run.logits(run.forward(cache, h=h_mid, start=dbar, end=d))[0, -1]
        clock.run_main(d - dbar)
        x = sampling.top_ids(logits)
        run.capture(0, logits.unsqueeze(0), [x])
        if run.emit(0, [x]):
            cache.truncate(pos, layers=range(0, lo))  # the last candidates are not needed
            break
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            break
        j = verify.match_candidate(cand, x)
        runs.add(j is not None)
        at = torch.tensor([[pos]], dtype=torch.long, device=dev)
        if j is not None:  # take over the sub-process's state and KV entries: continue at layer d - d̄
            cache.compact(pos, torch.tensor([j]), layers=range(0, lo))
            h_mid = h_cand[:, j : j + 1]
            if lo < dbar:  # (d̄ = d/2: the sub-process has run every layer below d̄, and no call is left)
                h_mid = run.forward(cache, h=h_mid, start=lo, end=dbar, positions=at)
            clock.run_main(dbar - lo, after=clock.sub_done)
        else:  # drop the candidates: x_{t+1} from layer 0
            cache.truncate(pos, layers=range(0, lo))
            h_mid = run.forward(cache, torch.tensor([[x]], device=dev), start=0, end=dbar, positions=at)
            clock.run_main(dbar)
        head_logits = exit_head(h_mid)[0, -1]
        logits = None
        pos += 1
    run.record([stats(d, dbar, k, len(run.out[0]), runs, clock, head=exit_head.kind)])


def expected_speedup(d: int, dbar: int, p: float) -> float:
    """Greedy latency over PPD's for long outputs: d / (d − (d − d̄)p) (eq. 3 generalised)."""
    return d / (d - (d - dbar) * p) if not math.isclose(d - (d - dbar) * p, 0.0) else math.inf
