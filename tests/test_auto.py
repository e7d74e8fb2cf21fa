"""``auto``: prompt lookup's chain and Hidden Transfer's tree verified in one call, the kind of call
chosen per round.  Whatever the choice, greedy output is greedy decoding and sampling is lossless:
the schedule is forced here (probes at once, every round or two) so both kinds of round and the
switches between them run within a few tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_draft_verify import exact_joint3
from test_speculative import chi2_pvalue, tiny_pair
from tiny_models import COSTLY_ROWS, naive_greedy, random_model

import layerleap
from layerleap.core import verify
from layerleap.core.tree import Candidates, build
from layerleap.drafters import auto as auto_drafter
from layerleap.drafters import lengths, medusa_transfer
from layerleap.drafters.auto import Chooser, merge_chain, shared_prefix
from layerleap.methods import auto as auto_method


@pytest.fixture
def switching(monkeypatch):
    """Probe transfer calls at once, for one round, then every other round (plain calls beside EAGLE
    calls whatever the call-cost curve)."""
    monkeypatch.setattr(auto_method, "plain_calls", lambda model: True)
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
    assert [shared_prefix(tree, c) for c in ([6, 8, 4, 2], [3], [5, 8, 8], [])] == [2, 0, 2, 0]
    assert m.k - tree.k == 4 - shared_prefix(tree, [6, 8, 4, 2])  # the new rows are the chain's unshared drafts
    logits = torch.full((1 + m.k, 10), -1.0)
    for row, want in ((0, 6), (2, 8), (4, 4), (5, 2), (6, 1)):  # the verifier agrees with the chain
        logits[row, want] = 1.0
    assert verify.accept_greedy(m.tokens, m.parents, logits) == ([1, 3, 4, 5], 1)


def test_merge_chain_keeps_sampled_drafts_distributions_first():
    """A tree whose drafts were drawn (``q``) keeps its rows of ``q`` in front; the copied nodes merged
    after them are certain (one-hot) proposals, and a shared prefix adds none."""
    q = torch.softmax(torch.randn(2, 10), -1)
    tree = Candidates.chain(7, [5, 8], list(q))
    m = merge_chain(tree, [5, 3, 4])  # shares 5, then branches: 3 under 5, 4 under 3
    assert m.tokens.tolist() == [5, 8, 3, 4] and m.parents.tolist() == [-1, 0, 0, 2]
    assert torch.equal(m.q[:2], q)
    assert m.q[2:].tolist() == [[1.0 if i == t else 0.0 for i in range(10)] for t in (3, 4)]
    assert torch.equal(merge_chain(tree, [5, 8]).q, q)
    assert merge_chain(Candidates.chain(7, [5]), [6]).q is None


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


def test_chooser_never_switches_to_a_mode_on_an_old_rate():
    """A probe ends on the faster of the probed mode and the best: a third mode's rate, as old as its last
    rounds, is no measure of it now.  Medusa was nearly as fast as plain calls early on and then turns
    slowest; the transfer probe that then beats plain calls switches to transfer calls, never to Medusa's
    on its early rate."""
    c = Chooser(("lookup", "transfer", "medusa"))
    modes = []
    for r in range(300):
        modes.append(c.mode)
        speed = (
            {"lookup": 1.0, "transfer": 0.5, "medusa": 0.9}
            if r < 100
            else {"lookup": 0.5, "transfer": 0.6, "medusa": 0.2}
        )
        c.record(c.mode, 1, 1 / speed[c.mode], counted=True)
    assert modes[:100].count("medusa") == 2 * 4  # probed twice while it was nearly as fast
    assert modes[100:].count("medusa") <= 4 and modes[-1] == "transfer"


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
    assert a.stats["transfer_rounds"] == a.stats["medusa_rounds"] == a.stats["eagle_rounds"] == 0


def test_auto_refuses_bad_transfer():
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="transfer"):
        layerleap.generate(model, [1, 2], "auto", 4, transfer=3)


def test_auto_names_the_transfer_weights_a_tree_is_too_deep_for():
    """auto's tree= is Hidden Transfer's: too deep a tree names the transfer weights (and the option to change)."""
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    proj = _transfer(model, layers=(1, 2))
    with pytest.raises(layerleap.GenerationError, match=r"the tree is 3 deep but the transfer weights have 2 step"):
        layerleap.generate(model, [1, 2], "auto", 4, tree="1,1,1", transfer=proj, medusa="none", eagle="none")


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
    tree = {"tree": "2,1"} if transfer else {}  # the tree is Hidden Transfer's
    r = layerleap.generate(model, prompt, "auto", 24, stop_at_eos=False, transfer=proj, medusa=_medusa(model), **tree)
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


def _eagle(model, seed=0, scale=0.3):
    d = medusa_transfer.new_drafter(model, "eagle")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return d


def test_chooser_probes_four_modes_in_turn(monkeypatch):
    """With EAGLE calls too: every mode is probed once, in order, before the gaps start; the fastest
    (here EAGLE's) is kept."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 4)
    c = Chooser(auto_drafter.MODES)
    modes = []
    gain = {"lookup": 1, "transfer": 2, "medusa": 2, "eagle": 4}
    for _ in range(80):
        modes.append(c.mode)
        c.record(c.mode, gain[c.mode], 10.0, counted=True)
    assert modes[:8] == ["lookup"] * 2 + ["transfer"] * 2 + ["medusa"] * 2 + ["eagle"] * 2
    assert c.best == "eagle" and modes[-20:].count("eagle") >= 16


@pytest.mark.parametrize("seed,plen", [(0, 3), (1, 9), (2, 17)])
@pytest.mark.parametrize("others", ["none", "transfer", "transfer+medusa"])
@pytest.mark.parametrize("width", [1, 3])
def test_auto_with_eagle_equals_greedy_while_switching(switching, monkeypatch, seed, plen, others, width):
    """EAGLE calls (the head's chain and fan with the lookup chain merged in) among the other kinds,
    switched every round or two: greedy's tokens, EAGLE rounds among them."""
    from layerleap.methods import eagle as eagle_method

    monkeypatch.setitem(eagle_method.DEFAULT_WIDTH, "float32", width)
    monkeypatch.setitem(eagle_method.DEFAULT_DRAFT_LEN, "float32", 3)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = torch.randint(0, 8, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    proj = _transfer(model, layers=(1, 1)) if "transfer" in others else "none"
    heads = _medusa(model) if "medusa" in others else "none"
    r = layerleap.generate(
        model,
        prompt,
        "auto",
        24,
        stop_at_eos=False,
        transfer=proj,
        medusa=heads,
        eagle=_eagle(model),
        **({"tree": "2,1"} if "transfer" in others else {}),  # the tree is Hidden Transfer's
    )
    assert r.token_ids == naive_greedy(model, prompt, 24)
    assert r.stats["eagle_rounds"] > 0 and r.stats["lookup_rounds"] > 0 and r.stats["mode_switches"] >= 2
    assert (r.stats["transfer_rounds"] > 0) == ("transfer" in others)
    assert (r.stats["medusa_rounds"] > 0) == ("medusa" in others)


def test_auto_eagle_rounds_draft_with_the_head(monkeypatch):
    """Only EAGLE calls after the prompt (a probe that never ends): greedy's tokens, every round's
    candidates the head's first draft and its two siblings (fp32's width 3)."""
    from layerleap.drafters.eagle import EagleChains

    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 0)
    monkeypatch.setattr(auto_drafter, "PROBE", 10_000)
    made = []
    real = EagleChains.candidates

    def spy(root, chain, siblings, q=None):
        made.append((len(chain), len(siblings)))
        return real(root, chain, siblings, q)

    monkeypatch.setattr(EagleChains, "candidates", staticmethod(spy))
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = [3, 1, 4, 1, 5]
    r = layerleap.generate(
        model, prompt, "auto", 20, stop_at_eos=False, transfer="none", medusa="none", eagle=_eagle(model)
    )
    assert r.token_ids == naive_greedy(model, prompt, 20)
    assert r.stats["lookup_rounds"] == 0 and r.stats["eagle_rounds"] == len(made) > 0
    assert set(made) == {(1, 2)}


@pytest.mark.parametrize("kind", ["lookup", "transfer", "medusa", "eagle", "all"])
def test_auto_tree_nodes_are_the_nodes_its_calls_verified(switching, monkeypatch, kind):
    """``tree_nodes``: the mean nodes a call verified (root included, rounded), whatever kind of call each
    round made, not the Hidden Transfer tree's size in Medusa and EAGLE rounds."""
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    if kind != "all":  # one kind of call after the prompt (a probe that never ends)
        monkeypatch.setattr(auto_drafter, "PROBE", 10_000)
    order = [m for m in auto_drafter.MODES if kind in (m, "all")]
    monkeypatch.setattr(auto_drafter, "Chooser", lambda modes: Chooser(tuple(m for m in modes if m in order)))
    kw = {
        "transfer": _transfer(model) if kind in ("transfer", "all") else "none",
        "medusa": _medusa(model) if kind in ("medusa", "all") else "none",
        "eagle": _eagle(model) if kind in ("eagle", "all") else "none",
    }
    verified = []
    real = auto_drafter.AutoDrafter.score

    def spy(self, cands):
        if cands[0].root is not None:  # a call after the prompt
            verified.append(1 + cands[0].k)
        return real(self, cands)

    monkeypatch.setattr(auto_drafter.AutoDrafter, "score", spy)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r = layerleap.generate(
        model,
        prompt,
        "auto",
        24,
        stop_at_eos=False,
        min_ngram=1,
        **kw,
        **({"tree": "2,1"} if kw["transfer"] != "none" else {}),
    )
    assert r.token_ids == naive_greedy(model, prompt, 24)
    s = r.stats
    assert len(verified) == s["rounds"] and s["tree_nodes"] == round(sum(verified) / len(verified)), (verified, s)
    if kind != "all":
        assert s[f"{kind}_rounds"] == s["rounds"]
    if kind in ("medusa", "eagle"):
        assert s["tree_nodes"] > 1


def test_auto_with_eagle_batch_equals_rows_alone(switching):
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    head, proj = _eagle(model), _transfer(model)
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6, 1, 2], [3]]
    batch = layerleap.generate(model, prompts, "auto", 16, stop_at_eos=False, transfer=proj, eagle=head, tree="2,1")
    for p, b in zip(prompts, batch):
        assert b.token_ids == naive_greedy(model, p, 16)
    assert batch[0].stats["eagle_rounds"] > 0


