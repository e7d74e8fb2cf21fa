"""BiLD (methods/bild.py): its exact limits, exact KV rollback, nothing recomputed, errors; both forms
on tiny random models (batch 1).

The two-model pair: a 4-layer large model with a sharpened LM head and a 2-layer small model made of
its first two layers and its head, so the small model is often confident and often right, but not
always (fallbacks and rollbacks both happen)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import layerleap
from layerleap import Transformer, tiny_config
from layerleap.core.stats import BildStats
from layerleap.decoding import GenerationConfig, GenerationError, Run
from layerleap.drafters.base import ChainRule
from layerleap.drafters.companion import DraftModel
from layerleap.drafters.early_exit import EarlyExitDrafter
from layerleap.methods import bild as bild_mod


def tiny_pair(seed: int, n_small: int = 2, scale: float = 6.0):
    torch.manual_seed(seed)
    large = Transformer(tiny_config(tie_embeddings=False)).eval()
    with torch.no_grad():
        large.lm_head.weight.mul_(scale)
    small = Transformer(tiny_config(tie_embeddings=False, n_layers=n_small)).eval()
    small.load_state_dict(
        {k: v for k, v in large.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_small}
    )
    return large, small


PROMPT = [5, 7, 11, 13, 17]
N = 32
SEEDS = range(3)


def greedy(model, n=N):
    return layerleap.generate(model, PROMPT, max_new_tokens=n, stop_at_eos=False)


def run_bild(large, n=N, **options):
    return layerleap.generate(large, PROMPT, "bild", n, stop_at_eos=False, **options)


def forms(large, small):
    """The two forms with the same small model: ``small=`` and the first two layers as an exit."""
    return {"two models": {"small": small}, "early exit": {"exit_layer": 2, "head": "shared"}}


# -- the exact limits ------------------------------------------------------------------------------
def test_always_falling_back_gives_the_large_models_greedy_output():
    for seed in SEEDS:
        large, small = tiny_pair(seed)
        ref = greedy(large).token_ids
        for name, form in forms(large, small).items():
            for alpha_rb in (0.5, 2.0, math.inf):
                r = run_bild(large, alpha_fb=1.0, alpha_rb=alpha_rb, **form)
                assert r.token_ids == ref, (seed, name, alpha_rb)
                assert r.stats["small_tokens"] == 0 and r.stats["large_tokens"] == N
                # the first token is the prompt pass's: N - 1 large passes after it, each a fallback
                assert r.stats["fallbacks"] == r.stats["large_calls"] == N - 1 and r.stats["fallback_rate"] == 1.0


@pytest.mark.parametrize("alpha_rb", [0.69, math.log(2), 0.0])
def test_rollback_at_or_below_ln2_gives_the_large_models_greedy_output(alpha_rb):
    kept = 0
    for seed in SEEDS if alpha_rb > 0 else SEEDS[:1]:
        large, small = tiny_pair(seed)
        ref = greedy(large).token_ids
        for name, form in forms(large, small).items():
            for alpha_fb, max_small in ((0.0, 10), (0.3, None), (0.6, 3)):
                r = run_bild(large, alpha_fb=alpha_fb, alpha_rb=alpha_rb, max_small=max_small, **form)
                assert r.token_ids == ref, (seed, name, alpha_fb, max_small)
                kept += r.stats["small_tokens"] - r.stats["rolled_back"]
                assert r.stats["large_tokens"] + r.stats["small_tokens"] - r.stats["rolled_back"] == N
    if alpha_rb > 0:  # (at 0 every small token is rolled back unless the large model is certain)
        assert kept > 50  # small-model tokens really were kept, so the equality is not trivial


def test_never_falling_back_nor_rolling_back_gives_the_small_models_greedy_output():
    for seed in SEEDS:
        large, small = tiny_pair(seed)
        want = greedy(small).token_ids
        assert want != greedy(large).token_ids
        for name, form in forms(large, small).items():
            r = run_bild(large, alpha_fb=0.0, alpha_rb=math.inf, max_small=None, **form)
            assert r.token_ids == want, (seed, name)
            assert r.stats["small_tokens"] == N and r.stats["large_tokens"] == 0
            assert r.stats["large_calls"] == 0  # alpha_rb = inf: the final check could change nothing
            r = run_bild(large, alpha_fb=0.0, alpha_rb=1e9, max_small=None, **form)
            assert r.token_ids == want and r.stats["large_calls"] == r.stats["final_checks"] == 1


def test_large_calls_count_the_large_passes_after_the_prompt():
    """A first token the small model is unsure of comes from the prompt pass: no large pass, so no fallback,
    and ``large_calls`` stays the large model's calls after the prompt; ``fallback_rate`` still counts that
    step (a small model unsure of every token has rate 1).  Each row of a batch counts as alone."""
    unsure_first = 0
    prompts = [PROMPT, [3, 4], [9, 2, 8, 6]]
    for seed in SEEDS:
        large, small = tiny_pair(seed)
        for alpha_fb in (0.3, 0.6, 0.99):
            rs = layerleap.generate(large, prompts, "bild", 8, stop_at_eos=False, small=small, alpha_fb=alpha_fb)
            for p, r in zip(prompts, rs):
                s = layerleap.generate(large, p, "bild", 8, stop_at_eos=False, small=small, alpha_fb=alpha_fb).stats
                assert s["large_calls"] == s["model_calls"] - 1, (seed, alpha_fb, s)
                assert s["large_calls"] == s["fallbacks"] + s["forced"] + s["final_checks"]
                assert s["rollback_rate"] == (s["rollbacks"] / s["large_calls"] if s["large_calls"] else 0.0)
                for key in ("large_calls", "fallbacks", "fallback_rate", "rollback_rate"):
                    assert r.stats[key] == s[key], (seed, alpha_fb, key)
                unsure_first += s["fallback_rate"] * s["small_steps"] > s["fallbacks"]
                if alpha_fb == 0.99:  # unsure of every token: the first is the prompt pass's, the rest fall back
                    assert s["fallback_rate"] == 1.0 and s["fallbacks"] == s["small_steps"] - 1 == 7, s
    assert unsure_first > 0  # the case the count is about did happen


def test_run_limit_hands_over_every_max_small_tokens():
    large, small = tiny_pair(0)
    r = run_bild(large, small=small, alpha_fb=0.0, alpha_rb=math.inf, max_small=4)
    # never falls back nor rolls back: 4 small tokens, then the large model's, in turn
    assert r.stats["forced"] == N // 5 and r.stats["fallbacks"] == 0
    assert r.stats["large_tokens"] == N // 5 and r.stats["small_tokens"] == N - N // 5


@pytest.mark.parametrize("form", ["two models", "early exit"])
def test_no_fallback_hands_over_at_a_fixed_interval(form):
    """The paper's no-fallback ablation (Figure 5) is alpha_fb=0 with max_small=k: the small model never
    hands over by confidence, the large model checks every k small tokens, and rollback still acts."""
    large, small = tiny_pair(1)
    for k in (3, 5):
        s = run_bild(large, alpha_fb=0.0, alpha_rb=1.0, max_small=k, **forms(large, small)[form]).stats
        assert s["fallbacks"] == 0 and s["forced"] >= 1 and s["rollbacks"] >= 1, (k, s)
        assert s["large_calls"] == s["forced"] + s["final_checks"]
        # each forced check follows exactly k small steps; a check at the budget follows at most k
        assert k * s["forced"] <= s["small_steps"] <= k * s["large_calls"], (k, s)


def test_a_run_limit_beyond_the_budget_sizes_chains_by_the_budget():
    """A chain never holds more drafts than the output has tokens left: the caches are sized by it."""
    assert ChainRule.fallback(256, 0.5).longest(4) == 4
    assert ChainRule.fallback(3, 0.5).longest(4) == 3
    assert ChainRule.fallback(None, 0.5).longest(4) == 4
    large, small = tiny_pair(0)
    r = run_bild(large, 3, small=small, alpha_fb=0.0, alpha_rb=math.inf, max_small=256)
    assert r.token_ids == run_bild(large, 3, small=small, alpha_fb=0.0, alpha_rb=math.inf, max_small=None).token_ids


def test_pending_tokens_are_checked_before_returning():
    """The last small tokens go through the rollback policy too: with a strict threshold and a large
    run limit the tail of the output is the large model's, not the small model's."""
    for seed in SEEDS:
        large, small = tiny_pair(seed)
        r = run_bild(large, small=small, alpha_fb=0.0, alpha_rb=0.69, max_small=None)
        assert r.token_ids == greedy(large).token_ids
        assert r.stats["final_checks"] >= 1


def test_eos_ends_like_greedy():
    large, small = tiny_pair(1)
    ref = greedy(large, 30).token_ids
    eos = ref[7]
    for m in (large, small):
        m.config = tiny_config(tie_embeddings=False, n_layers=m.config.n_layers, eos_token_ids=(eos,))
    want = layerleap.generate(large, PROMPT, max_new_tokens=30).token_ids
    for form in forms(large, small).values():
        got = layerleap.generate(large, PROMPT, "bild", 30, alpha_fb=0.3, alpha_rb=0.69, **form).token_ids
        assert got == want and got[-1] == eos


# -- caches: exact rollback, nothing recomputed ---------------------------------------------------------
def decode(large, drafter_factory, n=N, alpha_fb=0.5, alpha_rb=2.0, max_small=10):
    run = Run(large, [PROMPT], GenerationConfig(max_new_tokens=n, stop_at_eos=False))
    drafter = drafter_factory(run, ChainRule.fallback(max_small, alpha_fb))
    with torch.inference_mode():
        for _ in bild_mod.decode(run, drafter, alpha_rb):
            pass
    return run, drafter


def assert_cache_matches_fresh_pass(model, cache, seq, layers=None):
    layers = range(model.config.n_layers) if layers is None else layers
    for layer in layers:
        n = int(cache.lengths[layer, 0])
        fresh = model.new_cache(1, n)
        model(torch.tensor([seq[:n]]), cache=fresh)
        torch.testing.assert_close(cache.k[layer, :, :, :n], fresh.k[layer], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[layer, :, :, :n], fresh.v[layer], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["two models", "early exit"])
def test_kv_caches_roll_back_exactly(form):
    large, small = tiny_pair(1)
    if form == "two models":
        factory = lambda run, rule: DraftModel(run, small, rule, name="small")  # noqa: E731
    else:
        factory = lambda run, rule: EarlyExitDrafter(run, 2, large.logits, rule)  # noqa: E731
    run, drafter = decode(large, factory, alpha_fb=0.3, alpha_rb=1.0, max_small=6)
    st = run.records[BildStats][0]
    assert st.rollbacks >= 2 and st.rolled_back >= 2  # rollbacks really happened
    seq = PROMPT + run.out[0]
    assert len(run.out[0]) == N
    n_large = int(drafter.cache.lengths[-1, 0])
    assert len(seq) - 1 <= n_large <= len(seq)
    assert_cache_matches_fresh_pass(large, drafter.cache, seq)  # every layer, the skipped ones too
    if form == "two models":
        assert_cache_matches_fresh_pass(small, drafter.model.cache, seq)
        assert drafter.own_length(0) <= len(seq)
    else:
        assert drafter.pair.h_pending[0] is None and drafter.own_length(0) == n_large


def test_early_exit_computes_no_layer_twice():
    """Always falling back in the early-exit form, each token runs layers [0, E) in the small step
    and [E, L) in the large pass: exactly greedy's token-layer evaluations, one extra for the last
    token, which greedy never feeds back."""
    large, _ = tiny_pair(0)
    g = greedy(large).stats
    r = run_bild(large, exit_layer=2, head="shared", alpha_fb=1.0).stats
    assert r["layer_evals"] == g["layer_evals"] == 4 * N  # (the prompt's last position counts as generation)
    assert r["prompt_layer_evals"] == g["prompt_layer_evals"]
    # a certain fallback runs no small step (its exit head would be thrown away): one call a token, as greedy
    assert r["model_calls"] == g["model_calls"] and r["small_steps"] == 0
    assert r["fallbacks"] == r["large_calls"] == N - 1 == g["model_calls"] - 1  # after the prompt pass
    assert r["fallback_rate"] == 1.0  # every step the large model's
    # kept small tokens: N - 1 small steps (layers 0-1; the first token came from the prompt pass),
    # then the final check: layers 0-1 for the last token alone, layers 2-3 for all N
    r = run_bild(large, exit_layer=2, head="shared", alpha_fb=0.0, alpha_rb=1e9, max_small=None).stats
    assert r["layer_evals"] == 4 + 2 * (N - 1) + 2 + 2 * N


def test_two_model_form_meters_the_small_model_apart():
    large, small = tiny_pair(0)
    r = run_bild(large, small=small, alpha_fb=0.0, alpha_rb=1e9, max_small=None).stats
    assert r["small_calls"] == 1 + (N - 1)  # the prompt pass, then one call per fed token
    assert r["small_layer_evals"] == 2 * N and r["small_prompt_layer_evals"] == 2 * (len(PROMPT) - 1)
    assert r["layer_evals"] == 4 + 4 * N  # the prompt's last position, then one pass over the N pending tokens


# -- sampling --------------------------------------------------------------------------------------
def test_sampling_always_falling_back_is_the_large_models_sampling():
    large, small = tiny_pair(2, scale=2.0)
    for seed in (0, 1):
        want = layerleap.generate(large, PROMPT, "sample", N, seed=seed, temperature=0.9, stop_at_eos=False).token_ids
        for form in forms(large, small).values():
            got = layerleap.generate(
                large,
                PROMPT,
                "bild",
                N,
                do_sample=True,
                seed=seed,
                temperature=0.9,
                stop_at_eos=False,
                alpha_fb=1.0,
                **form,
            ).token_ids
            assert got == want


def test_sampling_is_reproducible_and_uses_both_models():
    large, small = tiny_pair(2)
    a = run_bild(large, small=small, do_sample=True, seed=3, alpha_fb=0.3, alpha_rb=2.0)
    b = run_bild(large, small=small, do_sample=True, seed=3, alpha_fb=0.3, alpha_rb=2.0)
    c = run_bild(large, small=small, do_sample=True, seed=4, alpha_fb=0.3, alpha_rb=2.0)
    assert a.token_ids == b.token_ids != c.token_ids
    assert a.stats["small_tokens"] > 0 and a.stats["large_tokens"] > 0


# -- defaults, heads, errors -----------------------------------------------------------------------------
def test_defaults_run_the_early_exit_form_on_one_model():
    large, _ = tiny_pair(0)
    r = layerleap.generate(large, PROMPT, "bild", 8, stop_at_eos=False)
    assert r.stats["exit_layer"] == bild_mod.default_exit_layer(large) == 3
    assert r.stats["head"] in ("shared", "trained") and len(r.token_ids) == 8
    from layerleap.eval import bench

    assert "bild" in bench.runnable_methods()


def test_truncated_model_uses_the_given_head():
    """The early-exit draft for speculative decoding: layers [0, E) of the model and the exit head."""
    from layerleap.drafters.exit_heads import AdapterHead
    from layerleap.drafters.companion import truncated

    large, _ = tiny_pair(0)
    head = AdapterHead(large, 2, rank=4)
    with torch.no_grad():
        head.up.weight.normal_()
    t = truncated(large, 2, head)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = head(large.run_layers(large.embed(ids), 0, 2, torch.arange(len(PROMPT)).unsqueeze(0)))
        torch.testing.assert_close(t(ids), want)
        assert not torch.allclose(t(ids), truncated(large, 2)(ids))
    r = run_bild(large, exit_layer=2, head=head, alpha_fb=0.0, alpha_rb=math.inf, max_small=None)
    assert r.token_ids == greedy(t).token_ids  # BiLD's small model is that truncated model


def test_a_callable_head_is_used():
    large, _ = tiny_pair(0)
    calls = []

    def head(h):
        calls.append(h.shape)
        return large.logits(h)

    r = run_bild(large, exit_layer=2, head=head, alpha_fb=0.0, alpha_rb=math.inf, max_small=None)
    assert r.stats["head"] == "custom" and len(calls) == N


@pytest.mark.parametrize(
    "options, message",
    [
        ({"alpha_fb": -0.1}, r"alpha_fb must be a finite number in \[0, 1\]"),
        ({"alpha_fb": 1.5}, r"alpha_fb must be a finite number in \[0, 1\]"),
        ({"alpha_fb": "high"}, "alpha_fb must be"),
        ({"alpha_fb": True}, "alpha_fb must be"),
        ({"alpha_rb": -1.0}, "alpha_rb must be a finite number >= 0; inf: never roll back"),
        ({"alpha_rb": float("nan")}, "alpha_rb must be"),
        ({"max_small": 0}, r"max_small must be an integer in \[1, 256\]"),
        ({"max_small": 2.5}, r"max_small must be an integer in \[1, 256\]"),
        ({"max_small": 10**9}, r"max_small must be an integer in \[1, 256\] or none \(no limit\)"),
        ({"exit_layer": 0}, r"exit_layer must be an integer in \[1, 3\]"),
        ({"exit_layer": 4}, r"exit_layer must be an integer in \[1, 3\]"),
        ({"exit_layer": "2"}, "exit_layer must be an integer"),
        ({"exit_layer": 2, "small": "SMALL"}, "either small= .* or exit_layer="),
        ({"small": "SMALL", "head": "shared"}, "head= chooses the exit head"),
        ({"small": "a model"}, "must be a layerleap model"),
        ({"exit_layer": 2, "head": "/no/such/head.safetensors"}, "head must be one of auto, shared, trained or an"),
    ],
)
def test_bad_options(options, message):
    large, small = tiny_pair(0)
    options = {k: small if v == "SMALL" else v for k, v in options.items()}
    with pytest.raises(GenerationError, match=message):
        layerleap.generate(large, PROMPT, "bild", 5, **options)


def test_mismatched_models_are_refused():
    large, small = tiny_pair(0)
    other_vocab = Transformer(tiny_config(vocab_size=50, n_layers=1)).eval()
    with pytest.raises(GenerationError, match="vocabulary has 50 tokens"):
        run_bild(large, small=other_vocab)
    with pytest.raises(GenerationError, match=r"small model \(.*\) is larger than the large model"):
        run_bild(small, small=large)

    class Tok:
        eos_token_id = None

        def __init__(self, prefix):
            self.v = {f"{prefix}{i}": i for i in range(97)}

        def __len__(self):
            return 97

        def get_vocab(self):
            return self.v

    large.tokenizer, small.tokenizer = Tok("a"), Tok("b")
    with pytest.raises(GenerationError, match="tokenizer differs from the large model's"):
        run_bild(large, small=small)


# -- prediction alignment --------------------------------------------------------------------------------
def _records(large, prompts, n=12):
    return [{"key": str(i), "prompt_ids": p, "output_ids": greedy_ids(large, p, n)} for i, p in enumerate(prompts)]


def greedy_ids(model, prompt, n):
    return layerleap.generate(model, prompt, max_new_tokens=n, stop_at_eos=False).token_ids


CALIB = [[5, 7, 11], [3, 1, 4, 1, 5], [9, 2, 6], [8, 8, 3, 2], [10, 20, 30], [42, 17]]


def test_align_exit_head_raises_agreement_and_loads(tmp_path):
    from layerleap.drafters.exit_heads import load_exit_head
    from layerleap.train import align

    large, _ = tiny_pair(0)
    recs = _records(large, CALIB)
    out = tmp_path / "head.safetensors"
    rep = align.align_exit_head(
        large, 2, recs, out, align.TrainConfig(epochs=30, lr=3e-2, batch_tokens=32), progress=False
    )
    assert out.is_file() and not align._ckpt_path(out).exists()
    assert rep["agreement_after"] > rep["agreement_before"] + 0.1
    head = load_exit_head(large, 2, out)
    r = run_bild(large, exit_layer=2, head=str(out), alpha_fb=0.0, alpha_rb=math.inf, max_small=None)
    assert r.stats["head"] == str(out) and len(r.token_ids) == N
    with pytest.raises(GenerationError, match="is for exit_layer=2, not 1"):
        load_exit_head(large, 1, out)
    other, _ = tiny_pair(5)
    with pytest.raises(GenerationError, match="trained for another model"):
        load_exit_head(other, 2, out)
    assert head(torch.zeros(1, 1, 32)).shape == (1, 1, 97)


def test_align_training_resumes_where_it_stopped(tmp_path):
    """Interrupted at step 5 and rerun, training ends with the same weights as an uninterrupted run."""
    from layerleap.train import align

    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def train(out, stop_at=None):
        w = torch.zeros(4, 4, requires_grad=True)
        calls = [0]

        def loss_fn(idx):
            calls[0] += 1
            if stop_at is not None and calls[0] == stop_at:
                raise KeyboardInterrupt
            return ((target[idx] @ w - target[idx]) ** 2).mean()

        cfg = align.TrainConfig(epochs=3, lr=0.05, batch_tokens=16, save_every=100)
        align._train({"w": w}, loss_fn, 64, cfg, out, "tag", "t", progress=False, machine="cpu")
        return w.detach(), calls[0]

    full, n_full = train(tmp_path / "a.safetensors")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b.safetensors", stop_at=6)
    assert align._ckpt_path(tmp_path / "b.safetensors").is_file()  # saved on the interrupt, after 5 steps
    resumed, n_rest = train(tmp_path / "b.safetensors")
    assert n_full == 12 and n_rest == 12 - 5
    torch.testing.assert_close(resumed, full)


def test_align_exit_head_resumed_on_another_machine_records_both(tmp_path, monkeypatch):
    from layerleap.drafters import weights
    from layerleap.drafters.exit_heads import read_meta
    from layerleap.train import align

    large, _ = tiny_pair(0)
    recs, out = _records(large, CALIB), tmp_path / "head.safetensors"
    cfg = align.TrainConfig(epochs=2, lr=3e-2, batch_tokens=16, save_every=1)
    loop = align.run_loop

    def interrupted(params, loss, cfg, ckpt):  # Ctrl-C at the third step: the state of two saved
        def stopping(step):
            if step == 2:
                raise KeyboardInterrupt
            return loss(step)

        return loop(params, stopping, cfg, ckpt)

    monkeypatch.setattr(weights, "machine", lambda device: "cpu A")
    monkeypatch.setattr(align, "run_loop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        align.align_exit_head(large, 2, recs, out, cfg, progress=False)
    monkeypatch.setattr(weights, "machine", lambda device: "cpu B")
    monkeypatch.setattr(align, "run_loop", loop)
    align.align_exit_head(large, 2, recs, out, cfg, progress=False)
    assert read_meta(out)["machine"] == "cpu A; then cpu B"


def test_align_small_model_saves_a_loadable_folder(tmp_path):
    from layerleap.train import align

    large, small = tiny_pair(1)
    recs = _records(large, CALIB)
    rep = align.align_small(
        small, recs, tmp_path / "aligned", align.TrainConfig(epochs=8, lr=1e-2, batch_tokens=24), progress=False
    )
    assert rep["agreement_after"] > rep["agreement_before"]
    loaded = layerleap.load_folder(tmp_path / "aligned")
    assert loaded.config.n_layers == 2
    sd, before = loaded.state_dict(), small.state_dict()
    assert any(not torch.equal(sd[k], before[k]) for k in before)  # trained weights were saved
    r = run_bild(large, small=loaded, alpha_fb=0.3, alpha_rb=2.0)
    assert len(r.token_ids) == N


def test_align_small_model_checks_its_folder_before_training(tmp_path, monkeypatch):
    """An empty folder (the command accepts one) is filled; a folder of other files, or a file, is refused
    before any training step, not after the whole run."""
    from layerleap.train import align

    large, small = tiny_pair(1)
    recs = _records(large, CALIB)
    cfg = align.TrainConfig(epochs=1, lr=1e-2, batch_tokens=24)
    (tmp_path / "empty").mkdir()
    align.align_small(small, recs, tmp_path / "empty", cfg, progress=False)
    assert (tmp_path / "empty" / "config.json").is_file()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    monkeypatch.setattr(align, "run_loop", lambda *a, **k: pytest.fail("trained before refusing the folder"))
    for out in (tmp_path / "other", tmp_path / "file"):
        with pytest.raises(align.AlignError, match="is not a model folder"):
            align.align_small(small, recs, out, cfg, progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"


def test_align_small_model_replaces_an_old_folder_only_once_the_new_one_is_written(tmp_path, monkeypatch):
    """An interrupted run keeps the old folder; a finished one swaps the new one in and leaves nothing beside it."""
    import safetensors.torch

    from layerleap.train import align

    large, small = tiny_pair(1)
    recs = _records(large, CALIB)
    out, cfg = tmp_path / "aligned", align.TrainConfig(epochs=1, lr=1e-2, batch_tokens=24)
    align.align_small(small, recs, out, cfg, progress=False)
    old = {p.name: p.read_bytes() for p in out.iterdir()}

    save_file = safetensors.torch.save_file

    def interrupted(tensors, path, *a, **kw):  # while the new folder is written, after training
        if "model" in Path(path).name:
            raise KeyboardInterrupt
        return save_file(tensors, path, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            align.align_small(small, recs, out, align.TrainConfig(epochs=2, lr=1e-2, batch_tokens=24), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aligned", "aligned.ckpt.safetensors"]  # no temporary
    align.align_small(small, recs, out, align.TrainConfig(epochs=2, lr=1e-2, batch_tokens=24), progress=False)
    assert (out / "model.safetensors").read_bytes() != old["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aligned"]


def test_align_small_model_on_a_full_disk_is_one_line_and_keeps_the_old_folder(tmp_path, monkeypatch):
    """The weights go through ``files.save_safetensors``: safetensors' own error for a full disk is a
    ``LayerleapError`` naming the file, and the old folder stays as it was, with nothing beside it."""
    import safetensors.torch
    from safetensors import SafetensorError

    from layerleap.errors import LayerleapError
    from layerleap.train import align

    large, small = tiny_pair(1)
    recs = _records(large, CALIB)
    out, cfg = tmp_path / "aligned", align.TrainConfig(epochs=1, lr=1e-2, batch_tokens=24)
    align.align_small(small, recs, out, cfg, progress=False)
    old = {p.name: p.read_bytes() for p in out.iterdir()}

    save_file = safetensors.torch.save_file

    def full_disk(tensors, path, *a, **kw):  # the checkpoint fits, the folder's weights do not
        if "model" in Path(path).name:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, path, *a, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(LayerleapError, match=r"^cannot write \S+/model\.safetensors: .*No space left on device"):
        align.align_small(small, recs, out, align.TrainConfig(epochs=2, lr=1e-2, batch_tokens=24), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aligned", "aligned.ckpt.safetensors"]


def test_calibration_is_resumable(tmp_path, monkeypatch):
    from layerleap.train import align

    large, _ = tiny_pair(0)
    large.tokenizer = None
    calls = []
    real = align.generate

    def counting(model, prompt, *a, **k):
        calls.append(prompt)
        return real(model, [int(t) for t in prompt.split()], *a, **{**k, "chat": False})

    monkeypatch.setattr(align, "generate", counting)
    path = tmp_path / "calib.json"
    texts = ["5 7 11", "3 1 4", "9 2 6"]
    first = align.calibrate(large, texts[:2], path, 6, progress=False)
    again = align.calibrate(large, texts, path, 6, progress=False)
    assert calls == texts[:2] + texts[2:]  # the first two were not generated again
    assert again[:2] == first and len(again[2]["output_ids"]) == 6
    with pytest.raises(layerleap.LayerleapError, match="another model or settings"):
        align.calibrate(large, texts, path, 7, progress=False)


# -- the command line: sweep and align ---------------------------------------------------------------
def cli(capsys, *argv):
    from layerleap.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_sweep_bild_command(capsys, tmp_path, tiny_hf_dir):
    import json

    out = tmp_path / "sweep.json"
    rc, stdout, err = cli(
        capsys,
        "sweep",
        "bild",
        "--model",
        tiny_hf_dir,
        "--exit-layer",
        2,
        "--head",
        "shared",
        "--alpha-fb",
        "0.5,1",
        "--alpha-rb",
        "0.69,inf",
        "--draft-lens",
        "2",
        "--categories",
        "summarization,translation",
        "--prompts",
        1,
        "--max-new-tokens",
        6,
        "--threads",
        1,
        "--json",
        out,
        "--plot",
        tmp_path / "s.png",
        "--table",
        tmp_path / "s.md",
    )
    assert rc == 0, err
    rep = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))  # strict JSON
    assert rep["complete"] and rep["prompts_done"] == 2
    assert {p["alpha_rb"] for p in rep["config"]["points"]} == {None, 0.69, "inf"}
    s = rep["summary"]
    assert set(s) == {
        "greedy",
        "bild fb=0.5 rb=0.69",
        "bild fb=1 rb=0.69",
        "bild fb=0.5 rb=inf",
        "bild fb=1 rb=inf",
        "speculative γ=2",
    }
    for label in ("bild fb=1 rb=inf", "bild fb=0.5 rb=0.69", "speculative γ=2", "greedy"):  # exact by construction
        assert s[label]["identical"] == 2, label
        assert s[label]["categories"]["summarization"]["quality"] == pytest.approx(100.0)
    assert s["greedy"]["speedup"] == pytest.approx(1.0)
    assert "BiLD, no loss" in stdout and (tmp_path / "s.png").stat().st_size > 1000
    assert "sweep bild" in (tmp_path / "s.md").read_text()
    # rerunning with the same settings resumes: nothing left to run
    rc, _, _ = cli(
        capsys,
        "sweep",
        "bild",
        "--model",
        tiny_hf_dir,
        "--exit-layer",
        2,
        "--head",
        "shared",
        "--alpha-fb",
        "0.5,1",
        "--alpha-rb",
        "0.69,inf",
        "--draft-lens",
        "2",
        "--categories",
        "summarization,translation",
        "--prompts",
        1,
        "--max-new-tokens",
        6,
        "--threads",
        1,
        "--json",
        out,
    )
    assert rc == 0 and json.loads(out.read_text())["resumed_from"] == 2


def test_sweep_bild_eagle_form(capsys, tmp_path, tiny_hf_dir):
    """``--eagle FILE``: BiLD's points with that head as the small model, and the eagle method with the same
    head as the lossless yardstick; rollback at ln 2 and the eagle method give greedy's output."""
    import json

    from layerleap.drafters import medusa_transfer

    model = layerleap.load(str(tiny_hf_dir))
    head_file = medusa_transfer.save_drafter(medusa_transfer.new_drafter(model, "eagle"), tmp_path / "e.safetensors")
    out = tmp_path / "sweep.json"
    rc, stdout, err = cli(
        capsys,
        *("sweep", "bild", "--model", tiny_hf_dir, "--eagle", head_file, "--alpha-fb", "0", "--alpha-rb", "0.69,inf"),
        *("--max-small", 1, "--categories", "summarization", "--prompts", 1, "--max-new-tokens", 6, "--threads", 1),
        *("--json", out, "--table", tmp_path / "s.md"),
    )
    assert rc == 0, err
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert set(s) == {"greedy", "bild fb=0 rb=0.69", "bild fb=0 rb=inf", "eagle"}
    assert s["bild fb=0 rb=0.69"]["identical"] == s["eagle"]["identical"] == 1
    assert s["bild fb=0 rb=inf"]["small_share"] > 0  # never rolled back: the head's tokens are kept
    assert "EAGLE head e.safetensors" in stdout and "| eagle (lossless) |" in stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--alpha-fb", "2"], r"--alpha-fb: each item alpha_fb must be a finite number in \[0, 1\], got 2"),
        (["--alpha-rb", "-1"], "--alpha-rb: each item alpha_rb must be a finite number >= 0"),
        (["--alpha-fb", "x"], "each item alpha_fb must be a finite number"),
        (["--draft-lens", "0"], r"each item draft_len must be an integer in \[1, 256\]"),
        (["--speculative", "fast:2"], "schedule must be one of constant, heuristic"),
        (["--speculative", "heuristic"], r"not SCHEDULE:γ\[:MIN_CONFIDENCE\]"),
        (["--speculative", "heuristic:x"], r"not SCHEDULE:γ\[:MIN_CONFIDENCE\]"),
        (["--speculative", "constant:4:2"], r"min_confidence must be a finite number in \[0, 1\]"),
        (["--exit-layer", 9], r"--exit-layer: exit_layer must be an integer in \[1, 3\]"),
        (["--exit-layer", 0], r"or none \(three quarters of the depth"),  # BiLD's default layer, not half the depth
        (["--small", "{D}", "--head", "shared"], "--head chooses the exit head"),
        (["--small", "x"], "unknown model 'x'"),
        (["--eagle", "trained"], "--eagle: no shipped eagle weights fit"),
        (["--eagle", "nofile.safetensors"], r"--eagle: no such file 'nofile.safetensors' \(the EAGLE head\)"),
        (["--eagle", "trained", "--head", "shared"], "--head chooses the exit head .* drop it with --eagle"),
        (["--eagle", "trained", "--transformers"], "--eagle has no draft model"),
        (["--eagle", "trained", "--exit-layer", 2], "not allowed with argument"),
    ],
)
def test_sweep_bad_input(capsys, tiny_hf_dir, argv, message):
    argv = [str(tiny_hf_dir) if a == "{D}" else a for a in argv]
    rc, _, err = cli(capsys, "sweep", "bild", "--model", tiny_hf_dir, "--prompts", 1, "--max-new-tokens", 2, *argv)
    assert rc == 2 and "Traceback" not in err
    assert __import__("re").search(message, err.strip().splitlines()[-1]), err


