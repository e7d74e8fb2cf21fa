"""Draft lengths from the running acceptance (``drafters.lengths``): the pure rule, its learning, and
prompt lookup with it (the exactness of ``adaptive=True`` is in test_exactness.py)."""

from __future__ import annotations

import json
import math

import pytest

import torch

import layerleap
from layerleap.core import cost_curve
from layerleap.drafters import lengths as L
from tiny_models import COSTLY_ROWS, COSTLY_ROWS_16, naive_greedy, random_model

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
        ([0.05] * 4, COSTLY_ROWS, 4, 0),  # rarely right, rows cost: none
        ([0.8, 0.8, 0.1, 0.1], COSTLY_ROWS, 4, 2),  # stop where acceptance falls
        ([0.9] * 4, FLAT, 2, 2),  # never past the chain
    ],
)
def test_best_length(rates, costs, most, want):
    assert L.best_length(rates, costs, most) == want


def test_chains_past_the_measured_sizes_are_priced_by_the_curve():
    """Past its 8 measured sizes the call-cost curve goes on to its 16-token cost: fp32's shipped curve is
    flat from 7 to 8 tokens, but a 16-token call costs 1.59 one-token calls, not 1.26.  A row whose drafts
    are always kept, offered 64-draft chains, keeps them short: a 65-token call costs far more than the
    few tokens its last drafts add."""
    curve = L.shipped_curve("float32")
    assert curve.costs[-1] == curve.costs[-2] < curve(16)
    assert L.best_length([0.8] * 64, curve, 64) == 8  # where the 8 measured sizes end
    chooser = L.LengthChooser(1, curve, 64)
    for _ in range(40):
        chain = chooser.cut(0, list(range(64)))
        chooser.observe(0, len(chain), len(chain), next_token=None)
    assert 1 <= len(chooser.cut(0, list(range(64)))) <= 16


def test_running_acceptance_counts_tried_positions_only():
    r = L.RunningAcceptance(3)
    r.observe(drafted=3, accepted=1)  # 1st kept, 2nd tried and missed, 3rd never tried
    assert r.tried == [1.0, 1.0, 0.0] and r.kept == [1.0, 0.0, 0.0]
    r.observe(drafted=3, accepted=3)
    assert r.tried == pytest.approx([1.9, 1.9, 1.0]) and r.kept == pytest.approx([1.9, 1.0, 1.0])


def test_chooser_stops_drafting_and_learns_back_from_the_next_token():
    c = L.LengthChooser(1, L.CostCurve(COSTLY_ROWS, COSTLY_ROWS_16), 3)
    for _ in range(10):  # drafts that are always wrong
        chain = c.cut(0, [7, 8, 9])
        c.observe(0, len(chain), 0, next_token=1)
    assert c.cut(0, [7, 8, 9]) == []
    for _ in range(20):  # the first draft would now be right: the next token shows it
        chain = c.cut(0, [7, 8, 9])
        c.observe(0, len(chain), len(chain), next_token=7)
    assert len(c.cut(0, [7, 8, 9])) >= 1


def test_a_chain_cut_short_grows_back_when_its_drafts_are_kept():
    """Where a cut chain's drafts are all kept, the next token shows whether the first draft cut away was
    right too: after a run of misses (cut to nothing) and then a run of right copies, the chain grows back
    to its whole length on a curve where a 4-token call costs two one-token calls."""
    steep = L.CostCurve(tuple(1 + (s - 1) / 3 for s in range(1, 9)), 6.0)
    c = L.LengthChooser(1, steep, 4)
    chain = [7, 8, 9, 10]
    for _ in range(30):  # the copy is wrong: no drafts
        c.observe(0, len(c.cut(0, chain)), 0, next_token=1)
    assert c.cut(0, chain) == []
    lengths = []
    for _ in range(30):  # the copy is right: the target continues it, past whatever was cut away
        n = len(c.cut(0, chain))
        lengths.append(n)
        c.observe(0, n, n, next_token=(chain + [11])[n])
    assert lengths[-1] == 4 and lengths == sorted(lengths)


def test_adaptive_lookup_drafts_less_where_copies_fail(monkeypatch):
    monkeypatch.setitem(L.CALL_COST, "float32", COSTLY_ROWS)  # rows that cost
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    prompt = list(range(1, 40)) * 2  # every bigram recurs, but a random model rarely continues the copy
    plain = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1, adaptive=False)
    cut = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1, adaptive=True)
    assert cut.token_ids == plain.token_ids
    assert cut.stats["drafted"] < plain.stats["drafted"]


