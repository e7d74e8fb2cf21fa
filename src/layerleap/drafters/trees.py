"""The tree drafters: trained multi-token heads whose top-k per step make a candidate tree, verified
with tree attention in one call (``tree.build`` shapes, ``verify.accept_greedy`` /
``accept_sampled``).  The call that verifies a tree also gives what drafts the next one.

- ``MedusaDrafter`` (Cai et al. 2024, Medusa-1): residual heads on the last layer's normalised state
  of the last accepted node predict the tokens 2..k+1 ahead (``MedusaHeads``).
- ``TransferDrafter`` (Wu et al., Hidden Transfer, §3.2-3.4, Figure 2): in the verification call,
  trained projections at layers ``t_i`` (``TransferProjections``) turn every node's hidden state into
  the *pseudo* hidden state of the token ``i`` ahead; pseudo states run on to the last layer beside
  the real nodes (``transfer_pass``), and the accepted last node's pseudo states, through the model's
  own final norm and unembedding, draft the next tree.

Drafts are the heads' top-k, chosen deterministically, so sampling verifies them as one-hot
proposals (lossless).  A batch verifies one tree shape per call, each row filled with its own
drafts at its own position, and keeps each row's accepted path.  Near the output's end a round verifies
only the nodes it could keep (``draft_verify``: a row's tree loses its deeper levels, the rows then each
their own shape), so a request that fills the context decodes as greedy decoding does; the heads draft, and a
transfer call makes pseudo states, only for the steps the next round can keep (``next_steps``, ``pseudo_steps``).

``tree="dynamic"`` (``DynamicTree``) instead builds each row's tree every round from its drafts'
own confidence, as EAGLE-2 (Li et al. 2024, §4) does: the paths with the highest product of draft
probabilities (``tree.best_paths``), a fixed count of them or the count with the most expected
tokens per unit of round cost (``lengths.curve_for``).  Rows of a batch then verify trees of
their own shapes in the one call (per-row masks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core import tree as tree_mod
from ..core.kv_cache import KVCache
from ..core.run import GenerationError, Run
from ..core.stats import TreeStats
from ..core.tree import Candidates
from .base import Drafter
from .draft_vocab import DraftVocab
from .lengths import DECAY, curve_for
from .medusa_transfer import MedusaHeads, TransferProjections


def tree_buffers(run: Run, name: str, tree, steps: int, vocab: DraftVocab | None = None) -> tree_mod.TreeBuffers:
    """The tree's buffers, after checking the tree against the trained steps and the (draft) vocabulary.
    The context bounds only the prompt and the output, as greedy decoding's: near its end no round verifies
    a node past the output (``draft_verify`` cuts the tree), and Hidden Transfer's pseudo states that stand
    for tokens past it are never kept; their positions are held at the last one (``transfer_pass``)."""
    buf = tree_mod.build(tree)
    V = run.model.config.vocab_size if vocab is None else vocab.size
    if buf.widest > V:
        what = "vocabulary" if vocab is None else "draft vocabulary"
        raise GenerationError(f"the tree takes draft ranks beyond the {what} ({V} tokens): give smaller top-k")
    if buf.n > 1 and buf.depth > steps:
        raise GenerationError(
            f"the tree is {buf.depth} deep but the {name} weights have {steps} step(s): give a "
            f"tree at most {steps} deep, or train more steps"
        )
    return buf


def top_drafts(buf: tree_mod.TreeBuffers, step_logits: torch.Tensor, vocab: DraftVocab | None = None) -> torch.Tensor:
    """``[k, V]`` draft logits by step (``[k, vocab.size]`` over a draft vocabulary's ids) -> ``[depth, K]``
    top-K token ids (K: the widest level)."""
    top = step_logits[: buf.depth].topk(buf.widest, dim=-1).indices
    return (top if vocab is None else vocab.token(top)).cpu()


def draft_logits(run: Run, z: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """Normalised states ``z`` ``[.., D]`` -> draft logits: ``[.., V]``, or ``[.., K]`` over ``vocab``'s ids."""
    return run.model.unembed(z) if vocab is None else vocab.logits(z)


AUTO_MOST = 16  # the most nodes of a dynamic tree whose count is chosen each round


@dataclass
class RunningScale:
    """One row's decaying sums of the drafts its dynamic trees were expected to keep (their nodes'
    values) and of the drafts kept: ``factor`` turns the drafts' confidence into the row's acceptance
    (a prior of one kept per one expected)."""

    expected: float = 1.0
    kept: float = 1.0

    def observe(self, expected: float, kept: int) -> None:
        self.expected = DECAY * self.expected + expected
        self.kept = DECAY * self.kept + kept

    @property
    def factor(self) -> float:
        return self.kept / self.expected


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree over ``depth`` draft steps: ``nodes`` paths of the highest value a round,
    or (``nodes`` None) the count, up to ``AUTO_MOST``, whose expected tokens ``1 + s (v_1 + .. + v_n)``
    per unit of round cost is the highest (a path's value ``v`` estimates its acceptance; ``s``, the
    row's ``RunningScale.factor``, corrects the drafts' over- or under-confidence)."""

    depth: int
    nodes: int | None

    @property
    def most(self) -> int:
        return AUTO_MOST if self.nodes is None else self.nodes

    def top(self, step_logits: torch.Tensor, vocab: DraftVocab | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``[steps, V]`` -> (top-K ids ``[depth, K]``, their probabilities ``[depth, K]``)."""
        p = step_logits[: self.depth].float().softmax(-1).topk(min(self.most, step_logits.shape[-1]), dim=-1)
        ids = p.indices if vocab is None else vocab.token(p.indices)
        return ids.cpu(), p.values.cpu()

    def candidates(
        self, root: int, ids: torch.Tensor, conf: torch.Tensor, budget: int, cost, scale: float = 1.0
    ) -> tuple[Candidates, float | None]:
        """This round's tree after ``root`` from the row's drafts (``ids``, ``conf``: ``top``'s), no path
        longer than ``budget``; ``cost(n)``: a round's cost with ``n`` nodes, in one-token calls.  -> (the
        tree, the drafts it is expected to keep: its nodes' values summed; with no node, the first draft's
        value; None with no draft at all)."""
        best = tree_mod.best_paths(conf[: max(0, min(self.depth, budget))].tolist(), self.most)
        values = [v for _, v in best]
        n = self.choose(values, cost, scale) if self.nodes is None else self.nodes
        if not best[:n]:
            return Candidates.chain(root, []), values[0] if values else None
        best = best[:n]
        index = {p: j for j, (p, _) in enumerate(best)}
        tokens = [int(ids[len(p) - 1, p[-1]]) for p, _ in best]
        return Candidates.from_parents(root, tokens, [index.get(p[:-1], -1) for p, _ in best]), sum(values[:n])

    @staticmethod
    def choose(values: list[float], cost: Callable[[int], float], scale: float = 1.0) -> int:
        """The ``n`` (0 included: a greedy step) with the most ``(1 + scale (v_1 + .. + v_n)) / cost(n)``."""
        sums = [1.0]
        for v in values:
            sums.append(sums[-1] + scale * v)
        return max(range(len(sums)), key=lambda n: (sums[n] / cost(n), -n))


class TreeDrafter(Drafter):
    """What the tree drafters share: the tree, each row's drafts for the next round, the last kept
    node.  Every row of a batch proposes the same tree shape, filled with its own drafts (a dynamic
    tree: each row its own shape)."""

    batched = True

    def __init__(
        self, run: Run, buf: tree_mod.TreeBuffers, vocab: DraftVocab | None = None, dynamic: DynamicTree | None = None
    ):
        self.buf, self.vocab, self.dynamic = buf, vocab, dynamic  # vocab: the draft vocabulary (None: the full one)
        super().__init__(run)
        self.topk: list[torch.Tensor | None] = [None] * run.batch  # per row [depth, K]: the next round's drafts
        self.conf: list[torch.Tensor | None] = [None] * run.batch  # dynamic: per row [depth, K], their probabilities
        self.nodes = [0] * run.batch  # dynamic: the nodes each row proposed, summed
        self.scales = [RunningScale() for _ in range(run.batch)]  # dynamic: confidence -> acceptance
        self.curve = curve_for(run.model) if dynamic is not None else None  # only a dynamic tree prices rounds
        self.costs = [self.round_cost(n) for n in range(dynamic.most + 1)] if dynamic is not None else []
        self.expected: list[tuple[float, int | None] | None] = [None] * run.batch  # dynamic: the round's
        # drafts expected to be kept, and the first draft where the tree has no node (is it the target's token?)
        self.layout: tuple = (None, None)  # transfer calls: (a tree's mask, its pseudo_layout)

    @property
    def draft_steps(self) -> int:
        """The draft steps each round makes: the tree's depth (a dynamic tree's most)."""
        return self.dynamic.depth if self.dynamic is not None else (self.buf.depth if self.buf.n > 1 else 0)

    @property
    def most_nodes(self) -> int:
        """The most nodes of a round's tree, the root included."""
        return self.dynamic.most + 1 if self.dynamic is not None else self.buf.n

    def next_steps(self, row: int, emitted: int) -> int:
        """The draft steps the row's next round can keep once this round has ``emitted`` tokens (its result
        reaches the drafter before the output, ``draft_verify``): the tree's depth, at most what the output
        will have left less the target's own token."""
        return max(0, min(self.draft_steps, self.run.remaining(row) - emitted - 1))

    def round_cost(self, n: int) -> float:
        """A round's call with ``n`` draft nodes, in one-token calls (``self.curve``)."""
        return self.curve(n + 1)

    def pseudo_steps(self, cands) -> int:
        """The transfer steps a transfer call of this round makes pseudo states for: the most that some live
        row's next round can keep (``next_steps``, this round emitting one token at least); fewer than the
        tree's depth near the output's end."""
        return max((self.next_steps(row, 1) for row, c in enumerate(cands) if c is not None), default=0)

    def set_drafts(self, row: int, step_logits: torch.Tensor) -> None:
        """The row's drafts for its next tree from draft logits by step ``[steps, V]``."""
        if self.dynamic is None:
            self.topk[row] = top_drafts(self.buf, step_logits, self.vocab)
        else:
            self.topk[row], self.conf[row] = self.dynamic.top(step_logits, self.vocab)

    def propose_row(self, row: int, root: int | None, budget: int) -> Candidates:
        if root is None or self.topk[row] is None:  # nothing drafts after the prompt, or the output ends first
            return Candidates.chain(root, [])
        if self.dynamic is None:
            return Candidates.from_tree(self.buf, root, self.topk[row])
        cand, expected = self.dynamic.candidates(
            root, self.topk[row], self.conf[row], budget, self.costs.__getitem__, self.scales[row].factor
        )
        self.nodes[row] += cand.k
        self.expected[row] = None if expected is None else (expected, None if cand.k else int(self.topk[row][0, 0]))
        return cand

    def update(self, cands, results) -> None:
        super().update(cands, results)
        for row, (c, r) in enumerate(zip(cands, results)):
            if c is not None and self.expected[row] is not None:  # a dynamic tree learns how sure its drafts are
                expected, first = self.expected[row]
                self.scales[row].observe(expected, len(r[0]) if first is None else int(r[1] == first))
                self.expected[row] = None

    def transfer_call(
        self, cands, proj: TransferProjections, steps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden Transfer's pass (``transfer_pass``) over every live row's root and tree (one shape, or each
        row's) with ``steps`` (at most ``self.steps``; None: all of them) pseudo states per node -> (real nodes'
        last hidden states ``[B, n, D]``, pseudo states ``[B, steps, n, D]``)."""
        self.mark_start()
        ids, tree = self.batch_tokens(cands)
        shape = tree if tree is not None else next(c for c in cands if c is not None)
        steps = self.steps if steps is None else steps
        return transfer_pass(self.run, self.cache, ids, self.pseudo_layout(shape), proj, steps)

    def pseudo_layout(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """``pseudo_layout`` of the round's tree ``shape`` (a ``Candidates`` or ``BatchTree``; a chain is
        causal), kept for the next round while its mask is the same tensor (a fixed tree's buffers)."""
        if shape.mask is not None and self.layout[0] is shape.mask:
            return self.layout[1]
        k1 = shape.k + 1
        mask = shape.mask if shape.mask is not None else torch.ones(k1, k1, dtype=torch.bool).tril()
        depths = shape.depths if shape.depths is not None else torch.arange(k1)
        self.layout = (shape.mask, pseudo_layout(mask, depths, self.steps))
        return self.layout[1]

    def kept_states(self, cands, results, states: torch.Tensor) -> dict[int, torch.Tensor]:
        """Row -> ``states[row, j]`` at the last kept node ``j`` of each live row (``states`` ``[B, S, ...]``)."""
        return {row: states[row, c.kept(r[0])[-1]] for row, (c, r) in enumerate(zip(cands, results)) if c is not None}

    def tree_stats(self, counts) -> list[TreeStats]:
        """One row's ``TreeStats`` per ``draft_verify.RoundCounts`` (a dynamic tree: its mean nodes a round,
        the root included)."""
        return [
            TreeStats(
                tree_nodes=self.buf.n if self.dynamic is None else round(1 + nodes / max(1, c.rounds)),
                accepted_per_round=c.accepted / c.rounds if c.rounds else None,
            )
            for c, nodes in zip(counts, self.nodes)
        ]


def medusa_logits(run: Run, heads: MedusaHeads, h: torch.Tensor, steps: int, vocab: DraftVocab | None) -> torch.Tensor:
    """The first ``steps`` heads' draft logits ``[steps, V]`` (``[steps, K]`` over ``vocab``) from one
    last-layer state ``h`` ``[D]``."""
    z = run.model.final_norm(h)
    states = torch.stack([heads.state(i, z) for i in range(1, steps + 1)])  # [steps, D]
    return draft_logits(run, states, vocab)


class MedusaDrafter(TreeDrafter):
    def __init__(
        self,
        run: Run,
        heads: MedusaHeads,
        buf: tree_mod.TreeBuffers,
        vocab: DraftVocab | None = None,
        dynamic: DynamicTree | None = None,
    ):
        super().__init__(run, buf, vocab, dynamic)
        self.heads = heads

    def round_tokens(self) -> int:
        return self.most_nodes + 1  # the root and the tree

    def _draft_from(self, row: int, h: torch.Tensor, emitted: int) -> None:
        """Drafts for the row's next tree from one last-layer state ``h`` ``[D]``, from the heads its next
        round can keep (``next_steps``; none: that round is a plain step)."""
        steps = self.next_steps(row, emitted)
        if steps:
            self.set_drafts(row, medusa_logits(self.run, self.heads, h, steps, self.vocab))
        else:
            self.topk[row] = None

    def prefill(self) -> torch.Tensor:
        logits = super().prefill()
        for row in range(self.run.batch):
            self._draft_from(row, self.hidden[row, -1], 1)  # the tree follows the prompt pass's token
        return logits

    def update(self, cands, results) -> None:
        called = self.called()
        super().update(cands, results)
        if called:
            for row, h in self.kept_states(cands, results, self.hidden).items():
                self._draft_from(row, h, len(results[row][0]) + 1)


def pseudo_layout(mask: torch.Tensor, depths: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A transfer call's attention mask and position offsets over a tree (``mask`` ``[n, n]``, ``depths``
    ``[n]``; or each row's: ``[B, n, n]``, ``[B, n]``) and its pseudo states of ``steps`` transfer steps for
    every node: -> (``[S, S]`` or ``[B, S, S]``, ``[1, S]`` or ``[B, S]``; ``tree.pseudo_mask``'s layout)."""
    sources = list(range(mask.shape[-1]))
    if mask.dim() == 2:
        return tree_mod.pseudo_mask(mask, sources, steps), tree_mod.pseudo_offsets(depths, sources, steps).unsqueeze(0)
    full = torch.stack([tree_mod.pseudo_mask(m, sources, steps) for m in mask])  # [B, S, S]
    return full, torch.stack([tree_mod.pseudo_offsets(d, sources, steps) for d in depths])  # [B, S]


def transfer_pass(
    run: Run,
    cache: KVCache,
    tokens: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor],
    proj: TransferProjections,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One model call over the tree ``tokens`` ``[B, n]`` of every row with pseudo states of ``steps``
    transfer steps for every node (``layout``: ``pseudo_layout``'s mask and offsets): -> (real nodes' last
    hidden states ``[B, n, D]``, pseudo states ``[B, steps, n, D]``)."""
    model = run.model
    B, n = tokens.shape
    full, offsets = layout
    full = full.to(model.device)
    base = (cache.lengths[0] - cache.pad).unsqueeze(1)  # [B, 1]
    # a pseudo state of a deep node stands for a token up to 2 x depth ahead, past the context near its end:
    # such a token is past the output too (its drafts are never kept), so its position is held at the last one
    pos = (base + offsets).clamp(max=model.config.max_position - 1).to(model.device)  # [B, S]
    h = model.embed(tokens.to(model.device))  # [B, n, D]
    bounds = proj.layers[:steps] + [model.config.n_layers]
    layer = 0
    for i, end in enumerate(bounds):
        S = h.shape[1]
        h = run.forward(
            cache,
            h=h,
            start=layer,
            end=end,
            positions=pos[:, :S],
            mask=full[..., :S, :S] if S > 1 else None,
            count_call=False,
        )
        layer = end
        if i < steps:
            h = torch.cat([h, proj.transfer(i + 1, h[:, :n])], dim=1)  # step i+1's pseudo states
    run.count(0, 0)  # the segments above are one model call
    return h[:, :n], h[:, n:].reshape(B, steps, n, h.shape[-1])


class TransferDrafter(TreeDrafter):
    def __init__(
        self,
        run: Run,
        proj: TransferProjections,
        buf: tree_mod.TreeBuffers,
        vocab: DraftVocab | None = None,
        dynamic: DynamicTree | None = None,
    ):
        self.steps = dynamic.depth if dynamic is not None else (buf.depth if buf.n > 1 else 0)
        self.proj = proj
        super().__init__(run, buf, vocab, dynamic)
        self.pseudo_states = 0
        self.pseudo: torch.Tensor | None = None  # [B, steps, n, D]

    def round_tokens(self) -> int:
        return self.most_nodes * (self.steps + 1) + 1  # the tree's nodes, and each node's pseudo states

    def round_cost(self, n: int) -> float:
        """Layers ``[0, t_1)`` over the ``n + 1`` nodes, ``[t_i, t_i+1)`` over them and their pseudo states
        of steps ``1..i``: each segment its share of the layers' call cost."""
        L = self.run.model.config.n_layers
        bounds = [0] + self.proj.layers[: self.steps] + [L]
        return sum((bounds[i + 1] - bounds[i]) / L * self.curve((i + 1) * (n + 1)) for i in range(self.steps + 1))

    def score(self, cands):
        live = [c for c in cands if c is not None]
        if live[0].root is None:  # right after the prompt: the prompt pass scored the first position
            return super().score(cands)
        steps = self.pseudo_steps(cands)
        h, self.pseudo = self.transfer_call(cands, self.proj, steps)
        self.pseudo_states += steps * h.shape[1] * len(live)
        logits = self.run.model.logits(h)  # [B, n, V]
        return [None if c is None else logits[row, : len(c.fed())] for row, c in enumerate(cands)]

    def update(self, cands, results) -> None:
        called = next(c for c in cands if c is not None).root is not None
        super().update(cands, results)
        if called and self.steps:
            transfer_drafts(self, cands, results)

    def tree_stats(self, counts) -> list[TreeStats]:
        stats = super().tree_stats(counts)
        for r in stats:
            r.pseudo_states = self.pseudo_states  # the whole batch's
        return stats


def transfer_drafts(drafter: TreeDrafter, cands, results) -> None:
    """Each live row's drafts for its next tree from the pseudo states of its last kept node (``drafter.pseudo``
    ``[B, steps, n, D]``, the round's transfer call's), of the steps that round can keep (``next_steps``;
    none: it is a plain step)."""
    pseudo = drafter.pseudo.transpose(1, 2)  # [B, n, steps, D]
    for row, p in drafter.kept_states(cands, results, pseudo).items():  # p [steps, D]
        steps = drafter.next_steps(row, len(results[row][0]) + 1)
        if steps:
            z = drafter.run.model.final_norm(p[:steps])
            drafter.set_drafts(row, draft_logits(drafter.run, z, drafter.vocab))
        else:
            drafter.topk[row] = None