def test_auto_with_eagle_samples_the_models_distribution(switching):
    """The first three sampled tokens over many seeds against the model's exact joint, with EAGLE
    calls among the rounds."""
    target, _ = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    warp = {"temperature": 0.8, "top_k": 5}
    p = exact_joint3(target, prompt, warp)
    head = _eagle(target)
    counts = torch.zeros(6, 6, 6)
    eagle_rounds = drafted = accepted = 0
    for seed in range(800):
        r = layerleap.generate(
            target, prompt, "auto", 3, do_sample=True, seed=seed, stop_at_eos=False, draft_len=2,
            transfer="none", medusa="none", eagle=head, **warp,
        )  # fmt: skip
        counts[tuple(r.token_ids)] += 1
        eagle_rounds += r.stats["eagle_rounds"]
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert eagle_rounds > 0 and 0 < accepted < drafted
    assert chi2_pvalue(counts.sum(2), p.sum(2)) > 1e-3
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3
    assert chi2_pvalue(counts.sum((0, 1)), p.sum((0, 1))) > 1e-3


def test_auto_refuses_bad_eagle():
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="eagle"):
        layerleap.generate(model, [1, 2], "auto", 4, eagle=3)
    with pytest.raises(medusa_transfer.DrafterError, match="not eagle weights of this model"):
        layerleap.generate(model, [1, 2], "auto", 4, eagle=_medusa(model))  # Medusa heads, not an EAGLE head


