"""SkipDecode (issue 6): the schedule, exactness limits, KV bookkeeping, baselines, errors, fine-tuning."""

from __future__ import annotations

import math
import json

import pytest
import torch
from tiny_models import randomize_

import layerleap
from layerleap import GenerationError, LayerleapError, Transformer, generate, tiny_config
from layerleap.decoding import GenerationConfig, Run, drive
from layerleap.methods.skipdecode import budget_at, calm, exit_schedule, layer_ranges, skipdecode, target_config
from layerleap.core.stats import SkipStats

D = 6
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(tiny_config(n_layers=D, tie_embeddings=False)).eval()
    return randomize_(m, seed=3)


def _ids(res):
    return [r.token_ids for r in res] if isinstance(res, list) else res.token_ids


# -- the schedule ----------------------------------------------------------------------------------
def test_linear_schedule_values():
    s = exit_schedule(14, 10, 2, 12)
    assert s[0] == 12 and s[5] == 7 and s[10:] == [2, 2, 2, 2]
    assert s == [12 - n for n in range(10)] + [2] * 4


def test_default_horizon_ends_one_past_the_last_token():
    """The paper's t = (i - P) / (max_len - P) with max_len = P + max_new_tokens: the minimum falls at
    position max_len, one past the last token, so the last token fed back runs above it (docs/SKIPDECODE.md)."""
    D8 = Transformer(tiny_config(n_layers=8)).eval()
    r = generate(D8, PROMPTS[1], "skipdecode", 8, stop_at_eos=False, min_exit_layer=2, max_exit_layer=8, warmup=1)
    assert r.stats["budgets"] == (8, 7, 7, 6, 5, 4, 4)


def test_schedules_monotone_and_bounded():
    for decay in ("linear", "power"):
        for lo, hi, H in [(1, 6, 7), (10, 20, 64), (5, 7, 96), (3, 3, 5)]:
            s = exit_schedule(H + 5, H, lo, hi, decay)
            assert s[0] == hi and s[-1] == lo
            assert all(a >= b for a, b in zip(s, s[1:]))
            assert all(lo <= b <= hi for b in s)


def test_power_decay_falls_faster():
    lin = exit_schedule(64, 64, 10, 20, "linear")
    pw = exit_schedule(64, 64, 10, 20, "power", power=2.0)
    assert all(p <= q for p, q in zip(pw, lin)) and sum(pw) < sum(lin)
    assert budget_at(32, 64, 10, 20, "power", 2.0) == 13  # 10 + 10 * 0.5^2 = 12.5, rounded half up
    assert budget_at(32, 64, 10, 20, "power", 3.0) == 11  # 10 + 1.25


def test_layer_ranges():
    assert layer_ranges(8, 5, 1) == [(0, 1), (4, 8)]
    assert layer_ranges(8, 8, 1) == [(0, 8)]
    assert layer_ranges(8, 3, 0) == [(5, 8)]
    assert layer_ranges(8, 2, 2) == [(0, 2)]


def test_table2_configs():
    for s, (lo, hi) in {2: (10, 20), 3: (7, 13), 4: (6, 9), 5: (5, 7)}.items():
        c = target_config(30, s)
        assert (c.warmup, c.min_exit_layer, c.max_exit_layer) == (1, lo, hi)
        assert abs(30 / ((lo + hi) / 2) - s) < 0.25
    assert target_config(24, 3).options() == {"warmup": 1, "min_exit_layer": 6, "max_exit_layer": 10}


# -- exactness limits ------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [1, 0])
def test_full_budget_equals_greedy(model, warmup):
    g1 = generate(model, PROMPTS[0], "greedy", 16, stop_at_eos=False)
    s1 = generate(
        model, PROMPTS[0], "skipdecode", 16, stop_at_eos=False, min_exit_layer=D, max_exit_layer=D, warmup=warmup
    )
    assert s1.token_ids == g1.token_ids
    gb = generate(model, PROMPTS, "greedy", 16, stop_at_eos=False)
    sb = generate(
        model, PROMPTS, "skipdecode", 16, stop_at_eos=False, min_exit_layer=D, max_exit_layer=D, warmup=warmup
    )
    assert _ids(sb) == _ids(gb)
    # and batching different-length prompts changes nothing against one at a time
    assert _ids(gb) == [generate(model, p, "greedy", 16, stop_at_eos=False).token_ids for p in PROMPTS]


