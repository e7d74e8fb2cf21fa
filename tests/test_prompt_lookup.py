"""Prompt lookup decoding: the n-gram index, greedy exactness, lossless sampling, stats, options."""

from __future__ import annotations

import pytest
import torch
from test_speculative import chi2_pvalue, exact_joint, tiny_pair
from tiny_models import naive_greedy, random_model

import layerleap
from layerleap.decoding import GenerationError
from layerleap.methods.prompt_lookup import NgramIndex


def test_index_drafts_what_followed_the_latest_occurrence():
    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 2, 3], min_n=1, max_n=3)
    assert idx.draft(3) == [5, 2, 3]  # "5 2 3" never occurred before; "2 3" last occurred at 5
    idx.extend([4])
    assert idx.draft(2) == [9, 2]  # "2 3 4" occurred at 1 only
    assert NgramIndex([5, 6, 7], 1, 3).draft(4) == []  # the last token never occurred before
    assert NgramIndex([5, 6, 5], 1, 3).draft(4) == [6, 5]  # unigram "5": what followed its earlier occurrence
    assert NgramIndex([5, 6, 5], 2, 3).draft(4) == []  # min_ngram 2: "6 5" is new
    assert NgramIndex([5, 5], 1, 3).draft(4) == [5]  # "5" at 0 is followed by the 5 at 1
    assert NgramIndex([5, 5, 5], 1, 3).draft(4) == [5]  # "5 5" at 0 (followed by the last 5)


def test_index_matches_a_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for _trial in range(200):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        idx = NgramIndex(seq[:3], 1, 3)
        idx.extend(seq[3:])
        want, end = [], len(seq)
        for n in range(min(3, end - 1), 0, -1):  # longest suffix first; its latest earlier start
            starts = [s for s in range(end - n) if seq[s : s + n] == seq[end - n :]]
            if starts:
                want = seq[starts[-1] + n : starts[-1] + n + 5]
                break
        assert idx.draft(5) == want, seq


def test_index_prefers_the_longest_suffix():
    idx = NgramIndex([7, 1, 2, 8, 3, 1, 2, 9, 3, 1, 2], min_n=1, max_n=3)
    assert idx.draft(1) == [9]  # "3 1 2" matches at 4 (followed by 9); "1 2" alone would give 8


@pytest.mark.parametrize(
    "options",
    [{}, {"draft_len": 1}, {"max_ngram": 1}, {"draft_len": 4, "max_ngram": 2}, {"min_ngram": 2, "max_ngram": 4}],
)
@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_greedy(options, seed):
    model = random_model("qwen2-gqa-untied", seed=seed, scale=2.0)
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, model.config.vocab_size, (6,), generator=g).tolist()
    prompt = base + base[:4] + base  # repeats: lookups find drafts
    want = naive_greedy(model, prompt, 24)
    got = layerleap.generate(model, prompt, "prompt-lookup", 24, stop_at_eos=False, **options)
    assert got.token_ids == want
    st = got.stats
    assert st["rounds"] >= 1 and st["accepted"] <= st["drafted"] and st["lookups_hit"] <= st["rounds"]
    assert st["new_tokens"] == 24 and 1 <= st["model_calls"] <= 25


def test_copying_text_accepts_drafts_and_saves_calls():
    """A model that continues a repeating pattern: drafts from the prompt are right and each call
    yields several tokens."""
    model = random_model("llama-gqa-tied", seed=2, scale=2.0)
    seq = naive_greedy(model, [3, 4, 5], 40)
    prompt = [3, 4, 5] + seq[:30]
    r = layerleap.generate(model, prompt, "prompt-lookup", 30, stop_at_eos=False)
    assert r.token_ids == naive_greedy(model, prompt, 30)
    if r.stats["accepted"]:
        assert r.stats["tokens_per_round"] > 1