@pytest.mark.parametrize(
    "dtype,costly,given,want",
    [("q4", True, None, True), ("q4", False, None, False), ("float32", False, None, False), ("q4", True, False, False)],
)
def test_adaptive_is_on_by_default_where_a_second_token_costs(monkeypatch, dtype, costly, given, want):
    """Chains are cut by default where the curve makes a 2-token call cost ADAPTIVE_STEP or more (q4 with
    torch's int4 kernel), not where it is nearly flat (fp32; q4's shipped block-kernel curve)."""
    from types import SimpleNamespace

    from layerleap.methods.prompt_lookup import adaptive_default

    if costly:
        monkeypatch.setitem(L.CALL_COST, dtype, COSTLY_ROWS)
    run = SimpleNamespace(model=SimpleNamespace(dtype_name=dtype))
    assert adaptive_default(run, given) is want


@pytest.fixture
def saved_curves(tmp_path, monkeypatch):
    """A fresh cache where curves saved by ``info --call-cost`` are read (the suite ignores them)."""
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv("LAYERLEAP_CALL_COST")
    return tmp_path


def steep(step: float) -> dict[int, float]:
    return {s: 1.0 + step * (s - 1) for s in cost_curve.SIZES}


def test_a_saved_curve_prices_the_model_on_this_machine_only(saved_curves, monkeypatch):
    model = random_model("llama-gqa-tied", seed=3)
    assert L.curve_for(model) == L.shipped_curve("float32")
    ratios = steep(0.5)
    ratios[5] = 2.5  # a dip below c(4) = 2.5: timing noise, held at the running maximum
    ratios[4] = 2.6
    assert cost_curve.save(model, ratios, ms_one=3.0)
    curve = L.curve_for(model)
    assert curve.source == "measured" and curve.costs[:6] == (1.0, 1.5, 2.0, 2.6, 2.6, 3.5)
    assert curve(16) == pytest.approx(8.5) and curve(12) == pytest.approx(4.5 + 4 * (8.5 - 4.5) / 8)
    other = random_model("llama-gqa-tied", seed=3, n_layers=3)  # another shape: not its curve
    assert L.curve_for(other).source == "shipped"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # other threads: not their curve
    assert L.curve_for(model).source == "shipped"
    monkeypatch.undo()
    monkeypatch.setenv("LAYERLEAP_CALL_COST", "shipped")
    assert L.curve_for(model).source == "shipped"


def test_a_saved_curve_decides_whether_chains_are_cut(saved_curves):
    from types import SimpleNamespace

    from layerleap.methods.prompt_lookup import adaptive_default

    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    run = SimpleNamespace(model=model)
    assert adaptive_default(run, None) is False  # fp32's shipped curve: rows nearly free
    cost_curve.save(model, steep(0.4), ms_one=3.0)  # a second token costs x1.4 here
    assert adaptive_default(run, None) is True
    prompt = list(range(1, 40)) * 2
    plain = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1, adaptive=False)
    cut = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, min_ngram=1)
    assert cut.token_ids == plain.token_ids and cut.stats["drafted"] < plain.stats["drafted"]


@pytest.mark.parametrize("broken", ["{not json", "[" * 100_000])  # the second nested past the parser's depth
def test_a_partial_or_broken_saved_curve_is_ignored(saved_curves, broken):
    model = random_model("llama-gqa-tied", seed=3)
    with pytest.raises(ValueError, match="missing"):
        cost_curve.save(model, {1: 1.0, 2: 1.1}, ms_one=3.0)
    (saved_curves / cost_curve.FILE).write_text(broken)
    assert L.curve_for(model).source == "shipped"
    assert cost_curve.save(model, steep(0.1), ms_one=3.0)  # and a save replaces it
    assert L.curve_for(model).source == "measured"


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -1.0])
@pytest.mark.parametrize("where", ["ratio", "ms_one"])
def test_a_saved_curve_with_a_time_or_ratio_that_is_not_finite_and_positive_is_ignored(saved_curves, where, bad):
    model = random_model("llama-gqa-tied", seed=3)
    ratios = steep(0.1)
    if where == "ratio":
        ratios[4] = bad
    assert cost_curve.save(model, ratios, ms_one=bad if where == "ms_one" else 3.0)
    assert cost_curve.saved(model) is None and L.curve_for(model).source == "shipped"  # as if none were saved
    assert cost_curve.save(model, steep(0.1), ms_one=3.0)  # and a save replaces it
    assert L.curve_for(model).source == "measured"