def test_align_command_writes_a_head(capsys, tmp_path, tiny_hf_dir):
    out = tmp_path / "h.safetensors"
    rc, stdout, err = cli(
        capsys,
        "align",
        "--model",
        tiny_hf_dir,
        "--exit-layer",
        2,
        "--out",
        out,
        "--categories",
        "summarization",
        "--prompts",
        2,
        "--max-new-tokens",
        5,
        "--epochs",
        2,
        "--threads",
        1,
    )
    assert rc == 0, err
    assert out.is_file() and (tmp_path / "h.safetensors.calib.json").is_file() and "agreement" in stdout
    rc, _, err = cli(capsys, "align", "--model", tiny_hf_dir, "--out", out)
    assert rc == 2 and "--exit-layer E" in err
    rc, _, err = cli(capsys, "align", "--model", tiny_hf_dir, "--exit-layer", 2, "--out", tmp_path / "h.bin")
    assert rc == 2 and ".safetensors" in err
    rc, _, err = cli(capsys, "align", "--model", tiny_hf_dir, "--exit-layer", 0, "--out", out)
    assert rc == 2 and "Traceback" not in err and "none" not in err.strip().splitlines()[-1]  # align needs a layer


# -- transformers yardsticks: greedy and assisted generation on the same (shared) weights -------------
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-gqa-untied"])
def test_transformers_view_shares_our_weights_and_decodes_like_greedy(name):
    from tiny_models import random_model

    from layerleap.eval.sweep import HFRunner

    dense = random_model(name, seed=1)  # dense weights: transformers gets views of them, no copies
    ours = {t.untyped_storage().data_ptr() for t in dense.parameters()}  # fused q/k/v: views of one storage
    assert all(p.untyped_storage().data_ptr() in ours for p in HFRunner(dense).hf.parameters()), (
        "transformers copied weights"
    )
    large = random_model(name, seed=1).optimize_layout()  # packed: transformers gets dense copies
    small = random_model(name, seed=2, n_layers=1).optimize_layout()
    run = HFRunner(large, small=small)
    want = greedy(large, 12).token_ids
    assert run.generate(PROMPT, 12, assisted=False).token_ids == want
    assert run.generate(PROMPT, 12, assisted=True).token_ids == want  # lossless, as transformers promises
    early = HFRunner(large, exit_layer=1)
    assert early.generate(PROMPT, 12, assisted=True).token_ids == want


