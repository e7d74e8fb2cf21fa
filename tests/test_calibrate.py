"""Quality budgets: Learn-then-Test calibration of the lossy methods, calibration files, generate(quality=...)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import layerleap
from layerleap.core.run import GenerationError
from layerleap.datasets import Prompt, spec_bench
from layerleap.eval import calibrate as C
from layerleap.eval import step_cost as SC
from layerleap.methods import budget
from layerleap.methods.skipdecode import NEVER_SATURATES
from tiny_models import full_logits, random_model

PROMPTS = [
    Prompt(i, cat, text, ref)
    for i, (cat, text, ref) in enumerate(
        [
            ("translation", "Translate: guten tag", "good day"),
            ("math_reasoning", "2 plus 3?", "#### 5"),
            ("qa", "why blue?", None),
            ("summarization", "sum: a b c d e", "a b c"),
        ]
    )
]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def char_model(char_model_dir):
    return layerleap.load(str(char_model_dir))


def test_binomial_p_value_and_min_prompts():
    assert C.binomial_p_value(0, 22, 0.1) == pytest.approx(0.9**22)
    assert C.binomial_p_value(1, 10, 0.2) == pytest.approx(0.8**10 + 10 * 0.2 * 0.8**9)
    assert C.binomial_p_value(10, 10, 0.3) == pytest.approx(1.0)
    assert C.min_prompts(0.1, 0.1) == 22 and 0.9**22 <= 0.1 < 0.9**21


# q4-like prices (ms) of a 30-layer model: a one-layer call costs about 60% of its layer's pass
PRICES = SC.StepCost(n_layers=30, step=6.0, layer=0.16, call=0.1, check=0.03, head=1.1, fill=0.12)


def _setting(i, cost, losses, n=30, calls=1.0, checks=0.0, prices=PRICES):
    s = C.Setting(i, {"k": i}, [], layer_passes=cost, losses=losses, calls=calls, checks=checks)
    s.p_value = C.binomial_p_value(losses, n, 0.1)
    s.modelled_speedup = prices.speedup(**s.counts())
    return s


def test_fixed_sequence_stops_at_the_first_failure_and_chooses_the_cheapest_valid():
    settings = [_setting(0, 30, 0), _setting(1, 25, 0), _setting(2, 28, 0), _setting(3, 20, 9), _setting(4, 10, 0)]
    valid = C.learn_then_test(settings, 0.1)
    assert [s.index for s in valid] == [0, 1, 2]  # setting 4 passes alone but comes after a failure
    assert C.choose(settings).index == 1
    assert C.faster_than_greedy(C.choose(settings))


def test_step_cost_prices_calls_checks_heads_and_fills_beside_layer_passes():
    assert PRICES.speedup(30) == 1.0  # greedy's own counts: exactly its step
    assert PRICES.token_ms(28, calls=2) == pytest.approx(6.0 - 2 * 0.16 + 0.1)
    assert PRICES.token_ms(30, calls=12, checks=11) == pytest.approx(6.0 + 11 * 0.1 + 11 * 0.03)
    assert PRICES.token_ms(20, heads=3, filled=10) == pytest.approx(6.0 - 10 * 0.16 + 2 * 1.1 + 10 * 0.12)
    layers = SC.layers_only(30)
    assert layers.speedup(24, calls=7, checks=6) == pytest.approx(30 / 24)  # the layer-pass model
    assert SC.StepCost.from_dict(PRICES.to_dict()) == PRICES


def test_a_setting_that_saves_layers_but_adds_calls_is_not_chosen_over_the_first():
    """CALM at a threshold it rarely reaches: 0.01 layer passes fewer a token, but 11 one-layer calls
    and checks more; priced as measured it is slower than greedy's own setting, which is kept."""
    rare = dict(calls=12.0, checks=11.0)
    settings = [_setting(0, 30, 0), _setting(1, 29.99, 0, **rare), _setting(2, 29.9, 0, **rare), _setting(3, 28, 9)]
    C.learn_then_test(settings, 0.1)
    assert settings[1].modelled_speedup < 0.85 and settings[2].modelled_speedup < 0.85
    assert C.choose(settings).index == 0 and not C.faster_than_greedy(C.choose(settings))
    # by layer passes alone, the slow setting would have won
    old = [
        _setting(j, s.layer_passes, s.losses, calls=s.calls, checks=s.checks, prices=SC.layers_only(30))
        for j, s in enumerate(settings)
    ]
    C.learn_then_test(old, 0.1)
    assert C.choose(old).index == 2 and C.faster_than_greedy(C.choose(old))
    # a setting that saves more than its calls cost is chosen, and said to be faster
    settings.insert(3, _setting(3, 22, 0, calls=9, checks=8))
    C.learn_then_test(settings, 0.1)
    assert C.choose(settings).index == 3 and C.faster_than_greedy(settings[3])


def test_step_cost_measures_nonnegative_prices(char_model):
    cost = SC.measure(char_model, context=16, rounds=2)
    assert cost.n_layers == char_model.config.n_layers and cost.step > 0
    assert all(math.isfinite(v) and v >= 0 for v in (cost.layer, cost.call, cost.check, cost.head, cost.fill))
    assert cost.speedup(cost.n_layers) == 1.0


def test_step_counts_of_greedy_and_of_calm_checking_every_layer(char_model):
    d, n = char_model.config.n_layers, 5
    g = layerleap.generate(char_model, "hi", "greedy", n, chat=True, stop_at_eos=False)
    greedy_counts = {"calls": 1.0, "checks": 0.0, "heads": 1.0, "filled": 0.0, "rows": 0.0, "drafts": 0.0}
    assert C.step_counts(g.stats) == greedy_counts
    # a threshold no cosine reaches that still checks: layers [0, 1) in one call, then one call per layer
    c = layerleap.generate(
        char_model, "hi", "calm", n, chat=True, stop_at_eos=False, threshold=NEVER_SATURATES, min_exit_layer=2
    )
    assert c.token_ids == g.token_ids
    counts = C.step_counts(c.stats)
    assert counts["calls"] == pytest.approx((1 + (n - 1) * (1 + d - 1)) / n)  # the prompt's call, then 1 + (d - 1)
    assert counts["checks"] == pytest.approx((n - 1) * (d - 2) / n) and counts["filled"] == 0.0