def test_skipping_changes_output_and_counts(model):
    g = generate(model, PROMPTS, "greedy", 20, stop_at_eos=False)
    s = generate(model, PROMPTS, "skipdecode", 20, stop_at_eos=False, min_exit_layer=2, max_exit_layer=5)
    assert _ids(s) != _ids(g)  # the policy really skips (random weights: every layer matters)
    sched = exit_schedule(19, 20, 2, 5)
    for r in s:
        assert list(r.stats["budgets"]) == sched
        assert r.stats["layer_evals"] == D + sum(sched)  # first token: the prompt's last position, all layers
        assert r.stats["avg_active_layers"] == pytest.approx((D + sum(sched)) / 20)
        assert r.stats["budget_speedup"] == pytest.approx(D / r.stats["avg_active_layers"])
        assert r.stats["model_calls"] == 20


def test_batched_skipdecode_equals_one_at_a_time(model):
    """The budget depends only on the generated position, so a batch equals its rows decoded alone
    (with max_len fixed relative to each prompt: the horizon is the same 16)."""
    batch = generate(model, PROMPTS, "skipdecode", 16, stop_at_eos=False, min_exit_layer=2, max_exit_layer=6)
    alone = [
        generate(model, p, "skipdecode", 16, stop_at_eos=False, min_exit_layer=2, max_exit_layer=6) for p in PROMPTS
    ]
    assert _ids(batch) == _ids(alone)


def _run(model, prompts, max_new, fn, **opts):
    run = Run(model, prompts, GenerationConfig(max_new_tokens=max_new, stop_at_eos=False))
    caches = []
    orig = run.new_cache
    run.new_cache = lambda extra=0: caches.append(orig(extra)) or caches[-1]
    drive(fn, run, **opts)
    return run, caches[0]


def test_kv_lengths_per_layer(model):
    run, cache = _run(model, PROMPTS, 12, skipdecode, min_exit_layer=2, max_exit_layer=5, warmup=1)
    budgets = run.records[SkipStats][0].budgets
    longest = max(map(len, PROMPTS))
    for layer in range(D):
        ran = sum(1 for b in budgets if any(s <= layer < e for s, e in layer_ranges(D, b, 1)))
        assert cache.lengths[layer].tolist() == [longest + ran] * len(PROMPTS)
    # every layer a token ran had all earlier tokens: the layers that ran at step n ran at every step < n
    sets = [{layer for s, e in layer_ranges(D, b, 1) for layer in range(s, e)} for b in budgets]
    assert all(later <= earlier for earlier, later in zip(sets, sets[1:]))


def test_matches_full_sequence_recomputation(model):
    """Decoding with the cache equals the training-time skip forward over the whole sequence (no cache)."""
    from layerleap.train.skipdecode import TrainConfig, active_mask, position_budgets, skip_logits

    p = PROMPTS[0]
    r = generate(model, p, "skipdecode", 14, stop_at_eos=False, min_exit_layer=2, max_exit_layer=5, warmup=1)
    seq = p + r.token_ids
    cfg = TrainConfig(min_exit_layer=2, max_exit_layer=5, warmup=1, gen_len=14).resolve(D)
    bud = torch.tensor([position_budgets(D, len(seq), len(p), cfg)])
    with torch.no_grad():
        logits = skip_logits(model, torch.tensor([seq]), active_mask(D, bud, 1))
    assert logits[0, len(p) - 1 : -1].argmax(-1).tolist() == r.token_ids


# -- baselines -------------------------------------------------------------------------------------
def test_early_exit(model):
    g = generate(model, PROMPTS, "greedy", 12, stop_at_eos=False)
    e = generate(model, PROMPTS, "early-exit", 12, stop_at_eos=False, exit_layer=D)
    assert _ids(e) == _ids(g)
    e3 = generate(model, PROMPTS, "early-exit", 12, stop_at_eos=False, exit_layer=3)
    assert _ids(e3) != _ids(g)
    assert all(r.stats["layer_evals"] == 3 * 12 and r.stats["avg_active_layers"] == 3 for r in e3)
    with pytest.raises(GenerationError, match="exit_layer"):
        generate(model, PROMPTS[0], "early-exit", 4)
    with pytest.raises(GenerationError, match="exit_layer"):
        generate(model, PROMPTS[0], "early-exit", 4, exit_layer=D + 1)


