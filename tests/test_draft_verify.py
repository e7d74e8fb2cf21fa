"""The one draft-and-verify loop (methods/draft_verify.py) and its verifier (core/verify.py): the
tree rules as pure functions, and lossless sampling end to end for every method that runs on the
loop and claims it.

Sampling is checked against the model's own distribution, computed exactly on a 6-token vocabulary:
the joint of the first three sampled tokens over many seeds, through pairs (x1, x2) and (x2, x3), so
that the first drafted tokens of every drafter pass through the acceptance rule (a draft model
drafts the first token; prompt lookup, self-spec and medusa the second; hidden-transfer the
third, drafted only where a fourth follows: a round keeps no draft for the output's last token)."""

from __future__ import annotations

import pytest
import torch
from test_speculative import chi2_pvalue, tiny_pair

import layerleap
from layerleap.core import sampling, verify
from layerleap.core.tree import Candidates, build
from layerleap.drafters import medusa_transfer
from layerleap.drafters.corpus import Corpus


# -- the pure rules --------------------------------------------------------------------------------
P = torch.tensor(
    [
        [0.05, 0.40, 0.05, 0.30, 0.20, 0.00],  # row 0: the first level
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],  # after draft 0
        [0.30, 0.10, 0.10, 0.10, 0.10, 0.30],  # after draft 1
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ]
)  # after draft 2


def _first_tokens(tokens, parents, q, n=20_000, seed=0):
    """How often each token comes first out of ``accept_sampled`` over ``n`` draws."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(n):
        path, nxt = verify.accept_sampled(tokens, parents, P, q, g)
        counts[int(tokens[path[0]]) if path else nxt] += 1
        accepted += bool(path)
    return counts, accepted / n


def test_tree_with_deterministic_siblings_samples_the_target():
    """Two top-k siblings at the first level (one-hot proposals) and a child: the first token is
    distributed as p's first row, and each sibling is accepted with its residual probability."""
    tokens, parents = torch.tensor([1, 3, 2]), torch.tensor([-1, -1, 0])
    counts, accepted = _first_tokens(tokens, parents, None)
    assert abs(accepted - 0.70) < 0.02  # 0.40 for the first sibling, then 0.30 of what is left
    assert chi2_pvalue(counts, P[0]) > 1e-3


def test_tree_with_sampled_siblings_samples_the_target():
    """SpecInfer's rule: siblings drawn independently from q, each rejection leaving the residual."""
    q = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.10, 0.10])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(6)
    for _ in range(20_000):
        a, b = sampling.sample(q.expand(2, 6), g).tolist()
        path, nxt = verify.accept_sampled(torch.tensor([a, b]), torch.tensor([-1, -1]), P[:3], q.expand(2, 6), g)
        counts[[a, b][path[0]] if path else nxt] += 1
    assert chi2_pvalue(counts, P[0]) > 1e-3
    assert chi2_pvalue(counts, q) < 1e-9


def test_accepted_path_follows_the_tree():
    """After accepting draft 0 the rule tries draft 0's child against row 1, never draft 1's subtree."""
    tokens, parents = torch.tensor([1, 3, 2]), torch.tensor([-1, -1, 0])
    g = torch.Generator().manual_seed(2)
    for _ in range(2000):
        path, nxt = verify.accept_sampled(tokens, parents, P, None, g)
        assert path in ([], [0], [0, 2], [1])
    logits = torch.log(P + 1e-9)
    assert verify.accept_greedy(tokens, parents, logits) == ([0, 2], 0)  # argmax 1, then 2, then row 3's first 0.2
    assert verify.accept_greedy(tokens[:0], parents[:0], logits[:1]) == ([], 1)


def test_candidates_from_a_tree_keep_its_shape():
    buf = build([(0,), (1,), (0, 0)])
    topk = torch.tensor([[7, 8], [9, 5]])
    c = Candidates.from_tree(buf, 4, topk)
    assert c.fed() == [4, 7, 8, 9] and c.parents.tolist() == [-1, -1, 0] and c.depth == 2
    assert c.kept([0, 2]) == [0, 1, 3]
    chain = Candidates.chain(None, [3, 4])
    assert chain.fed() == [3, 4] and chain.kept([0]) == [0] and chain.is_chain