def _out(text, ppl=2.0, ref=None, agree=None):
    return C.Output(text, [], 1.0, 0.1, ppl, ref, agree)


def test_kept_checks_reference_agreement_and_perplexity():
    g = _out("g", ppl=2.0, ref=0.4)
    assert C.kept(_out("m", ppl=2.9, ref=0.39), g, 0.95, 1.5)
    assert not C.kept(_out("m", ppl=2.9, ref=0.37), g, 0.95, 1.5)  # below 95% of greedy's score
    assert not C.kept(_out("m", ppl=3.1, ref=0.5), g, 0.95, 1.5)  # unreadable: perplexity 1.55x greedy's
    assert not C.kept(_out("m", ppl=float("nan"), ref=0.5), g, 0.95, 1.5)  # a perplexity no one can read
    g0 = _out("g", ref=0.0)  # greedy scores nothing on the reference: agreement decides
    assert C.kept(_out("m", ref=0.0, agree=0.96), g0, 0.95, 1.5)
    assert not C.kept(_out("m", ref=0.0, agree=0.9), g0, 0.95, 1.5)


def test_perplexity_matches_a_plain_forward():
    model = random_model()
    prompt, ids = [3, 5, 7, 11], [13, 17, 19]
    logits = full_logits(model, prompt + ids)  # [S, V]
    nll = torch.nn.functional.cross_entropy(logits[len(prompt) - 1 : -1], torch.tensor(ids))
    assert C.perplexity(model, prompt, ids) == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_reference_scores():
    assert C.reference_score("math_reasoning", "so the answer is 5", "... #### 5") == 1.0
    assert C.reference_score("math_reasoning", "the answer is 6", "#### 5") == 0.0
    assert C.reference_score("summarization", "a b c", "a b c") == pytest.approx(1.0)
    assert 0 < C.reference_score("translation", "good day to you", "good day to you all") < 1
    assert C.agreement("same words here", "same words here") == pytest.approx(1.0)


def test_splits_are_disjoint_from_the_tables():
    cal = C.split_prompts("calibration", 20)
    hold = C.split_prompts("holdout", 20)
    tables = spec_bench(None, list(C.CATEGORIES), C.TABLE_PROMPTS)
    ids = [{p.id for p in s} for s in (cal, hold, tables)]
    assert all(len(s) == 60 for s in ids[:2]) and len(ids[2]) == 120
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert all(p.reference for p in cal + hold)


def test_calibrate_end_to_end_writes_a_file_generate_reads(char_model, cache, tmp_path):
    report = tmp_path / "run.json"
    cal = C.calibrate(
        char_model,
        "early-exit",
        0.95,
        prompts=PROMPTS,
        max_new_tokens=6,
        epsilon=0.5,
        delta=0.5,
        report=report,
        extra=1,
    )
    d = char_model.config.n_layers
    first = cal.settings[0]
    assert first.options == {"exit_layer": d} and first.losses == 0 and first.valid
    assert first.layer_passes == pytest.approx(d) and first.calls == 1.0 and first.modelled_speedup == 1.0
    chosen = cal.chosen
    assert chosen is not None and chosen.valid
    stop = next((s for s in cal.settings if not s.valid), None)
    if stop is not None:  # the walk stopped at a failure and measured `extra` more settings untested
        assert stop.p_value > 0.5
        assert all(not s.tested for s in cal.settings[stop.index + 1 :])
    path = C.write_calibration(cal)
    assert path == budget.calibration_path(char_model.fingerprint, "float32", "early-exit")
    data = json.loads(path.read_text())
    entry = data["budgets"]["0.95"]
    assert entry["chosen"]["options"] == chosen.options and "probability" in entry["guarantee"]
    assert SC.StepCost.from_dict(entry["config"]["step_cost"]).n_layers == d  # the prices it was modelled with
    assert entry["config"]["threads"] == torch.get_num_threads() and entry["config"]["cpu"]  # and what priced them
    assert entry["faster_than_greedy"] == (round(entry["chosen"]["modelled_speedup"], 3) > 1)
    # generate(quality=...) runs the chosen setting and says which
    r = layerleap.generate(char_model, "hi", "early-exit", 4, chat=True, quality=0.95)
    ref = layerleap.generate(char_model, "hi", "early-exit", 4, chat=True, **chosen.options)
    assert r.token_ids == ref.token_ids and r.stats["quality_budget"]["options"] == chosen.options
    # the method's defaults are the calibrated setting at 0.95
    assert layerleap.generate(char_model, "hi", "early-exit", 4, chat=True).token_ids == ref.token_ids
    # a rerun resumes from the report without decoding again
    again = C.calibrate(
        char_model,
        "early-exit",
        0.95,
        prompts=PROMPTS,
        max_new_tokens=6,
        epsilon=0.5,
        delta=0.5,
        report=report,
        extra=1,
    )
    assert [s.options for s in again.settings] == [s.options for s in cal.settings]
    assert [o.text for o in again.greedy] == [o.text for o in cal.greedy]


