"""``auto``: prompt lookup's chain and Hidden Transfer's or Medusa's tree verified in one call, the kind
of call chosen per round.  Whatever the choice, greedy output is greedy decoding and sampling is
lossless: the schedule is forced here (``Cycle``: another kind every round) so every kind of round and
the switches between them run within a few tokens; the chooser is tested on its own."""

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


class Cycle:
    """A chooser that switches every round, through ``ORDER``'s modes that the drafter has (a transfer
    call twice: the first after another kind has no tree)."""

    ORDER = ("transfer", "transfer", "medusa", "lookup")

    def __init__(self, modes):
        self.order = [m for m in self.ORDER if m in modes]
        self.i, self.switches = 0, 0
        self.mode = self.order[0]

    def record(self, mode, *args, **kwargs):
        self.i += 1
        nxt = self.order[self.i % len(self.order)]
        self.switches += int(nxt != self.mode)
        self.mode = nxt


@pytest.fixture
def switching(monkeypatch):
    """Switch the kind of call every round (whatever the rounds' speeds)."""
    monkeypatch.setattr(auto_drafter, "Chooser", Cycle)


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


def test_chooser_probes_the_tree_modes_and_keeps_the_fastest(monkeypatch):
    """Three modes: plain calls first, then Medusa's probed (its rounds show the plain mode's too), then
    Hidden Transfer's after a gap, and again in gaps that grow; the slow plain mode is not run again."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 4)
    c = Chooser(("lookup", "transfer", "medusa"))
    modes = []
    gain = {"lookup": 1, "transfer": 2, "medusa": 4}
    for _ in range(80):
        modes.append(c.mode)
        c.record(c.mode, gain[c.mode], 10.0, True, units=1.0 if c.mode == "lookup" else 1.2, plain=(1, 1.0))
    assert modes[:10] == ["lookup"] * 2 + ["medusa"] * 6 + ["transfer"] * 2
    assert c.best == "medusa" and "lookup" not in modes[2:]
    assert 2 < modes.count("transfer") <= 2 * 4 and c.gap > 8  # probed again, less and less often


def test_chooser_reads_the_plain_mode_from_tree_rounds(monkeypatch):
    """Medusa rounds show what the chain alone would have kept, priced at the plain rounds' own ms per
    unit of call cost: when the chain starts to hit, the plain mode is chosen without a probe."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 50)
    c = Chooser(("lookup", "medusa"))
    modes = []
    for i in range(40):
        modes.append(c.mode)
        hits = 1 if i < 20 else 3  # the chain's tokens: 1 / 7.5 < 2 / 10 < 3 / 7.5 tokens per ms
        if c.mode == "medusa":
            c.record("medusa", 2, 10.0, True, units=1.2, draft_ms=1.0, plain=(hits, 1.0))
        else:
            c.record("lookup", hits, 7.5, True, units=1.0)
    assert modes[:20] == ["lookup"] * 2 + ["medusa"] * 18  # the probe won; the chain missed
    assert modes[23:] == ["lookup"] * 17 and c.switches == 2  # read: plain calls pay again
    assert c.rates["lookup"].runs == 2 + 17 + modes[20:23].count("lookup")


