"""Verification rules shared by every draft-and-check method, as pure functions.

Drafts form a chain or a tree after the current position (``tree.Candidates``): ``tokens`` ``[k]``
and ``parents`` ``[k]`` (-1 for the first level).  The verifier has scored them in one pass, giving
``1 + k`` rows: row 0 predicts the first level, row ``1 + j`` the children of draft ``j``.  A chain is
the tree ``parents = -1, 0, .., k-2``.

- ``accept_greedy``: keep the longest root-first path whose every token is the verifier's argmax,
  then the verifier's argmax (the output is the verifier's greedy decoding, token for token).
- ``accept_sampled``: lossless sampling: on a chain, speculative sampling (Leviathan et al. 2023,
  Chen et al. 2023): accept ``d[i]`` with probability ``min(1, p(d_i) / q(d_i))``, at the first
  rejection sample from the residual ``norm(max(0, p - q))``; on a tree, SpecInfer's multi-step
  speculative sampling (Miao et al. 2024): siblings are tried in turn, each rejection leaving the
  residual for the next.  Deterministic drafts are one-hot proposals.  The tokens it emits are
  distributed exactly as sampling from ``p`` one token at a time.
- ``greedy_accept`` / ``speculative_accept`` / ``tree_accept``: the same rules in the chain and
  flattened-tree layouts that tests and tools use.
- ``match_candidate``: PPD's check (Yang et al. 2023, Algorithm 1 line 22): which of the early top-k
  candidates equals the token the full model chose, if any.
- ``hard_cross_entropy`` / ``rollback_path``: BiLD's rollback rule (Kim et al. 2023, §3.4 and
  §4.1): the distance of a draft token from the verifier is the cross-entropy between the draft's
  hard label and the verifier's soft label, ``-log p(d_i)``; the first position where it exceeds
  ``alpha_rb`` is rolled back (on a tree, along the path of the verifier's most likely children).

``p`` and ``q`` are probability rows (already warped by temperature / top-k / top-p, see
``sampling.probs``); every function takes one sequence (no batch dimension).
"""

from __future__ import annotations

import torch

from . import sampling


