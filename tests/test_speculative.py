"""Speculative decoding and the shared verification rules (layerleap.core.verify), on tiny random models.

The pair: a 4-layer target with a sharpened LM head (so it has preferences a draft can match) and a
2-layer draft made of the target's first two layers and its head (so the draft agrees often enough
that accepted drafts are exercised, and disagrees often enough that rejections are)."""

from __future__ import annotations

import math

import pytest
import torch

import layerleap
from layerleap import Transformer, tiny_config
from layerleap.core import sampling, verify
from layerleap.drafters.companion import Companion
from layerleap.decoding import GenerationError, Run


def tiny_pair(seed: int, vocab: int = 97, scale: float = 6.0, n_draft: int = 2):
    torch.manual_seed(seed)
    target = Transformer(tiny_config(tie_embeddings=False, vocab_size=vocab)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(scale)
    draft = Transformer(tiny_config(tie_embeddings=False, vocab_size=vocab, n_layers=n_draft)).eval()
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_draft}
    )
    return target, draft


PROMPT = [5, 7, 11, 13, 17]


# -- greedy: the target's greedy decoding, token for token --------------------------------------------
def test_greedy_equals_target_greedy_over_seeds_and_draft_lengths():
    accepted = 0
    for seed in range(4):
        target, draft = tiny_pair(seed)
        ref = layerleap.generate(target, PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids
        for gamma in (1, 2, 3, 5, 8):
            r = layerleap.generate(
                target, PROMPT, "speculative", 24, draft=draft, draft_len=gamma, min_confidence=0.0, stop_at_eos=False
            )
            assert r.token_ids == ref, (seed, gamma)
            assert r.stats["accepted"] <= r.stats["drafted"]
            assert r.stats["draft_calls"] > 0 and r.stats["draft_layer_evals"] > 0
            accepted += r.stats["accepted"]
    assert accepted > 50  # the drafts were really used, so equality is not a trivial all-rejected run


ADAPTIVE = [
    ("heuristic", 1, 0.0),
    ("heuristic", 4, 0.0),
    ("heuristic", 2, 0.5),
    ("constant", 8, 0.6),
    ("constant", 3, 1.0),
]


def test_adaptive_draft_lengths_keep_greedy_exact():
    """The heuristic schedule and the confidence stop change how many tokens are drafted, never
    which tokens come out."""
    grew = stopped = accepted = 0
    for seed in range(4):
        target, draft = tiny_pair(seed)
        ref = layerleap.generate(target, PROMPT, max_new_tokens=32, stop_at_eos=False).token_ids
        for schedule, gamma, conf in ADAPTIVE:
            r = layerleap.generate(
                target,
                PROMPT,
                "speculative",
                32,
                draft=draft,
                draft_len=gamma,
                schedule=schedule,
                min_confidence=conf,
                stop_at_eos=False,
            )
            assert r.token_ids == ref, (seed, schedule, gamma, conf)
            s = r.stats
            assert s["drafted"] == pytest.approx(s["draft_len_mean"] * s["rounds"])
            assert s["tokens_per_round"] == pytest.approx(32 / s["rounds"])
            grew += schedule == "heuristic" and s["draft_len_max"] > gamma
            stopped += s["confidence_stops"]
            accepted += s["accepted"]
            if conf == 0:
                assert s["confidence_stops"] == 0
            if schedule == "constant":
                assert s["draft_len_max"] <= gamma
    assert grew and stopped and accepted > 100  # the schedule grew γ, the confidence stop cut rounds


def test_confidence_one_drafts_one_token_per_round():
    target, draft = tiny_pair(1)
    r = layerleap.generate(
        target, PROMPT, "speculative", 20, draft=draft, draft_len=5, min_confidence=1.0, stop_at_eos=False
    )
    # one draft per round; a last round with one token left drafts none
    assert r.stats["draft_len_max"] == 1 and r.stats["rounds"] - 1 <= r.stats["drafted"] <= r.stats["rounds"]


def test_heuristic_schedule_rule():
    from layerleap.methods.speculative import DraftLength

    g = DraftLength(4, "heuristic")
    seen = []
    for drafted, accepted in [(4, 4), (6, 6), (8, 3), (7, 0), (6, 6)]:
        g.update(drafted, accepted)
        seen.append(g.gamma)
    assert seen == [6, 8, 7, 6, 8]  # +2 after a fully accepted round, -1 otherwise
    low = DraftLength(1, "heuristic")
    low.update(1, 0)
    assert low.gamma == 1  # never below one
    const = DraftLength(4)
    const.update(4, 4)
    assert const.gamma == 4


def test_greedy_stops_at_eos_like_greedy():
    target, draft = tiny_pair(2)
    ref = layerleap.generate(target, PROMPT, max_new_tokens=30).token_ids
    eos = ref[5]  # make the 6th greedy token the end of sequence
    target.config = tiny_config(tie_embeddings=False, eos_token_ids=(eos,))
    draft.config = tiny_config(tie_embeddings=False, n_layers=2, eos_token_ids=(eos,))
    want = layerleap.generate(target, PROMPT, max_new_tokens=30).token_ids
    got = layerleap.generate(target, PROMPT, "speculative", 30, draft=draft, draft_len=4).token_ids
    assert got == want and got[-1] == eos and len(got) == 6


@pytest.mark.parametrize(
    "options",
    [{"draft_len": 4, "min_confidence": 0.0}, {}, {"draft_len": 2, "schedule": "heuristic", "min_confidence": 0.5}],
)
def test_kv_caches_roll_back_exactly(monkeypatch, options):
    """After decoding, every kept cache entry of the target and of the draft equals a fresh prompt
    pass over the same tokens: rejected drafts left no trace."""
    caches, companions = [], []
    new_cache = Run.new_cache
    monkeypatch.setattr(Run, "new_cache", lambda self, extra=0: caches.append(new_cache(self, extra)) or caches[-1])
    init = Companion.__init__
    monkeypatch.setattr(Companion, "__init__", lambda self, *a, **k: (companions.append(self), init(self, *a, **k))[1])
    target, draft = tiny_pair(0)
    r = layerleap.generate(target, PROMPT, "speculative", 30, draft=draft, stop_at_eos=False, **options)
    assert r.stats["drafted"] > r.stats["accepted"] > 0  # both rejections and acceptances happened
    seq = PROMPT + r.token_ids
    for model, cache in ((target, caches[-1]), (draft, companions[-1].cache)):
        n = int(cache.lengths[0, 0])
        # the draft lags by up to 3 tokens: its last draft, the target's token, and a final round
        # with one token left (nothing drafted, so nothing fed to the draft)
        assert bool((cache.lengths == n).all()) and len(seq) - 3 <= n <= len(seq)
        fresh = model.new_cache(1, n)
        model(torch.tensor([seq[:n]]), cache=fresh)
        torch.testing.assert_close(cache.k[:, :, :, :n], fresh.k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :, :n], fresh.v, rtol=1e-4, atol=1e-5)