def test_chooser_prices_a_read_round_by_the_tree_call_before_a_plain_one(monkeypatch):
    """Before any plain round, the plain mode's time is the tree round's less the heads' drafting and
    the tree's extra call cost: 10 - 1 - 9 / 1.2 * (1.2 - 1.0) = 7.5 ms."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 0)
    c = Chooser(("lookup", "medusa"))
    assert c.mode == "medusa"
    c.record("medusa", 2, 10.0, True, units=1.2, draft_ms=1.0, plain=(3, 1.0))
    assert c.rates["lookup"].ms == pytest.approx(7.5) and c.rates["lookup"].tokens == 3
    assert c.rates["lookup"].runs == 0 and c.rates["medusa"].runs == 1


def test_chooser_probes_no_tree_mode_its_estimate_puts_below_the_current(monkeypatch):
    """Plain rounds of 3 tokens in 10 ms (10 ms per unit of call cost, 0.3 tokens per ms); a Medusa call
    costs 1.2 units.  Where it could keep no more than the chain (at most 3) it is never probed; where
    it could keep 5, half that room (the prior) makes 4 tokens in 12 ms: probed, once, as its rounds
    keep no more than the chain (then 3.35 tokens: slower than plain calls)."""
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    monkeypatch.setattr(auto_drafter, "PROBE", 2)
    monkeypatch.setattr(auto_drafter, "GAP", 2)
    for most, probes in ((3, 0), (5, 1)):
        c = Chooser(("lookup", "medusa"))
        modes = []
        for _ in range(30):
            modes.append(c.mode)
            ms, units = (10.0, 1.0) if c.mode == "lookup" else (12.0, 1.2)  # 10 ms per unit either way
            c.record(c.mode, 3, ms, True, units=units, plain=(3, 1.0), bounds={"medusa": (most, 1.2)})
        assert modes.count("medusa") == 2 * probes and modes[:2] == ["lookup"] * 2
        hit = c.bounds["medusa"].hit
        assert hit == 0.5 if not probes else hit == pytest.approx(1 / (2 + 2 + 2 * 0.85))
        want = 3 if not probes else 3 + 2 * hit
        assert c.estimate("medusa") == pytest.approx(want / 12, rel=0.01)  # (the estimates before have decayed)


def test_bound_estimates_a_tree_mode_by_the_room_its_rounds_filled():
    b = auto_drafter.Bound()
    b.add(1, 3, 1.2)  # nothing measured yet: half the room (the prior)
    assert (b.tokens, b.units, b.hit) == (2.0, 1.2, 0.5)
    b.own(3, 1, 3)  # kept the 2 tokens of room
    b.own(4, 4, 4)  # no room: nothing learnt
    assert b.hit == pytest.approx((2 + 1) / (2 + 2))
    b.add(2, 4, 1.0)
    assert b.tokens == pytest.approx(0.85 * 2 + 2 + 0.75 * 2) and b.units == pytest.approx(0.85 * 1.2 + 1.0)


def test_chooser_starts_no_probe_near_the_end(monkeypatch):
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 2)
    for left, probed in ((auto_drafter.LAST_PROBE, True), (auto_drafter.LAST_PROBE - 1, False)):
        c = Chooser(("lookup", "transfer"))
        modes = []
        for _ in range(10):
            modes.append(c.mode)
            c.record(c.mode, 1, 10.0, True, left=left)
        assert ("transfer" in modes) == probed


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


@pytest.mark.parametrize(  # prompts whose greedy output repeats itself (2, 7, 7, 7, ... 2, 7, 7, 7)
    "mode,prompt", [("medusa", [3]), ("transfer", [3]), ("transfer", [0, 1, 2, 0, 1, 2, 0, 1])]
)
def test_auto_reads_what_the_chain_alone_would_keep(monkeypatch, mode, prompt):
    """In a tree round, the plain mode's tokens read from the round are what a plain call with the
    same chain keeps under greedy decoding: the chain's drafts while they equal greedy's tokens, plus one;
    and the round's bound for its own mode (the tree's depth or the chain's agreement, plus one) holds."""

    class Stay(Cycle):
        ORDER = (mode,)

    monkeypatch.setattr(auto_drafter, "Chooser", Stay)
    seen, emitted = [], []
    costs = auto_drafter.AutoDrafter._costs

    def spy(self, cands, results):
        units, plain, bounds = costs(self, cands, results)
        seen.append((len(self.run.out[0]), list(self.chains[0]), plain[0]))
        emitted.append((len(results[0][0]) + 1, bounds[mode][0]))
        return units, plain, bounds

    monkeypatch.setattr(auto_drafter.AutoDrafter, "_costs", spy)
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    r = layerleap.generate(
        model, prompt, "auto", 40, stop_at_eos=False, transfer=_transfer(model), medusa=_medusa(model), tree="2,1"
    )
    ref = naive_greedy(model, prompt, 48)
    assert r.token_ids == ref[:40]
    kept = []
    for pos, chain, plain in seen:
        agree = 0
        while agree < len(chain) and chain[agree] == ref[pos + agree]:
            agree += 1
        assert plain == agree + 1, (pos, chain)
        kept.append(agree)
    assert max(kept) >= 2 and 0 in kept, kept  # chains of several drafts kept, and chains missed
    assert all(got <= most for got, most in emitted)  # the tree mode's bound holds for its own rounds
    assert any(got == most for got, most in emitted)
    if mode == "medusa":  # its tree kept more than the chain: the bound's depth term is needed
        assert any(got > 1 + a for (got, _), a in zip(emitted, kept))