def test_sweep_with_transformers_yardsticks(capsys, tmp_path, tiny_hf_dir):
    import json

    out = tmp_path / "sweep.json"
    rc, stdout, err = cli(
        capsys,
        "sweep",
        "bild",
        "--model",
        tiny_hf_dir,
        "--exit-layer",
        2,
        "--head",
        "shared",
        "--alpha-fb",
        "1",
        "--alpha-rb",
        "inf",
        "--draft-lens",
        "none",
        "--transformers",
        "--categories",
        "translation",
        "--prompts",
        2,
        "--max-new-tokens",
        5,
        "--threads",
        1,
        "--json",
        out,
        "--plot",
        tmp_path / "s.png",
    )
    assert rc == 0, err
    s = json.loads(out.read_text())["summary"]
    assert set(s) == {"greedy", "bild fb=1 rb=inf", "transformers greedy", "transformers assisted"}
    for label in ("transformers greedy", "transformers assisted"):
        assert s[label]["identical"] == 2 and s[label]["new_tokens"] == 10, label
        assert s[label]["speedup"] > 0
    assert "| transformers assisted |" in stdout


def test_sweep_adaptive_speculative_points_without_bild(capsys, tmp_path, tiny_hf_dir):
    import json

    out = tmp_path / "sweep.json"
    rc, stdout, err = cli(
        capsys,
        "sweep",
        "bild",
        "--model",
        tiny_hf_dir,
        "--exit-layer",
        2,
        "--head",
        "shared",
        "--alpha-fb",
        "none",
        "--alpha-rb",
        "none",
        "--draft-lens",
        "2",
        "--speculative",
        "heuristic:2,constant:3:0.5",
        "--categories",
        "translation",
        "--prompts",
        2,
        "--max-new-tokens",
        6,
        "--threads",
        1,
        "--json",
        out,
    )
    assert rc == 0, err
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert set(s) == {"greedy", "speculative γ=2", "speculative heuristic γ=2", "speculative constant γ=3 conf=0.5"}
    opts = {p["label"]: p["options"] for p in rep["config"]["points"]}
    assert opts["speculative γ=2"] == {"draft_len": 2, "schedule": "constant", "min_confidence": 0.0}
    assert opts["speculative heuristic γ=2"]["schedule"] == "heuristic"
    for label in set(s) - {"greedy"}:
        assert s[label]["identical"] == 2, label  # greedy-exact
        assert s[label]["draft_len_mean"] > 0 and s[label]["tokens_per_round"] >= 1
    assert "| speculative heuristic γ=2 |" in stdout and "mean γ" in stdout