def _device(generator: torch.Generator | None, t: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else t.device


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the probability row ``p`` ``[V]``, on the generator's device."""
    return int(sampling.sample(p.reshape(1, -1).to(_device(generator, p)), generator)[0])


def children(parents: torch.Tensor) -> dict[int, list[int]]:
    """``parents`` ``[k]`` (-1: a child of the root) -> parent index -> its children, in order."""
    out: dict[int, list[int]] = {}
    for j, p in enumerate(parents.tolist()):
        out.setdefault(int(p), []).append(j)
    return out


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance over a chain or a tree of drafts.  ``tokens`` ``[k]``, ``parents`` ``[k]``
    (-1 for the first level), verifier ``logits`` ``[1 + k, V]`` (row 0 predicts the first level, row
    ``1 + j`` the children of draft ``j``) -> (the drafts of the longest root-first path whose every
    token is the verifier's argmax at its parent, the verifier's token after it).  The output is the
    verifier's greedy decoding, token for token."""
    target = sampling.top_ids(logits)  # [1 + k]
    toks, kids = tokens.cpu().tolist(), children(parents)
    path, node = [], -1
    while True:
        want = int(target[node + 1])
        nxt = next((c for c in kids.get(node, ()) if toks[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def accept_sampled(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless sampling over a chain or a tree (SpecInfer's multi-step speculative sampling, Miao et
    al. 2024, Algorithm 2; for a chain, Leviathan et al. 2023).  ``p`` ``[1 + k, V]`` verifier
    probabilities laid out as in ``accept_greedy``; ``q`` ``[k, V]`` the distribution each draft was
    drawn from, or None when every draft was chosen deterministically (a one-hot proposal).

    From the root, the children of the current node are tried in order: child ``c`` with token
    ``x`` is accepted with probability ``min(1, r(x) / q_c(x))``; a rejected child turns ``r`` into
    the residual ``norm(max(0, r - q_c))`` for the next sibling; the first accepted child becomes the
    current node (``r`` its row of ``p``); when every child is rejected the token is drawn from
    ``r``.  Each emitted token is distributed exactly as sampling from ``p`` one token at a time, for
    siblings drawn independently from one ``q`` or chosen deterministically (one-hot ``q``: accept
    ``x`` with probability ``r(x)``, else drop ``x`` from ``r``)."""
    dev = _device(generator, p)
    toks, kids = tokens.cpu().tolist(), children(parents)
    path, node = [], -1
    while True:
        # [V]: only the rows the walk reaches, as they are until a rejection makes a residual (in fp64);
        # the tests read single entries (exact in Python floats) and ``sample`` sums in fp64 either way
        r = p[node + 1].to(dev)
        for c in kids.get(node, ()):
            x = toks[c]
            u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=dev))
            if q is None:  # a certain proposal: accept with probability r(x), else drop x from r
                if u < float(r[x]):
                    path.append(c)
                    node = c
                    break
                r = r.clone() if r.dtype == torch.float64 else r.double()
                r[x] = 0.0  # residual(r, one-hot x): the same values, so the same sum
                r = r / r.sum()
                continue
            if u * float(q[c, x]) < float(r[x]):  # u < r/q, without a division
                path.append(c)
                node = c
                break
            r = residual(r.double().unsqueeze(0), q[c].to(dev).double().unsqueeze(0))[0]
        else:
            return path, int(sampling.sample(r.unsqueeze(0), generator)[0])


def greedy_accept(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """A chain's ``accept_greedy``: ``draft`` ``[k]`` ids, verifier ``logits`` ``[k+1, V]`` -> (accepted
    count n, the verifier's token at position n)."""
    k = int(draft.shape[0])
    path, nxt = accept_greedy(draft, torch.arange(-1, k - 1), logits)
    return len(path), nxt


def match_candidate(candidates: torch.Tensor, token: int) -> int | None:
    """``candidates`` ``[k]`` ids (early top-k, best first), ``token`` the verifier's choice -> the index
    of the candidate equal to it, or None."""
    hit = (candidates.cpu() == int(token)).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over the last dimension; ``p`` where the residual is empty (p == q, where
    a rejection cannot happen)."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)


def speculative_accept(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """A chain's ``accept_sampled``: ``draft`` ``[k]`` ids sampled from the draft rows ``q`` ``[k, V]``;
    verifier rows ``p`` ``[k+1, V]`` -> (accepted count n, the token at position n: a residual sample
    after a rejection, a sample of ``p[k]`` when all k were accepted)."""
    k = int(draft.shape[0])
    path, nxt = accept_sampled(draft, torch.arange(-1, k - 1), p, q, generator)
    return len(path), nxt


def hard_cross_entropy(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``-log probs[i, tokens[i]]`` ``[k]`` (inf where the probability is 0)."""
    if tokens.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    pt = probs.gather(1, tokens.view(-1, 1).to(probs.device)).squeeze(1).double()
    return -torch.log(pt)


def rollback_path(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, alpha_rb: float, own: list[int] | None = None
) -> list[int]:
    """BiLD's rollback policy over a chain or a tree -> the drafts of the kept path.  From the root, each
    step takes the child the verifier gives the most probability and keeps it while its cross-entropy
    ``-log p`` is at most ``alpha_rb`` (on a chain: every draft before the first rolled back one).
    ``own`` (greedy decoding: each row's argmax) also keeps a child that is the verifier's own choice
    there, which a rollback would only put back.  ``tokens`` ``[k]``, ``parents`` ``[k]`` (-1 for the
    first level), ``probs`` ``[1 + k, V]`` laid out as in ``accept_greedy``.  With ``own`` and
    ``alpha_rb < ln 2`` (a kept draft has more than half the probability: the argmax) the path is
    ``accept_greedy``'s (at exactly ln 2 too, except where the verifier splits its probability half and half,
    within float32 rounding, between the draft and another token)."""
    toks, kids = tokens.cpu().tolist(), children(parents)
    path, node = [], -1
    while kids.get(node):
        row = probs[node + 1]  # [V]
        best = max(kids[node], key=lambda c: (float(row[toks[c]]), -c))
        ce = float(hard_cross_entropy(tokens[best : best + 1], row.unsqueeze(0))[0])
        if ce > alpha_rb and not (own is not None and toks[best] == own[node + 1]):
            return path
        path.append(best)
        node = best
    return path


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """``accept_greedy`` over a flattened ``TreeBuffers`` tree whose node 0 is the root: ``tokens``
    ``[n]``, ``parents`` ``[n]`` (-1 for node 0), ``logits`` ``[n, V]`` -> (node indices of the
    accepted path, root first, the verifier's token after it)."""
    path, nxt = accept_greedy(tokens[1:], parents[1:] - 1, logits)
    return [0] + [1 + j for j in path], nxt