# -- lossless sampling end to end -------------------------------------------------------------------
def exact_joint3(model, prompt: list[int], warp: dict) -> torch.Tensor:
    """P(x1, x2, x3) of the model's own sampling with ``warp``: ``[V, V, V]``."""
    V = model.config.vocab_size
    with torch.inference_mode():
        p1 = sampling.probs(model(torch.tensor([prompt]))[0, -1], **warp)  # [V]
        p2 = sampling.probs(model(torch.tensor([prompt + [a] for a in range(V)]))[:, -1], **warp)  # [V, V]
        ids = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = sampling.probs(model(ids)[:, -1], **warp).view(V, V, V)
    return p1.view(V, 1, 1) * p2.view(V, V, 1) * p3


def _perturbed(model, kind: str, **config):
    d = medusa_transfer.new_drafter(model, kind, **config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d


SAMPLING = {
    "speculative": lambda t, d: {"draft": d, "draft_len": 2, "min_confidence": 0.0},
    "prompt-lookup": lambda t, d: {"draft_len": 2},
    # the corpus continues the tokens the prompt lacks (0, 2, 5), where prompt lookup finds nothing
    "rest": lambda t, d: {"draft_len": 2, "corpus": Corpus([[0, 2, 5, 1], [2, 0, 0, 3], [5, 5, 2, 4]], 6)},
    "self-spec": lambda t, d: {"exit_layer": 1, "draft_len": 2, "head": "shared"},
    "medusa": lambda t, d: {"tree": "2,1", "heads": _perturbed(t, "medusa", steps=2)},
    "hidden-transfer": lambda t, d: {"tree": "2,1", "transfer": _perturbed(t, "transfer", layers=[1, 2])},
    "eagle": lambda t, d: {"draft_len": 2, "eagle_head": _perturbed(t, "eagle")},
    "eagle width": lambda t, d: {"draft_len": 2, "width": 3, "eagle_head": _perturbed(t, "eagle")},
    "medusa dynamic": lambda t, d: {"tree": "dynamic", "tree_nodes": 3, "heads": _perturbed(t, "medusa", steps=2)},
    "auto": lambda t, d: {"tree": "2,1", "draft_len": 2, "transfer": _perturbed(t, "transfer", layers=[1, 2])},
}


def test_every_lossless_sampling_method_is_covered():
    want = {n for n, m in layerleap.METHODS.items() if m.exact and m.sampling}
    assert want == {label.split()[0] for label in SAMPLING}


@pytest.mark.parametrize("method", list(SAMPLING))
def test_sampled_tokens_follow_the_models_distribution(method):
    target, draft = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]  # repeats, so prompt lookup finds drafts
    warp = dict(temperature=0.8, top_k=5)
    p = exact_joint3(target, prompt, warp)
    options = SAMPLING[method](target, draft)
    counts = torch.zeros(6, 6, 6)
    drafted = accepted = 0
    for seed in range(800):
        r = layerleap.generate(
            target, prompt, method.split()[0], 4, do_sample=True, seed=seed, stop_at_eos=False, **warp, **options
        )
        counts[tuple(r.token_ids[:3])] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    assert chi2_pvalue(counts.sum(2), p.sum(2)) > 1e-3  # (x1, x2)
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3  # (x2, x3)
    assert chi2_pvalue(counts.sum((0, 1)), p.sum((0, 1))) > 1e-3  # x3