def test_calm_never_exiting_equals_greedy(model):
    g = generate(model, PROMPTS, "greedy", 12, stop_at_eos=False)
    c = [generate(model, p, "calm", 12, stop_at_eos=False, threshold=1.5) for p in PROMPTS]  # calm does not batch
    assert _ids(c) == _ids(g)
    assert all(set(r.stats["exit_layers"]) == {D} and r.stats["kv_filled_layers"] == 0 for r in c)


def test_calm_compares_its_threshold_with_an_exact_cosine_in_bfloat16():
    """Layers that turn the state by a cosine of about 0.998-0.999 (a bf16 cosine rounds those to 1.0
    or 0.996): a threshold of 0.9999 is never reached, so CALM decodes bf16 greedy's tokens with
    every layer."""
    torch.manual_seed(0)
    m = randomize_(Transformer(tiny_config(n_layers=4, n_kv_heads=4, tie_embeddings=False)).eval(), seed=11, scale=2.0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.down.weight")):
                p.mul_(0.02)  # small residual updates: consecutive states nearly parallel
    m = m.requires_grad_(False).to(torch.bfloat16)
    r = generate(m, PROMPTS[0], "calm", 8, stop_at_eos=False, threshold=0.9999)
    assert set(r.stats["exit_layers"]) == {4}
    assert r.token_ids == generate(m, PROMPTS[0], "greedy", 8, stop_at_eos=False).token_ids
    assert set(generate(m, PROMPTS[0], "calm", 8, stop_at_eos=False, threshold=0.99).stats["exit_layers"]) == {1}


def test_calm_exits_and_fills_kv(model):
    run, cache = _run(model, [PROMPTS[0]], 10, calm, threshold=-1.0, min_exit_layer=2)
    assert set(run.records[SkipStats][0].exit_layers) == {2}
    assert run.records[SkipStats][0].kv_filled_layers == 9 * (D - 2)
    assert run.layer_evals[0] == D + 9 * 2
    assert cache.lengths[:, 0].tolist() == [len(PROMPTS[0]) + 9] * D  # skipped layers were filled


@pytest.mark.parametrize("threshold, min_exit, first", [(1.5, 1, D), (1.01, 4, D), (0.999, 4, 3), (-1.0, 1, 0)])
def test_calm_runs_the_layers_before_its_first_check_in_one_call(model, monkeypatch, threshold, min_exit, first):
    """A token can exit after layer ``min_exit_layer`` at the earliest, so the layers before it run in
    one call (all of them for a threshold no cosine reaches: greedy's cost); one model call a token."""
    ranges = []
    real = model.run_layers
    monkeypatch.setattr(model, "run_layers", lambda h, a, b, *r, **k: ranges.append((a, b)) or real(h, a, b, *r, **k))
    run, _ = _run(model, [PROMPTS[0]], 5, calm, threshold=threshold, min_exit_layer=min_exit)
    after_prefill = ranges[1:]
    starts = [i for i, (a, _) in enumerate(after_prefill) if a == 0]
    assert len(starts) == 4  # 4 tokens after the prompt's
    for i in starts:
        assert after_prefill[i] == ((0, first) if first else (0, 1))
    assert run.model_calls == 1 + 4
    assert run.layer_calls[0] == len(ranges)  # every call over a range of layers, the prompt's included
    checks = sum(1 for a, b in after_prefill if a >= first and b == a + 1 < D)  # a check after each such layer
    assert run.records[SkipStats][0].exit_checks == checks


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(min_exit_layer=5, max_exit_layer=3), "must\nnot rise|not rise"),
        (dict(min_exit_layer=0, max_exit_layer=3), r"\[1, 6\]"),
        (dict(min_exit_layer=2, max_exit_layer=D + 1), r"\[1, 6\]"),
        (dict(min_exit_layer=2, max_exit_layer=4, warmup=3), "warmup"),
        (dict(schedule=[5, 4, 5, 3]), "not monotone"),
        (dict(schedule=[7, 3]), r"schedule must be a list of integers in \[1, 6\]"),
        (dict(decay="cubic"), "decay"),
        (dict(max_len=3), "max_len"),
        (dict(schedule=[5, 4], target_speedup=2.0), "so target_speedup would be ignored .* drop target_speedup"),
        (dict(schedule=[5, 4], min_exit_layer=2, max_len=9), "so min_exit_layer, max_len would be ignored"),
        (dict(schedule=[5, 4], decay="power", power=3.0), "so power, decay would be ignored"),
        (dict(target_speedup=2.0, min_exit_layer=2, max_exit_layer=4), "drop target_speedup or one of them"),
        (dict(power=3.0), "power is the exponent of decay='power', and decay is 'linear': add decay='power'"),
        (dict(power=2.0, decay="linear"), "add decay='power'"),
    ],
)
def test_bad_budgets(model, opts, match):
    with pytest.raises(GenerationError, match=match):
        generate(model, PROMPTS, "skipdecode", 8, **opts)