# -- a batch ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("form", ["two models", "early exit", "eagle"])
def test_a_batch_equals_its_rows_alone(form, sample):
    """Ragged prompts falling back and rolling back at different steps: each row of a batch is what
    its prompt decodes alone (sampled: seeded with seed + row), statistics included."""
    from layerleap.core.run import row_seed

    if form == "eagle":
        large, head = bigram_pair(1, eps=1.0)  # its drafts often wrong: rollbacks
        given = {"eagle": head}
    else:
        large, small = tiny_pair(1)
        given = forms(large, small)[form]
    prompts = [PROMPT, [3, 9], PROMPT[::-1] + [2, 2, 8]]
    kw = dict(given, alpha_fb=0.3, alpha_rb=1.0, max_small=6, stop_at_eos=False, do_sample=sample)
    batch = layerleap.generate(large, prompts, "bild", N, **kw, **({"seed": 4} if sample else {}))
    alone = [
        layerleap.generate(large, p, "bild", N, **kw, **({"seed": row_seed(4, i)} if sample else {}))
        for i, p in enumerate(prompts)
    ]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    for key in ("rollbacks", "rolled_back", "fallbacks", "small_tokens", "large_tokens", "layer_calls", "small_steps"):
        assert [r.stats[key] for r in batch] == [r.stats[key] for r in alone], key
    assert sum(r.stats["rollbacks"] for r in batch) >= 2