def test_companion_prompt_pass_keeps_the_last_positions_logits_alone(monkeypatch):
    """The second model's prompt pass gives the logits of each row's last prompt position, those of a
    whole pass over the prompt, and holds nothing more: not a view into every position's logits."""
    got = []
    prefill = Companion.prefill
    monkeypatch.setattr(Companion, "prefill", lambda self: got.append(prefill(self)) or got[-1])
    target, draft = tiny_pair(1)
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    layerleap.generate(target, prompts, "speculative", 4, draft=draft, stop_at_eos=False)
    (logits,) = got
    assert logits.shape == (2, draft.config.vocab_size)
    assert logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()
    for row, p in enumerate(prompts):
        torch.testing.assert_close(logits[row], draft(torch.tensor([p]))[0, -1], rtol=1e-4, atol=1e-5)


# -- sampling: lossless --------------------------------------------------------------------------
def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities (cells with p > 0); the p-value from
    the Wilson-Hilferty normal approximation.  Counts in cells of probability 0 give p-value 0."""
    observed, expected_p = observed.double().flatten(), expected_p.double().flatten()
    n = observed.sum()
    if bool((observed[expected_p <= 0] > 0).any()):
        return 0.0
    live = expected_p > 0
    e = expected_p[live] * n
    x2 = float(((observed[live] - e) ** 2 / e).sum())
    k = int(live.sum()) - 1
    z = ((x2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_speculative_accept_rule_reproduces_the_target_distribution():
    """The pure rule: draw d ~ q, accept/resample against p; the emitted token is distributed as p
    (Leviathan et al., Theorem 3.5).  15k draws, 6 tokens; the draft alone is rejected."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.20, 0.00], [0.1, 0.2, 0.3, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(15_000):
        d = sampling.sample(q, g)
        n, tok = verify.speculative_accept(d, q, p, g)
        counts[int(d[0]) if n == 1 else tok] += 1
        accepted += n
    assert 0.4 < accepted / 15_000 < 0.6  # sum min(p, q) = 0.5
    assert chi2_pvalue(counts, p[0]) > 1e-3
    assert chi2_pvalue(counts, q[0]) < 1e-9