def test_quality_errors_name_the_fix(char_model, cache):
    with pytest.raises(GenerationError) as e:
        layerleap.generate(char_model, "hi", "calm", 2, chat=True, quality=0.9)
    # the model's own folder: without --model the command calibrates the default model
    assert f"run `layerleap calibrate calm --model {char_model.source} --quality 0.9 --dtype float32`" in str(e.value)
    with pytest.raises(GenerationError, match="no quality budget"):
        layerleap.generate(char_model, "hi", "greedy", 2, chat=True, quality=0.9)
    with pytest.raises(GenerationError, match=r"quality must be .* \(0, 1\]"):
        layerleap.generate(char_model, "hi", "skipdecode", 2, chat=True, quality=1.5)
    for bad in (math.nan, 10**400, -(10**400)):  # an int past float's range too (math.isnan(10**400) overflows)
        with pytest.raises(GenerationError, match=r"quality must be .* \(0, 1\]"):
            layerleap.generate(char_model, "hi", "skipdecode", 2, chat=True, quality=bad)
    with pytest.raises(GenerationError, match="give 0.95 or 0.96"):  # a 0.95 calibration would not certify it
        layerleap.generate(char_model, "hi", "skipdecode", 2, chat=True, quality=0.954)
    with pytest.raises(C.CalibrationError, match="at least 22"):
        C.calibrate(char_model, "calm", prompts=PROMPTS, max_new_tokens=2)


def _write(model, method, options, fast, quality="0.95", config=None):
    path = budget.calibration_path(model.fingerprint, model.dtype_name, method)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"chosen": {"options": options, "modelled_speedup": 1.0}, "faster_than_greedy": fast}
    path.write_text(json.dumps({"budgets": {quality: {**entry, **({"config": config} if config else {})}}}))
    return path


DAMAGED_BUDGETS = {
    "budget not an object": ([], "holds JSON list, not an object"),
    "speedup not a number": (
        {"chosen": {"options": {"threshold": 1.01, "min_exit_layer": 1}, "modelled_speedup": "fast"}},
        "has the modelled speedup 'fast', not a positive number",
    ),
    "speedup null": (
        {"chosen": {"options": {"threshold": 1.01, "min_exit_layer": 1}, "modelled_speedup": None}},
        "has the modelled speedup None, not a positive number",
    ),
    "fallback options not an object": ({"chosen": None, "settings": [{"options": [1, 2]}]}, "has options list"),
    "an option calibration never sets": ({"chosen": {"options": {"bogus": 1}}}, "sets bogus, which calm's"),
}


@pytest.mark.parametrize("damage", DAMAGED_BUDGETS)
def test_a_damaged_calibration_file_is_one_line_naming_it(char_model, cache, damage):
    """A calibration file in the cache whose budget is damaged (hand-edited, another tool's) is refused in
    one line naming the file and the fix, whether the budget is asked for or is the default's."""
    entry, what = DAMAGED_BUDGETS[damage]
    path = budget.calibration_path(char_model.fingerprint, char_model.dtype_name, "calm")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"budgets": {"0.95": entry}}))
    for quality in (0.95, None):
        with pytest.raises(layerleap.LayerleapError) as e:
            layerleap.generate(char_model, "hi", "calm", 2, quality=quality)
        assert str(e.value).startswith(f"calibration file {path}: budget 0.95 ") and what in str(e.value)
        assert str(e.value).endswith("delete it and run layerleap calibrate again")
    path.write_text("[" * 100_000)  # nested past the JSON parser's depth
    with pytest.raises(
        layerleap.LayerleapError,
        match="is not valid JSON .RecursionError: .*: delete it and run layerleap calibrate again",
    ):
        layerleap.generate(char_model, "hi", "calm", 2, quality=0.95)


def test_a_calibration_priced_on_another_machine_says_so_once_per_file(char_model, cache):
    """A calibration whose settings were priced on another CPU model or thread count is still used, with
    one warning per file in the process naming what differs and the command that calibrates here."""
    from layerleap.core.cpu import cpu_signature

    n, here, threads = char_model.config.n_layers, cpu_signature(), torch.get_num_threads()
    other = {"cpu": "Some Other CPU, family 1 model 2 (AVX2)", "threads": threads + 1}
    path = _write(char_model, "calm", budget.PATHS["calm"](n)[0], fast=True, config=other)
    greedy = layerleap.generate(char_model, "hi", "greedy", 3, chat=True)
    for quality in (0.95, None):  # asked for, or the default's calibration: the same file
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            r = layerleap.generate(char_model, "hi", "calm", 3, chat=True, quality=quality)
        assert r.token_ids == greedy.token_ids and r.stats["quality_budget"]["calibration"] == str(path)
        told = [str(w.message) for w in said if issubclass(w.category, layerleap.decoding.BudgetWarning)]
        if quality is not None:  # the first use of the file in this process
            assert len(told) == 1, told
            assert str(path) in told[0] and here in told[0] and other["cpu"] in told[0], told
            assert f"torch runs {threads} threads, not {threads + 1}" in told[0], told
            command = f"layerleap calibrate calm --model {char_model.source} --quality 0.95 --dtype float32"
            assert f"`{command} --threads {threads}`" in told[0]
        else:
            assert told == [], told
    # the thread count alone differs: it alone is named; the same machine: nothing said
    _write(char_model, "skipdecode", budget.PATHS["skipdecode"](n)[0], fast=True, config={"threads": threads + 2})
    with pytest.warns(layerleap.decoding.BudgetWarning, match=f"runs {threads} threads, not {threads + 2}") as said:
        layerleap.generate(char_model, "hi", "skipdecode", 2, chat=True)
    assert not any("the CPU is" in str(w.message) for w in said)
    _write(char_model, "bild", budget.PATHS["bild"](n)[0], fast=True, config={"cpu": here, "threads": threads})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layerleap.generate(char_model, "hi", "bild", 2, chat=True)


