"""The one draft-and-verify loop under speculative, self-spec, prompt-lookup, medusa,
hidden-transfer and BiLD: a drafter (``drafters.base.Drafter``) and an acceptance rule.

Each round, for every unfinished row: ``propose`` a chain or a tree after the row's last token,
``score`` all rows in ONE target call, ``accept`` by the rule, ``update`` the drafter (caches roll
back to the accepted tokens), emit the accepted drafts and the target's next token, yield.  The round
after the prompt pass has no root: the prompt pass already scored the first position, so a drafter
with ``draft_first`` (a draft model; BiLD's small model in either form) drafts there, and the others
propose nothing: the first token then comes from the prompt pass alone, at no call (the tree heads
need a verified state; for prompt lookup and self-spec it keeps the first token as quick as greedy's).
Each row's candidates are cut to what its round can keep (``Candidates.within`` the rule's budget: the
tokens the output has left less the target's own; BiLD's rollback: all of them): near the output's end no
call verifies a tree's deeper nodes or a chain's later drafts, and with one token left a round is a plain step.

Rules:

- ``Exact``: greedy decoding keeps the longest path the target agrees with plus the target's argmax
  (``verify.accept_greedy``: output equal to greedy decoding); sampling accepts by speculative
  sampling on a chain and SpecInfer's multi-draft rule on a tree (``verify.accept_sampled``:
  distributed exactly as the target's own sampling).
- Under a grammar (structured output, ``core.grammar``), ``Exact`` masks the target's logits at
  every node by the tokens the grammar allows after the node's path, so the output is constrained
  greedy decoding token for token (sampling: lossless for the masked distributions); a drafter
  whose chains are copies (``Drafter.grammar_drafts``) has them cut to what the grammar allows and
  extended by the tokens it forces.  The logits processors (penalties, biases: ``core.processors``) are
  applied the same way, at every node by the row's history followed by the node's path.
- ``Rollback``: BiLD's rule (``verify.rollback_path``): drafts are kept up to the first whose
  cross-entropy under the target exceeds ``alpha_rb`` (greedy: and that is not the target's own
  choice); the target picks the token there.

Log probabilities (``generate(..., logprobs=N)``) come from the round's target logits, at no call of their
own: each kept draft's from its parent's row, the target's own token's from the row after the path
(``path_rows``).  A ``Rollback`` round left unscored (``alpha_rb = inf``) is scored when they are asked for.

Statistics, one ``core.stats.DraftStats`` per row: ``rounds`` (target calls after the prompt pass
while the row ran), ``drafted`` (the longest path proposed, summed), ``accepted``, ``acceptance``,
``tokens_per_round``; ``RoundCounts`` keeps more for the methods' own records.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..core import sampling, verify
from ..core.processors import none_left, none_left_message, tree_paths
from ..core.run import NoTokenLeft, Run
from ..core.stats import DraftStats
from ..core.tree import Candidates
from ..drafters.base import Drafter


@dataclass
class RoundCounts:
    """What the loop saw for one row."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    proposed: int = 0  # rounds with at least one draft
    draft_max: int = 0
    target_tokens: int = 0  # emitted tokens the target chose (not drafts)
    stops: Counter = field(default_factory=Counter)  # chain stop reasons of scored rounds that called the target
    prompt_stop: str | None = None  # the stop reason of a chain the prompt pass alone scored (nothing fed)
    rolled_back: int = 0  # drafts the target rejected (of a tree: of its longest path)
    rollbacks: int = 0  # rounds with a rejected draft
    scored: int = 0  # draft tokens the target's calls scored (a tree's every node)