def exact_joint(target: Transformer, prompt: list[int], warp: dict) -> torch.Tensor:
    """P(x1, x2) of the target's own sampling with ``warp``: ``[V, V]``."""
    V = target.config.vocab_size
    with torch.inference_mode():
        p1 = sampling.probs(target(torch.tensor([prompt]))[0, -1], **warp)
        ids = torch.tensor([prompt + [x] for x in range(V)])
        p2 = sampling.probs(target(ids)[:, -1], **warp)
    return p1.unsqueeze(1) * p2


@pytest.mark.parametrize(
    "options",
    [{"draft_len": 2, "min_confidence": 0.0}, {"draft_len": 1, "schedule": "heuristic", "min_confidence": 0.4}],
    ids=["constant", "heuristic-confidence"],
)
def test_sampled_tokens_follow_the_targets_distribution(options):
    """End to end: the first two sampled tokens (both drafted, so both pass the acceptance rule)
    over 1,200 seeds, 6-token vocabulary, temperature 0.8 and top-k 5; the joint distribution of the
    pair matches the target's exactly computed one and differs from the draft's."""
    target, draft = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    SHORT = [1, 3, 4]
    warp = dict(temperature=0.8, top_k=5)
    p = exact_joint(target, SHORT, warp)
    q = exact_joint(draft, SHORT, warp)
    assert 0.5 * float((p - q).abs().sum()) > 0.15  # the draft really is another distribution
    counts = torch.zeros(6, 6)
    drafted = accepted = 0
    for seed in range(1200):
        r = layerleap.generate(
            target,
            SHORT,
            "speculative",
            3,
            draft=draft,
            do_sample=True,
            seed=seed,
            stop_at_eos=False,
            **warp,
            **options,
        )
        counts[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts.sum(1), p.sum(1)) > 1e-3  # first token
    assert chi2_pvalue(counts.sum(0), p.sum(0)) > 1e-3  # second token
    assert chi2_pvalue(counts, q) < 1e-6  # the same test tells the draft's distribution apart


def test_sampling_is_reproducible_with_a_seed():
    target, draft = tiny_pair(1)
    a = layerleap.generate(target, PROMPT, "speculative", 20, draft=draft, do_sample=True, seed=7, stop_at_eos=False)
    b = layerleap.generate(target, PROMPT, "speculative", 20, draft=draft, do_sample=True, seed=7, stop_at_eos=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


# -- the pure rules --------------------------------------------------------------------------------
def test_greedy_accept_and_residual():
    logits = torch.full((4, 5), -1.0)
    for i, t in enumerate([3, 1, 4, 0]):
        logits[i, t] = 1.0
    assert verify.greedy_accept(torch.tensor([3, 1, 4]), logits) == (3, 0)
    assert verify.greedy_accept(torch.tensor([3, 2, 4]), logits) == (1, 1)
    assert verify.greedy_accept(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)
    r = verify.residual(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.25, 0.25, 0.5]]))
    torch.testing.assert_close(r, torch.tensor([[0.5, 0.5, 0.0]]))
    same = torch.tensor([[0.2, 0.8]])
    torch.testing.assert_close(verify.residual(same, same), same)


def test_rollback_rule_on_a_chain():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    toks = torch.tensor([0, 0, 0])  # -log p = 0.105, 0.511, 1.204
    parents = torch.arange(-1, 2)

    def kept(alpha_rb, own=None):
        return len(verify.rollback_path(toks, parents, probs, alpha_rb, own))

    assert kept(2.0) == 3 and kept(math.inf) == 3
    assert kept(1.0) == 2 and kept(0.69) == 2  # ln 2: only tokens with p >= 1/2 stay
    assert kept(0.5) == 1
    assert kept(0.5, own=[0, 0, 1, 0]) == 2  # the verifier's own choice is never rolled back
    assert kept(0.5, own=[0, 1, 1, 0]) == 1


def test_rollback_rule_on_a_tree_walks_the_most_likely_children():
    # root -> drafts 0 (token 1) and 1 (token 2); draft 2 (token 0) below draft 1
    toks, parents = torch.tensor([1, 2, 0]), torch.tensor([-1, -1, 1])
    probs = torch.tensor([[0.1, 0.3, 0.6], [1.0, 0.0, 0.0], [0.3, 0.6, 0.1], [1.0, 0.0, 0.0]])
    assert verify.rollback_path(toks, parents, probs, 1.0) == [1]  # token 2 (p 0.6), then token 0 (p 0.3 < e^-1)
    assert verify.rollback_path(toks, parents, probs, 1.0, own=[2, 0, 1, 0]) == [1]  # not its choice
    assert verify.rollback_path(toks, parents, probs, 1.0, own=[2, 0, 0, 0]) == [1, 2]
    assert verify.rollback_path(toks, parents, probs, 0.4) == []  # -log 0.6 = 0.51
    assert verify.rollback_path(toks, parents, probs, math.inf) == [1, 2]
    for alpha_rb in (0.0, 0.69):  # with greedy's own choices: accept_greedy's path
        own = probs.argmax(-1).tolist()
        want = verify.accept_greedy(toks, parents, probs)[0]
        assert verify.rollback_path(toks, parents, probs, alpha_rb, own) == want