def test_a_shipped_calibration_runs_without_the_machine_warning(char_model, cache, tmp_path, monkeypatch):
    """The package's own calibration files name their machine in the docs: used anywhere, they run silently
    (the same file as the user's would warn, above)."""
    n, threads = char_model.config.n_layers, torch.get_num_threads()
    monkeypatch.setattr(budget, "SHIPPED", tmp_path / "shipped")
    path = budget.calibration_path(char_model.fingerprint, char_model.dtype_name, "calm", tmp_path / "shipped")
    path.parent.mkdir(parents=True)
    entry = {"chosen": {"options": budget.PATHS["calm"](n)[0], "modelled_speedup": 1.0}, "faster_than_greedy": True}
    path.write_text(json.dumps({"budgets": {"0.95": {**entry, "config": {"cpu": "Other", "threads": threads + 1}}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = layerleap.generate(char_model, "hi", "calm", 3, chat=True, quality=0.95)
    assert r.stats["quality_budget"]["calibration"] == str(path)


def test_bilds_calibration_holds_for_its_default_small_model_only(char_model, cache):
    """A BiLD calibration was made with the default small model: another one (``small``, ``exit_layer``,
    or an ``eagle`` other than "auto") runs as given, not with the calibrated thresholds."""
    setting = {"alpha_fb": 0.0, "alpha_rb": 0.69, "max_small": 1}
    _write(char_model, "bild", setting, fast=True)
    options, cal = budget.resolve(char_model, "bild", {}, None)
    assert cal is not None and options == setting
    options, cal = budget.resolve(char_model, "bild", {"eagle": "auto"}, None)
    assert cal is not None and options == {"eagle": "auto", **setting}
    for other in ({"eagle": "none"}, {"exit_layer": 1}, {"eagle": "none", "exit_layer": 1}):
        assert budget.resolve(char_model, "bild", dict(other), None) == (other, None)
    with pytest.raises(layerleap.GenerationError, match="drop eagle"):
        budget.resolve(char_model, "bild", {"eagle": "none"}, 0.95)


def test_skipdecodes_own_schedule_runs_as_given_and_is_refused_with_a_quality(char_model, cache):
    setting = {"min_exit_layer": 2, "max_exit_layer": 3, "warmup": 1}
    _write(char_model, "skipdecode", setting, fast=True)
    for own in ({"schedule": [3, 2]}, {"target_speedup": 2.0}):
        assert budget.resolve(char_model, "skipdecode", dict(own), None) == (own, None)
        with pytest.raises(GenerationError, match=f"drop {next(iter(own))} or drop quality"):
            budget.resolve(char_model, "skipdecode", dict(own), 0.95)


def test_no_faster_setting_says_so_once_and_knobs_win(char_model, cache):
    _write(char_model, "calm", {"threshold": 1.01, "min_exit_layer": 2}, fast=False)
    with pytest.warns(layerleap.decoding.BudgetWarning, match="no setting faster than greedy"):
        r = layerleap.generate(char_model, "hi", "calm", 3, chat=True)
    assert r.stats["quality_budget"]["faster_than_greedy"] is False
    greedy = layerleap.generate(char_model, "hi", "greedy", 3, chat=True)
    assert r.token_ids == greedy.token_ids  # a threshold above 1 never exits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = layerleap.generate(char_model, "hi", "calm", 3, chat=True, threshold=0.5)  # a knob: no calibration
    assert "quality_budget" not in r.stats
    with pytest.raises(GenerationError, match="drop threshold"):
        layerleap.generate(char_model, "hi", "calm", 3, chat=True, quality=0.95, threshold=0.5)


@pytest.mark.parametrize("method", budget.LOSSY)
def test_uncalibrated_defaults_say_so_and_a_calibration_or_knob_silences_it(char_model, cache, method):
    if method == "early-exit":  # it has no default exit layer: uncalibrated, it asks for one
        with pytest.raises(GenerationError, match="needs the option exit_layer"):
            layerleap.generate(char_model, "hi", method, 2, chat=True)
    else:
        with pytest.warns(
            layerleap.decoding.BudgetWarning, match=f"calibrate {method} --model {char_model.source} --dtype float32"
        ):
            layerleap.generate(char_model, "hi", method, 2, chat=True)
    knob = sorted(budget.knobs(method, char_model.config.n_layers))[0]
    value = budget.PATHS[method](char_model.config.n_layers)[0][knob]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layerleap.generate(char_model, "hi", method, 2, chat=True, **{knob: value})
    _write(char_model, method, budget.PATHS[method](char_model.config.n_layers)[0], fast=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = layerleap.generate(char_model, "hi", method, 2, chat=True)
    assert r.stats["quality_budget"]["faster_than_greedy"] is True


def test_paths_start_at_greedy_and_get_cheaper():
    d = 30
    sd = budget.PATHS["skipdecode"](d)
    assert sd[0] == {"min_exit_layer": d, "max_exit_layer": d, "warmup": 4}
    means = [(s["min_exit_layer"] + s["max_exit_layer"]) / 2 for s in sd]
    assert means == sorted(means, reverse=True)
    assert budget.PATHS["early-exit"](d)[0] == {"exit_layer": d}
    assert budget.PATHS["calm"](d)[0]["threshold"] > 1  # never exits
    assert all(s["alpha_rb"] <= math.log(2) for s in budget.PATHS["bild"](d)[:2])  # keeps only greedy's argmax


@pytest.mark.parametrize("method", budget.FIRST_IS_GREEDY)
def test_first_settings_said_to_be_greedy_decode_greedy_at_its_cost(method, char_model):
    """Calibration reuses greedy's outputs and costs for these: they must be greedy's, call for call."""
    g = layerleap.generate(char_model, "hello there", "greedy", 12, stop_at_eos=False)
    options = budget.PATHS[method](char_model.config.n_layers)[0]
    r = layerleap.generate(char_model, "hello there", method, 12, stop_at_eos=False, **options)
    assert r.token_ids == g.token_ids
    assert r.stats["model_calls"] == g.stats["model_calls"] and r.stats["layer_evals"] == g.stats["layer_evals"]


def test_bench_shows_quality_beside_speed_and_the_report_draws_the_frontier(char_model, cache):
    from layerleap.eval import bench
    from layerleap.eval.report import html_report

    d = char_model.config.n_layers
    settings = [
        {
            "options": {"exit_layer": d},
            "tested": True,
            "valid": True,
            "modelled_speedup": 1.0,
            "reference_kept": 1.0,
            "agreement": 1.0,
            "losses": 0,
        },
        {
            "options": {"exit_layer": d - 1},
            "tested": True,
            "valid": False,
            "modelled_speedup": 1.3,
            "reference_kept": 0.5,
            "agreement": 0.4,
            "losses": 3,
        },
    ]
    path = budget.calibration_path(char_model.fingerprint, "float32", "early-exit")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "budgets": {
                    "0.95": {
                        "quality": 0.95,
                        "chosen": {"options": {"exit_layer": d}, "modelled_speedup": 1.0},
                        "faster_than_greedy": False,
                        "settings": settings,
                        "guarantee": "with probability >= 0.8 ...",
                    }
                }
            }
        )
    )
    methods = {"ee": ("early-exit", {"exit_layer": d - 1}), "sk": ("skipdecode", {})}
    res = bench.run_bench(
        char_model, methods, PROMPTS[:2], 4, hf_baseline=False, chat=True, call_cost=False, warmup=False, progress=False
    )
    summary = res.summary
    assert summary["greedy"]["agreement"] == 1.0 and summary["greedy"]["reference_score"] is not None
    assert summary["greedy"]["reference_kept"] in (None, pytest.approx(1.0))  # None: greedy scores 0 on them
    for label in ("ee", "sk"):
        assert 0 <= summary[label]["agreement"] <= 1 and summary[label]["ppl_ratio"] > 0
    recs = [r for r in res.records if r.label == "ee"]
    greedy = {r.prompt_index: r for r in res.records if r.label == "greedy"}
    assert all(r.agreement == pytest.approx(C.agreement(r.text, greedy[r.prompt_index].text)) for r in recs)
    assert "agree" in res.table() and "ppl x" in res.table()
    assert res.config["calibration"]["ee"]["chosen"]["options"] == {"exit_layer": d}
    page = html_report(res.to_dict())
    assert "quality against speed" in page and "ee calibrated" in page and "reference kept" in page
    # without lossy methods the table has no quality columns
    plain = bench.run_bench(
        char_model,
        {"greedy": ("greedy", {})},
        PROMPTS[:1],
        2,
        hf_baseline=False,
        chat=True,
        call_cost=False,
        warmup=False,
        progress=False,
    )
    assert "agree" not in plain.table()


@pytest.mark.parametrize("dtype,sizes", [("float32", {3}), ("bfloat16", {1})])
def test_batches_only_where_rows_decode_as_alone(char_model_dir, monkeypatch, dtype, sizes):
    """fp32 decodes a category as one batch; bf16 (and q4), whose logits tie, decode each prompt alone."""
    model = layerleap.load(str(char_model_dir), dtype=dtype)
    seen = []
    real = C.generate

    def spy(model, texts, *args, **kwargs):
        seen.append(len(texts))
        return real(model, texts, *args, **kwargs)

    monkeypatch.setattr(C, "generate", spy)
    same = [Prompt(i, "qa", text, None) for i, text in enumerate(["hi", "why blue?", "a b c d"])]
    C.run_outputs(model, "greedy", {}, same, 2)
    assert set(seen) == sizes


def test_a_budget_no_setting_meets_runs_the_most_conservative_and_says_so(char_model, cache):
    path = budget.calibration_path(char_model.fingerprint, char_model.dtype_name, "calm")
    path.parent.mkdir(parents=True, exist_ok=True)
    first = {"options": {"threshold": 1.01, "min_exit_layer": 2}, "losses": 4}
    path.write_text(json.dumps({"budgets": {"0.95": {"chosen": None, "prompts": 24, "settings": [first]}}}))
    with pytest.warns(layerleap.decoding.BudgetWarning, match="not even its most conservative.*lost 4 of 24"):
        r = layerleap.generate(char_model, "hi", "calm", 3, chat=True)
    assert r.stats["quality_budget"]["options"] == first["options"]


def _build(model) -> dict:
    from layerleap.drafters import variants

    return {"rank": 2, "alpha": 2.0, "layers": list(range(model.config.n_layers)), "projections": variants.PROJECTIONS}


def _deltas(model, seed: int = 0, scale: float = 0.5) -> dict:
    """Random rank-2 deltas for every projection of ``model`` (``A`` [2, in], ``B`` [out, 2])."""
    from layerleap.drafters import variants

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.config.n_layers):
        for name in variants.PROJECTIONS:
            lin = variants.projection(model, layer, name)
            a, b = variants.delta_names(layer, name)
            tensors[a] = scale * torch.randn(2, lin.in_features, generator=g)
            tensors[b] = scale * torch.randn(lin.out_features, 2, generator=g)
    return tensors


def _variant_of(model_dir):
    """The model in ``model_dir`` with the deltas of ``_deltas`` merged in (a variant)."""
    from layerleap.drafters import variants

    model = layerleap.load(str(model_dir))
    return variants.merge(model, _build(model), _deltas(model))


def test_a_variant_is_calibrated_against_its_base_models_greedy_and_perplexity(char_model, char_model_dir, cache):
    variant = _variant_of(char_model_dir)
    base_greedy = C.greedy_outputs(char_model, PROMPTS, 6)
    own_greedy = C.greedy_outputs(variant, PROMPTS, 6)
    assert [o.text for o in own_greedy] != [o.text for o in base_greedy]  # the deltas change the output
    cal = C.calibrate(
        variant, "early-exit", 0.95, prompts=PROMPTS, max_new_tokens=6, epsilon=0.5, delta=0.5, extra=0, base=char_model
    )
    assert [o.text for o in cal.greedy] == [o.text for o in base_greedy]
    assert [o.ppl for o in cal.greedy] == pytest.approx([o.ppl for o in base_greedy])
    assert cal.config["base_fingerprint"] == char_model.fingerprint
    # the full depth decodes the variant's own greedy text: measured against the base's, not copied
    full = cal.settings[0]
    assert full.options == {"exit_layer": variant.config.n_layers}
    assert [o.text for o in full.outputs] == [o.text for o in own_greedy]
    assert full.agreement < 1.0
    from layerleap.core.run import chat_token_ids

    ids = [chat_token_ids(char_model.tokenizer, [{"role": "user", "content": p.text}], True) for p in PROMPTS]
    by_base = [C.perplexity(char_model, i, o.token_ids) for i, o in zip(ids, full.outputs)]
    by_variant = [C.perplexity(variant, i, o.token_ids) for i, o in zip(ids, full.outputs)]
    assert [o.ppl for o in full.outputs] == pytest.approx(by_base, rel=1e-4)
    assert by_base != pytest.approx(by_variant, rel=1e-2)
    variant.variant = "v"  # as drafters.variants.apply names it
    C.write_calibration(cal)
    assert cal.chosen is None  # the variant's own full depth lost too many prompts: generate says to drop it
    with pytest.warns(layerleap.decoding.BudgetWarning, match="without variant v decodes greedy's own"):
        layerleap.generate(variant, "hi", "early-exit", 3, chat=True, quality=0.95)
    with pytest.raises(C.CalibrationError, match="same --model and --dtype"):
        C.calibrate(
            variant,
            "early-exit",
            prompts=PROMPTS,
            max_new_tokens=6,
            epsilon=0.5,
            delta=0.5,
            base=layerleap.load(str(char_model_dir), dtype="bfloat16"),
        )


def test_the_table_says_when_not_even_the_first_setting_meets_the_budget():
    from layerleap.commands.calibrate import table

    first = {"options": {"exit_layer": 4}, "tested": True, "valid": False, "modelled_speedup": 1.0}
    first.update(layer_passes=4.0, losses=3, p_value=0.9, agreement=0.3, reference_kept=None, ppl_ratio=1.9)
    entry = {"prompts": 4, "settings": [first], "guarantee": "g", "chosen": None, "faster_than_greedy": False}
    assert "not even the first" in table(entry) and "fastest one that does" not in table(entry)
    entry.update(chosen={"options": first["options"]}, settings=[{**first, "valid": True}])
    assert "fastest one that does" in table(entry)


def test_calibrate_cli_with_a_variant_measures_against_the_base_model(char_model, char_model_dir, cache, tmp_path):
    """``layerleap calibrate METHOD --variant FILE``: greedy's outputs are the base model's."""
    from layerleap.cli import main
    from layerleap.drafters import variants, weights

    variant = _variant_of(char_model_dir)
    rows, qid = [], 0
    for cat, ref in (("summarization", "a b"), ("translation", "good day"), ("math_reasoning", "#### 4")):
        for i in range(C.SPLITS["calibration"] + 1):
            qid += 1
            rows.append({"question_id": qid, "category": cat, "turns": [f"q{i} {cat[:4]}"], "reference": [ref]})
    data = tmp_path / "question.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    path = weights.write(tmp_path / "v.safetensors", char_model, variants.KIND, _build(char_model), _deltas(char_model))
    report = tmp_path / "run.json"
    argv = ["calibrate", "early-exit", "--model", str(char_model_dir), "--variant", str(path), "--data", str(data)]
    argv += ["--prompts", "1", "--epsilon", "0.5", "--delta", "0.5", "--max-new-tokens", "5", "--extra", "0"]
    assert main([*argv, "--report", str(report), "--out", str(tmp_path / "cal"), "--yes"]) == 0
    run = json.loads(report.read_text())
    prompts = C.split_prompts("calibration", 1, data=str(data))
    assert [g["text"] for g in run["greedy"]] == [o.text for o in C.greedy_outputs(char_model, prompts, 5)]
    assert run["config"]["base_fingerprint"] == char_model.fingerprint
    own = [o.text for o in C.greedy_outputs(variant, prompts, 5)]
    assert [o["text"] for o in run["settings"][0]["outputs"]] == own


@pytest.mark.parametrize("path", sorted(budget.SHIPPED.glob("*/*/*.json")), ids=lambda p: "/".join(p.parts[-2:]))
def test_shipped_files_choose_the_fastest_valid_setting_by_their_measured_step_cost(path):
    """Every shipped budget was priced with the step cost it records: its chosen setting is the valid one
    modelled fastest (the earlier on a tie), and it says it is faster than greedy only when modelled so."""
    for key, entry in json.loads(path.read_text())["budgets"].items():
        cost = SC.StepCost.from_dict(entry["config"]["step_cost"])
        settings = []
        for i, s in enumerate(entry["settings"]):
            setting = C.Setting(i, s["options"], [], layer_passes=s["layer_passes"], valid=s["valid"])
            setting.calls, setting.checks, setting.heads, setting.filled = (
                s["calls"],
                s["checks"],
                s["heads"],
                s["filled"],
            )
            setting.rows, setting.drafts = s.get("rows", 0.0), s.get("drafts", 0.0)  # BiLD's EAGLE form
            setting.modelled_speedup = cost.speedup(**setting.counts())
            assert setting.modelled_speedup == pytest.approx(s["modelled_speedup"], rel=1e-4), (key, s["options"])
            settings.append(setting)
        chosen = C.choose(settings)
        assert entry["chosen"]["options"] == chosen.options
        assert entry["faster_than_greedy"] == C.faster_than_greedy(chosen)


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is 5. Wait, recheck. Final Answer: 7", "7"),  # the last marker, wherever it stands
        ("The answer is unclear.\nSo 3 + 4 = 7, and 7 it is", "7"),  # a marker's line without a number
        ("In 2013-2014 the price rose", "2014"),  # no minus inside a range
        ("#### 1,234.50", "1234.5"),
        ("so x = -5", "-5"),
        ("no number", None),
    ],
)
def test_final_answer(text, want):
    from layerleap.eval import quality as Q

    assert Q.final_answer(text) == want


