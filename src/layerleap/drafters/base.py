"""The drafter interface: what every draft-and-verify method plugs into ``methods.draft_verify``.

A ``Drafter`` proposes candidate tokens, has the target model score them in one call, and hears
back what was accepted (in the spirit of `transformers`' ``CandidateGenerator`` and Medusa's
``generate_candidates -> tree_decoding -> evaluate_posterior -> update``):

- ``round_tokens()``: the most tokens one round appends to a row of the target's cache (the root
  and the longest path of drafts; a batch pads every row to its longest): the base sizes the cache
  from it;
- ``prefill()`` -> ``[B, V]``: the prompt pass; the target's logits for the first new position;
- ``propose(roots, budgets)`` -> one ``Candidates`` per live row: a chain or a tree after the row's
  current position, with the draft distributions when the drafts were sampled;
- ``score(cands)`` -> one ``[1 + k, V]`` logits tensor per row: ONE target call over every row's
  root and drafts (row 0 predicts the first level, ``1 + j`` the children of draft ``j``);
- ``update(cands, results)``: each row's accepted drafts and the target's next token; the drafter
  rolls its caches back to them and keeps what it needs for the next round.

The base class scores with the target model itself (chains padded with filler tokens that nothing
attends to; trees with tree attention, every row of a batch the same tree at its own position, or
each its own tree with per-row masks: ``BatchTree``) and
rolls the target's cache back by position (chains) or keeps each row's accepted path (trees).
``StepDrafter`` is a drafter that writes its chain one token at a time from its own next-token logits
(a draft model, an early exit), stopping by ``ChainRule``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ..core import sampling, verify
from ..core.kv_cache import KVCache
from ..core.run import Run
from ..core.tree import Candidates

Result = tuple[list[int], int | None]  # (accepted draft indices, the target's next token)


@dataclass
class BatchTree:
    """The trees of a batch whose rows propose different shapes (a dynamic tree): each row's mask and
    position offsets over ``S`` fed tokens; a chain is causal, and a row's filler tokens (past its own
    tokens, or a finished row's) see only themselves at offset 0."""

    mask: torch.Tensor  # [B, S, S] bool
    depths: torch.Tensor  # [B, S] long

    @property
    def k(self) -> int:
        return int(self.mask.shape[-1]) - 1

    @classmethod
    def of(cls, cands: list[Candidates | None], S: int) -> "BatchTree":
        mask = torch.eye(S, dtype=torch.bool).repeat(len(cands), 1, 1)
        depths = torch.zeros(len(cands), S, dtype=torch.long)
        for row, c in enumerate(cands):
            if c is None:
                continue
            n = len(c.fed())
            if c.is_chain:
                mask[row, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
                depths[row, :n] = torch.arange(n)
            else:  # a tree: its root is fed (the round after the prompt proposes no tree)
                mask[row, :n, :n] = c.mask
                depths[row, :n] = c.depths
        return cls(mask, depths)


class Drafter:
    """Proposes candidates for one ``generate`` call, scored by the target model (see the module
    docstring).  ``batched``: proposes and scores a list of prompts as one batch."""

    batched = False
    draft_first = False  # drafts right after the prompt pass (else that token comes from the prompt pass alone)
    grammar_drafts = False  # its chains may be replaced by one-hot chains under a grammar (update reads cands)

    def __init__(self, run: Run, cache: KVCache | None = None):
        self.run = run
        self.cache = run.new_cache(extra=self.round_tokens()) if cache is None else cache
        self.first_logits: torch.Tensor | None = None  # [B, V] the prompt pass's
        self.hidden: torch.Tensor | None = None  # [B, S, D] the last target call's last-layer states
        self.keeps_prompt = False  # whether ``prefill`` keeps every prompt position's state (``prompt_states``)
        self.prompt_states: torch.Tensor | None = None  # [B, T, D] the prompt pass's, when kept
        self.start: torch.Tensor | None = None  # [B] the target cache's length before the last call
        self.start_lengths: list[int] = []  # the same as ints

    # -- the interface ---------------------------------------------------------------------------
    def round_tokens(self) -> int:
        """The most tokens one round appends to a row of the target's cache: the root and the
        longest path of drafts, or more where the drafter feeds positions of its own."""
        raise NotImplementedError

    def prefill(self) -> torch.Tensor:
        """The prompt pass -> the target's logits ``[B, V]`` for the first new position."""
        states = self.run.prefill_at(self.cache, (self.run.n_layers,), whole=self.keeps_prompt)[-1]  # [B, T, D]
        self.prompt_states = states if self.keeps_prompt else None
        self.hidden = states[:, -1:]  # [B, 1, D]
        self.first_logits = self.run.logits(self.hidden)[:, -1]
        return self.first_logits

    def propose(self, roots: list[int | None], budgets: list[int | None]) -> list[Candidates | None]:
        """Each live row's candidates: at most ``budgets[row]`` drafts along any path after
        ``roots[row]`` (None: right after the prompt); None for a finished row (``budgets[row]`` None)."""
        return [
            None
            if budget is None
            else Candidates.chain(None, [])
            if root is None and not self.draft_first
            else self.propose_row(row, root, budget)
            for row, (root, budget) in enumerate(zip(roots, budgets))
        ]

    def propose_row(self, row: int, root: int | None, budget: int) -> Candidates:
        """One row's candidates, for drafters that propose row by row."""
        raise NotImplementedError

    def score(self, cands: list[Candidates | None]) -> list[torch.Tensor | None]:
        """One target call over every live row's root and drafts (None: a finished row)."""
        self.mark_start()
        ids, tree = self.batch_tokens(cands)
        if ids is None:  # nothing to feed: the prompt pass already scored the only position
            return [None if c is None else self.first_logits[row : row + 1] for row, c in enumerate(cands)]
        rows = [row for row, c in enumerate(cands) if c is not None and c.fed()]  # the others ride along padded
        if tree is not None:  # every row the same tree (or its own: a BatchTree), at its own position
            depths = tree.depths if tree.depths.dim() == 2 else tree.depths.unsqueeze(0)
            pos = (self.start - self.cache.pad).unsqueeze(1) + depths  # [B, 1 + k]
            pos = pos.clamp(max=self.run.model.config.max_position - 1).to(self.run.model.device)
            h = self.run.forward(self.cache, ids, positions=pos, mask=tree.mask.to(self.run.model.device), rows=rows)
        else:
            pos = self.run.positions(self.cache, ids.shape[1]).clamp(max=self.run.model.config.max_position - 1)
            h = self.run.forward(self.cache, ids, positions=pos, rows=rows)
        self.hidden = h
        logits = self.run.logits(h)  # [B, S, V]
        return [
            None if c is None else self._with_first(row, c, logits[row, : len(c.fed())]) for row, c in enumerate(cands)
        ]

    def batch_tokens(self, cands: list[Candidates | None]) -> tuple[torch.Tensor | None, Candidates | BatchTree | None]:
        """The fed tokens of every row ``[B, S]`` (None when no row feeds any), and the tree they share
        (None for chains): one ``Candidates`` when every row's tree has one shape, else a ``BatchTree``
        of each row's mask and depths.  Chains of different lengths and finished rows are padded with
        filler tokens that nothing attends to and that ``update`` rolls back."""
        fed = [c.fed() if c is not None else [] for c in cands]
        S = max(len(f) for f in fed)
        if S == 0:
            return None, None
        pad = [f + [f[-1] if f else 0] * (S - len(f)) for f in fed]
        ids = torch.tensor(pad, dtype=torch.long, device=self.run.model.device)
        tree = next((c for c in cands if c is not None and not c.is_chain), None)
        if tree is None or all(c is None or (not c.is_chain and torch.equal(c.parents, tree.parents)) for c in cands):
            return ids, tree
        return ids, BatchTree.of(cands, S)

    def update(self, cands: list[Candidates | None], results: list[Result | None]) -> None:
        """Keep, in the target's cache, each row's root and accepted drafts; drop the rest."""
        if not self.called():
            return  # no call this round
        kept = [[] if c is None else c.kept(r[0]) for c, r in zip(cands, results)]  # offsets among the fed tokens
        if any(k != list(range(len(k))) for k in kept):  # a tree path past other nodes: moved down to its root
            self.cache.compact(self.start, [torch.tensor(k, dtype=torch.long) for k in kept])
            return
        lengths = [s + len(k) for s, k in zip(self.start_lengths, kept)]  # what each row keeps is a prefix
        self.cache.truncate(lengths[0] if lengths.count(lengths[0]) == len(lengths) else torch.tensor(lengths))

    # -- helpers ---------------------------------------------------------------------------------
    def mark_start(self) -> None:
        """Note the target cache's lengths before this round's call (``update`` rolls back to them)."""
        self.start = self.cache.lengths[0].clone()
        self.start_lengths = self.start.tolist()

    def called(self) -> bool:
        """Whether this round's ``score`` made a target call (the round after the prompt makes none)."""
        return self.start is not None and self.cache.lengths[0].tolist() != self.start_lengths

    def _ids(self, tokens: list[list[int]]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.run.model.device)

    def _with_first(self, row: int, cand: Candidates, logits: torch.Tensor) -> torch.Tensor:
        """A row's ``[1 + k, V]`` logits: the prompt pass's in front when the root was not fed."""
        return logits if cand.root is not None else torch.cat([self.first_logits[row : row + 1], logits])

    def seq(self, row: int = 0) -> list[int]:
        """The row's prompt and the tokens emitted so far."""
        return self.run.prompts[row] + self.run.out[row]


# -- chains written one token at a time ------------------------------------------------------------
@dataclass
class DraftLength:
    """γ for the next round and how it moves (`transformers`' constant and heuristic schedules)."""

    gamma: int
    schedule: str = "constant"

    def update(self, drafted: int, accepted: int) -> None:
        if self.schedule == "heuristic":
            self.gamma = self.gamma + 2 if accepted == drafted else max(1, self.gamma - 1)


@dataclass
class ChainRule:
    """When a step drafter stops a round's chain.

    - ``length``: γ, the most drafts per round (None: only the budget limits it);
    - ``min_confidence``: a draft row whose top probability is below it is *unsure*;
    - ``keep_unsure``: True drafts the unsure row's token and then stops (speculative decoding,
      `transformers`' ``assistant_confidence_threshold``: its step is paid); False stops before it,
      leaving that position to the target (BiLD's fallback, self-speculative decoding).
    Stop reasons, recorded in ``Candidates.stop``: "eos", "budget" (the output's end), "length"
    (γ reached), "unsure"."""

    length: DraftLength | None = None
    min_confidence: float = 0.0
    keep_unsure: bool = True

    @property
    def never_drafts(self) -> bool:
        """Every draft row would be unsure and left to the target (BiLD's ``alpha_fb=1``): no chain
        gets a draft, so the drafter need not run at all."""
        return self.min_confidence > 1.0 and not self.keep_unsure

    def longest(self, max_new_tokens: int) -> int:
        """The most drafts in one chain: γ, or the output's budget where γ is unset or may grow (never more
        than the budget)."""
        if self.length is None or self.length.schedule != "constant":
            return max_new_tokens
        return min(self.length.gamma, max_new_tokens)

    @classmethod
    def fallback(cls, max_small: int | None, alpha_fb: float) -> "ChainRule":
        """BiLD: the small model keeps the token only when its top probability is above ``alpha_fb``."""
        return cls(None if max_small is None else DraftLength(max_small), math.nextafter(alpha_fb, math.inf), False)


class _Chain:
    """One row's chain while it is being written."""

    def __init__(self, root: int | None, budget: int, k: int):
        self.root, self.budget, self.k = root, budget, k
        self.drafts: list[int] = []
        self.q_rows: list[torch.Tensor] = []
        self.stop: str | None = None

    def candidates(self) -> Candidates:
        cand = Candidates.chain(self.root, self.drafts, self.q_rows or None)
        cand.stop = self.stop
        return cand


class StepDrafter(Drafter):
    """A drafter that writes chains one token at a time from its own next-token logits, every row of
    a batch in the same steps: ``step_logits({row: tokens})`` feeds each listed row its tokens (ONE
    call) and returns the row's logits ``[V]`` after the last; ``own_length(row)`` is how many tokens
    it holds for the row; ``draft_logits`` ``[B, V]`` are its logits for the first new position (set
    by ``prefill``).
    Each row has its own γ (``ChainRule.length``, copied per row) and random generator, so a row
    drafts what it drafts alone."""

    def __init__(self, run: Run, rule: ChainRule, cache: KVCache | None = None):
        self.rule = rule
        super().__init__(run, cache)
        self.gamma = [None if rule.length is None else copy.copy(rule.length) for _ in range(run.batch)]
        self.eos = set(run.gen.eos_ids) if run.gen.stop_at_eos else set()
        self.draft_logits: torch.Tensor | None = None  # [B, V] the drafter's for the first new position
        self.draft_steps = [0] * run.batch  # per row: the draft distributions the drafter decided on

    def round_tokens(self) -> int:
        return self.rule.longest(self.run.gen.max_new_tokens) + 1  # the root and the chain

    def own_length(self, row: int) -> int:
        raise NotImplementedError

    def step_logits(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def propose(self, roots, budgets) -> list[Candidates | None]:
        chains: dict[int, _Chain] = {}
        for row, (root, budget) in enumerate(zip(roots, budgets)):
            if budget is not None:
                k = budget if self.gamma[row] is None else min(budget, self.gamma[row].gamma)
                chains[row] = _Chain(root, budget, 0 if root is None and not self.draft_first else k)
        writing = {row: c for row, c in chains.items() if c.k > 0}
        catch_up = {row: self.seq(row)[self.own_length(row) :] for row in writing}
        logits = {row: self.draft_logits[row] for row, t in catch_up.items() if not t}  # right after the prompt
        if any(catch_up.values()):
            logits.update(self.step_logits({row: t for row, t in catch_up.items() if t}))
        while writing:
            feed = {row: [c.drafts[-1]] for row, c in writing.items() if self._decide(row, c, logits[row])}
            writing = {row: writing[row] for row in feed}
            if feed:
                logits = self.step_logits(feed)
        if self.run.constraints is not None:  # back to the emitted tokens' state (``_decide`` advanced it)
            for row, c in chains.items():
                self.run.constraints[row].rollback(len(c.drafts))
        return [chains[row].candidates() if row in chains else None for row in range(len(roots))]

    def _decide(self, row: int, chain: _Chain, logits: torch.Tensor) -> bool:
        """Draft one token of ``chain`` from the drafter's ``logits`` ``[V]``, or stop it; True to go on.
        Under a grammar the drafter chooses from the tokens it allows after the chain so far (its state is
        advanced by each draft here and rolled back at the end of ``propose``)."""
        rule, g = self.rule, self.run.gen
        grammar = None if self.run.constraints is None else self.run.constraints[row]
        if grammar is not None:
            if grammar.stopped:
                chain.stop = "eos"  # the grammar is complete: the output ends here
                return False
            logits = grammar.mask(logits)
        self.draft_steps[row] += 1
        q = (
            sampling.probs(logits, g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p)
            if g.do_sample
            else (logits.float().softmax(-1) if rule.min_confidence > 0 else None)
        )
        unsure = rule.min_confidence > 0 and float(q.max()) < rule.min_confidence
        if unsure and not rule.keep_unsure:
            chain.stop = "unsure"
            return False
        chain.drafts.append(verify.draw(q, self.run.generators[row]) if g.do_sample else sampling.top_ids(logits))
        if grammar is not None:
            grammar.advance(chain.drafts[-1])
        if g.do_sample:
            chain.q_rows.append(q)
        n = len(chain.drafts)
        chain.stop = (
            "eos"
            if chain.drafts[-1] in self.eos or (grammar is not None and grammar.stopped)
            else "budget"
            if n == chain.budget
            else "length"
            if n == chain.k
            else "unsure"
            if unsure
            else None
        )
        return chain.stop is None

    def update(self, cands, results) -> None:
        super().update(cands, results)
        self.update_length(cands, results)

    def update_length(self, cands, results) -> None:
        """Move each row's γ by its round (the heuristic schedule)."""
        for g, c, r in zip(self.gamma, cands, results):
            if g is not None and c is not None:
                g.update(c.k, len(r[0]))
