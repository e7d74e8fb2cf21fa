"""Verification rules shared by every draft-and-check method, as pure functions.

A *draft* is a run of proposed tokens ``d[0..k)``; the verifier has scored the same positions in
one pass, giving ``k + 1`` rows: row ``i`` is its prediction for the position of ``d[i]`` and row
``k`` the one after the last draft token.

- ``greedy_accept``: keep the longest prefix where the draft equals the verifier's argmax, then the
  verifier's argmax (the output is the verifier's greedy decoding, token for token).
- ``speculative_accept``: lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
  accept ``d[i]`` with probability ``min(1, p(d_i) / q(d_i))``; at the first rejection sample from the
  residual ``norm(max(0, p - q))``; when all are accepted sample the bonus token from ``p[k]``.  The
  tokens it emits are distributed exactly as sampling from ``p`` one token at a time.
- ``match_candidate``: PPD's check (Yang et al. 2023, Algorithm 1 line 22): which of the early top-k
  candidates equals the token the full model chose, if any.
- ``hard_cross_entropy`` / ``first_rollback``: BiLD's rollback rule (Kim et al. 2023, §3.4 and
  §4.1): the distance of a draft token from the verifier is the cross-entropy between the draft's
  hard label and the verifier's soft label, ``-log p(d_i)``; the first position where it exceeds
  ``alpha_rb`` is rolled back.

``p`` and ``q`` are probability rows (already warped by temperature / top-k / top-p, see
``sampling.probs``); every function takes one sequence (no batch dimension).
"""

from __future__ import annotations

import math

import torch

from . import sampling


def _device(generator: torch.Generator | None, t: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else t.device


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the probability row ``p`` ``[V]``, on the generator's device."""
    return int(sampling.sample(p.reshape(1, -1).to(_device(generator, p)), generator)[0])


def greedy_accept(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """``draft`` ``[k]`` ids, verifier ``logits`` ``[k+1, V]`` -> (accepted count n, the verifier's token
    at position n)."""
    k = int(draft.shape[0])
    target = logits.argmax(-1).cpu()  # [k+1]
    miss = (draft.cpu() != target[:k]).nonzero()
    n = int(miss[0, 0]) if miss.numel() else k
    return n, int(target[n])


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


def speculative_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """Lossless speculative sampling.  ``draft`` ``[k]`` ids sampled from the draft rows ``q`` ``[k, V]``;
    verifier rows ``p`` ``[k+1, V]`` -> (accepted count n, the token at position n: a residual sample
    after a rejection, a sample of ``p[k]`` when all k were accepted)."""
    k = int(draft.shape[0])
    dev = _device(generator, p)
    p, q = p.to(dev), q.to(dev)  # random numbers come from the generator's device
    if k:
        idx = draft.view(-1, 1).to(dev)
        p_d = p[:k].gather(1, idx).squeeze(1).double()
        q_d = q.gather(1, idx).squeeze(1).double()
        u = torch.rand(k, generator=generator, dtype=torch.float64, device=dev)
        # accept iff u < p/q, written without a division (q_d > 0 for a token that was sampled)
        reject = (u * q_d >= p_d).nonzero()
        if reject.numel():
            n = int(reject[0, 0])
            return n, int(sampling.sample(residual(p[n:n + 1].double(), q[n:n + 1].double()), generator)[0])
    return k, int(sampling.sample(p[k:k + 1], generator)[0])


def hard_cross_entropy(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``-log probs[i, tokens[i]]`` ``[k]`` (inf where the probability is 0)."""
    if tokens.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    pt = probs.gather(1, tokens.view(-1, 1).to(probs.device)).squeeze(1).double()
    return -torch.log(pt)


def first_rollback(tokens: torch.Tensor, probs: torch.Tensor, alpha_rb: float) -> int | None:
    """BiLD's rollback policy: the first ``i`` with ``-log probs[i, tokens[i]] > alpha_rb``, or None.
    ``alpha_rb = inf`` never rolls back; ``alpha_rb <= ln 2`` keeps only tokens the verifier gives
    at least half its probability, i.e. its argmax."""
    if math.isinf(alpha_rb) or tokens.numel() == 0:
        return None
    bad = (hard_cross_entropy(tokens, probs) > alpha_rb).nonzero()
    return int(bad[0, 0]) if bad.numel() else None


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance over a flattened candidate tree (Medusa / Hidden Transfer).  ``tokens``
    ``[n]`` node ids, ``parents`` ``[n]`` (-1 for the root, node 0, which is already decided),
    verifier ``logits`` ``[n, V]`` (row i predicts the token after node i) -> (node indices of the
    longest root-first path whose every token equals the verifier's argmax at its parent, the
    verifier's token after the path's last node).  With one path (a chain) this is
    ``greedy_accept``; the output is the verifier's greedy decoding, token for token."""
    target = logits.argmax(-1).cpu()  # [n]
    toks, par = tokens.cpu().tolist(), parents.cpu().tolist()
    children: dict[int, list[int]] = {}
    for j, p in enumerate(par):
        if p >= 0:
            children.setdefault(p, []).append(j)
    path = [0]
    while True:
        want = int(target[path[-1]])
        nxt = next((c for c in children.get(path[-1], ()) if toks[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