def test_auto_eagle_sampled_batch_rows_equal_rows_alone(monkeypatch):
    """With the kind of call fixed (EAGLE calls only: the choice is by wall time, so a batch and a row
    alone may otherwise choose differently and draw differently), row i of a sampled batch seeded with
    s samples what its prompt alone samples with seed s + i."""
    from layerleap.core.run import row_seed

    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 0)
    monkeypatch.setattr(auto_drafter, "PROBE", 10_000)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6, 1, 2], [3]]
    kw = dict(transfer="none", medusa="none", eagle=_eagle(model), do_sample=True, temperature=1.5)
    batch = layerleap.generate(model, prompts, "auto", 12, stop_at_eos=False, seed=5, **kw)
    for i, (p, b) in enumerate(zip(prompts, batch)):
        alone = layerleap.generate(model, p, "auto", 12, stop_at_eos=False, seed=row_seed(5, i), **kw)
        assert b.token_ids == alone.token_ids and alone.stats["eagle_rounds"] > 0


@pytest.mark.parametrize("flat", [True, False])
def test_auto_with_eagle_makes_plain_calls_only_where_a_second_token_costs(monkeypatch, flat):
    """With the EAGLE head and a flat call-cost curve every call is an EAGLE call (the lookup chain merged
    in: a prompt that repeats itself is copied in long steps); where a second token costs, plain calls
    come back among them.  Greedy's tokens either way."""
    monkeypatch.setattr(auto_method, "plain_calls", lambda model: not flat)
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 1)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    kw = dict(transfer="none", medusa="none", eagle=_eagle(model))
    r = layerleap.generate(model, prompt, "auto", 24, stop_at_eos=False, **kw)
    assert r.token_ids == naive_greedy(model, prompt, 24)
    if flat:
        assert r.stats["lookup_rounds"] == 0 and r.stats["eagle_rounds"] == r.stats["model_calls"] - 1
    else:
        assert r.stats["lookup_rounds"] > 0 and r.stats["eagle_rounds"] > 0