def test_eagle_drafts_are_drawn_from_the_heads_distribution_when_sampling(monkeypatch):
    """Under sampling the EAGLE head's chain drafts are drawn (they vary with the seed) from the
    distribution ``q`` that goes with them (a warped distribution holding the draft); the fan's
    siblings are one-hot and differ from the drawn draft.  In greedy decoding no ``q`` goes along."""
    from layerleap.drafters.eagle import EagleChains

    target, _ = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    head = _perturbed(target, "eagle")
    made = []
    real = EagleChains.candidates

    def spy(root, chain, siblings, q=None):
        cand = real(root, chain, siblings, q)
        made.append(cand)
        return cand

    monkeypatch.setattr(EagleChains, "candidates", staticmethod(spy))
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    firsts = set()
    for seed in range(30):
        made.clear()
        layerleap.generate(
            target, prompt, "eagle", 6, do_sample=True, seed=seed, temperature=1.5, stop_at_eos=False,
            draft_len=2, width=3, eagle_head=head,
        )  # fmt: skip
        for c in (c for c in made if c.k):
            assert c.q is not None and c.q.shape == (c.k, 6)
            torch.testing.assert_close(c.q.sum(-1), torch.ones(c.k, dtype=c.q.dtype))
            toks, parents = c.tokens.tolist(), c.parents.tolist()
            assert all(float(c.q[j, t]) > 0 for j, t in enumerate(toks))
            fan = [j for j, p in enumerate(parents) if p == -1][1:]
            assert all(float(c.q[j, toks[j]]) == 1.0 for j in fan) and toks[0] not in [toks[j] for j in fan]
            firsts.add(toks[0])
    assert len(firsts) >= 3  # drawn, not the argmax every time
    made.clear()
    layerleap.generate(target, prompt, "eagle", 6, stop_at_eos=False, draft_len=2, width=3, eagle_head=head)
    assert made and all(c.q is None for c in made)
    made.clear()  # BiLD's fallback drops an unsure draft: its distribution goes with it
    for seed in range(10):
        layerleap.generate(
            target, prompt, "bild", 6, do_sample=True, seed=seed, temperature=1.5, stop_at_eos=False,
            eagle=head, alpha_fb=0.4, max_small=3,
        )  # fmt: skip
    drawn = [c for c in made if c.k]
    assert drawn and all(c.q is not None and c.q.shape[0] == c.k for c in drawn)
    assert any(c.stop == "unsure" for c in drawn)


# -- the drafter owns its cache needs ----------------------------------------------------------------
def test_drafters_size_the_cache_from_their_round():
    """A drafter declares the most tokens a round appends (``round_tokens``) and the base sizes the
    target's cache from it: prompt + budget + round + 1 slots.  A γ that may grow is bounded by the
    budget alone."""
    from layerleap.decoding import GenerationConfig, Run
    from layerleap.drafters.base import ChainRule, DraftLength
    from layerleap.drafters.companion import DraftModel
    from layerleap.drafters.early_exit import EarlyExitDrafter
    from layerleap.drafters.prompt_lookup import PromptLookup

    large, small = tiny_pair(1)
    run = Run(large, [[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=10))
    assert [ChainRule(length).longest(10) for length in (DraftLength(4), DraftLength(4, "heuristic"), None)] == [
        4,
        10,
        10,
    ]
    lookup = PromptLookup(run, 5, 1, 3)
    assert lookup.round_tokens() == 6 and lookup.cache.max_len == 3 + 10 + 6 + 1
    early = EarlyExitDrafter(run, 1, large.logits, ChainRule(DraftLength(3)))
    assert early.cache.max_len == 3 + 10 + 4 + 1 and early.pair.cache is early.cache
    draft = DraftModel(run, small, ChainRule(DraftLength(2, "heuristic")))
    assert draft.cache.max_len == draft.model.cache.max_len == 3 + 10 + 11 + 1


def test_one_prefill_serves_every_drafter():
    """The early-exit drafter's prompt pass is ``Run.prefill_at``'s: the same padding (EOS) and the
    same cache, slot for slot, as the plain prompt pass on a ragged batch, and the same meters."""
    from layerleap.decoding import GenerationConfig, Run
    from layerleap.drafters.base import ChainRule, DraftLength
    from layerleap.drafters.early_exit import EarlyExitDrafter
    from layerleap.drafters.prompt_lookup import PromptLookup

    import dataclasses

    large, _ = tiny_pair(1)
    large.config = dataclasses.replace(large.config, eos_token_ids=(7,))  # padding with EOS, not 0
    prompts = [[1, 2, 3, 4], [5]]
    runs = [Run(large, prompts, GenerationConfig(max_new_tokens=4)) for _ in range(2)]
    plain = PromptLookup(runs[0], 3, 1, 2)
    early = EarlyExitDrafter(runs[1], 1, large.logits, ChainRule(DraftLength(3)))
    with torch.inference_mode():
        want, got = plain.prefill(), early.prefill()
    torch.testing.assert_close(got, want)
    n = len(prompts[0])
    torch.testing.assert_close(early.cache.k[:, :, :, :n], plain.cache.k[:, :, :, :n])  # padding slots too
    assert early.cache.pad.tolist() == plain.cache.pad.tolist() == [0, 3]
    assert (runs[0].model_calls, runs[0].layer_evals, runs[0].prompt_layer_evals) == (
        runs[1].model_calls,
        runs[1].layer_evals,
        runs[1].prompt_layer_evals,
    )


# -- the loop's counts and limits ------------------------------------------------------------------
def test_drafts_after_an_end_of_sequence_token_are_not_counted_accepted():
    """A prompt-lookup chain copies greedy's own continuation, an end-of-sequence token inside it: the
    output stops there, and only the drafts it emitted count as accepted."""
    import dataclasses

    from tiny_models import random_model

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    p = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(5)).tolist()
    cont = layerleap.generate(model, p, "greedy", 12, stop_at_eos=False).token_ids
    pp = p + cont + p  # the prompt's tail repeats its start: lookup drafts the continuation
    checked = 0
    for eos in dict.fromkeys(cont[1:8]):
        model.config = dataclasses.replace(model.config, eos_token_ids=(eos,))
        r = layerleap.generate(model, pp, "prompt-lookup", 12, draft_len=8)
        assert r.token_ids == layerleap.generate(model, pp, "greedy", 12).token_ids
        s = r.stats
        assert s["accepted"] <= len(r.token_ids) - 1, (eos, r.token_ids, s)  # the first token is the prompt pass's
        checked += s["drafted"] > s["accepted"]
    assert checked  # some chain held drafts past the end


