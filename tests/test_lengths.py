"""Draft lengths from the running acceptance (``drafters.lengths``): the pure rule, its learning, and
prompt lookup with it (the exactness of ``adaptive=True`` is in test_exactness.py)."""

from __future__ import annotations

import pytest

import layerleap
from layerleap.drafters import lengths as L
from tiny_models import random_model

FLAT = (1.0,) * 8
STEEP = (1.0, 2.0, 3.0, 4.0)


def test_expected_tokens_and_call_cost():
    assert L.expected_tokens([0.5, 0.5], 0) == 1.0
    assert L.expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert L.call_cost(STEEP, 3) == 3.0 and L.call_cost(STEEP, 6) == 6.0  # extended linearly


@pytest.mark.parametrize(
    "rates,costs,most,want",
    [
        ([0.9] * 4, FLAT, 4, 4),  # free rows: draft everything
        ([0.9] * 4, STEEP, 4, 0),  # each row a full step: no draft beats a greedy step
        ([0.05] * 4, L.CALL_COST["q4"], 4, 0),  # rarely right, rows cost: none
        ([0.8, 0.8, 0.1, 0.1], L.CALL_COST["q4"], 4, 2),  # stop where acceptance falls
        ([0.9] * 4, FLAT, 2, 2),  # never past the chain
    ],
)
def test_best_length(rates, costs, most, want):
    assert L.best_length(rates, costs, most) == want


def test_running_acceptance_counts_tried_positions_only():
    r = L.RunningAcceptance(3)
    r.observe(drafted=3, accepted=1)  # 1st kept, 2nd tried and missed, 3rd never tried
    assert r.tried == [1.0, 1.0, 0.0] and r.kept == [1.0, 0.0, 0.0]
    r.observe(drafted=3, accepted=3)
    assert r.tried == pytest.approx([1.9, 1.9, 1.0]) and r.kept == pytest.approx([1.9, 1.0, 1.0])


def test_chooser_stops_drafting_and_learns_back_from_the_next_token():
    c = L.LengthChooser(1, "q4", 3)
    for _ in range(10):  # drafts that are always wrong
        chain = c.cut(0, [7, 8, 9])
        c.observe(0, len(chain), 0, next_token=1)
    assert c.cut(0, [7, 8, 9]) == []
    for _ in range(20):  # the first draft would now be right: the next token shows it
        chain = c.cut(0, [7, 8, 9])
        c.observe(0, len(chain), len(chain), next_token=7)
    assert len(c.cut(0, [7, 8, 9])) >= 1


def test_adaptive_lookup_drafts_less_where_copies_fail(monkeypatch):
    monkeypatch.setitem(L.CALL_COST, "float32", L.CALL_COST["q4"])  # rows priced as in q4
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    prompt = list(range(1, 40)) * 2  # every bigram recurs, but a random model rarely continues the copy
    plain = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1)
    cut = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1, adaptive=True)
    assert cut.token_ids == plain.token_ids
    assert cut.stats["drafted"] < plain.stats["drafted"]


@pytest.mark.parametrize("dtype,given,want", [("q4", None, True), ("float32", None, False), ("q4", False, False)])
def test_adaptive_is_on_by_default_in_q4_only(dtype, given, want):
    from types import SimpleNamespace

    from layerleap.methods.prompt_lookup import adaptive_default

    run = SimpleNamespace(model=SimpleNamespace(dtype_name=dtype))
    assert adaptive_default(run, given) is want


def test_adaptive_refuses_a_non_bool():
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="adaptive"):
        layerleap.generate(model, [1, 2, 3], "prompt-lookup", 4, adaptive=3)
