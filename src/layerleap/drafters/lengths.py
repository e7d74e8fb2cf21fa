"""Draft lengths from the running acceptance: how many of a chain's drafts are worth a call.

A call over ``S`` new tokens costs ``c(S)`` one-token calls (``curve_for``: this machine's curve for
the model where ``layerleap info --call-cost`` saved one, else the weight format's ``CALL_COST``).
A chain of ``L`` drafts whose i-th draft is kept, given the ones before it were, with probability
``a_i`` emits ``E(L) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_L`` tokens.  Each round keeps the ``L``
(0 included: a greedy step) that maximises ``E(L) / c(L + 1)``, the tokens per unit of call cost,
with ``a_i`` estimated per row from the rounds so far (decaying counts under a uniform prior).  A
round whose drafts are all kept still learns the next position's rate: the target's next token shows
whether the first draft cut away would have been kept (a round that drafts nothing learns ``a_1``).
The choice cuts what is verified, never what is accepted, so a lossless method stays lossless."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core import cost_curve

# Call cost over S = 1..8 new tokens relative to one token, 256 cached tokens, 2 threads (fp32 and
# bf16: a 2-core AMD EPYC Zen 5, docs/results/call_cost_1to8_<dtype>_t2.json; q4: the same machine
# with the native block kernel, `layerleap info --dtype q4 --call-cost --threads 2`, the curve it
# saved; torch's int4 kernel there cost x1.12 / 1.34 / 2.09 at S = 2 / 4 / 8).  A curve that dips
# (timing noise) is held at its running maximum.
CALL_COST = {
    "float32": (1.0, 1.065, 1.133, 1.133, 1.133, 1.133, 1.264, 1.264),
    "bfloat16": (1.0, 1.088, 1.162, 1.232, 1.277, 1.366, 1.52, 1.568),
    "q4": (1.0, 1.054, 1.167, 1.229, 1.339, 1.453, 1.548, 1.689),
}
CALL_COST["float16"] = CALL_COST["bfloat16"]
# Where a 2-token call costs at least this many one-token calls, chains are cut by default
# (``adaptive``): in q4 at 1 thread on a Zen 4 EPYC, where rows cost, the cut gave 1.13x greedy against
# 1.08x for fixed chains (15 Spec-Bench prompts, docs/BENCHMARKS.md); where rows are nearly free (fp32
# x1.07, the shipped q4 curve x1.05) it changes little.
ADAPTIVE_STEP = 1.10
# The call cost at 16 new tokens relative to one (the same machines and threads,
# docs/results/call_cost_after_<dtype>_t2.json), for calls past 8 tokens (dynamic trees).
CALL_COST_16 = {"float32": 1.591, "bfloat16": 2.13, "float16": 2.13, "q4": 2.867}
DECAY = 0.9  # weight of the past rounds in the acceptance counts
PRIOR = (1.0, 1.0)  # kept, missed pseudo-counts of every draft position (a uniform prior: 0.5)


def call_cost(costs: tuple[float, ...], s: int) -> float:
    """``c(s)``: the curve's value, extended linearly past its end."""
    if s <= len(costs):
        return costs[s - 1]
    step = costs[-1] - costs[-2]
    return costs[-1] + step * (s - len(costs))


@dataclass(frozen=True)
class CostCurve:
    """``c(S)``, a model call over ``S`` new tokens in one-token calls: ``costs`` for S = 1..8, then
    linear to ``c16`` at 16 tokens and on at that slope.  ``source``: "measured" (this machine's, saved
    by ``layerleap info --call-cost``) or "shipped" (the weight format's ``CALL_COST``)."""

    costs: tuple[float, ...]
    c16: float
    source: str = "shipped"

    def __call__(self, s: int) -> float:
        if s <= len(self.costs):
            return self.costs[s - 1]
        return self.costs[-1] + (self.c16 - self.costs[-1]) * (s - len(self.costs)) / (16 - len(self.costs))


def shipped_curve(dtype_name: str) -> CostCurve:
    """The weight format's shipped curve (fp32's for a format without one)."""
    return CostCurve(
        CALL_COST.get(dtype_name, CALL_COST["float32"]), CALL_COST_16.get(dtype_name, CALL_COST_16["float32"])
    )


def curve_for(model) -> CostCurve:
    """``model``'s curve on this machine: the one ``layerleap info --call-cost`` saved for it (on a GPU
    without one: measured now, ``cost_curve.for_model``), else the shipped one.  A measured curve that
    dips (timing noise) is held at its running maximum."""
    ratios = cost_curve.for_model(model)
    if ratios is None:
        return shipped_curve(model.dtype_name)
    costs, top = [], 0.0
    for s in range(1, 9):
        top = max(top, ratios[s] / ratios[1])
        costs.append(top)
    return CostCurve(tuple(costs), max(top, ratios[16] / ratios[1]), "measured")


def expected_tokens(rates: list[float], length: int) -> float:
    """``E(L)``: tokens a round emits with ``length`` drafts kept with conditional rates ``rates``."""
    total, p = 1.0, 1.0
    for a in rates[:length]:
        p *= a
        total += p
    return total


def best_length(rates: list[float], costs, most: int) -> int:
    """The ``L`` in ``0..most`` with the most expected tokens per unit of call cost (the shorter on a tie);
    ``costs``: the curve ``c(S)`` (a ``CostCurve``), or its values for S = 1, 2, .. (``call_cost``)."""
    cost = costs if callable(costs) else lambda s: call_cost(costs, s)
    return max(range(most + 1), key=lambda n: (expected_tokens(rates, n) / cost(n + 1), -n))


