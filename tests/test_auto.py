"""``auto``: prompt lookup's chain and Hidden Transfer's tree verified in one call, the kind of call
chosen per round.  Whatever the choice, greedy output is greedy decoding and sampling is lossless:
the schedule is forced here (probes at once, every round or two) so both kinds of round and the
switches between them run within a few tokens."""

from __future__ import annotations

import pytest
import torch
from test_draft_verify import exact_joint3
from test_speculative import chi2_pvalue, tiny_pair
from tiny_models import naive_greedy, random_model

import layerleap
from layerleap.core import verify
from layerleap.core.tree import Candidates, build
from layerleap.drafters import auto as auto_drafter
from layerleap.drafters import medusa_transfer
from layerleap.drafters.auto import Chooser, merge_chain


@pytest.fixture
def switching(monkeypatch):
    """Probe transfer calls at once, for one round, then every other round."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 0)
    monkeypatch.setattr(auto_drafter, "PROBE", 1)
    monkeypatch.setattr(auto_drafter, "GAP", 1)


def _transfer(model, seed=0, layers=(1, 1)):
    d = medusa_transfer.new_drafter(model, "transfer", layers=list(layers))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def test_merge_chain_follows_the_tree_then_branches():
    tree = Candidates.from_tree(build("2,1"), 7, torch.tensor([[5, 6], [8, 9]]))  # 5, 6; the top 8 after each
    assert tree.tokens.tolist() == [5, 6, 8, 8] and tree.parents.tolist() == [-1, -1, 0, 1]
    m = merge_chain(tree, [6, 8, 4, 2])  # follows 6 -> 8, then branches: 4 under that 8, 2 under 4
    assert m.tokens.tolist() == [5, 6, 8, 8, 4, 2] and m.parents.tolist() == [-1, -1, 0, 1, 3, 4]
    assert m.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert m.mask[6].tolist() == [True, False, True, False, True, True, True]  # root, 6, 8, 4, 2
    m2 = merge_chain(tree, [3])  # a new first-level sibling
    assert m2.parents.tolist() == [-1, -1, 0, 1, -1]
    logits = torch.full((1 + m.k, 10), -1.0)
    for row, want in ((0, 6), (2, 8), (4, 4), (5, 2), (6, 1)):  # the verifier agrees with the chain
        logits[row, want] = 1.0
    assert verify.accept_greedy(m.tokens, m.parents, logits) == ([1, 3, 4, 5], 1)


def test_chooser_keeps_the_faster_mode_and_backs_off(monkeypatch):
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 4)
    c = Chooser(("lookup", "transfer"))
    modes = []
    for _ in range(40):
        modes.append(c.mode)
        c.record(c.mode, 1 if c.mode == "lookup" else 3, 10.0, counted=True)  # transfer: 3x the tokens
    assert modes[:2] == ["lookup"] * 2 and modes[2:4] == ["transfer"] * 2
    assert modes[4:].count("lookup") <= 3 * 2  # kept, probing lookup now and then, less and less often
    c = Chooser(("lookup", "transfer"))
    modes = []
    for _ in range(60):
        modes.append(c.mode)
        c.record(c.mode, 1, 10.0 if c.mode == "lookup" else 20.0, counted=True)  # transfer: twice the cost
    assert modes.count("transfer") <= 2 * 4 and c.gap > 4  # probes grew apart


@pytest.mark.parametrize("seed,plen", [(0, 3), (1, 9), (2, 17)])
@pytest.mark.parametrize(
    "options", [{"tree": "2,1"}, {"tree": "1,1", "draft_len": 2, "max_ngram": 2}, {"tree": "2,2,1", "min_ngram": 2}]
)
def test_auto_equals_greedy_while_switching(switching, seed, plen, options):
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    layers = [1, 1, 2][: len(options["tree"].split(","))]
    prompt = torch.randint(0, 8, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()  # repeats
    r = layerleap.generate(
        model, prompt, "auto", 20, stop_at_eos=False, transfer=_transfer(model, layers=layers), **options
    )
    assert r.token_ids == naive_greedy(model, prompt, 20)
    assert r.stats["transfer_rounds"] > 2 and r.stats["lookup_rounds"] > 2 and r.stats["mode_switches"] > 2


def test_auto_batch_equals_rows_alone(switching):
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    proj = _transfer(model)
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6, 1, 2], [3]]
    batch = layerleap.generate(model, prompts, "auto", 16, stop_at_eos=False, transfer=proj, tree="2,1")
    for p, b in zip(prompts, batch):
        assert b.token_ids == naive_greedy(model, p, 16)


def test_auto_without_transfer_weights_is_prompt_lookup():
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    a = layerleap.generate(model, prompt, "auto", 16, stop_at_eos=False)  # no shipped weights for it
    b = layerleap.generate(model, prompt, "prompt-lookup", 16, stop_at_eos=False)
    assert a.token_ids == b.token_ids and a.stats["model_calls"] == b.stats["model_calls"]
    assert a.stats["transfer_rounds"] == 0


def test_auto_refuses_bad_transfer():
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="transfer"):
        layerleap.generate(model, [1, 2], "auto", 4, transfer=3)


def test_auto_samples_the_models_distribution(switching):
    """The first three sampled tokens over many seeds against the model's exact joint; the third
    passes through a transfer round's tree."""
    target, _ = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    warp = {"temperature": 0.8, "top_k": 5}
    p = exact_joint3(target, prompt, warp)
    proj = _transfer(target, layers=(1, 2))
    counts = torch.zeros(6, 6, 6)
    drafted = accepted = 0
    for seed in range(800):
        r = layerleap.generate(
            target,
            prompt,
            "auto",
            3,
            do_sample=True,
            seed=seed,
            stop_at_eos=False,
            tree="2,1",
            draft_len=2,
            transfer=proj,
            **warp,
        )
        counts[tuple(r.token_ids)] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts.sum(2), p.sum(2)) > 1e-3
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3
    assert chi2_pvalue(counts.sum((0, 1)), p.sum((0, 1))) > 1e-3