# -- errors ------------------------------------------------------------------------------------------
class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab
        self.eos_token_id = None

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


DRAFT = object()  # stands for the tiny draft model in the cases below


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "needs the option draft"),
        ({"draft": None}, "draft must be a model"),
        ({"draft": DRAFT, "draft_len": 0}, r"draft_len must be an integer in \[1, 256\]"),
        ({"draft": DRAFT, "draft_len": 2.5}, r"draft_len must be an integer in \[1, 256\]"),
        ({"draft": DRAFT, "draft_len": True}, r"draft_len must be an integer in \[1, 256\]"),
        ({"draft": DRAFT, "schedule": "fast"}, "schedule must be one of constant, heuristic"),
        ({"draft": DRAFT, "schedule": None}, "schedule must be one of"),
        ({"draft": DRAFT, "min_confidence": 1.5}, r"min_confidence must be a finite number in \[0, 1\]"),
        ({"draft": DRAFT, "min_confidence": -0.1}, "min_confidence must be a finite number in"),
        ({"draft": DRAFT, "min_confidence": float("nan")}, "min_confidence must be a finite number in"),
        ({"draft": DRAFT, "min_confidence": True}, "min_confidence must be a finite number in"),
        ({"draft": DRAFT, "min_confidence": "0.4"}, "min_confidence must be a finite number in"),
        ({"draft": "small"}, "must be a layerleap model"),
    ],
)
def test_bad_options(options, message):
    target, draft = tiny_pair(0)
    options = {k: draft if v is DRAFT else v for k, v in options.items()}
    with pytest.raises(GenerationError, match=message):
        layerleap.generate(target, PROMPT, "speculative", 5, **options)


def test_mismatched_models_are_refused():
    target, draft = tiny_pair(0)
    other_vocab = Transformer(tiny_config(vocab_size=50, n_layers=1)).eval()
    with pytest.raises(GenerationError, match="vocabulary has 50 tokens.*share one tokenizer"):
        layerleap.generate(target, PROMPT, "speculative", 5, draft=other_vocab)
    with pytest.raises(GenerationError, match="larger than the large model"):
        layerleap.generate(draft, PROMPT, "speculative", 5, draft=target)
    target.tokenizer = FakeTokenizer({f"t{i}": i for i in range(97)})
    draft.tokenizer = FakeTokenizer({f"u{i}": i for i in range(97)})
    with pytest.raises(GenerationError, match="tokenizer differs"):
        layerleap.generate(target, PROMPT, "speculative", 5, draft=draft)
    draft.tokenizer = FakeTokenizer({f"t{i}": i for i in range(97)})
    assert len(layerleap.generate(target, PROMPT, "speculative", 5, draft=draft, stop_at_eos=False).token_ids) == 5


def test_method_is_not_in_the_default_runnable_set():
    from layerleap.eval import bench

    assert "speculative" not in bench.runnable_methods()  # it needs a draft model
    assert bench.required_options("speculative", {}) == ["draft"]


def test_defaults_are_transformers_assisted_generation_defaults():
    from layerleap.decoding import get_method

    opts = get_method("speculative").options()
    assert (opts["draft_len"], opts["schedule"], opts["min_confidence"]) == (20, "constant", 0.4)


def test_the_tokenizer_check_keeps_nothing_of_freed_tokenizers():
    """A long-lived process that loads and frees draft models keeps no answer per freed tokenizer pair
    (kept by id, a freed pair's answer could also be handed to a new pair at the same addresses)."""
    import gc

    from layerleap.drafters import companion

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def __len__(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab)

    def kept() -> int:  # the answers kept
        return sum(len(v) if hasattr(v, "__len__") else 1 for v in list(companion._SAME_TOKENIZER.values()))

    before = kept()
    for i in range(50):
        a, b = Tok({"x": 0, "y": 1}), Tok({"x": 0, "y": 1} if i % 2 else {"x": 1, "y": 0})
        assert companion._same_tokenizer(a, b) is bool(i % 2)
        assert companion._same_tokenizer(a, b) is bool(i % 2) and companion._same_tokenizer(a, a)
        del a, b
    gc.collect()
    assert kept() == before
