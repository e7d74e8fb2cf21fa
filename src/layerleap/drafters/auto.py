"""The ``auto`` drafter: prompt lookup's copied chain and Hidden Transfer's or Medusa's tree in one
verification call, and a choice, round by round, between the kinds of call by the tokens per
millisecond each has given on this request, on this machine.

- a *plain* call (``"lookup"``): the root and the prompt-lookup chain (none where nothing matches:
  then the call is a greedy step, at a greedy step's cost);
- a *transfer* call (``"transfer"``): Hidden Transfer's pass (``trees.transfer_pass``) over the root,
  the tree drafted from the last transfer call's pseudo states and, for one row, the lookup chain
  merged into that tree as one more branch (``merge_chain``); it verifies them and makes the pseudo
  states that draft the next tree;
- a *Medusa* call (``"medusa"``): the root and the tree Medusa's heads drafted from the last call's
  state at its last kept node (whatever that call's kind), with the lookup chain merged in as above.
  The heads run only after a round whose successor is a Medusa round.

Each mode's rate is a decaying sum of emitted tokens over a decaying sum of wall milliseconds per
round (proposal, call, acceptance and drafting: what the round cost here).  A tree call verifies the
lookup chain merged into its tree, so every tree round also shows what a plain call would have
given there: the chain's drafts while they agree with what the round emitted, plus one (exact under
greedy decoding, where what is emitted does not depend on the drafts).  That is read into the plain
mode's rate, priced at the milliseconds per unit of call cost (``lengths.curve_for``'s curve) the
plain rounds took, so plain calls are never probed.  The drafter starts with ``FIRST_PROBE`` plain
rounds, then probes Medusa calls (and, after a gap, transfer calls: the first transfer round after
another kind has no tree yet and is not counted) for ``PROBE`` rounds each, and follows the fastest
mode (of those with ``PROBE`` rounds, the current one included).  Tree modes are probed again, in
turn, after a gap that doubles each time a probe does not change the mode, but only where they might
win: a tree call keeps what the chain alone keeps and at most its tree's depth or the chain's
agreement, plus one, and fills the share of that room its own rounds filled (under a uniform prior:
half, before it ran), so every round estimates each tree mode's rate (``Bound``, priced at its own rounds'
milliseconds per unit of call cost, else the plain rounds').  No probe starts with fewer than
``LAST_PROBE`` tokens left.  The choice changes only which drafts are verified, never what is accepted: greedy output is
greedy decoding, and sampled output is lossless (every draft is a deterministic, one-hot proposal,
siblings distinct).

A batch shares the mode; a tree call then verifies every row's tree of the one shape (the lookup
chains ride only in plain calls, where chains of any length pad; the plain mode is still read from a
tree round, and no bound is drawn)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core import tree as tree_mod
from ..core.run import Run
from ..core.stats import AutoStats
from ..core.tree import Candidates
from .prompt_lookup import NgramIndex
from .draft_vocab import DraftVocab
from .lengths import PRIOR, LengthChooser, curve_for
from .trees import TreeDrafter, draft_logits, medusa_logits, top_drafts, transfer_pass

MODES = ("lookup", "transfer", "medusa")
FIRST_PROBE = 3  # plain rounds before the first probe, when the drafter starts with plain calls (0: at once)
PROBE = 4  # counted rounds a probe lasts
GAP = 8  # rounds between probes, doubled after each probe that does not change the mode
DECAY = 0.85  # weight of the past in a mode's rate
LAST_PROBE = 16  # no probe starts with fewer tokens than this left to the request


@dataclass
class Rate:
    """Tokens per millisecond of one mode: decaying sums over the rounds it ran and the rounds of
    other modes that showed what it would have given (added with an estimated wall time)."""

    tokens: float = 0.0
    ms: float = 0.0
    call_ms: float = 0.0  # the rounds run: their wall time less drafting for later rounds
    units: float = 0.0  # ... and their calls' cost in one-token calls
    rounds: int = 0  # rounds run or read
    runs: int = 0  # rounds run

    def add(self, tokens: int, ms: float, call_ms: float = 0.0, units: float = 0.0) -> None:
        """A round run (or read, with ``call_ms`` and ``units`` 0)."""
        self.tokens = DECAY * self.tokens + tokens
        self.ms = DECAY * self.ms + ms
        self.call_ms = DECAY * self.call_ms + call_ms
        self.units = DECAY * self.units + units
        self.rounds += 1
        self.runs += int(units > 0)

    @property
    def ms_per_unit(self) -> float | None:
        """Milliseconds a unit of call cost has taken in the rounds run (None before one)."""
        return self.call_ms / self.units if self.units > 0 else None

    @property
    def value(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


@dataclass
class Bound:
    """What a tree mode's call would have given in the rounds of other modes: decaying sums of its
    estimated tokens there and of that call's cost (one-token calls).  A tree call keeps what the
    chain alone would (``plain``) and at most ``most``; it is estimated to keep ``plain + hit * (most -
    plain)``, ``hit`` the share of that room its own rounds filled (decaying sums under a uniform prior,
    ``lengths.PRIOR``: one token of room filled, one not)."""

    tokens: float = 0.0
    units: float = 0.0
    filled: float = 0.0
    room: float = 0.0

    @property
    def hit(self) -> float:
        kept, missed = PRIOR
        return (self.filled + kept) / (self.room + kept + missed)

    def add(self, plain: int, most: int, units: float) -> None:
        """A round of another mode: the chain alone kept ``plain`` tokens; this mode's call could have kept
        ``most`` at cost ``units``."""
        self.tokens = DECAY * self.tokens + plain + self.hit * (most - plain)
        self.units = DECAY * self.units + units

    def own(self, tokens: int, plain: int, most: int) -> None:
        """A round of this mode: it kept ``tokens`` where the chain alone would have kept ``plain``."""
        if most > plain:
            self.filled = DECAY * self.filled + tokens - plain
            self.room = DECAY * self.room + most - plain


class Chooser:
    """Which mode the next round uses: the fastest by ``Rate`` once each compared mode has ``PROBE``
    rounds.  The plain mode is read from every tree round (its chain is in the tree), so only tree
    modes are probed, and only those whose ``Bound`` estimate beats the current mode."""

    def __init__(self, modes: tuple[str, ...]):
        self.modes = modes
        self.rates = {m: Rate() for m in modes}
        self.bounds = {m: Bound() for m in modes if m != "lookup"}
        self.mode = modes[0]
        self.best = self.mode
        self.probe_left = 0
        self.next_probe = FIRST_PROBE
        self.gap = GAP
        self.rounds = 0
        self.switches = 0
        self.turn = -1  # the last probed of the tree modes, by position
        if len(modes) > 1 and self.next_probe == 0:  # probe at once
            self.probe_left = PROBE
            self.mode = self._next_probe()

    def record(
        self,
        mode: str,
        tokens: int,
        ms: float,
        counted: bool,
        units: float = 1.0,
        draft_ms: float = 0.0,
        plain: tuple[int, float] | None = None,
        left: int | None = None,
        bounds: dict[str, tuple[int, float]] | None = None,
    ) -> None:
        """One round's outcome (``units``: its call's cost in one-token calls; ``draft_ms``: time spent
        drafting for another mode; ``plain``: the tokens and call cost a plain round would have had here;
        ``left``: tokens the request has left; ``bounds``: tree mode -> the most tokens its call could
        have given here and that call's cost), then choose the next round's mode."""
        self.rounds += 1
        if counted:
            self.rates[mode].add(tokens, ms, ms - draft_ms, units)
        if plain is not None and mode != "lookup" and "lookup" in self.rates:
            self._read_plain(mode, ms - draft_ms, units, *plain)
        for m, (most, cost) in (bounds or {}).items():
            if m not in self.bounds or plain is None:
                continue
            if m != mode:
                self.bounds[m].add(plain[0], most, cost)
            elif counted:
                self.bounds[m].own(tokens, plain[0], most)
        if len(self.modes) == 1:
            return
        if self.probe_left > 0:
            self.probe_left -= int(counted)
            if self.probe_left == 0:
                self._end_probe()
            return
        if self.rounds >= self.next_probe and (left is None or left >= LAST_PROBE) and self._may_win():
            self.best, self.probe_left = self.mode, PROBE
            self._set(self._next_probe())
            return
        self._set(self._fastest())

    def _read_plain(self, mode: str, call_ms: float, units: float, tokens: int, plain_units: float) -> None:
        """The plain mode's round read from a tree round: its tokens, at the ms per unit of call cost its
        own rounds took (a tree's call may cost more than its size says: its attention is masked), else at
        the round's time less the tree's extra nodes."""
        lookup = self.rates["lookup"]
        if lookup.ms_per_unit is not None:
            lookup.add(tokens, plain_units * lookup.ms_per_unit)
        elif self.rates[mode].ms_per_unit is not None:
            lookup.add(tokens, max(call_ms - self.rates[mode].ms_per_unit * (units - plain_units), 0.1))

    def _fastest(self) -> str:
        """The fastest mode with ``PROBE`` rounds, if the current one has as many."""
        known = [m for m in self.modes if self.rates[m].rounds >= PROBE]
        if self.mode not in known:
            return self.mode
        return max(known, key=lambda m: self.rates[m].value)

    def _end_probe(self) -> None:
        """Keep the fastest; back off when the mode stays."""
        winner = max((m for m in self.modes if self.rates[m].rounds), key=lambda m: self.rates[m].value)
        self.gap = self.gap if winner != self.best else 2 * self.gap
        self.best = winner
        self.next_probe = self.rounds + self.gap
        self._set(winner)

    def _tree_modes(self, current: str) -> list[str]:
        """The modes a round of ``current`` does not show: the tree modes but ``current`` (Medusa first: its
        first round has a tree, a transfer call's has none)."""
        return [m for m in ("medusa", "transfer") if m in self.modes and m != current]

    def estimate(self, mode: str) -> float | None:
        """A tree mode's rate by its ``Bound``: its estimated tokens at its call's cost priced at its own
        rounds' ms per unit (the plain mode's before it ran: a tree call costs at least its size); None
        while unpriced."""
        b = self.bounds[mode]
        lookup = self.rates.get("lookup")
        per_unit = self.rates[mode].ms_per_unit or (lookup.ms_per_unit if lookup else None)
        return b.tokens / (b.units * per_unit) if per_unit and b.units > 0 else None

    def _may_win(self) -> list[str]:
        """The tree modes a probe might find faster than the current mode (unpriced, or estimated faster)."""
        now = self.rates[self.mode].value
        return [m for m in self._tree_modes(self.mode) if (self.estimate(m) or float("inf")) > now]

    def _next_probe(self) -> str:
        """The mode to probe: a tree mode never run yet, else the next after the last probed, in order,
        of those that might win."""
        others = self._may_win() or self._tree_modes(self.mode)
        fresh = [m for m in others if self.rates[m].runs == 0]
        if fresh:
            return fresh[0]
        self.turn = (self.turn + 1) % len(others)
        return others[self.turn]

    def _set(self, mode: str) -> None:
        self.switches += int(mode != self.mode)
        self.mode = mode


def merge_chain(tree: Candidates, chain: list[int]) -> Candidates:
    """``tree``'s drafts with ``chain`` (drafts after the same root) as one more branch: the chain follows
    the tree's nodes while its tokens match them and branches off at the first that does not (so no
    node has two children with one token)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    kids: dict[int, dict[int, int]] = {}
    for j, (t, p) in enumerate(zip(tokens, parents)):
        kids.setdefault(p, {}).setdefault(t, j)
    node = -1
    for t in chain:
        nxt = kids.get(node, {}).get(t)
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = len(tokens) - 1
            kids.setdefault(node, {})[t] = nxt
        node = nxt
    return Candidates.from_parents(tree.root, tokens, parents)


class AutoDrafter(TreeDrafter):
    """Prompt lookup and, when ``proj`` is given, Hidden Transfer's tree ``buf``, and when ``heads`` are
    given, Medusa's tree ``medusa_buf`` (see the module docstring)."""

    def __init__(
        self,
        run: Run,
        draft_len: int,
        min_ngram: int,
        max_ngram: int,
        proj=None,
        buf: tree_mod.TreeBuffers | None = None,
        vocab: DraftVocab | None = None,
        adaptive: bool = False,
        heads=None,
        medusa_buf: tree_mod.TreeBuffers | None = None,
    ):
        buf = tree_mod.build("") if proj is None or buf is None else buf
        self.steps = buf.depth if buf.n > 1 else 0
        self.draft_len = draft_len
        self.heads = heads if heads is not None and medusa_buf is not None and medusa_buf.n > 1 else None
        self.medusa_buf = medusa_buf if self.heads is not None else None
        super().__init__(run, buf, vocab)
        self.proj = proj if self.steps else None
        self.index = [NgramIndex(p, min_ngram, max_ngram) for p in run.prompts]
        self.curve = curve_for(run.model)
        self.lengths = LengthChooser(run.batch, self.curve, draft_len) if adaptive else None
        self.medusa_topk: list[torch.Tensor | None] = [None] * run.batch  # per row [depth, K]: Medusa's drafts
        kinds = {"lookup": True, "transfer": self.proj is not None, "medusa": self.heads is not None}
        self.chooser = Chooser(tuple(m for m in MODES if kinds[m]))
        self.pseudo: torch.Tensor | None = None  # [B, steps, n, D] the last transfer call's pseudo states
        self.t_round = 0.0
        self.round_mode = "lookup"
        self.counted = True
        self.mode_rounds = {m: 0 for m in MODES}
        self.chains: list[list[int]] = [[] for _ in range(run.batch)]  # each row's lookup chain this round
        self.left: int | None = None  # the most tokens a row has left before this round
        self.draft_ms = 0.0  # this round's time in Medusa's heads

    def round_tokens(self) -> int:
        transfer = (self.buf.n + self.draft_len) * (self.steps + 1) + 1  # tree, chain, their pseudo states
        return max(transfer, (self.medusa_buf.n if self.heads else 0) + self.draft_len + 1)

    def prefill(self) -> torch.Tensor:
        logits = super().prefill()
        if self.chooser.mode == "medusa":
            for row in range(self.run.batch):
                self._medusa_from(row, self.hidden[row, -1])
        return logits

    def _medusa_from(self, row: int, h: torch.Tensor) -> None:
        """Medusa's drafts for the row's next tree from one last-layer state ``h`` ``[D]``."""
        t = time.perf_counter()
        logits = medusa_logits(self.run, self.heads, h, self.medusa_buf.depth, self.vocab)  # [depth, V | K]
        self.medusa_topk[row] = top_drafts(self.medusa_buf, logits, self.vocab)
        self.draft_ms += (time.perf_counter() - t) * 1e3

    def propose(self, roots, budgets):
        self.t_round = time.perf_counter()
        self.round_mode = self.chooser.mode
        # a transfer round right after another kind has no tree yet: it only makes the pseudo states
        drafts = {"transfer": self.topk, "medusa": self.medusa_topk}.get(self.round_mode)
        self.counted = drafts is None or any(t is not None for t in drafts)
        self.left = max((b for b in budgets if b is not None), default=None)
        self.draft_ms = 0.0
        return super().propose(roots, budgets)

    def propose_row(self, row: int, root: int | None, budget: int) -> Candidates:
        if root is None:
            return Candidates.chain(None, [])
        chain = self.index[row].draft(min(self.draft_len, budget))
        if self.run.constraints is not None:  # under a grammar: what it allows of the copy, then what it forces
            chain = self.run.constraints[row].draft(chain, min(self.draft_len, budget))
        self.chains[row] = chain
        if self.round_mode == "lookup":
            return Candidates.chain(root, self.lengths.cut(row, chain) if self.lengths else chain)
        if self.round_mode == "medusa":
            drafts = self.medusa_topk[row]
            tree = Candidates.chain(root, []) if drafts is None else Candidates.from_tree(self.medusa_buf, root, drafts)
        else:
            tree = super().propose_row(row, root, budget)
        if self.run.batch > 1:  # one tree shape for every row: no chains beside it
            return tree
        return merge_chain(tree, chain) if chain else tree

    def score(self, cands):
        live = [c for c in cands if c is not None]
        if self.round_mode != "transfer" or live[0].root is None:
            return super().score(cands)
        self.start = self.cache.lengths[0].clone()
        ids, tree = self.batch_tokens(cands)
        shape = tree if tree is not None else live[0]
        k1 = shape.k + 1
        mask = shape.mask if shape.mask is not None else torch.ones(k1, k1, dtype=torch.bool).tril()
        depths = shape.depths if shape.depths is not None else torch.arange(k1)
        h, self.pseudo = transfer_pass(self.run, self.cache, ids, mask, depths, self.proj, self.steps)
        self.hidden = h
        logits = self.run.model.logits(h)  # [B, n, V]
        return [None if c is None else logits[b] for b, c in enumerate(cands)]

    def update(self, cands, results) -> None:
        live = next(c for c in cands if c is not None)
        called = live.root is not None
        super().update(cands, results)
        for row, (ix, c, r) in enumerate(zip(self.index, cands, results)):
            if c is not None:
                ix.extend(c.tokens[r[0]].tolist() + [r[1]])
                if self.lengths and called and self.round_mode == "lookup":
                    self.lengths.observe(row, c.k, len(r[0]), r[1])
        if not called:
            return
        if self.round_mode == "transfer":
            pseudo = self.pseudo.transpose(1, 2)  # [B, n, steps, D]
            for b, p in self.kept_states(cands, results, pseudo).items():  # p [steps, D]
                z = self.run.model.final_norm(p)
                self.set_drafts(b, draft_logits(self.run, z, self.vocab))
        else:
            self.topk = [None] * self.run.batch  # drafts from an older position: of no use
        self.mode_rounds[self.round_mode] += 1
        tokens = sum(len(r[0]) + 1 for r in results if r is not None)
        self.medusa_topk = [None] * self.run.batch
        if self.chooser.mode == "medusa":  # the heads' time is this round's: it ends when they have drafted
            for row, h in self.kept_states(cands, results, self.hidden).items():
                self._medusa_from(row, h)
        ms = (time.perf_counter() - self.t_round) * 1e3
        units, plain, bounds = self._costs(cands, results)
        self.chooser.record(self.round_mode, tokens, ms, self.counted, units, self.draft_ms, plain, self.left, bounds)
        if self.chooser.mode == "medusa" and all(t is None for t in self.medusa_topk):
            for row, h in self.kept_states(cands, results, self.hidden).items():
                self._medusa_from(row, h)

    def _costs(self, cands, results) -> tuple[float, tuple[int, float], dict[str, tuple[int, float]]]:
        """This round's call cost in one-token calls; the tokens and call cost a plain round would have
        had: each row's chain kept while it agrees with what the round emitted (exact under greedy
        decoding, where what is emitted does not depend on the drafts; a chain that agrees to the end
        may have kept more); and per tree mode the most tokens its call could have given (its tree
        keeps at most its depth, the merged chain what it agrees) and that call's cost."""
        live = [(c, r, ch) for c, r, ch in zip(cands, results, self.chains) if c is not None]
        n = 1 + max(c.k for c, _, _ in live)
        units = self.curve(n * (self.steps + 1) if self.round_mode == "transfer" else n)  # transfer: pseudo states
        agree = []
        for c, r, chain in live:
            emitted = c.tokens[r[0]].tolist() + [r[1]]
            agree.append(
                next((i for i, (a, b) in enumerate(zip(chain, emitted)) if a != b), min(len(chain), len(emitted)))
            )
        chain = max(len(ch) for _, _, ch in live)
        plain = (sum(agree) + len(agree), self.curve(1 + chain))
        trees = {
            "medusa": (self.medusa_buf, 1),
            "transfer": (self.buf if self.proj is not None else None, self.steps + 1),
        }
        bounds = {  # (one row: a batch's tree calls carry no chains)
            m: (sum(1 + max(a, buf.depth) for a in agree), self.curve((buf.n + chain) * calls))
            for m, (buf, calls) in trees.items()
            if buf is not None and self.run.batch == 1
        }
        return units, plain, bounds

    def auto_stats(self) -> list[AutoStats]:
        """One ``AutoStats`` per row (the batch shares its rounds' modes)."""
        return [
            AutoStats(
                self.mode_rounds["lookup"],
                self.mode_rounds["transfer"],
                self.mode_rounds["medusa"],
                self.chooser.switches,
            )
            for _ in range(self.run.batch)
        ]