def test_agreement_of_any_script():
    assert C.agreement("Привет мир", "Привет мир") == 1.0 and C.agreement("!!!", "!!!") == 1.0
    assert C.agreement("Привет мир", "Привет друг") == pytest.approx(0.5)
    assert C.agreement("日本 語", "日本") > 0
    assert C.agreement("The cat sat.", "The cat sat on the mat.") == pytest.approx(2 / 3)  # ROUGE-L as before


def test_rouge_scores_of_any_script_and_of_empty_texts():
    from layerleap.eval import quality as Q

    for metric in (Q.rouge_l, Q.rouge_lsum):  # ROUGE's own tokenizer finds no word in these: they scored 0
        assert metric(["Привет мир"], ["Привет мир"]) == pytest.approx(100.0)
        assert metric(["日本。語"], ["日本。語"]) == pytest.approx(100.0)
        assert metric(["Привет мир"], ["Привет друг"]) == pytest.approx(50.0)
        assert metric([""], [""]) == pytest.approx(100.0) and metric([""], ["ref"]) == 0.0
        assert metric(["The cat sat."], ["The cat sat on the mat."]) == pytest.approx(100 * 2 / 3)  # as before
    assert Q.split_sentences("我很好。你呢？好！ End. Next") == ["我很好。", "你呢？", "好！", "End.", "Next"]
    assert C.reference_score("summarization", "Привет мир", "Привет мир") == pytest.approx(1.0)
    assert C.reference_score("translation", "Hello there.", "Hello there.") <= 1.0  # sentence BLEU: 100.0000004


