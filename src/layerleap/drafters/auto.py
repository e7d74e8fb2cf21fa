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
  The heads run only after a round whose successor is a Medusa round;
- an *EAGLE* call (``"eagle"``): the root and the EAGLE head's drafts (``eagle.EagleChains``: a chain
  drafted feature by feature from the last call's state at its last kept node and the root, with
  the first draft's top-k as a fan), with the lookup chain merged in as above.  The head drafts at
  the start of the round, once the root is known.

A chain merged into a tree is cut to the length whose new rows pay beside the tree's
(``lengths.MergedChainCut``: the chain's running acceptance past the nodes it shares with the tree,
priced with the call-cost curve); ``adaptive=False`` merges whole chains.

Each mode's rate is a decaying sum of emitted tokens over a decaying sum of wall milliseconds per
round (proposal, call, acceptance and drafting: what the round cost here); when sampling, over the
call-cost curve's price of each round's rows instead, so that the choices, and with them what a seed
draws, do not depend on the clock: a seeded sample reproduces (a batch's rows share the choices, so
a row may still draw otherwise than its prompt alone).  The drafter starts with
plain calls, probes transfer calls for ``PROBE`` rounds after ``FIRST_PROBE`` rounds (the first
transfer round after a plain one has no tree yet and is not counted), keeps the faster of the probed
mode and the one it was probed against (another mode's rate is as old as its last rounds), and
probes the others again, in turn, after a gap that doubles each time a probe loses (the modes are
probed one after another the first time).  The choice changes only
which drafts are verified, never what is accepted: greedy output is greedy decoding, and sampled
output is lossless (every draft is a deterministic, one-hot proposal, siblings distinct, except the EAGLE
head's chain drafts, which are drawn from its distribution and tried first: ``merge_chain``).

A batch shares the mode; a transfer or Medusa call then verifies every row's tree of the one shape
(the lookup chains ride only in plain and EAGLE calls), an EAGLE call each row's own drafts and chain
(per-row masks where their shapes differ, as they do in any batch of EAGLE drafts)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..core import tree as tree_mod
from ..core.run import Run
from ..core.stats import AutoStats, TreeStats
from ..core.tree import Candidates
from .corpus import Corpus
from .prompt_lookup import lookup_index
from .draft_vocab import DraftVocab
from .eagle import EagleChains
from .lengths import LengthChooser, MergedChainCut, curve_for
from .trees import TreeDrafter, medusa_logits, top_drafts, transfer_drafts

MODES = ("lookup", "transfer", "medusa", "eagle")
FIRST_PROBE = 3  # plain rounds before the first probe of transfer calls (0: start with the probe)
PROBE = 4  # counted rounds a probe lasts
GAP = 8  # rounds between probes, doubled after each probe that does not change the mode
DECAY = 0.85  # weight of the past in a mode's rate


@dataclass
class Rate:
    """Tokens per millisecond of one mode, decaying sums."""

    tokens: float = 0.0
    ms: float = 0.0
    rounds: int = 0

    def add(self, tokens: int, ms: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.ms = DECAY * self.ms + ms
        self.rounds += 1

    @property
    def value(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


class Chooser:
    """Which mode the next round uses: the faster by ``Rate``, with probes of the other."""

    def __init__(self, modes: tuple[str, ...]):
        self.modes = modes
        self.rates = {m: Rate() for m in modes}
        self.best = modes[0]
        self.mode = modes[0]
        self.probe_left = 0
        self.next_probe = FIRST_PROBE
        self.gap = GAP
        self.rounds = 0
        self.switches = 0
        self.turn = -1  # the last probed of the other modes, by position
        if len(modes) > 1 and FIRST_PROBE == 0:  # probe at once
            self.probe_left = PROBE
            self.mode = modes[1]

    def record(self, mode: str, tokens: int, ms: float, counted: bool) -> None:
        """One round's outcome; then choose the next round's mode."""
        self.rounds += 1
        if counted:
            self.rates[mode].add(tokens, ms)
        if len(self.modes) == 1:
            return
        if self.probe_left > 0:
            self.probe_left -= int(counted)
            if self.probe_left == 0:  # the probe ends: keep the faster of it and the best, or probe a mode never probed
                # (only these two rates are this request's now: another mode's is as old as its last rounds)
                winner = max((self.best, self.mode), key=lambda m: self.rates[m].value)
                if any(self.rates[m].rounds == 0 for m in self.modes if m != winner):
                    self.best, self.probe_left = winner, PROBE
                    self._set(self._next_probe())
                    return
                self.gap = self.gap if winner != self.best else 2 * self.gap
                self.best = winner
                self.next_probe = self.rounds + self.gap
                self._set(winner)
            return
        if self.rounds >= self.next_probe:
            self.probe_left = PROBE
            self._set(self._next_probe())

    def _next_probe(self) -> str:
        """The mode to probe: one never probed yet, else the next after the last probed, in order."""
        others = [m for m in self.modes if m != self.best]
        fresh = [m for m in others if self.rates[m].rounds == 0]
        if fresh:
            return fresh[0]
        self.turn = (self.turn + 1) % len(others)
        return others[self.turn]

    def _set(self, mode: str) -> None:
        self.switches += int(mode != self.mode)
        self.mode = mode


def shared_prefix(tree: Candidates, chain: list[int]) -> int:
    """How many of ``chain``'s first drafts follow ``tree``'s nodes from the root (``merge_chain`` shares them)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, n = -1, 0
    for t in chain:
        node = next((j for j, (u, p) in enumerate(zip(tokens, parents)) if p == node and u == t), None)
        if node is None:
            break
        n += 1
    return n


def merge_chain(tree: Candidates, chain: list[int]) -> Candidates:
    """``tree``'s drafts with ``chain`` (drafts after the same root) as one more branch: the chain follows
    the tree's nodes while its tokens match them and branches off at the first that does not (so no
    node has two children with one token).  The chain's own nodes come after the tree's, so a sampled
    draft of the tree (``q``) is tried before the copies beside it; they are one-hot proposals."""
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
    merged = Candidates.from_parents(tree.root, tokens, parents)
    merged.q = tree.q
    if tree.q is not None and merged.k > tree.k:  # [k, V]: the copied nodes' certain proposals after the tree's
        copied = F.one_hot(merged.tokens[tree.k :], tree.q.shape[-1]).to(tree.q)
        merged.q = torch.cat([tree.q, copied])
    return merged


class AutoDrafter(TreeDrafter):
    """Prompt lookup and, when ``proj`` is given, Hidden Transfer's tree ``buf``, when ``heads`` are
    given, Medusa's tree ``medusa_buf``, and when ``eagle`` is given, the EAGLE head's drafts (see the
    module docstring).  ``plain=False`` with ``eagle``: no plain calls (the lookup chain rides in the
    other kinds' calls only)."""

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
        eagle: EagleChains | None = None,
        plain: bool = True,
        cut_merged: bool = False,
        corpus: Corpus | None = None,
    ):
        buf = tree_mod.build("") if proj is None or buf is None else buf
        self.steps = buf.depth if buf.n > 1 else 0
        self.draft_len = draft_len
        self.heads = heads if heads is not None and medusa_buf is not None and medusa_buf.n > 1 else None
        self.medusa_buf = medusa_buf if self.heads is not None else None
        self.eagle = eagle
        super().__init__(run, buf, vocab)
        self.keeps_prompt = eagle is not None and eagle.attends
        self.proj = proj if self.steps else None
        self.index = [lookup_index(p, min_ngram, max_ngram, corpus) for p in run.prompts]
        self.curve = curve_for(run.model)
        self.lengths = LengthChooser(run.batch, self.curve, draft_len) if adaptive else None
        self.cuts = MergedChainCut(run.batch, self.curve, draft_len) if cut_merged else None
        self.medusa_topk: list[torch.Tensor | None] = [None] * run.batch  # per row [depth, K]: Medusa's drafts
        self.kept_state: dict[int, torch.Tensor] = {}  # EAGLE: row -> [D], its last kept node's state
        self.eagle_drafts: dict[int, tuple] = {}  # EAGLE: row -> (chain, siblings, sampled drafts' distributions)
        kinds = {
            "lookup": plain or eagle is None,
            "transfer": self.proj is not None,
            "medusa": self.heads is not None,
            "eagle": eagle is not None,
        }
        self.chooser = Chooser(tuple(m for m in MODES if kinds[m]))
        self.pseudo: torch.Tensor | None = None  # [B, steps, n, D] the last transfer call's pseudo states
        self.t_round = 0.0
        self.round_mode = "lookup"
        self.counted = True
        self.mode_rounds = {m: 0 for m in MODES}

    def round_tokens(self) -> int:
        transfer = (self.buf.n + self.draft_len) * (self.steps + 1) + 1  # tree, chain, their pseudo states
        eagle = self.eagle.most_nodes if self.eagle else 0
        return max(transfer, max(self.medusa_buf.n if self.heads else 0, eagle + 1) + self.draft_len + 1)

    def prefill(self) -> torch.Tensor:
        logits = super().prefill()
        if self.eagle is not None:
            self.eagle.open_rows(self)
            self.kept_state = dict(enumerate(self.hidden[:, -1]))
        if self.chooser.mode == "medusa":
            for row in range(self.run.batch):
                self._medusa_from(row, self.hidden[row, -1], 1)  # the tree follows the prompt pass's token
        return logits

    def _medusa_from(self, row: int, h: torch.Tensor, emitted: int) -> None:
        """Medusa's drafts for the row's next tree from one last-layer state ``h`` ``[D]``, from the heads its
        next round can keep once this round has ``emitted`` tokens (none: no tree)."""
        steps = max(0, min(self.medusa_buf.depth, self.run.remaining(row) - emitted - 1))
        if not steps:
            self.medusa_topk[row] = None
            return
        logits = medusa_logits(self.run, self.heads, h, steps, self.vocab)  # [steps, V | K]
        self.medusa_topk[row] = top_drafts(self.medusa_buf, logits, self.vocab)

    def propose(self, roots, budgets):
        self.t_round = time.perf_counter()
        self.round_mode = self.chooser.mode
        # a transfer round right after another kind has no tree yet: it only makes the pseudo states
        drafts = {"transfer": self.topk, "medusa": self.medusa_topk}.get(self.round_mode)
        self.counted = drafts is None or any(t is not None for t in drafts)
        self.eagle_drafts = {}
        if self.round_mode == "eagle":  # every row's drafts, one head call per step for the batch
            self.eagle_drafts = self.eagle.for_rows(self.kept_state, roots, budgets)
        return super().propose(roots, budgets)

    def propose_row(self, row: int, root: int | None, budget: int) -> Candidates:
        if root is None:
            return Candidates.chain(None, [])
        chain = self.index[row].draft(min(self.draft_len, budget))
        if self.run.constraints is not None:  # under a grammar: what it allows of the copy, then what it forces
            chain = self.run.constraints[row].draft(chain, min(self.draft_len, budget))
        if self.round_mode == "lookup":
            return Candidates.chain(root, self.lengths.cut(row, chain) if self.lengths else chain)
        if self.round_mode == "medusa":
            drafts = self.medusa_topk[row]
            tree = Candidates.chain(root, []) if drafts is None else Candidates.from_tree(self.medusa_buf, root, drafts)
        elif self.round_mode == "eagle":
            tree = self.eagle.candidates(root, *self.eagle_drafts.get(row, ([], [], None)))
        else:
            tree = super().propose_row(row, root, budget)
        if self.run.batch > 1 and self.round_mode != "eagle":  # one tree shape for every row: no chains beside it
            return tree
        if self.cuts is not None:
            price = partial(self.call_price, mode=self.round_mode)
            chain = self.cuts.cut(row, chain, shared_prefix(tree, chain), tree.k, price)
        return merge_chain(tree, chain) if chain else tree

    def score(self, cands):
        live = [c for c in cands if c is not None]
        if self.round_mode != "transfer" or live[0].root is None:
            return super().score(cands)
        h, self.pseudo = self.transfer_call(cands, self.proj, self.pseudo_steps(cands))
        self.hidden = h
        logits = self.run.model.logits(h)  # [B, n, V]
        return [None if c is None else logits[b] for b, c in enumerate(cands)]

    def update(self, cands, results) -> None:
        live = next(c for c in cands if c is not None)
        called = live.root is not None
        super().update(cands, results)
        for row, (ix, c, r) in enumerate(zip(self.index, cands, results)):
            if c is not None:
                drafts = c.tokens.tolist()
                kept = [drafts[j] for j in r[0]]
                ix.extend(kept + [r[1]])
                if self.lengths and called and self.round_mode == "lookup":
                    self.lengths.observe(row, c.k, len(r[0]), r[1])
                if self.cuts and called:
                    self.cuts.observe(row, kept, list(r[0]), r[1])
        if not called:
            return
        if self.eagle is not None:  # whatever the call's kind, its last kept node's state drafts an EAGLE round
            self.eagle.advance_rows(dict(self.kept_state), cands, results, self.hidden)
            self.kept_state.update(self.kept_states(cands, results, self.hidden))
        if self.round_mode == "transfer":
            transfer_drafts(self, cands, results)
        else:
            self.topk = [None] * self.run.batch  # drafts from an older position: of no use
        self.mode_rounds[self.round_mode] += 1
        tokens = sum(len(r[0]) + 1 for r in results if r is not None)
        self.medusa_topk = [None] * self.run.batch
        if self.chooser.mode == "medusa":  # the heads' time is this round's: it ends when they have drafted
            for row, h in self.kept_states(cands, results, self.hidden).items():
                self._medusa_from(row, h, len(results[row][0]) + 1)
        self.chooser.record(self.round_mode, tokens, self._round_cost(cands), self.counted)
        if self.chooser.mode == "medusa" and all(t is None for t in self.medusa_topk):
            for row, h in self.kept_states(cands, results, self.hidden).items():
                self._medusa_from(row, h, len(results[row][0]) + 1)

    def call_price(self, rows: int, mode: str) -> float:
        """A ``mode`` call over ``rows`` rows (the root included) in one-token calls (``self.curve``): a
        transfer call's layers from each transfer layer on run over the rows' pseudo states too, each segment
        its share of the layers at its width (``TransferDrafter.round_cost``)."""
        if mode != "transfer" or not self.steps:
            return self.curve(rows)
        L = self.run.model.config.n_layers
        bounds = [0] + list(self.proj.layers[: self.steps]) + [L]
        return sum((bounds[i + 1] - bounds[i]) / L * self.curve((i + 1) * rows) for i in range(self.steps + 1))

    def _round_cost(self, cands) -> float:
        """What this round cost: wall milliseconds (greedy: the output is the same whatever is chosen); when
        sampling, the call-cost curve's price of its rows in one-token calls, so that the choice, and with
        it what a seed draws, does not depend on the clock."""
        if not self.run.gen.do_sample:
            return (time.perf_counter() - self.t_round) * 1e3
        rows = max(c.k + 1 for c in cands if c is not None)
        return self.call_price(rows, self.round_mode)

    def tree_stats(self, counts) -> list[TreeStats]:
        """One row's ``TreeStats`` per ``draft_verify.RoundCounts``: ``tree_nodes`` is the mean nodes a call
        verified, the root included, whatever its kind (a plain call's chain, a tree with the chain merged in,
        the EAGLE head's drafts), rounded; 1 without a call after the prompt."""
        return [
            TreeStats(
                tree_nodes=round(1 + c.scored / c.rounds) if c.rounds else 1,
                accepted_per_round=c.accepted / c.rounds if c.rounds else None,
            )
            for c in counts
        ]

    def auto_stats(self) -> list[AutoStats]:
        """One ``AutoStats`` per row (the batch shares its rounds' modes)."""
        return [
            AutoStats(
                self.mode_rounds["lookup"],
                self.mode_rounds["transfer"],
                self.mode_rounds["medusa"],
                self.mode_rounds["eagle"],
                self.chooser.switches,
            )
            for _ in range(self.run.batch)
        ]