def test_a_saved_curve_with_infinite_or_nan_costs_is_ignored(saved_curves):
    """An entry json reads as Infinity or NaN is no curve: an infinite c(1) priced every call at zero and
    cut chains by dividing by it."""
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    for bad in ("Infinity", "NaN"):
        ratios = {str(s): r for s, r in steep(0.1).items()}
        text = json.dumps({cost_curve.key(model): {"ratios": {**ratios, "1": "BAD"}, "ms_one_token": 3.0}})
        (saved_curves / cost_curve.FILE).write_text(text.replace('"BAD"', bad))
        assert L.curve_for(model).source == "shipped"
        prompt = list(range(1, 20)) * 2
        got = layerleap.generate(model, prompt, "prompt-lookup", 8, stop_at_eos=False, adaptive=True).token_ids
        assert got == naive_greedy(model, prompt, 8)


def test_adaptive_refuses_a_non_bool():
    model = random_model("llama-gqa-tied", seed=3, scale=2.0)
    with pytest.raises(layerleap.GenerationError, match="adaptive"):
        layerleap.generate(model, [1, 2, 3], "prompt-lookup", 4, adaptive=3)


def test_dynamic_trees_draft_by_the_saved_curve(saved_curves):
    """A dynamic tree's node count is priced by the machine's saved curve: more nodes where a call over
    more tokens is cheap; greedy's tokens either way."""
    from layerleap.drafters import medusa_transfer

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    heads = medusa_transfer.new_drafter(model, "medusa", steps=3)
    prompt = list(range(5, 25))
    want = layerleap.generate(model, prompt, "greedy", 24, stop_at_eos=False).token_ids
    drafted = {}
    for name, step in (("flat", 0.0), ("steep", 1.0)):
        cost_curve.save(model, steep(step), ms_one=3.0)
        got = layerleap.generate(model, prompt, "medusa", 24, stop_at_eos=False, heads=heads, tree="dynamic")
        drafted[name] = got.stats["drafted"]
        assert got.token_ids == want
    assert drafted["flat"] > drafted["steep"]


def test_a_gpu_without_a_saved_curve_measures_it_once(saved_curves, monkeypatch):
    """No shipped curve fits a GPU: the first method that needs one measures it there and saves it; a
    CPU keeps the shipped curve; ``LAYERLEAP_CALL_COST=shipped`` measures nothing."""
    model = random_model("llama-gqa-tied", seed=3)
    calls = []

    def fake_time_calls(m, context, sizes, rounds):
        calls.append(rounds)
        return context, {s: [1e-3 * (1 + 0.5 * (s - 1)), 2e-3] for s in sizes}

    monkeypatch.setattr(cost_curve, "time_calls", fake_time_calls)
    assert L.curve_for(model).source == "shipped" and not calls  # a CPU: the shipped curve
    monkeypatch.setattr(cost_curve, "key", lambda m: "a GPU | cuda | tiny | float32")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setenv("LAYERLEAP_CALL_COST", "shipped")
    assert L.curve_for(model).source == "shipped" and not calls
    monkeypatch.delenv("LAYERLEAP_CALL_COST")
    curve = L.curve_for(model)
    assert curve.source == "measured" and curve(3) == pytest.approx(2.0) and len(calls) == 1
    assert L.curve_for(model).source == "measured" and len(calls) == 1  # saved: not measured again


SHIPPED_F32 = L.CostCurve(L.CALL_COST["float32"], L.CALL_COST_16["float32"])


def test_merged_cut_keeps_a_chain_that_the_target_follows_and_drops_one_it_does_not():
    cut = L.MergedChainCut(2, L.CostCurve(COSTLY_ROWS, COSTLY_ROWS_16), 4)  # rows that cost
    chain = [5, 6, 7, 8]
    for _ in range(15):  # row 0: the target continues the chain; row 1: never
        assert cut.cut(0, chain, shared=0, nodes=3) is not None
        cut.observe(0, kept=chain, kept_at=[3, 4, 5, 6], next_token=9)
        cut.cut(1, chain, shared=0, nodes=3)
        cut.observe(1, kept=[], kept_at=[], next_token=1)
    assert cut.cut(0, chain, shared=0, nodes=3) == chain
    assert cut.cut(1, chain, shared=0, nodes=3) == []


