"""The EAGLE head's drafter: a chain drafted feature by feature (``medusa_transfer.EagleHead``).

After each verification call, every row keeps the last-layer state ``h`` of its last kept position;
the next round's root (the target's own token) and ``h`` give the first draft, each draft the next:
``s_1 = step(final_norm(h), root)``, ``s_i = step(final_norm(s_{i-1}), d_{i-1})``, ``d_i`` the top
token of ``final_norm(s_i)`` over the draft vocabulary.  Rows of a batch draft together, one head
call per step.  The chain ends at ``draft_len``, at an end-of-sequence draft, or after a draft whose
top probability is below ``min_confidence`` (with ``keep_unsure`` False, before such a draft: BiLD's
fallback leaves that position to the target).  ``width`` > 1 adds the first draft's next ``width - 1``
candidates as siblings (a tree of one chain and a fan at its first level, verified with tree
attention; the chain goes on from the top one).  In greedy decoding drafts are top-k choices (one-hot
proposals), so the output is greedy decoding's.  When the run samples, each chain draft is drawn from
the head's own distribution over the draft vocabulary, warped as the target's (temperature, top-k,
top-p), with the row's generator, and its distribution ``q`` goes with the candidates: the target
accepts it with probability ``min(1, p / q)`` (speculative sampling), which keeps more drafts than a
one-hot argmax whenever the head's distribution is spread like the target's.  The fan's siblings
stay one-hot: the distribution's top tokens other than the drawn one, tried after it.  Either way
sampling is lossless (``verify.accept_sampled``).

An attending head (``EagleHead.attention``) keeps each row's keys and values of the pairs (a kept
position's state, the token after it) in a ``HeadCache``: the prompt's pairs from the prompt pass
(``open``), each call's kept pairs after it (``advance``); a chain's own drafts extend a copy.

``EagleChains`` is the drafting itself, shared by ``EagleDrafter`` and ``auto``'s EAGLE calls
(``drafters.auto``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import sampling
from ..core.run import Run
from ..core.tree import Candidates
from .base import Drafter
from .draft_vocab import DraftVocab
from .medusa_transfer import EagleHead, HeadCache
from .trees import draft_logits


class EagleChains:
    """The head's drafts for rows of a batch: ``draft(states, roots, lengths)`` -> each row's chain and
    its first draft's siblings; ``candidates`` turns them into a row's ``Candidates``."""

    def __init__(
        self,
        run: Run,
        head: EagleHead,
        draft_len: int,
        vocab: DraftVocab | None = None,
        min_confidence: float = 0.0,
        width: int = 1,
        keep_unsure: bool = True,
    ):
        self.run, self.head, self.draft_len, self.vocab = run, head, draft_len, vocab
        self.min_confidence, self.width, self.keep_unsure = min_confidence, width, keep_unsure
        self.eos = set(run.gen.eos_ids) if run.gen.stop_at_eos else set()
        self.head_steps = 0  # head calls (each drafts one token for every drafting row)
        self.row_steps: dict[int, int] = {}  # row -> the head steps that drafted for it
        self.stops: dict[int, str] = {}  # row -> why its last chain ended (``ChainRule``'s reasons)
        self.caches: dict[int, HeadCache] = {}  # an attending head's: row -> its pairs' keys and values

    @property
    def attends(self) -> bool:
        return self.head.attention

    def open_rows(self, drafter: Drafter) -> None:
        """An attending head's caches of every row's prompt pairs (``open``) from ``drafter``'s prompt
        pass (``Drafter.prompt_states``, then dropped)."""
        states, drafter.prompt_states = drafter.prompt_states, None
        if not self.attends:
            return
        T = states.shape[1]
        for row, prompt in enumerate(self.run.prompts):
            self.open(row, states[row, T - len(prompt) :], prompt)

    def open(self, row: int, states: torch.Tensor, ids: list[int]) -> None:
        """Row ``row``'s cache of the pairs of its prompt ``ids`` (``n``) from its states ``[n, D]``."""
        model = self.run.model
        z = model.final_norm(states[:-1])  # [n - 1, D]
        x = torch.tensor(ids[1:], dtype=torch.long, device=model.device)
        self.caches[row] = HeadCache(*self.head.entries(z, x, 1))

    def advance(self, row: int, before: torch.Tensor, cand: Candidates, result, hidden: torch.Tensor) -> None:
        """After a call: row ``row``'s pairs of the positions it kept, from ``before`` (the state of the
        position before the call's first kept one ``[D]``) and the call's states ``hidden`` ``[S, D]``."""
        if not self.attends or row not in self.caches:
            return
        fed, kept = cand.fed(), cand.kept(result[0])
        if not kept:
            return
        model = self.run.model
        z = model.final_norm(torch.cat([before.unsqueeze(0), hidden[kept[:-1]]]))  # [m, D]
        x = torch.tensor([fed[j] for j in kept], dtype=torch.long, device=model.device)
        cache = self.caches[row]
        self.caches[row] = cache.extended(*self.head.entries(z, x, cache.length + 1))

    def advance_rows(self, before: dict, cands, results, hidden: torch.Tensor) -> None:
        """``advance`` for every live row: ``before`` row -> its last kept state before the call,
        ``hidden`` ``[B, S, D]`` the call's states."""
        if not self.attends:
            return
        for row, (c, r) in enumerate(zip(cands, results)):
            if c is not None and r is not None and row in before:
                self.advance(row, before[row], c, r, hidden[row])

    @property
    def most_nodes(self) -> int:
        """The most draft nodes of one row's candidates (the chain and the first draft's siblings)."""
        return self.draft_len + self.width - 1

    @staticmethod
    def candidates(root: int | None, chain: list[int], siblings: list[int], q: list | None = None) -> Candidates:
        """The chain after ``root``, with ``siblings`` of its first draft as a fan (a tree) when there are
        any; ``q``: the distribution each chain draft was drawn from (``[V]`` each; sampled drafts), the
        siblings then one-hot."""
        if not siblings or not chain:
            return Candidates.chain(root, chain, q or None)
        tokens = [chain[0], *siblings, *chain[1:]]
        n = len(siblings)
        parents = [-1] * (1 + n) + ([0] + list(range(n + 1, n + len(chain) - 1)) if len(chain) > 1 else [])
        cand = Candidates.from_parents(root, tokens, parents)
        if q:
            fan = F.one_hot(torch.tensor(siblings), q[0].shape[-1]).to(q[0])  # certain proposals
            cand.q = torch.cat([q[0].unsqueeze(0), fan, *(d.unsqueeze(0) for d in q[1:])])  # [k, V]
        return cand

    def for_rows(self, states, roots, budgets) -> dict[int, tuple]:
        """Row -> (its chain, its first draft's siblings, its chain drafts' distributions when they were
        drawn, else None) for every row with a root and a budget left,
        drafted from ``states[row]`` (the last kept position's last-layer state ``[D]``), the chain at
        most ``min(budget, draft_len)`` long."""
        rows = [r for r, (root, b) in enumerate(zip(roots, budgets)) if b and root is not None]
        lengths = [min(budgets[r], self.draft_len) for r in rows]
        chains, siblings = self.draft([states[r] for r in rows], [roots[r] for r in rows], lengths, rows)
        self.stops = {
            row: "budget" if stop == "length" and lengths[i] == budgets[row] else stop
            for i, (row, stop) in enumerate(zip(rows, self.last_stops))
        }
        qs = self.last_q or [None] * len(rows)
        return {row: (c, s, q) for row, c, s, q in zip(rows, chains, siblings, qs)}

    @torch.no_grad()
    def draft(
        self, states: list[torch.Tensor], roots: list[int], lengths: list[int], rows: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Rows' chains from their last kept positions' last-layer states (``[D]`` each) and their roots,
        each at most its length (>= 1) long, drafted together one head call per step -> (the chains, each
        chain's first draft's next ``width - 1`` candidates).  ``rows``: the batch rows they are (an
        attending head reads their caches; default ``0..``)."""
        chains: list[list[int]] = [[] for _ in roots]
        siblings: list[list[int]] = [[] for _ in roots]
        self.last_stops: list[str] = ["length"] * len(roots)  # why each chain ended: eos, length, unsure
        gen = self.run.gen
        # sampled drafts: each chain draft's distribution [V], per row (``candidates``' q)
        self.last_q: list[list[torch.Tensor]] | None = [[] for _ in roots] if gen.do_sample else None
        if not roots:
            return chains, siblings
        model = self.run.model
        row_of = list(rows or range(len(roots)))
        live = list(range(len(roots)))
        first = True
        z = model.final_norm(states[0].unsqueeze(0) if len(states) == 1 else torch.stack(states))  # [R, D]
        x = torch.tensor(roots, dtype=torch.long, device=model.device)  # [R]
        native = self.head.native_step(self.vocab)  # the same step in one native call, where it serves
        caches = [self.caches[r] for r in row_of] if self.attends else None
        while live:
            if native is not None:
                z, logits = native(z.contiguous(), x)
            elif caches is not None:
                s, caches = self.head.step_rows(z, x, caches)
                z = model.final_norm(s)  # [R', D]
                logits = draft_logits(self.run, z, self.vocab)  # [R', V or K]
            else:
                z = model.final_norm(self.head.step(z, x))  # [R', D]
                logits = draft_logits(self.run, z, self.vocab)  # [R', V or K]
            q = None
            if self.last_q is None:
                top = sampling.top_ids(logits)  # [R'] indices into the vocabulary or the draft vocabulary
            else:  # drawn from the head's warped distribution with each row's generator
                q = sampling.probs(
                    logits, gen.temperature, gen.top_k, gen.top_p, gen.min_p, gen.typical_p
                )  # [R', V or K]
                top = [int(sampling.sample(q[j], self.run.generators[row_of[i]])) for j, i in enumerate(live)]
            tokens = top if self.vocab is None else self.vocab.tokens(top)
            if first and self.width > 1:
                for j, i in enumerate(live):  # the next best candidates after the first draft
                    siblings[i] = self._fan(logits[j], top[j])
            first = False
            sure = logits.float().softmax(-1).amax(-1).tolist() if self.min_confidence > 0 else [1.0] * len(live)
            self.head_steps += 1
            keep = []
            for j, i in enumerate(live):
                row = row_of[i]
                self.row_steps[row] = self.row_steps.get(row, 0) + 1
                unsure = sure[j] < self.min_confidence
                if unsure and not self.keep_unsure:  # BiLD's fallback: the target takes this position
                    self.last_stops[i] = "unsure"
                    continue
                chains[i].append(tokens[j])
                if q is not None:  # the kept draft's distribution, over the full vocabulary
                    self.last_q[i].append(q[j] if self.vocab is None else self._widen(q[j]))
                stop = "eos" if tokens[j] in self.eos else "length" if len(chains[i]) >= lengths[i] else None
                self.last_stops[i] = stop or ("unsure" if unsure else "length")
                if stop is None and not unsure:
                    keep.append(j)
            live = [live[j] for j in keep]
            if keep:
                sel = torch.tensor(keep, device=model.device)
                z, x = z[sel], torch.tensor([tokens[j] for j in keep], device=model.device)
                caches = [caches[j] for j in keep] if caches is not None else None
        return chains, siblings

    def _fan(self, logits: torch.Tensor, first: int) -> list[int]:
        """The ``width - 1`` best candidates of one row's first draft ``logits`` ``[V or K]`` other than its
        drawn or top one ``first`` (an index into them), as token ids."""
        k = min(self.width, logits.shape[-1])
        best = [i for i in logits.topk(k).indices.tolist() if i != first][: k - 1]
        return best if self.vocab is None else self.vocab.tokens(best)

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        """A draft distribution over the draft vocabulary ``[K]`` -> over the full vocabulary ``[V]``."""
        full = q.new_zeros(self.run.model.config.vocab_size)
        return full.index_copy_(0, self.vocab.ids.to(q.device), q)


class EagleDrafter(Drafter):
    batched = True

    def __init__(self, run: Run, chains: EagleChains):
        self.chains = chains
        super().__init__(run)
        self.keeps_prompt = chains.attends
        self.kept_state: list[torch.Tensor | None] = [None] * run.batch  # per row [D]: the last kept position's

    @property
    def head_steps(self) -> int:
        return self.chains.head_steps

    def round_tokens(self) -> int:
        return self.chains.most_nodes + 1  # the root, the chain and the first draft's siblings

    def prefill(self) -> torch.Tensor:
        logits = super().prefill()
        self.chains.open_rows(self)
        for row in range(self.run.batch):
            self.kept_state[row] = self.hidden[row, -1]
        return logits

    @property
    def draft_steps(self) -> list[int]:
        """Per row: the head steps that drafted for it (BiLD's small-model steps)."""
        return [self.chains.row_steps.get(row, 0) for row in range(self.run.batch)]

    def propose(self, roots, budgets) -> list[Candidates | None]:
        drafted = self.chains.for_rows(self.kept_state, roots, budgets)
        out = []
        for row, (root, b) in enumerate(zip(roots, budgets)):
            cand = None if b is None else self.chains.candidates(root, *drafted.get(row, ([], [], None)))
            if cand is not None and row in drafted:
                cand.stop = self.chains.stops.get(row)
            out.append(cand)
        return out

    def update(self, cands, results) -> None:
        called = self.called()
        super().update(cands, results)
        if called:
            before = dict(enumerate(self.kept_state))
            self.chains.advance_rows(before, cands, results, self.hidden)
            for row, (c, r) in enumerate(zip(cands, results)):
                if c is not None:
                    self.kept_state[row] = self.hidden[row, c.kept(r[0])[-1]]