class Exact:
    """Greedy-exact or lossless: the rule of every lossless method."""

    can_reject = True

    def budget(self, run: Run, row: int) -> int:
        return run.remaining(row) - 1  # leave room for the target's own token

    def accept(self, run: Run, row: int, cand: Candidates, logits: torch.Tensor) -> tuple[list[int], int]:
        g = run.gen
        if run.histories is not None:  # every node processed by the row's history and then its path
            logits = run.histories[row].apply(logits, tree_paths(cand.tokens.tolist(), cand.parents.tolist()))
        if run.constraints is not None:  # every node scored by the tokens the grammar allows after its path
            allowed = run.constraints[row].tree_masks(cand.tokens.tolist(), cand.parents.tolist())  # [1 + k, V]
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        empty = None
        if run.histories is not None and run.histories[row].filters:
            # a node where the filters leave no token: refused if the walk chooses there, as greedy's step would be
            empty = none_left(logits)  # [1 + k]
            logits = logits.masked_fill(empty.unsqueeze(1), 0.0)  # finite meanwhile: a walk past it draws no NaN
        if not g.do_sample:
            result = verify.accept_greedy(cand.tokens, cand.parents, logits)
        else:
            p = sampling.probs(logits, g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p)  # [1 + k, V]
            result = verify.accept_sampled(cand.tokens, cand.parents, p, cand.q, run.generators[row])
        if empty is not None:
            _check_left(run, row, cand, result, empty)
        return result


def _check_left(run: Run, row: int, cand: Candidates, result: tuple[list[int], int], empty: torch.Tensor) -> None:
    """Refuse a round that chose a token where the filters left none (``empty``: ``[1 + k]`` the rows where
    they did), unless the row ends before that token, as greedy decoding, which never chooses there."""
    drafts = cand.tokens.tolist()
    new = [drafts[j] for j in result[0]] + [result[1]]
    dead = [i for i, r in enumerate(path_rows(cand, result[0])) if bool(empty[r])]
    if dead and not _ends_within(run, row, new[: dead[0]]):
        raise NoTokenLeft(none_left_message(run.histories[row], run.constraints is not None))


def _ends_within(run: Run, row: int, tokens: list[int]) -> bool:
    """Whether emitting ``tokens`` ends ``row`` (``Run.emit``: an end-of-sequence token, the end of its grammar,
    its budget; a stop token, before which it ends), so that nothing after them is chosen."""
    g = run.gen
    if (g.stop_at_eos and any(t in g.eos_ids for t in tokens)) or len(run.out[row]) + len(tokens) >= g.max_new_tokens:
        return True
    if any(t in g.stop_token_ids for t in tokens):
        return True
    c = None if run.constraints is None else run.constraints[row]
    if c is None:
        return False
    n = c.matcher.try_consume_tokens(tokens) if tokens else 0  # as far as it takes them: to its end at most
    try:
        return c.stopped
    finally:
        c.rollback(n)


class Rollback:
    """BiLD's rollback policy (``alpha_rb``) over a chain, or a tree (``verify.rollback_path``: at each
    node the child the target gives the most probability), the target choosing (greedy or sampled)
    the token at the first rejected position or after the path.  Its chain may fill the output: the
    target's token then falls outside and is dropped; with ``alpha_rb = inf`` such a round is not
    scored at all (it could change nothing)."""

    def __init__(self, alpha_rb: float):
        self.alpha_rb = alpha_rb
        self.can_reject = not math.isinf(alpha_rb)

    def budget(self, run: Run, row: int) -> int:
        return run.remaining(row)

    def accept(self, run: Run, row: int, cand: Candidates, logits: torch.Tensor) -> tuple[list[int], int]:
        g = run.gen
        probs = (
            sampling.probs(logits, g.temperature, g.top_k, g.top_p, g.min_p, g.typical_p)
            if g.do_sample
            else logits.float().softmax(-1)
        )
        own = None if g.do_sample else sampling.top_ids(logits)  # [1 + k] greedy's own choices
        path = verify.rollback_path(cand.tokens, cand.parents, probs, self.alpha_rb, own)
        at = 1 + path[-1] if path else 0  # the row that predicts after the path
        nxt = verify.draw(probs[at], run.generators[row]) if g.do_sample else own[at]
        return path, nxt


EXACT = Exact()