@dataclass
class RunningAcceptance:
    """Decaying counts of one row's kept and tried drafts per position (position i is tried when the
    i drafts before it were kept)."""

    size: int
    kept: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.kept = [0.0] * self.size
        self.tried = [0.0] * self.size

    def rates(self) -> list[float]:
        a, b = PRIOR
        return [(k + a) / (t + a + b) for k, t in zip(self.kept, self.tried)]

    def observe(self, drafted: int, accepted: int) -> None:
        """A round that verified ``drafted`` drafts and kept the first ``accepted``."""
        self.kept = [DECAY * k for k in self.kept]
        self.tried = [DECAY * t for t in self.tried]
        for i in range(min(accepted + 1, drafted, self.size)):
            self.tried[i] += 1.0
            self.kept[i] += float(i < accepted)


def adaptive_default(model) -> bool:
    """Whether chains are cut by default: where a 2-token call costs ``ADAPTIVE_STEP`` or more."""
    return curve_for(model)(2) >= ADAPTIVE_STEP


class LengthChooser:
    """Per row of a batch: cuts each round's chain to its best length (``cut``) and learns from what
    the target kept (``observe``)."""

    def __init__(self, batch: int, curve: CostCurve, most: int):
        self.curve = curve  # past its 8 measured sizes, on to ``c16`` and at that slope
        self.rows = [RunningAcceptance(most) for _ in range(batch)]
        self.first: list[int | None] = [None] * batch  # the first draft cut away (None: none cut away)

    def cut(self, row: int, chain: list[int]) -> list[int]:
        n = best_length(self.rows[row].rates(), self.curve, len(chain)) if chain else 0
        self.first[row] = chain[n] if n < len(chain) else None
        return chain[:n]

    def observe(self, row: int, drafted: int, accepted: int, next_token: int | None) -> None:
        """A round that verified ``drafted`` drafts, kept the first ``accepted`` and gave ``next_token``:
        where every verified draft was kept, the next token shows whether the first draft cut away
        would have been kept too (so a chain cut short still learns whether to grow)."""
        if accepted == drafted and self.first[row] is not None and next_token is not None:
            self.rows[row].observe(drafted + 1, drafted + int(next_token == self.first[row]))
        elif drafted:
            self.rows[row].observe(drafted, accepted)
        self.first[row] = None


TREE_PRIOR = 1.5  # tokens a round's tree alone gives, before a row has observed any


class MergedChainCut:
    """Per row of a batch: cuts the lookup chain merged into a tree (``auto``'s EAGLE, transfer and
    Medusa calls, ``auto.merge_chain``) to the length whose new rows pay for themselves.

    The chain follows the tree's nodes for its first ``s`` drafts (``shared``) and branches off there.
    Where the chain is kept past ``s``, the tree is kept to exactly ``s`` (its own node at ``s + 1``
    differs from the chain's), so the chain's first ``n`` drafts add ``P_(s+1) + ... + P_n`` expected
    tokens (``P_i``: the chain kept to ``i``, from the row's running acceptance) to the tree's own
    ``T`` (a decaying mean of the tokens the tree alone gave; 1 where the round has no tree), for
    ``n - s`` rows more.  Each round keeps the ``n`` with the most ``(T + gain(n)) / c(nodes + 1 + n - s)``
    (``c``: the call's price, ``cut``'s ``price``).  The chain's acceptance is
    learned from the whole chain against what the call showed of the target's continuation (its kept
    tokens and the next one), so a cut chain still learns."""

    def __init__(self, batch: int, curve: CostCurve, most: int):
        self.curve = curve
        self.rows = [RunningAcceptance(most) for _ in range(batch)]
        self.tree_tokens = [TREE_PRIOR] * batch
        self.pending: dict[int, tuple[list[int], int]] = {}  # row -> (its whole chain, the tree's nodes)

    def cut(self, row: int, chain: list[int], shared: int, nodes: int, price=None) -> list[int]:
        """``chain``'s best prefix beside a tree of ``nodes`` drafts whose first ``shared`` it follows;
        ``price``: a call over ``S`` rows, the root included, in one-token calls (None: ``curve``; a
        transfer call's is more, its rows' pseudo states run too)."""
        price = self.curve if price is None else price
        self.pending[row] = (chain, nodes)
        base, gain, p = self.tree_tokens[row] if nodes else 1.0, 0.0, 1.0  # no tree (yet): the root's token alone
        best, best_n = base / price(nodes + 1), 0
        for n, a in enumerate(self.rows[row].rates()[: len(chain)], start=1):
            p *= a
            gain += p if n > shared else 0.0
            score = (base + gain) / price(nodes + 1 + max(0, n - shared))
            if score > best:
                best, best_n = score, n
        return chain[:best_n]

    def observe(self, row: int, kept: list[int], kept_at: list[int], next_token: int | None) -> None:
        """A call that kept the drafts ``kept``, at offsets ``kept_at`` among the merged drafts (the tree's
        nodes first, ``merge_chain``), and gave ``next_token``."""
        if row not in self.pending:
            return
        chain, nodes = self.pending.pop(row)
        tree_kept = sum(j < nodes for j in kept_at)
        known = kept + ([] if next_token is None else [next_token])
        drafted = min(len(chain), len(known))
        matched = next((i for i in range(drafted) if chain[i] != known[i]), drafted)
        if drafted:
            self.rows[row].observe(drafted, matched)
        if nodes:
            self.tree_tokens[row] = DECAY * self.tree_tokens[row] + (1 - DECAY) * (1 + tree_kept)