def test_the_decays_options_that_go_together(model):
    kw = dict(stop_at_eos=False, min_exit_layer=2, max_exit_layer=5)
    default = generate(model, PROMPTS[0], "skipdecode", 8, **kw, decay="power").stats["budgets"]
    assert generate(model, PROMPTS[0], "skipdecode", 8, **kw, decay="power", power=2.0).stats["budgets"] == default
    assert generate(model, PROMPTS[0], "skipdecode", 8, **kw, decay="power", power=0.5).stats["budgets"] != default
    one = generate(model, PROMPTS[0], "skipdecode", 8, stop_at_eos=False, target_speedup=2.0, min_exit_layer=1)
    hi = target_config(D, 2.0).max_exit_layer  # the one exit layer not given comes from target_speedup
    both = generate(model, PROMPTS[0], "skipdecode", 8, stop_at_eos=False, min_exit_layer=1, max_exit_layer=hi)
    assert one.stats["budgets"] == both.stats["budgets"] and hi > 2


@pytest.mark.parametrize("given,lo,hi", [(dict(max_exit_layer=1), 1, 1), (dict(min_exit_layer=5), 5, 5)])
def test_one_exit_layer_given_bounds_the_other(model, given, lo, hi):
    """The exit layer not given comes from the default target, kept within the one given: one beyond
    the target's range is not refused as if the budgets rose."""
    assert target_config(D, 2).min_exit_layer > 1 and target_config(D, 2).max_exit_layer < 5
    r = generate(model, PROMPTS[0], "skipdecode", 6, stop_at_eos=False, **given)
    assert max(r.stats["budgets"]) == hi and min(r.stats["budgets"]) == lo


@pytest.mark.parametrize("given,lo,hi", [(dict(max_exit_layer=1), 1, 1), (dict(min_exit_layer=5), 5, 5)])
def test_finetune_completes_one_exit_layer_as_decoding_does(given, lo, hi):
    """Fine-tuning trains the policy decoding runs: an exit layer given alone takes the other from the
    target within it, instead of being refused with "min_exit_layer > max_exit_layer: swap them"."""
    from layerleap.train.skipdecode import TrainConfig

    cfg = TrainConfig(**given).resolve(D)
    assert (cfg.min_exit_layer, cfg.max_exit_layer) == (lo, hi)


@pytest.mark.filterwarnings("ignore:skipdecode. no calibration")
def test_default_budgets_on_a_one_layer_model():
    torch.manual_seed(0)
    one = randomize_(Transformer(tiny_config(n_layers=1, tie_embeddings=False)).eval(), seed=3)
    r = generate(one, PROMPTS[0], "skipdecode", 4, stop_at_eos=False)
    assert r.token_ids == generate(one, PROMPTS[0], "greedy", 4, stop_at_eos=False).token_ids
    assert set(r.stats["budgets"]) == {1}


def test_explicit_schedule(model):
    r = generate(model, PROMPTS[0], "skipdecode", 6, stop_at_eos=False, schedule=[6, 5, 3])
    assert list(r.stats["budgets"]) == [6, 5, 3, 3, 3]  # the last budget holds


def test_batch_over_context(model):
    long = [3 + i % 90 for i in range(250)]
    with pytest.raises(GenerationError, match="context"):
        generate(model, [PROMPTS[0], long], "skipdecode", 10)
    with pytest.raises(LayerleapError, match="context"):
        generate(model, [PROMPTS[0], long], "skipdecode", 6, max_len=400)