def test_eval_frontier_runs_bilds_ablations_and_calm(capsys, tmp_path, tiny_hf_dir):
    import json

    out = tmp_path / "frontier.json"
    grids = ["--grid", "base:bild", "--grid", "base:bild-no-rollback", "--grid", "base:bild-no-fallback"]
    rc, stdout, err = cli(
        capsys,
        *("eval", "frontier", "--model", tiny_hf_dir, *grids, "--grid", "base:calm", "--threads", 1),
        *("--categories", "translation", "--prompts", 2, "--max-new-tokens", 6, "--json", out, "--yes"),
    )
    assert rc == 0, err
    report = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert "partial" not in report
    groups = [s["group"] for s in report["summary"]]
    assert groups == ["greedy"] + ["bild"] * 3 + ["bild-no-rollback"] * 3 + ["bild-no-fallback"] * 3 + ["calm"] * 3
    rows = {r["label"]: r for r in report["rows"]}
    assert rows["greedy"]["identical"] == 2 and rows["greedy"]["speedup"] == 1.0
    assert all(r["n"] == 2 and r["tokens"] > 0 and r["seconds"] > 0 for r in rows.values())
    assert rows["bild-no-fallback every 3"]["options"] == {
        "eagle": "none",
        "alpha_fb": 0.0,
        "alpha_rb": 1.5,
        "max_small": 3,
    }
    assert rows["bild-no-rollback fb0.5 rb inf"]["options"]["alpha_rb"] == "inf"  # strict JSON: no Infinity