def test_a_second_model_with_a_shorter_context_is_refused_for_a_longer_prompt():
    from tiny_models import random_model

    large = random_model("llama-gqa-tied", seed=11, scale=2.0)
    small = random_model("llama-gqa-tied", seed=5, scale=2.0, max_position=64)
    fits = list(range(1, 53))  # 52 + 12 new tokens: the small model's 64 positions
    want = layerleap.generate(large, fits, "greedy", 12).token_ids
    assert layerleap.generate(large, fits, "speculative", 12, draft=small).token_ids == want
    for method, kw in (("speculative", {"draft": small}), ("bild", {"small": small})):
        for prompt, n in ((list(range(1, 66)), 8), (fits, 13)):  # a prompt too long, or the answer
            with pytest.raises(layerleap.GenerationError, match="exceeds the (draft|small) model's context"):
                layerleap.generate(large, prompt, method, n, **kw)


def test_a_tree_decodes_a_batch_that_fills_the_context_in_any_order():
    """The longest prompt + max_new_tokens filling the context, as greedy decoding serves it: a tree's
    nodes past its end stand for tokens past the output; one row more is refused as greedy refuses it."""
    from tiny_models import random_model

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    heads = _perturbed(model, "medusa", steps=3)
    long, short = [i % 90 + 1 for i in range(model.config.max_position - 6)], [1, 2, 3]
    for batch in ([long, short], [short, long]):
        want = [r.token_ids for r in layerleap.generate(model, batch, "greedy", 6, stop_at_eos=False)]
        got = layerleap.generate(model, batch, "medusa", 6, heads=heads, tree="1,1,1", stop_at_eos=False)
        assert [r.token_ids for r in got] == want
        with pytest.raises(layerleap.GenerationError, match="that exceeds the context length"):
            layerleap.generate(model, batch, "medusa", 7, heads=heads, tree="1,1,1")