def test_transformers_baseline_counts_its_calls(char_model):
    from layerleap.eval.bench import HFBaseline

    hf = HFBaseline(char_model)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = hf.generate(prompt, 8)
    assert plain.stats["model_calls"] == 8 and plain.stats["tokens_per_call"] == 1.0
    lookup = hf.generate(prompt, 8, prompt_lookup_num_tokens=4)
    assert lookup.token_ids == plain.token_ids and 1 <= lookup.stats["model_calls"] <= 8
    assert lookup.stats["tokens_per_call"] == pytest.approx(8 / lookup.stats["model_calls"])


@pytest.mark.parametrize(
    "method, option",
    [("skipdecode", {"decay": "power"}), ("skipdecode", {"max_len": 12}), ("bild", {"head": "shared"})],
)
def test_a_budget_refuses_options_that_change_what_was_calibrated(char_model, cache, method, option):
    with pytest.raises(GenerationError, match="quality"):
        layerleap.generate(char_model, "hi", method, 2, chat=True, quality=0.95, **option)


def test_a_resumed_run_is_priced_again_on_another_thread_count(char_model, tmp_path, monkeypatch):
    """The report's step costs are reused only where they were measured on this CPU at this thread count: the
    file records the machine that priced its settings."""
    priced = []

    def fake_measure(model, **kw):
        priced.append(torch.get_num_threads())
        return SC.StepCost(
            n_layers=model.config.n_layers,
            step=float(torch.get_num_threads()),
            layer=0.1,
            call=0.0,
            check=0.0,
            head=0.0,
            fill=0.0,
        )

    monkeypatch.setattr(SC, "measure", fake_measure)
    report, threads = tmp_path / "run.json", torch.get_num_threads()
    run = dict(prompts=PROMPTS, max_new_tokens=4, epsilon=0.5, delta=0.5, report=report, extra=0)
    try:
        torch.set_num_threads(1)
        C.calibrate(char_model, "early-exit", 0.95, **run)
        assert C.calibrate(char_model, "early-exit", 0.95, **run).config["step_cost"]["step"] == 1.0
        assert priced == [1]  # same machine and threads: the report's prices
        torch.set_num_threads(2)
        again = C.calibrate(char_model, "early-exit", 0.95, **run)
    finally:
        torch.set_num_threads(threads)
    assert priced == [1, 2] and again.config["threads"] == 2 and again.config["step_cost"]["step"] == 2.0