# -- the EAGLE form ----------------------------------------------------------------------------------
def bigram_pair(seed: int, eps: float = 0.3):
    """A large model whose layers add little to the residual stream (its next token is mostly a function of
    the current one) and an EAGLE head that drafts exactly that function: the head's state is the current
    token's normalised embedding.  The drafts are often the large model's own tokens, not always."""
    from layerleap.drafters import medusa_transfer

    torch.manual_seed(seed)
    large = Transformer(tiny_config(tie_embeddings=False)).eval()
    with torch.no_grad():
        large.lm_head.weight.mul_(6.0)
        for layer in large.layers:
            layer.attn.o.weight.mul_(eps)
            layer.mlp.down.weight.mul_(eps)
    head = medusa_transfer.new_drafter(large, "eagle")
    D = large.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, D:] = torch.eye(D)
        head.down.weight.zero_()
    return large, head


@pytest.mark.parametrize("width", [1, 3])
def test_eagle_form_at_or_below_ln2_gives_the_large_models_greedy_output(monkeypatch, width):
    from layerleap.methods import eagle as eagle_method

    monkeypatch.setitem(eagle_method.DEFAULT_WIDTH, "float32", width)
    kept = 0
    for seed in SEEDS:
        large, head = bigram_pair(seed)
        ref = greedy(large).token_ids
        for alpha_rb in (0.0, 0.69):
            for alpha_fb, max_small in ((0.0, 1), (0.0, 10), (0.3, None), (0.6, 3)):
                r = run_bild(large, eagle=head, alpha_fb=alpha_fb, alpha_rb=alpha_rb, max_small=max_small)
                s = r.stats
                assert r.token_ids == ref, (seed, alpha_rb, alpha_fb, max_small)
                assert s["head"] == "eagle" and s["exit_layer"] is None
                assert s["large_tokens"] + s["small_tokens"] - s["rolled_back"] == N
                assert s["large_calls"] == s["fallbacks"] + s["forced"] + s["final_checks"]
                assert s["scored_drafts"] >= s["small_tokens"] - s["rolled_back"]
                if max_small is not None:
                    assert s["small_tokens"] <= max_small * s["large_calls"]
                kept += s["small_tokens"] - s["rolled_back"]
    assert kept > 100  # the head's drafts really were kept, so the equality is not trivial