# -- fine-tuning -----------------------------------------------------------------------------------
def test_finetune_saves_resumes_reloads(tiny_hf_dir, tmp_path):
    from layerleap.train.skipdecode import STATE_JSON, TrainConfig, finetune

    g = torch.Generator().manual_seed(1)
    examples = [
        (torch.randint(3, 500, (int(n),), generator=g).tolist(), torch.randint(3, 500, (10,), generator=g).tolist())
        for n in torch.randint(4, 12, (8,), generator=g)
    ]
    cfg = dict(min_exit_layer=2, max_exit_layer=3, warmup=1, batch_size=2, lr=1e-2, gen_len=10, save_every=1, seed=0)
    base = layerleap.load(str(tiny_hf_dir))
    teacher = layerleap.load(str(tiny_hf_dir))

    m = layerleap.load(str(tiny_hf_dir))
    r = finetune(m, tmp_path / "a", TrainConfig(steps=2, **cfg), examples, teacher, progress=False)
    assert r.steps_done == 2 and r.resumed_from == 0 and len(r.losses) == 2
    st = json.loads((tmp_path / "a" / STATE_JSON).read_text())
    assert st["step"] == 2 and not list((tmp_path / "a").glob(".*tmp*"))
    assert not list((tmp_path / "a").glob("*.bin")) and not list((tmp_path / "a").glob("*.pt"))
    reloaded = layerleap.load(str(tmp_path / "a"))
    want = m.dense_state()
    for k, v in reloaded.dense_state().items():
        assert torch.equal(v, want[k]), k
    assert not torch.equal(reloaded.layers[1].mlp.down.dense_weight(), base.layers[1].mlp.down.dense_weight())
    assert torch.equal(reloaded.tok_embeddings.weight, base.tok_embeddings.weight)  # head/embedding frozen

    # resume to 3 steps == 3 steps straight (deterministic for the seed, optimizer state restored)
    m2 = layerleap.load(str(tiny_hf_dir))
    r2 = finetune(m2, tmp_path / "a", TrainConfig(steps=3, **cfg), examples, teacher, progress=False)
    assert r2.resumed_from == 2 and len(r2.losses) == 3
    m3 = layerleap.load(str(tiny_hf_dir))
    r3 = finetune(m3, tmp_path / "b", TrainConfig(steps=3, **cfg), examples, teacher, progress=False)
    assert r3.losses == pytest.approx(r2.losses, rel=1e-5)
    for (k, v), (_, w) in zip(m2.state_dict().items(), m3.state_dict().items()):
        assert torch.allclose(v, w, atol=1e-6), k

    # another configuration in the same folder is refused; the model decodes with the policy
    with pytest.raises(LayerleapError, match="other settings"):
        finetune(
            layerleap.load(str(tiny_hf_dir)),
            tmp_path / "a",
            TrainConfig(steps=4, **{**cfg, "lr": 1e-3}),
            examples,
            teacher,
            progress=False,
        )
    out = generate(reloaded, "Hello there", "skipdecode", 5, min_exit_layer=2, max_exit_layer=3)
    assert out.stats["new_tokens"] >= 1