def test_a_report_of_other_prompts_with_the_same_ids_is_not_resumed(char_model, tmp_path):
    """Another data file whose question ids match: greedy's outputs and the settings are measured again."""
    run = dict(max_new_tokens=4, epsilon=0.5, delta=0.5, report=tmp_path / "run.json", extra=0, step_cost=PRICES)
    C.calibrate(char_model, "early-exit", 0.95, prompts=PROMPTS, **run)
    other = [Prompt(p.id, p.category, "other " + p.text, p.reference and "xyz") for p in PROMPTS]
    again = C.calibrate(char_model, "early-exit", 0.95, prompts=other, **run)
    fresh = C.greedy_outputs(char_model, other, 4)
    assert [o.text for o in again.greedy] == [o.text for o in fresh]
    assert [o.reference_score for o in again.greedy] == [o.reference_score for o in fresh]


@pytest.mark.parametrize(
    "epsilon, delta, confidence, share",
    [
        (0.1, 0.1, ">= 0.90 ", "at most 10% "),
        (0.125, 0.001, ">= 0.999 ", "at most 12.5% "),
        (0.005, 0.05, ">= 0.95 ", "at most 0.5% "),
    ],
)
def test_the_guarantee_states_the_confidence_and_share_unrounded(epsilon, delta, confidence, share):
    """A confidence of 0.999 is not written "1.00", nor a share of 12.5% "12%" (a promise stronger than the test's)."""
    text = C.guarantee(C.Calibration("calm", 0.95, epsilon, delta, 1.5, "calibration", {}))
    assert confidence in text and share in text