def test_a_transfer_tree_near_the_context_end_decodes_greedy():
    """Hidden Transfer's pseudo states of a deep node stand for tokens up to twice the tree's depth ahead:
    with the prompt and the output near the context's end, they lie past it, and the call still decodes
    (its drafts there are past the output), equal to greedy decoding."""
    from tiny_models import random_model

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    proj = _perturbed(model, "transfer", layers=[1, 2, 3])
    n = 5
    prompt = [i % 90 + 3 for i in range(model.config.max_position - n - 3 - 1)]  # + n + depth 3 + 1: the limit
    want = layerleap.generate(model, prompt, "greedy", n, stop_at_eos=False).token_ids
    for tree in ("1,1,1", "3,2,2"):
        got = layerleap.generate(model, prompt, "hidden-transfer", n, stop_at_eos=False, tree=tree, transfer=proj)
        assert got.token_ids == want


def test_a_numpy_integer_seed_samples_as_the_same_int():
    import numpy as np

    from tiny_models import random_model

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    a = layerleap.generate(model, [5, 6, 7], "sample", 8, seed=np.int64(3)).token_ids
    assert a == layerleap.generate(model, [5, 6, 7], "sample", 8, seed=3).token_ids


def test_options_that_would_change_nothing_are_refused():
    from tiny_models import random_model

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="tree= shapes Hidden Transfer's tree"):
        layerleap.generate(model, [1, 2, 3], "auto", 4, tree="5,3,1", transfer=None)
    with pytest.raises(layerleap.GenerationError, match="corpus_draft_len= limits"):
        layerleap.generate(model, [1, 2, 3], "rest", 4, corpus="none", corpus_draft_len=2)