def test_merged_cut_prices_only_the_rows_past_the_shared_prefix():
    curve = L.CostCurve((1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0), 3.0)  # a step at 5 rows
    cut = L.MergedChainCut(1, curve, 4)
    cut.rows[0].kept, cut.rows[0].tried = [4.0, 0.0, 0.0, 0.0], [4.0, 4.0, 4.0, 4.0]  # 1st kept, the rest missed
    # a tree of 3 nodes: 4 rows with the root; one new row for the chain's first draft costs a step
    assert cut.cut(0, [5, 6, 7, 8], shared=0, nodes=3) == []
    # the chain's first draft is a tree node: it costs nothing, and adds nothing the tree does not hold
    assert cut.cut(0, [5, 6, 7, 8], shared=1, nodes=3) == []
    cut.rows[0].kept = [4.0, 4.0, 4.0, 4.0]  # now every draft is kept: the rows past the step pay
    assert cut.cut(0, [5, 6, 7, 8], shared=1, nodes=3) == [5, 6, 7, 8]


def test_merged_cut_learns_from_the_whole_chain_when_it_was_cut():
    cut = L.MergedChainCut(1, SHIPPED_F32, 3)
    cut.cut(0, [5, 6, 7], shared=0, nodes=3)
    cut.observe(0, kept=[5, 6], kept_at=[3, 4], next_token=4)  # the call kept 5, 6 on the chain's branch
    assert cut.rows[0].tried == [1.0, 1.0, 1.0] and cut.rows[0].kept == [1.0, 1.0, 0.0]
    assert cut.tree_tokens[0] == pytest.approx(L.DECAY * L.TREE_PRIOR + (1 - L.DECAY) * 1)
    cut.observe(0, kept=[5], kept_at=[0], next_token=6)  # nothing pending: nothing learned
    assert cut.rows[0].tried == [1.0, 1.0, 1.0]


def test_merged_cut_beside_no_tree_prices_the_chain_as_a_plain_call():
    """A round with no tree yet (the first transfer or Medusa round after another kind) gives the root's
    token alone, whatever the tree gave before: the chain beside it is cut as a plain call's would be."""
    steep = L.CostCurve(tuple(1 + (s - 1) / 3 for s in range(1, 9)), 6.0)
    cut = L.MergedChainCut(1, steep, 4)
    for _ in range(30):  # the copies are right
        cut.rows[0].observe(4, 4)
    cut.tree_tokens[0] = 4.0  # and a tree gave 4 tokens a round
    rates = cut.rows[0].rates()
    assert L.best_length(rates, steep, 4) == 4
    assert cut.cut(0, [7, 8, 9, 10], shared=0, nodes=0) == [7, 8, 9, 10]


def _save_curve(args):
    """One process saving its curve (``cost_curve.key`` stands in: the argument is the key)."""
    name, barrier = args
    barrier.wait(5)
    return cost_curve.save(name, steep(0.1), ms_one=3.0)


def test_processes_saving_curves_at_once_keep_every_curve(saved_curves, monkeypatch):
    """`layerleap info --call-cost` run for several models at once (or a GPU measuring its curve in two
    servers): every curve is saved, none lost to another process's write of the file (a slow disk)."""
    import multiprocessing as mp
    import time

    from layerleap import files

    slow_write = files.write_json
    monkeypatch.setattr(cost_curve, "key", lambda model: model)
    monkeypatch.setattr(cost_curve, "write_json", lambda *a, **k: time.sleep(0.2) or slow_write(*a, **k))
    ctx = mp.get_context("fork")
    names = [f"model {i}" for i in range(4)]
    with ctx.Manager() as manager, ctx.Pool(len(names)) as pool:
        barrier = manager.Barrier(len(names))
        assert pool.map(_save_curve, [(n, barrier) for n in names]) == [True] * len(names)
    assert sorted(json.loads((saved_curves / cost_curve.FILE).read_text())) == names
    assert all(cost_curve.saved(n) == pytest.approx(steep(0.1)) for n in names)  # and this process reads them


def test_a_curve_another_process_saves_within_one_clock_tick_is_read(saved_curves):
    """The saved curves are read again when the file changes: also when another process's write keeps the
    modification time of the file read before (a coarse file-system clock ticks every few milliseconds)."""
    import os

    from layerleap.files import write_json

    model = random_model("llama-gqa-tied", seed=3)
    assert cost_curve.save(model, steep(0.1), ms_one=3.0)
    assert cost_curve.saved(model) == pytest.approx(steep(0.1))
    path = saved_curves / cost_curve.FILE
    st = path.stat()
    entry = {"ratios": {str(s): r for s, r in steep(0.2).items()}, "ms_one_token": 3.0}
    write_json(path, {cost_curve.key(model): entry})  # another process's write, in the same tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cost_curve.saved(model) == pytest.approx(steep(0.2))