def test_min_prompts_certifies_a_perfect_setting_by_the_tests_own_p_value():
    for epsilon, delta in ((0.99, 0.01), (0.1, 0.1), (0.05, 0.2), (0.5, 0.25)):
        n = C.min_prompts(epsilon, delta)
        assert C.binomial_p_value(0, n, epsilon) <= delta and (n == 1 or C.binomial_p_value(0, n - 1, epsilon) > delta)
    assert C.min_prompts(0.99, 0.01) == 2  # (1 - 0.99) ** 1 is 0.010000000000000009, above delta


def test_calibrate_refuses_a_quality_finer_than_hundredths_before_loading(char_model_dir, tmp_path, capsys):
    """``--check --quality 0.954`` would measure the 0.95 budget's setting and report it as 0.954."""
    from layerleap.cli import main

    for extra in ([], ["--check", str(tmp_path / "check.json")]):  # refused while parsing: nothing is loaded
        argv = ["calibrate", "early-exit", "--model", str(char_model_dir), "--quality", "0.954", "--yes", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "give 0.95 or 0.96" in err and "Traceback" not in err
    assert not (tmp_path / "check.json").exists()


def _write_budget(args):
    """One `layerleap calibrate` process writing its budget to the method's calibration file."""
    quality, barrier = args
    cfg = {"fingerprint": "f" * 16, "dtype": "float32", "model": "tiny"}
    barrier.wait(5)
    return str(C.write_calibration(C.Calibration("early-exit", quality, 0.5, 0.5, 2.0, "calibration", cfg)))


def test_calibrations_of_other_budgets_finishing_at_once_keep_every_budget(cache, monkeypatch):
    """`layerleap calibrate` run for several --quality at once (one process each): the method's file ends
    up with every budget, none lost to another process's write of it (a slow disk)."""
    import multiprocessing as mp
    import time
    from pathlib import Path

    from layerleap import files

    monkeypatch.setattr(C, "write_json", lambda *a, **k: time.sleep(0.2) or files.write_json(*a, **k))
    ctx = mp.get_context("fork")
    qualities = [0.8, 0.85, 0.9, 0.95]
    with ctx.Manager() as manager, ctx.Pool(len(qualities)) as pool:
        barrier = manager.Barrier(len(qualities))
        (path,) = set(pool.map(_write_budget, [(q, barrier) for q in qualities]))
    assert sorted(json.loads(Path(path).read_text())["budgets"]) == ["0.80", "0.85", "0.90", "0.95"]


def test_a_report_with_an_overflowed_perplexity_is_strict_json_and_resumes(char_model, tmp_path, monkeypatch):
    """A perplexity past float range is written "inf" (JSON has no Infinity) and read back as inf on resume:
    the output it belongs to is lost, as in the run that measured it."""
    real = C.perplexity
    monkeypatch.setattr(C, "perplexity", lambda m, p, ids: math.inf if len(ids) % 2 else real(m, p, ids))
    report = tmp_path / "run.json"
    run = dict(prompts=PROMPTS, max_new_tokens=3, epsilon=0.5, delta=0.5, report=report, extra=0, step_cost=PRICES)
    first = C.calibrate(char_model, "early-exit", 0.95, **run)
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert data["greedy"][0]["ppl"] == "inf"
    again = C.calibrate(char_model, "early-exit", 0.95, **run)
    assert again.greedy[0].ppl == math.inf
    assert [s.losses for s in again.settings] == [s.losses for s in first.settings]


def test_the_check_prints_strict_json_when_a_perplexity_overflowed(monkeypatch, capsys, tmp_path):
    """``calibrate --check``'s line is JSON a browser or jq reads: a perplexity ratio past float range is "inf"."""
    from types import SimpleNamespace

    from layerleap.commands import calibrate as cmd

    res = {"options": {"alpha_rb": math.inf}, "prompts": 3, "losses": 3, "loss_rate": 1.0, "epsilon": 0.1}
    res.update(within_epsilon=False, agreement=0.5, reference_kept=None, ppl_ratio=math.inf)
    monkeypatch.setattr(C, "holdout_check", lambda *a, **k: dict(res))
    args = SimpleNamespace(max_new_tokens=4, quality=0.95)
    cmd._check(args, None, [], "bild", (tmp_path / "x.json", {}), None)
    line = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert line["ppl_ratio"] == "inf" and line["options"] == {"alpha_rb": "inf"}


def test_the_calibrate_command_named_is_the_models_own(tmp_path):
    """The command a message names calibrates the model at hand: the default model bare, a packaged one
    by name, a folder by its path, and a variant with its file."""
    from types import SimpleNamespace

    from layerleap.core.loading import DEFAULT_MODEL

    def model(name, source, **kw):
        return SimpleNamespace(config=SimpleNamespace(name=name), source=source, dtype_name="float32", **kw)

    assert budget.calibrate_command(model("tiny", "/m/tiny"), "calm") == (
        "layerleap calibrate calm --model /m/tiny --dtype float32"
    )
    assert budget.calibrate_command(model(DEFAULT_MODEL, "/cache/x"), "calm", 0.9, 2) == (
        "layerleap calibrate calm --quality 0.9 --dtype float32 --threads 2"
    )
    assert budget.calibrate_command(model("qwen2.5-coder-0.5b", "/cache/y"), "calm") == (
        "layerleap calibrate calm --model qwen2.5-coder-0.5b --dtype float32"
    )
    variant = model(DEFAULT_MODEL, "/cache/x", variant_file=str(tmp_path / "my variant.safetensors"))
    assert budget.calibrate_command(variant, "calm") == (
        f"layerleap calibrate calm --variant '{tmp_path}/my variant.safetensors' --dtype float32"
    )