def test_eagle_form_falls_back_below_its_confidence_and_rolls_back_by_alpha_rb(monkeypatch):
    from layerleap.methods import eagle as eagle_method

    monkeypatch.setitem(eagle_method.DEFAULT_WIDTH, "float32", 1)  # chains: at alpha_rb = inf all is kept
    large, head = bigram_pair(0)
    sure = run_bild(large, eagle=head, alpha_fb=0.0, alpha_rb=0.69, max_small=10).stats
    unsure = run_bild(large, eagle=head, alpha_fb=0.99, alpha_rb=0.69, max_small=10).stats
    assert sure["fallbacks"] == 0 and unsure["fallbacks"] > 0
    assert unsure["small_tokens"] < sure["small_tokens"]
    # lenient rollback keeps at least what the strict rule keeps, and everything at alpha_rb = inf
    strict = run_bild(large, eagle=head, alpha_fb=0.0, alpha_rb=0.69, max_small=4).stats
    lenient = run_bild(large, eagle=head, alpha_fb=0.0, alpha_rb=math.inf, max_small=4).stats
    assert lenient["rolled_back"] == 0 and strict["rolled_back"] > 0


def test_eagle_form_is_the_default_only_where_a_head_ships(monkeypatch):
    from layerleap.drafters import medusa_transfer

    large, head = bigram_pair(1)
    assert run_bild(large, n=8, alpha_fb=0.0, alpha_rb=0.69).stats["head"] != "eagle"  # no shipped head
    monkeypatch.setattr(medusa_transfer, "shipped_files", lambda model, kind: ["x"] if kind == "eagle" else [])
    monkeypatch.setattr(medusa_transfer, "get_drafter", lambda model, kind, spec="trained": head)
    r = run_bild(large, n=8, alpha_fb=0.0, alpha_rb=0.69, max_small=1)
    assert r.stats["head"] == "eagle" and r.token_ids == greedy(large, 8).token_ids
    assert run_bild(large, n=8, exit_layer=2, alpha_fb=0.0).stats["exit_layer"] == 2  # a given form wins
    assert run_bild(large, n=8, eagle="none", alpha_fb=0.0).stats["head"] != "eagle"
    with pytest.raises(GenerationError, match="give one small model"):
        run_bild(large, n=8, eagle=head, exit_layer=2)
    with pytest.raises(GenerationError, match='ships an EAGLE head, .*: give eagle="none" for the early-exit form'):
        run_bild(large, n=8, head="trained", alpha_fb=0.0)
    assert run_bild(large, n=8, head="shared", eagle="none", alpha_fb=0.0).stats["head"] == "shared"  # as it says
    with pytest.raises(GenerationError, match="early-exit form: drop it with eagle="):
        run_bild(large, n=8, head="shared", eagle=head, alpha_fb=0.0)