def test_finetune_resume_refuses_another_base_model_or_other_examples(tmp_path):
    from tiny_models import random_model

    from layerleap.train.skipdecode import TrainConfig, finetune

    examples = [([3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), ([5, 6], [7, 8, 9, 10, 11, 12]), ([9, 3, 4], [5, 6, 7, 8, 9, 3])]
    cfg = dict(min_exit_layer=2, max_exit_layer=3, warmup=1, batch_size=2, lr=1e-2, gen_len=6, save_every=1)

    def run(steps, seed=0, ex=examples):
        model, teacher = random_model("llama-gqa-tied", seed=seed), random_model("llama-gqa-tied", seed=seed)
        return finetune(model, tmp_path / "a", TrainConfig(steps=steps, **cfg), ex, teacher, progress=False)

    run(1)
    with pytest.raises(LayerleapError, match="another base model"):
        run(2, seed=1)
    with pytest.raises(LayerleapError, match="other training examples"):
        run(2, ex=examples[:2] + [([3, 3], [4, 4, 4, 4, 4, 4])])
    assert run(2).resumed_from == 1


def test_cli_rejects_bad_targets(capsys):
    from layerleap.cli import main

    assert main(["eval", "skipdecode", "--targets", "7"]) == 2
    assert "--targets" in capsys.readouterr().err


def test_rouge_lsum_and_compare():
    from layerleap.eval import quality as ev

    assert ev.split_sentences("A b. C d!\nE") == ["A b.", "C d!", "E"]
    assert ev.rouge_lsum(["the cat sat. a dog ran."], ["the cat sat. a dog ran."]) == pytest.approx(100.0)
    c = ev.compare(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert 0 < c["rougeL"] < 100 and 0 < c["bleu"] < 100 and c["n"] == 1


def test_frontier_grids_hold_table2_points_and_bilds_ablations():
    from layerleap.commands.skipdecode import _grids

    g = _grids(30)
    sd = {label: o for label, o in g["skipdecode"]}
    assert sd["10-20 w1"] == {"min_exit_layer": 10, "max_exit_layer": 20, "warmup": 1}  # Table 2, 2x
    assert sd["7-13 w1"] == {"min_exit_layer": 7, "max_exit_layer": 13, "warmup": 1}  # Table 2, 3x
    assert [o["exit_layer"] for _, o in g["early-exit"]] == [28, 24, 15, 10]
    full, no_rb, no_fb = g["bild"], g["bild-no-rollback"], g["bild-no-fallback"]
    assert [o["alpha_fb"] for _, o in no_rb] == [o["alpha_fb"] for _, o in full]  # the same fallback thresholds
    assert all(o["alpha_rb"] == math.inf for _, o in no_rb)
    assert all(o["alpha_fb"] == 0 and o["alpha_rb"] == 1.5 and 3 <= o["max_small"] <= 10 for _, o in no_fb)
    assert all(o["eagle"] == "none" for _, o in full + no_rb + no_fb)  # the early-exit form, as the paper's
    for d in (2, 4):  # tiny models: only layers that exist
        g = _grids(d)
        assert all(1 <= o["exit_layer"] < d for _, o in g["early-exit"])
        assert all(1 <= o["warmup"] <= o["min_exit_layer"] <= o["max_exit_layer"] <= d for _, o in g["skipdecode"])


def test_frontier_summary_gives_the_speed_up_per_generated_token():
    from layerleap.eval import frontier

    row = {"label": "p", "model": "m", "method": "calm", "options": {}, "score_share": 1.0, "ppl_ratio": 1.0}
    row |= {"agreement": 100.0, "layers_per_token": 15.0, "n_layers": 30, "category": "qa", "score": 1.0}
    row |= {"seconds": 1.0, "tokens": 4, "greedy_seconds": 2.0, "greedy_tokens": 10}
    (s,) = frontier.summary([row])
    assert s["speedup"] == 2.0  # summed times: the point stopped sooner
    assert s["speedup_per_token"] == pytest.approx((2.0 / 10) / (1.0 / 4))  # slower per token


def test_the_frontier_drops_a_point_as_fast_but_worse_or_as_good_but_slower():
    from layerleap.eval import frontier

    def line(label, speed, quality):
        return {"label": label, "speedup": speed, "quality": quality}

    lines = [line("a", 1.5, 90), line("b", 1.5, 80), line("c", 1.0, 95), line("d", 2.0, 50), line("e", 1.2, 90)]
    assert frontier.frontier(lines) == ["a", "c", "d"]  # b: as fast as a, worse; e: as good as a, slower
    same = [line("x", 1.0, 70), line("y", 1.0, 99), line("z", 1.0, 99)]  # all equal speeds: the best, ties kept
    assert frontier.frontier(same) == ["y", "z"]
    assert frontier.frontier([line("only", 1.3, 80)]) == ["only"]
    assert frontier.best_at(same, 0.95)["label"] == "y"


def test_eval_skipdecode_speed_runs_and_writes_its_table(char_model_dir, tmp_path, capsys):
    from layerleap.cli import main

    out = tmp_path / "speed.json"
    argv = ["eval", "skipdecode-speed", "--model", str(char_model_dir), "--targets", "2", "--categories", "qa"]
    argv += ["--batch-sizes", "1,2", "--repeats", "1", "--max-new-tokens", "4", "--json", str(out)]
    assert main(argv) == 0  # was AttributeError: the run count had taken the runs list's name
    report = json.loads(out.read_text())
    assert {r["batch"] for r in report["runs"]} == {1, 2} and {r["label"] for r in report["runs"]} == {
        "greedy",
        "skipdecode 2x",
    }
    assert "| 2 | skipdecode 2x |" in capsys.readouterr().out