@pytest.mark.parametrize("flat", [True, False])
def test_q4_leaves_the_eagle_head_out_only_where_a_second_token_costs(monkeypatch, flat):
    """In q4 "auto" weights leave Hidden Transfer and Medusa out, and the EAGLE head too unless the
    call-cost curve is flat (then every call is an EAGLE call); fp32 leaves nothing out."""
    monkeypatch.setattr(auto_method, "plain_calls", lambda model: not flat)
    q4, fp32 = SimpleNamespace(dtype_name="q4"), SimpleNamespace(dtype_name="float32")
    assert auto_method.left_out(q4, "transfer") and auto_method.left_out(q4, "medusa")
    assert auto_method.left_out(q4, "eagle") is not flat
    assert not any(auto_method.left_out(fp32, kind) for kind in ("transfer", "medusa", "eagle"))


def test_a_seeded_sample_reproduces_whatever_the_clock_says(monkeypatch):
    """Sampling, the kinds of call are chosen by the call-cost curve's price of each round, not by wall
    time: with a clock that jumps at random, the same seed draws the same tokens, while the choice
    still moves between kinds of call."""
    import random

    monkeypatch.setattr(auto_method, "plain_calls", lambda model: True)
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 1)
    monkeypatch.setattr(auto_drafter, "GAP", 2)
    jumpy = random.Random(0)
    clock = {"t": 0.0}

    def perf_counter():
        clock["t"] += jumpy.choice([1e-4, 1e-3, 5e-2])
        return clock["t"]

    monkeypatch.setattr(auto_drafter.time, "perf_counter", perf_counter)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    kw = dict(
        transfer=_transfer(model), medusa="none", eagle=_eagle(model), tree="2,1", do_sample=True, temperature=1.5
    )
    runs = [layerleap.generate(model, [3, 1, 4, 1, 5], "auto", 32, stop_at_eos=False, seed=9, **kw) for _ in range(4)]
    assert len({tuple(r.token_ids) for r in runs}) == 1
    assert runs[0].stats["mode_switches"] >= 2