def decode(run: Run, drafter: Drafter, rule=EXACT, loop_stats: bool = True):
    """Run ``drafter`` with ``rule`` to the end of every row, yielding after each round; then record
    the loop's ``DraftStats`` (unless ``loop_stats`` is False: a method that reports the counts under
    its own names) and return the per-row ``RoundCounts``."""
    B = run.batch
    counts = [RoundCounts() for _ in range(B)]
    drafter.prefill()
    roots: list[int | None] = [None] * B
    while True:
        budgets = [None if run.finished[row] else rule.budget(run, row) for row in range(B)]
        cands = drafter.propose(roots, budgets)
        if run.constraints is not None and drafter.grammar_drafts:
            cands = grammar_drafts(run, drafter, cands, budgets)
        cands = [None if c is None else c.within(budgets[row]) for row, c in enumerate(cands)]  # what can be kept
        if not rule.can_reject and B == 1 and _ends_output(run, cands[0]) and run.logprobs is None:
            run.emit(0, cands[0].tokens.tolist())  # nothing could change these drafts
            _count(counts[0], cands[0], cands[0].k, 0, scored=False, called=False)
            break
        calls = run.model_calls
        logits = drafter.score(cands)
        called = run.model_calls > calls
        results = [None if c is None else rule.accept(run, row, c, logits[row]) for row, c in enumerate(cands)]
        drafter.update(cands, results)
        for row, (c, r) in enumerate(zip(cands, results)):
            if c is None:
                continue
            before = len(run.out[row])
            drafts = c.tokens.tolist()
            new = [drafts[j] for j in r[0]] + [r[1]]
            if run.logprobs is not None:
                run.capture(row, logits[row][path_rows(c, r[0])], new)
            run.emit(row, new)
            emitted = len(run.out[row]) - before  # fewer than len(new) where an end-of-sequence token came first
            _count(counts[row], c, min(len(r[0]), emitted), int(emitted == len(new)), scored=True, called=called)
            roots[row] = r[1]
        if run.done:
            break
        yield
        if run.done:  # every row cancelled between two rounds (Decoding.cancel)
            break
    if loop_stats:
        run.record([draft_stats(out, c) for out, c in zip(run.out, counts)])
    return counts


def path_rows(cand: Candidates, path: list[int]) -> list[int]:
    """The rows of a round's target logits ``[1 + k, V]`` that chose the emitted tokens: each kept draft's
    parent's row (row 0 for the first level), then the row after the path's last draft."""
    parents = cand.parents.tolist()
    return [1 + parents[j] for j in path] + [1 + path[-1] if path else 0]


def grammar_drafts(run: Run, drafter: Drafter, cands: list, budgets: list) -> list:
    """Each row's chain under its grammar (``Constraint.draft``): the drafts it allows, then the tokens it
    forces, as many as a round holds.  For drafters whose drafts are one-hot copies (no ``q``) and that
    read back what was proposed from the candidates (``Drafter.grammar_drafts``)."""
    out = []
    for row, c in enumerate(cands):
        if c is None or not c.is_chain or c.q is not None:
            out.append(c)
            continue
        limit = min(budgets[row], drafter.round_tokens() - 1)
        out.append(Candidates.chain(c.root, run.constraints[row].draft(c.tokens.tolist(), limit)))
    return out


def _ends_output(run: Run, cand: Candidates) -> bool:
    """The chain fills the row's output (its budget, or an end-of-sequence token)."""
    return cand.stop in ("budget", "eos")


def _count(c: RoundCounts, cand: Candidates, acc: int, target_token: int, scored: bool, called: bool) -> None:
    """Add one round of one row: ``acc`` drafts accepted and emitted (none after an end-of-sequence token),
    ``target_token`` 1 where the target's own next token was emitted too."""
    c.rounds += int(called)
    c.drafted += cand.depth
    c.accepted += acc
    c.proposed += int(cand.k > 0)
    c.draft_max = max(c.draft_max, cand.k)
    c.target_tokens += target_token
    c.rolled_back += cand.depth - acc if scored else 0
    c.rollbacks += int(scored and acc < cand.depth)
    c.scored += cand.k if called else 0
    if scored and cand.stop is not None:
        if cand.fed():
            c.stops[cand.stop] += 1
        else:  # the first token, left to the target: the prompt pass scored it, no call for this row
            c.prompt_stop = cand.stop


def draft_stats(out: list[int], c: RoundCounts) -> DraftStats:
    """One row's loop statistics from its output and counts."""
    return DraftStats(
        rounds=c.rounds,
        drafted=c.drafted,
        accepted=c.accepted,
        acceptance=c.accepted / c.drafted if c.drafted else None,
        tokens_per_round=len(out) / c.rounds if c.rounds else None,
    )