# -- drafts past the output's end ------------------------------------------------------------------
def test_candidates_within_a_depth_keep_what_a_round_can_keep():
    """``Candidates.within(d)``: a tree loses its nodes deeper than ``d`` (parents renumbered, mask and depths
    cut with them, ``q`` rows too), a chain its drafts past ``d`` (its stop then "budget"); nothing left is a
    plain step; nothing deeper is the candidates themselves."""
    buf = build([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    tree = Candidates.from_tree(buf, 4, torch.tensor([[7, 8], [9, 5], [6, 6]]))
    assert tree.within(3) is tree and tree.within(7) is tree
    two = tree.within(2)
    assert two.fed() == [4, 7, 8, 9, 9] and two.parents.tolist() == [-1, -1, 0, 1] and two.depth == 2
    assert torch.equal(two.mask, buf.mask[:5, :5]) and two.depths.tolist() == [0, 1, 1, 2, 2]
    one = tree.within(1)
    assert one.fed() == [4, 7, 8] and one.parents.tolist() == [-1, -1] and not one.is_chain
    assert tree.within(0).fed() == [4] and tree.within(-1).k == 0
    fan = Candidates.from_parents(3, [1, 2, 5, 6], [-1, -1, 0, 2])  # a fan beside a chain, nodes not by depth
    fan.q = torch.eye(8)[[1, 2, 5, 6]]
    cut = fan.within(2)
    assert cut.fed() == [3, 1, 2, 5] and cut.parents.tolist() == [-1, -1, 0] and cut.q.argmax(-1).tolist() == [1, 2, 5]
    assert cut.mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    chain = Candidates.chain(9, [1, 2, 3], [torch.eye(4)[i] for i in (1, 2, 3)])
    short = chain.within(2)
    assert short.fed() == [9, 1, 2] and short.stop == "budget" and short.q.shape == (2, 4) and short.is_chain
    assert chain.within(0).fed() == [9] and chain.within(0).stop == "budget"


def _end_methods(target, draft):
    """Every drafting method on the loop, with trees and chains deeper than the last rounds' budgets."""
    medusa = _perturbed(target, "medusa", steps=4)
    transfer = _perturbed(target, "transfer", layers=[1, 2, 3])
    eagle = _perturbed(target, "eagle")
    corpus = Corpus([[1, 3, 4, 1, 3, 4, 1, 3, 4, 2, 5, 6]], 97)
    return {
        "speculative": {"draft": draft, "draft_len": 4, "min_confidence": 0.0},
        "prompt-lookup": {"draft_len": 4},
        "rest": {"draft_len": 4, "corpus": corpus},
        "self-spec": {"exit_layer": 1, "draft_len": 4, "head": "shared"},
        "medusa": {"tree": "2,2,1,1", "heads": medusa},
        "medusa dynamic": {"tree": "dynamic", "tree_nodes": 6, "heads": medusa},
        "hidden-transfer": {"tree": "2,1,1", "transfer": transfer},
        "eagle": {"draft_len": 4, "width": 2, "eagle_head": eagle},
        "auto": {"tree": "2,1,1", "draft_len": 4, "transfer": transfer},
        "auto medusa": {"draft_len": 4, "medusa": medusa},
        "auto eagle": {"draft_len": 4, "eagle": eagle, "transfer": transfer, "tree": "2,1,1"},
        "bild": {"small": draft, "alpha_fb": 0.0, "alpha_rb": 0.0, "max_small": 4},
        "bild eagle": {"eagle": eagle, "alpha_fb": 0.0, "alpha_rb": 0.0, "max_small": 4},
    }


END_METHODS = list(_end_methods(*tiny_pair(3, scale=2.0, n_draft=1)))


@pytest.mark.parametrize("method", END_METHODS)
def test_no_round_verifies_drafts_past_the_output(monkeypatch, method):
    """With ``r`` tokens left a round keeps at most ``r - 1`` drafts and the target's token (BiLD's rollback:
    ``r`` drafts), so no call verifies a node deeper (a tree's, a chain's), and with one token left a round is a
    plain step; the output is greedy decoding's, alone and in a batch whose rows end at different rounds, and
    ``drafted`` counts the verified paths only."""
    from layerleap.methods import draft_verify

    target, draft = tiny_pair(3, scale=2.0, n_draft=1)
    options = _end_methods(target, draft)[method]
    past, depths = [], []
    for rule in (draft_verify.Exact, draft_verify.Rollback):  # every verified row's candidates pass its rule

        def accept(self, run, row, cand, logits, real=rule.accept):
            depths.append(cand.depth)
            if cand.depth > self.budget(run, row):
                past.append((run.remaining(row), cand.depth))
            return real(self, run, row, cand, logits)

        monkeypatch.setattr(rule, "accept", accept)
    prompts = [[1, 3, 4, 1, 3, 4, 1, 3], [5, 6, 7, 8], [40, 41, 40, 41, 40]]
    for n in (1, 2, 3, 5, 17):
        want = [layerleap.generate(target, p, "greedy", n, stop_at_eos=False).token_ids for p in prompts]
        depths.clear()
        one = layerleap.generate(target, prompts[0], method.split()[0], n, stop_at_eos=False, **options)
        assert one.token_ids == want[0], n
        if not method.startswith("bild"):
            assert one.stats["drafted"] == sum(depths), n
        many = layerleap.generate(target, prompts, method.split()[0], n, stop_at_eos=False, **options)
        assert [r.token_ids for r in many] == want, n
    assert not past, past


@pytest.mark.parametrize("tree", ["2,2,1,1", "dynamic"])
def test_medusa_heads_draft_only_what_the_next_round_can_keep(monkeypatch, tree):
    """After each call the heads draft the next tree: only as many steps as that round can keep (the tokens
    the output will have left, less the target's own), none before a plain step; the output stays greedy's."""
    from layerleap.drafters import trees

    target, _ = tiny_pair(3, scale=2.0, n_draft=1)
    heads = _perturbed(target, "medusa", steps=4)
    steps = []
    real = trees.medusa_logits
    monkeypatch.setattr(trees, "medusa_logits", lambda *a: (steps.append(a[3]), real(*a))[1])
    prompts = [[1, 3, 4, 1, 3, 4, 1, 3], [5, 6, 7, 8]]
    for n, most in ((1, 0), (2, 0), (3, 1), (5, 3), (17, 4)):
        want = [layerleap.generate(target, p, "greedy", n, stop_at_eos=False).token_ids for p in prompts]
        steps.clear()
        got = layerleap.generate(target, prompts, "medusa", n, stop_at_eos=False, tree=tree, heads=heads)
        assert [r.token_ids for r in got] == want, n
        assert max(steps, default=0) == most and 0 not in steps, (n, steps)
        assert not steps or steps[-1] == 1, (n, steps)  # the last tree is one deep (then a plain step)