def _medusa(model, seed=0, steps=2):
    d = medusa_transfer.new_drafter(model, "medusa", steps=steps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def test_chooser_probes_every_mode_and_keeps_the_fastest(monkeypatch):
    """Three modes: each is probed once before the gaps start, the fastest is kept, and the others
    are probed in turn."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 4)
    c = Chooser(("lookup", "transfer", "medusa"))
    modes = []
    gain = {"lookup": 1, "transfer": 2, "medusa": 4}
    for _ in range(80):
        modes.append(c.mode)
        c.record(c.mode, gain[c.mode], 10.0, counted=True)
    assert modes[:6] == ["lookup"] * 2 + ["transfer"] * 2 + ["medusa"] * 2
    assert c.best == "medusa" and modes[-20:].count("medusa") >= 16
    later = modes[6:]
    assert "lookup" in later and "transfer" in later  # both probed again, in turn


@pytest.mark.parametrize("seed,plen", [(0, 3), (1, 9), (2, 17)])
@pytest.mark.parametrize("transfer", [True, False])
def test_auto_with_medusa_equals_greedy_while_switching(switching, seed, plen, transfer):
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = torch.randint(0, 8, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    proj = _transfer(model, layers=(1, 1)) if transfer else "none"
    r = layerleap.generate(
        model, prompt, "auto", 24, stop_at_eos=False, transfer=proj, medusa=_medusa(model), tree="2,1"
    )
    assert r.token_ids == naive_greedy(model, prompt, 24)
    # every mode is probed once at the start; which wins later depends on the rounds' wall times
    assert r.stats["medusa_rounds"] > 0 and r.stats["lookup_rounds"] > 0 and r.stats["mode_switches"] >= 2
    assert (r.stats["transfer_rounds"] > 0) == transfer


def test_auto_with_medusa_batch_equals_rows_alone(switching):
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    heads, proj = _medusa(model), _transfer(model)
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6, 1, 2], [3]]
    batch = layerleap.generate(model, prompts, "auto", 16, stop_at_eos=False, transfer=proj, medusa=heads, tree="2,1")
    for p, b in zip(prompts, batch):
        assert b.token_ids == naive_greedy(model, p, 16)
    assert batch[0].stats["medusa_rounds"] > 0


def test_auto_with_medusa_samples_the_models_distribution(switching):
    """The first three sampled tokens over many seeds against the model's exact joint, with Medusa
    calls among the rounds."""
    target, _ = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    warp = {"temperature": 0.8, "top_k": 5}
    p = exact_joint3(target, prompt, warp)
    heads = _medusa(target)
    counts = torch.zeros(6, 6, 6)
    medusa_rounds = 0
    for seed in range(800):
        r = layerleap.generate(
            target, prompt, "auto", 3, do_sample=True, seed=seed, stop_at_eos=False, draft_len=2,
            transfer="none", medusa=heads, **warp,
        )  # fmt: skip
        counts[tuple(r.token_ids)] += 1
        medusa_rounds += r.stats["medusa_rounds"]
    assert medusa_rounds > 0
    assert chi2_pvalue(counts.sum(2), p.sum(2)) > 1e-3
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3
    assert chi2_pvalue(counts.sum((0, 1)), p.sum((0, 1))) > 1e-3