def test_auto_cuts_a_merged_chain_the_target_does_not_follow(monkeypatch):
    """EAGLE calls only, rows that cost (q4 with torch's int4 kernel): a prompt whose every token recurs
    makes lookup chains the random target rarely continues; the merged cut (``adaptive`` none) verifies
    fewer of them than whole chains (``adaptive=False``), and both give greedy's tokens."""
    monkeypatch.setattr(auto_method, "plain_calls", lambda model: False)
    monkeypatch.setitem(lengths.CALL_COST, "float32", COSTLY_ROWS)
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    prompt = list(range(1, 40)) * 2
    kw = dict(stop_at_eos=False, min_ngram=1, transfer="none", medusa="none", eagle=_eagle(model))
    whole = layerleap.generate(model, prompt, "auto", 24, adaptive=False, **kw)
    cut = layerleap.generate(model, prompt, "auto", 24, **kw)
    assert cut.token_ids == whole.token_ids == naive_greedy(model, prompt, 24)
    assert cut.stats["eagle_rounds"] > 0 and cut.stats["drafted"] < whole.stats["drafted"]


def test_auto_prices_a_chain_merged_into_a_transfer_call_with_its_pseudo_states(switching, monkeypatch):
    """In a transfer call every row, a merged chain's included, runs with its pseudo states past each transfer
    layer: the merged cut and a sampled round's cost price a call over ``S`` rows as each segment of layers at
    its width (``TransferDrafter.round_cost``), not as ``S`` rows (too cheap) nor ``S x (steps + 1)`` rows
    through every layer (too dear)."""
    monkeypatch.setitem(lengths.CALL_COST, "float32", COSTLY_ROWS)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    n = model.config.n_layers
    curve = lengths.shipped_curve("float32")
    priced = []
    cut = lengths.MergedChainCut.cut

    def spy(self, row, chain, shared, nodes, price=None):
        priced.append((nodes, None if price is None else price(nodes + 2)))
        return cut(self, row, chain, shared, nodes, price)

    monkeypatch.setattr(lengths.MergedChainCut, "cut", spy)
    prompt = list(range(1, 9)) * 3
    r = layerleap.generate(model, prompt, "auto", 16, stop_at_eos=False, transfer=_transfer(model), tree="2,1")
    assert r.token_ids == naive_greedy(model, prompt, 16) and r.stats["transfer_rounds"] > 2
    want = {k: 1 / n * curve(k + 2) + (n - 1) / n * curve(3 * (k + 2)) for k, _ in priced}  # layers (1, 1)
    assert priced and all(p == pytest.approx(want[k]) for k, p in priced)


def test_auto_prices_and_merges_a_chain_beside_the_tree_the_round_can_keep(switching, monkeypatch):
    """Near the output's end a round keeps only the tree's nodes within its budget: the merged cut prices the
    chain beside those (not the whole tree's nodes), and learns from what they kept."""
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    seen, cut, propose_row = [], lengths.MergedChainCut.cut, auto_drafter.AutoDrafter.propose_row

    def row(self, r, root, budget):
        seen.append([budget])
        return propose_row(self, r, root, budget)

    def spy(self, r, chain, shared, nodes, price=None):
        seen[-1].append(nodes)
        return cut(self, r, chain, shared, nodes, price)

    monkeypatch.setattr(auto_drafter.AutoDrafter, "propose_row", row)
    monkeypatch.setattr(lengths.MergedChainCut, "cut", spy)
    prompt = list(range(1, 9)) * 3
    for n in (4, 5, 6, 16):
        seen.clear()
        proj = _transfer(model, layers=(1, 1, 1))
        r = layerleap.generate(model, prompt, "auto", n, stop_at_eos=False, transfer=proj, tree="1,1,1")
        assert r.token_ids == naive_greedy(model, prompt, n)
        priced = [s for s in seen if len(s) == 2]
        assert priced and all(nodes <= budget for budget, nodes in priced), (n, priced)