def test_sampled_tokens_follow_the_models_distribution():
    """The first two sampled tokens over 1,000 seeds match the model's own joint distribution, with
    drafts offered (the prompt repeats its tokens) and sometimes accepted."""
    target, _ = tiny_pair(3, vocab=6, scale=2.0, n_draft=1)
    prompt = [1, 3, 4, 1, 3, 4, 1, 3]
    warp = dict(temperature=0.8, top_k=5)
    p = exact_joint(target, prompt, warp)
    counts = torch.zeros(6, 6)
    drafted = accepted = 0
    for seed in range(1000):
        r = layerleap.generate(
            target, prompt, "prompt-lookup", 3, do_sample=True, seed=seed, stop_at_eos=False, draft_len=2, **warp
        )
        counts[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts, p) > 1e-3


def test_stops_at_eos_like_greedy():
    model = random_model("llama-gqa-tied", seed=4, scale=2.0)
    prompt = [9, 8, 7, 9, 8, 7, 9, 8]
    full = naive_greedy(model, prompt, 30)
    eos = full[5]
    model.config = model.config.__class__(**{**model.config.__dict__, "eos_token_ids": (eos,)})
    r = layerleap.generate(model, prompt, "prompt-lookup", 30)
    assert r.token_ids == full[: full.index(eos) + 1]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"draft_len": 0}, "draft_len"),
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "min_ngram"),
        ({"draft_len": 1000}, r"draft_len must be an integer in \[1, 256\]"),
        ({"draft_len": True}, "draft_len"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(GenerationError, match=message):
        layerleap.generate(random_model(), [1, 2, 3], "prompt-lookup", 4, **options)


def _ragged_copying_prompts(model, seed: int) -> list[list[int]]:
    """Prompts of different lengths that repeat themselves (lookups find drafts) and one that does not."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, model.config.vocab_size, (9,), generator=g).tolist()
    return [base[:n] * 2 + base[: n - 1] for n in (2, 6, 3, 9)] + [base[::-1][:7]]


@pytest.mark.parametrize("options", [{}, {"draft_len": 3, "max_ngram": 2}, {"draft_len": 1}])
@pytest.mark.parametrize("seed", range(4))
def test_a_batch_equals_greedy_row_by_row(options, seed):
    """Ragged rows that accept different numbers of drafts per call, each equal to its own greedy decoding;
    with an EOS, rows finish at different times."""
    model = random_model("llama-gqa-tied", seed=seed, scale=2.0)
    prompts = _ragged_copying_prompts(model, seed)
    got = layerleap.generate(model, prompts, "prompt-lookup", 20, stop_at_eos=False, **options)
    want = [naive_greedy(model, p, 20) for p in prompts]
    assert [r.token_ids for r in got] == want
    assert len({r.stats["accepted"] for r in got}) > 1 and all(r.stats["batch"] == len(prompts) for r in got)
    assert {r.stats["model_calls"] for r in got} == {1 + max(r.stats["rounds"] for r in got)}  # calls serve every row
    eos = want[0][4]
    model.config = model.config.__class__(**{**model.config.__dict__, "eos_token_ids": (eos,)})
    got = layerleap.generate(model, prompts, "prompt-lookup", 20, **options)
    want = [naive_greedy(model, p, 20, eos=(eos,)) for p in prompts]
    assert [r.token_ids for r in got] == want and len({len(w) for w in want}) > 1


@pytest.mark.parametrize("seed", range(3))
def test_a_sampled_batch_row_equals_its_prompt_alone_with_the_row_seed(seed):
    model = random_model("llama-gqa-tied", seed=seed, scale=2.0)
    prompts = _ragged_copying_prompts(model, seed)
    kw = dict(do_sample=True, temperature=0.7, stop_at_eos=False, draft_len=4)
    got = layerleap.generate(model, prompts, "prompt-lookup", 16, seed=40 + seed, **kw)
    assert [r.token_ids for r in got] == [
        layerleap.generate(model, p, "prompt-lookup", 16, seed=40 + seed + i, **kw).token_ids
        for i, p in enumerate(prompts)
    ]
    assert sum(r.stats["accepted"] for r in got) > 0