def test_a_row_that_feeds_nothing_to_a_batch_call_is_not_counted_in_it():
    """A row whose small model is unsure at its first step takes the prompt pass's token (here its end)
    and feeds nothing to the batch's first large call, which its batch-mates' drafts make: it counts
    the one call it took part in, as alone."""
    from tiny_models import random_model

    eos = 19  # this row's first greedy token
    large = random_model("llama-gqa-tied", seed=1, eos_token_ids=(eos,))
    small = random_model("llama-gqa-tied", seed=5, eos_token_ids=(eos,))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (12, 7, 10)]
    kw = dict(small=small, alpha_fb=0.6, alpha_rb=0.5, max_small=5)
    batch = layerleap.generate(large, prompts, "bild", 12, **kw)
    alone = [layerleap.generate(large, p, "bild", 12, **kw) for p in prompts]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert batch[1].token_ids == [eos] and batch[1].stats["fallback_rate"] == 1.0  # the case in point
    assert batch[1].stats["model_calls"] > 1  # the batch made large calls after the prompt pass
    assert [r.stats["layer_calls"] for r in batch] == [r.stats["layer_calls"] for r in alone]
    assert batch[1].stats["layer_calls"] == 1


@pytest.mark.parametrize(
    "content, message",
    [
        ("[" * 100_000, "RecursionError"),  # nested past the parser's depth
        ('{"records": [1, 2]}', "is not a calibration file"),
        ('{"model": "x", "max_new_tokens": 2, "chat": true, "records": [{"output_ids": []}]}', "not a calibration"),
    ],
)
def test_a_damaged_align_calibration_file_is_a_clear_error(tmp_path, content, message):
    from tiny_models import random_model

    from layerleap.errors import LayerleapError
    from layerleap.train import align

    path = tmp_path / "calib.json"
    path.write_text(content)
    with pytest.raises(LayerleapError, match=f"{message}.*delete it"):
        align.calibrate(random_model(), ["hi"], path, max_new_tokens=2, progress=False)
