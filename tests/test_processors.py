"""Logits processors (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``min_tokens``) and the ``min_p`` warp: greedy decoding against a reference loop (a full no-cache forward
per token, the formulas applied to the whole vocabulary), every method that follows a grammar against
greedy with the same processors token for token, batched rows as alone, seeded sampling as the
reference's draws, the refusals."""

from __future__ import annotations

import pytest
import torch
from test_exactness import EXACT
from tiny_models import full_logits, random_model

from layerleap import GenerationError, generate
from layerleap.core import sampling
from layerleap.core.run import METHODS, GenerationConfig, Run, row_seed

CONFIG = "llama-mha-untied"


@pytest.fixture(scope="module")
def models():
    """Untied heads and scale 2 give varied greedy tokens (and runs of one token: something to penalise)."""
    return random_model(CONFIG, seed=11, scale=2.0), random_model(CONFIG, seed=5, scale=2.0)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def processed(logits, prompt, out, rep=1.0, presence=0.0, frequency=0.0, bias=None, min_tokens=0, eos=(), ngram=0):
    """Reference: the processors over the whole vocabulary ``[V]`` (fp32), in vLLM's order; ``ngram``:
    `transformers`' own ``NoRepeatNGramLogitsProcessor`` over the prompt and the output."""
    x, V = logits.float().clone(), logits.shape[-1]
    if ngram:
        from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

        ids = torch.tensor([list(prompt) + list(out)])
        x = NoRepeatNGramLogitsProcessor(ngram)(ids, x.unsqueeze(0))[0]
    for t, b in (bias or {}).items():
        x[t] += b
    if len(out) < min_tokens and eos:
        x[list(eos)] = float("-inf")
    seen = torch.zeros(V, dtype=torch.bool)
    seen[list(prompt) + list(out)] = True
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
    if rep != 1.0:
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if frequency:
        x = torch.where(counts > 0, x - frequency * counts, x)
    if presence:
        x = torch.where(counts > 0, x - presence, x)
    return x


def reference(model, prompt, n, eos=(), sample=None, **procs):
    """Greedy (or, ``sample``: (seed, temperature, min_p), sampled as ``Run.choose`` draws) decoding
    with the processors, one full no-cache forward per token."""
    seq, out = list(prompt), []
    gen = None if sample is None else torch.Generator().manual_seed(row_seed(sample[0], 0))
    for _ in range(n):
        x = processed(full_logits(model, seq)[-1], prompt, out, eos=eos, **procs)
        if sample is None:
            t = int(x.argmax())
        else:
            t = int(sampling.sample(sampling.probs(x.unsqueeze(0), sample[1], 0, 1.0, sample[2]), gen)[0])
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


# name -> (generate's arguments, the reference's)
SETTINGS = {
    "no repeated 1-grams": ({"no_repeat_ngram_size": 1}, {"ngram": 1}),
    "no repeated 2-grams": ({"no_repeat_ngram_size": 2}, {"ngram": 2}),
    "no repeated 3-grams with a penalty": (
        {"no_repeat_ngram_size": 3, "repetition_penalty": 0.8},
        {"ngram": 3, "rep": 0.8},
    ),
    "repetition": ({"repetition_penalty": 1.6}, {"rep": 1.6}),
    "repetition below 1": ({"repetition_penalty": 0.7}, {"rep": 0.7}),
    "frequency and presence": (
        {"frequency_penalty": 0.8, "presence_penalty": -0.5},
        {"frequency": 0.8, "presence": -0.5},
    ),
    "all with bias": (
        {
            "repetition_penalty": 1.3,
            "frequency_penalty": 0.4,
            "presence_penalty": 0.6,
            "logit_bias": {7: 3.5, 90: -100},
        },
        {"rep": 1.3, "frequency": 0.4, "presence": 0.6, "bias": {7: 3.5, 90: -100}},
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("seed,plen", [(1, 9), (2, 3)])
def test_greedy_with_processors_equals_the_reference(models, name, seed, plen):
    m = models[0]
    p = _prompt(m.config.vocab_size, plen, seed)
    args, ref = SETTINGS[name]
    got = generate(m, p, "greedy", 24, stop_at_eos=False, **args)
    assert got.token_ids == reference(m, p, 24, **ref)


def test_min_tokens_holds_off_the_end_tokens(models):
    """With the end-of-sequence token made likely (a bias), greedy ends at once; ``min_tokens`` forbids it until
    that many tokens are out, then it ends there."""
    m = models[0]
    eos = m.eos_ids()
    p = _prompt(m.config.vocab_size, 5, 1)
    bias = {eos[0]: 30.0}
    assert generate(m, p, "greedy", 20, logit_bias=bias).token_ids == [eos[0]]
    got = generate(m, p, "greedy", 20, logit_bias=bias, min_tokens=6)
    assert got.token_ids == reference(m, p, 20, eos=eos, bias=bias, min_tokens=6)
    assert len(got.token_ids) == 7 and got.token_ids[-1] == eos[0] and got.finish_reason == "stop"


def test_a_penalty_stops_a_repeating_model_repeating(models):
    """On a prompt where the model falls into a loop (47, 10, 47, 10, ...), the penalty keeps it out."""
    m = models[0]
    p = _prompt(m.config.vocab_size, 3, 2)
    plain = generate(m, p, "greedy", 30, stop_at_eos=False).token_ids
    penalised = generate(m, p, "greedy", 30, stop_at_eos=False, repetition_penalty=1.8).token_ids
    assert len(set(plain)) <= 16 and len(set(penalised)) >= 28


def _looping_prompt(m, seed: int) -> list[int]:
    """A prompt and then the model's own greedy continuation of it (what greedy tends to say again)."""
    p = _prompt(m.config.vocab_size, 12, seed)
    return p + generate(m, p, "greedy", 12, stop_at_eos=False).token_ids


def test_no_repeat_ngram_size_reads_the_prompt(models):
    """`transformers`' rule reads the whole sequence: an n-gram of the prompt is not repeated by the output,
    as `transformers`' own processor decides it (the reference): at the first token already (seed 18)."""
    m = models[0]
    for seed, n in [(18, 2), (19, 3)]:
        prompt = _looping_prompt(m, seed)
        plain = generate(m, prompt, "greedy", 12, stop_at_eos=False).token_ids
        got = generate(m, prompt, "greedy", 12, stop_at_eos=False, no_repeat_ngram_size=n).token_ids
        assert got == reference(m, prompt, 12, ngram=n) != plain
        seq = prompt + got
        grams = [tuple(seq[i : i + n]) for i in range(len(prompt) - n + 1, len(seq) - n + 1)]
        assert not set(grams) & {tuple(seq[i : i + n]) for i in range(len(prompt) - n + 1)}
        assert len(grams) == len(set(grams))
        assert seed != 18 or got[0] != plain[0]


GRAMMAR_CASES = [(method, label, fn) for method, rows in EXACT.items() if METHODS[method].grammar for label, fn in rows]


@pytest.mark.parametrize("name", ["repetition", "all with bias", "no repeated 2-grams", "no repeated 1-grams"])
@pytest.mark.parametrize(
    "method,label,options", GRAMMAR_CASES, ids=[f"{m}-{lab}" if lab else m for m, lab, _ in GRAMMAR_CASES]
)
def test_every_grammar_method_equals_greedy_with_the_same_processors(models, name, method, label, options):
    m, other = models
    args = SETTINGS[name][0]
    for seed, plen in [(1, 9), (2, 17), (18, 0)]:  # (the last: a prompt the model repeats itself after)
        p = _looping_prompt(m, seed) if plen == 0 else _prompt(m.config.vocab_size, plen, seed)
        want = generate(m, p, "greedy", 28, stop_at_eos=False, **args).token_ids
        got = generate(m, p, method, 28, stop_at_eos=False, **args, **options(m, other)).token_ids
        assert got == want, f"{method} {label} differs from greedy under {name}"


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup", "rest"])
def test_batched_rows_decode_with_their_own_histories(models, method):
    m = models[0]
    prompts = [_prompt(m.config.vocab_size, n, s) for s, n in [(1, 9), (2, 3), (3, 12)]]
    args = SETTINGS["all with bias"][0]
    options = EXACT[method][0][1](m, None)
    rows = generate(m, prompts, method, 20, stop_at_eos=False, **args, **options)
    assert [r.token_ids for r in rows] == [
        generate(m, p, "greedy", 20, stop_at_eos=False, **args).token_ids for p in prompts
    ]


def test_seeded_sampling_draws_from_the_processed_distribution(models):
    m = models[0]
    p = _prompt(m.config.vocab_size, 9, 1)
    args, ref = SETTINGS["all with bias"]
    got = generate(m, p, "sample", 20, stop_at_eos=False, seed=3, temperature=0.8, min_p=0.05, **args)
    assert got.token_ids == reference(m, p, 20, sample=(3, 0.8, 0.05), **ref)


@pytest.mark.parametrize(
    "method,options",
    [("sample", {}), ("prompt-lookup", {}), ("speculative", {"draft_len": 4}), ("self-spec", {"exit_layer": 1})],
)
def test_sampling_methods_sample_the_processed_distributions(models, method, options):
    """``min_p=1`` keeps the likeliest token alone: sampling is greedy decoding (with the processors); a
    bias of -100 on a token greedy picks keeps every lossless sampler off it."""
    m, other = models
    options = {"draft": other, **options} if method == "speculative" else options
    p = _prompt(m.config.vocab_size, 9, 1)
    args = {"repetition_penalty": 1.4, "frequency_penalty": 0.3}
    want = generate(m, p, "greedy", 24, stop_at_eos=False, **args).token_ids
    got = generate(m, p, method, 24, stop_at_eos=False, seed=1, min_p=1.0, **args, **options).token_ids
    assert got == want
    banned = {t: -100 for t in set(want[:8])}
    for seed in range(3):
        got = generate(m, p, method, 24, stop_at_eos=False, seed=seed, logit_bias=banned, **options).token_ids
        assert not set(got) & set(banned), seed


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    p = logits.softmax(-1)
    kept = sampling.process_logits(logits, min_p=0.3).isfinite()
    assert kept.tolist() == (p >= 0.3 * p.max()).tolist() == [[True, True, False, False]]
    assert sampling.process_logits(logits, min_p=1.0).isfinite().sum() == 1


def test_settings_that_ask_for_nothing_keep_no_history(models):
    m = models[0]
    assert Run(m, [[1, 2]], GenerationConfig()).histories is None
    neutral = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0, logit_bias={5: 0}, min_tokens=0)
    p = _prompt(m.config.vocab_size, 9, 1)
    assert (
        generate(m, p, "ppd", 8, exit_layer=2, k=1, head="shared", **neutral).token_ids
        == generate(m, p, "greedy", 8).token_ids
    )


@pytest.mark.parametrize(
    "args,words",
    [
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": True}, "repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a finite number in [-2, 2]"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a finite number in [-2, 2]"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token id -> bias"),
        ({"logit_bias": {"7": 1}}, "logit_bias's token id '7' must be an integer"),
        ({"logit_bias": {10**6: 1}}, "a token id of this model"),
        ({"logit_bias": {-1: 1}}, "a token id of this model"),
        ({"logit_bias": {3: 101}}, "logit_bias[3] must be a finite number in [-100, 100]"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": 9}, "min_tokens=9 exceeds max_new_tokens=8"),
        ({"min_p": 1.5}, "min_p must be a finite number in [0, 1]"),
        ({"min_p": 0.1, "do_sample": False}, "do_sample=False decodes greedily and would ignore min_p"),
    ],
)
def test_bad_values_are_refused_with_the_fix(models, args, words):
    with pytest.raises(GenerationError) as e:
        generate(models[0], [1, 2, 3], "sample" if "min_p" in args else "greedy", 8, **args)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "method,options",
    [
        ("ppd", {"exit_layer": 2, "k": 1, "head": "shared"}),
        ("skipdecode", {}),
        ("early-exit", {"exit_layer": 1}),
        ("bild", {"exit_layer": 1, "head": "shared"}),
    ],
)
def test_methods_that_cannot_apply_them_refuse_them(models, method, options):
    with pytest.raises(GenerationError, match=f"method '{method}' cannot apply repetition_penalty, logit_bias"):
        generate(models[0], [1, 2, 3], method, 8, repetition_penalty=1.2, logit_bias={4: 1.0}, **options)


def test_min_p_is_a_warp_every_sampling_method_takes(models):
    m = models[0]
    r = generate(m, [1, 2, 3], "early-exit", 8, exit_layer=1, seed=0, min_p=1.0, stop_at_eos=False)
    assert r.token_ids == generate(m, [1, 2, 3], "early-exit", 8, exit_layer=1, stop_at_eos=False).token_ids
    with pytest.raises(GenerationError, match="method 'ppd' decodes greedily and would ignore min_p"):
        generate(m, [1, 2, 3], "ppd", 8, exit_layer=2, k=1, head="shared", min_p=0.1)


# -- the command line ---------------------------------------------------------------------------------
def test_generate_command_takes_the_processors(capsys, char_model_dir):
    import json

    import layerleap
    from layerleap.cli import main

    model = layerleap.load_folder(char_model_dir)
    args = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={70: 4.0, 71: -100})
    flags = "--repetition-penalty 1.5 --presence-penalty 0.5 --frequency-penalty -0.25"
    flags += " --logit-bias 70=4 --logit-bias 71=-100"
    for method in ("greedy", "prompt-lookup"):
        argv = ["generate", "--model", str(char_model_dir), "--prompt", "abcabc", "--max-new-tokens", "12", "--json"]
        assert main(argv + ["--method", method, *flags.split()]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == generate(model, "abcabc", "greedy", 12, **args).token_ids
        assert got["token_ids"] != generate(model, "abcabc", "greedy", 12).token_ids
    argv = ["generate", "--model", str(char_model_dir), "--prompt", "ab", "--max-new-tokens", "12", "--json"]
    assert main(argv + ["--method", "sample", "--min-p", "1", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == generate(model, "ab", "greedy", 12).token_ids


def test_generate_command_takes_the_token_filters(capsys, char_model_dir):
    import json

    import layerleap
    from layerleap.cli import main

    model = layerleap.load_folder(char_model_dir)
    plain = generate(model, "abcabc", "greedy", 12)
    word = plain.text.strip()[:1]
    args = dict(allowed_token_ids=sorted(set(plain.token_ids[2:]) | {70, 71}), bad_words=[word])
    flags = ["--allowed-token-ids", *map(str, args["allowed_token_ids"]), "--bad-words", word]
    argv = ["generate", "--model", str(char_model_dir), "--prompt", "abcabc", "--max-new-tokens", "12", "--json"]
    for method in ("greedy", "prompt-lookup"):
        assert main(argv + ["--method", method, *flags]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == generate(model, "abcabc", "greedy", 12, **args).token_ids != plain.token_ids
    assert main(argv + ["--allowed-token-ids", "500"]) == 2
    err = capsys.readouterr().err
    assert "token id 500" in err and "a token id of this model" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags,words",
    [
        ("--repetition-penalty 0", "--repetition-penalty: must be a finite number > 0"),
        ("--presence-penalty 3", "--presence-penalty: must be a finite number in [-2, 2]"),
        ("--frequency-penalty x", "--frequency-penalty: must be a finite number in [-2, 2]"),
        ("--logit-bias 5", "--logit-bias: must be TOKEN_ID=BIAS"),
        ("--logit-bias 5=200", "the bias must be a finite number in [-100, 100]"),
        ("--logit-bias=-1=2", "the token id must be an integer >= 0"),
        ("--logit-bias 500=2", "a token id of this model"),  # after the model loads
        ("--min-tokens -2", "--min-tokens: must be an integer >= 0"),
        ("--min-tokens 9 --max-new-tokens 8", "--min-tokens 9 exceeds --max-new-tokens 8"),
        ("--min-p 2", "--min-p: must be a finite number in [0, 1]"),
        ("--min-p 0.1 --method ppd", "method 'ppd' decodes greedily and would ignore min_p"),
        ("--repetition-penalty 1.2 --method skipdecode", "method 'skipdecode' cannot apply --repetition-penalty"),
        ("--min-tokens 2 --regex [a-c]+", "--min-tokens with a grammar"),
    ],
)
def test_generate_command_refuses_bad_processor_flags(capsys, char_model_dir, flags, words):
    from layerleap.cli import main

    argv = ["generate", "--model", str(char_model_dir), "--prompt", "ab", *flags.split()]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


# -- allowed_token_ids and bad_words ------------------------------------------------------------------
def _filtered_reference(model, prompt, n, allowed=None, bad=()):
    """Greedy with vLLM's token filters over the whole vocabulary: only ``allowed``; each sequence of ``bad``
    never completed (its last token forbidden where the output, the prompt not read, ends with the tokens
    before it)."""
    seq, out = list(prompt), []
    for _ in range(n):
        x = full_logits(model, seq)[-1].float().clone()
        if allowed is not None:
            keep = torch.full_like(x, float("-inf"))
            keep[list(allowed)] = x[list(allowed)]
            x = keep
        for w in bad:
            before = list(w[:-1])
            if len(out) >= len(before) and out[len(out) - len(before) :] == before:
                x[w[-1]] = float("-inf")
        t = int(x.argmax())
        out.append(t)
        seq.append(t)
    return out


def _filters(model, p, n):
    """Filters that change greedy's output on ``p``: allowed ids (some of its tokens, and others); bad words
    (a one-token one, and a two-token one that greedy completes, given as token ids)."""
    plain = generate(model, p, "greedy", n, stop_at_eos=False).token_ids
    allowed = sorted(set(plain[2:9]) | set(range(0, model.config.vocab_size, 7)))
    return plain, [
        {"allowed_token_ids": allowed},
        {"bad_words": [[plain[4]], [plain[1], plain[2]], [p[-1], plain[0]]]},  # the last: the prompt not read
    ]


def _as_reference(args: dict) -> dict:
    return {"allowed": args.get("allowed_token_ids"), "bad": args.get("bad_words", ())}


def test_allowed_token_ids_and_bad_words_equal_the_reference(models):
    m = models[0]
    for seed, plen in [(1, 9), (2, 3)]:
        p = _prompt(m.config.vocab_size, plen, seed)
        plain, filters = _filters(m, p, 24)
        for args in filters:
            got = generate(m, p, "greedy", 24, stop_at_eos=False, **args).token_ids
            assert got == _filtered_reference(m, p, 24, **_as_reference(args)) != plain, args
        assert set(generate(m, p, "greedy", 24, stop_at_eos=False, **filters[0]).token_ids) <= set(
            filters[0]["allowed_token_ids"]
        )


class _Letters:
    """A tokenizer of letters: ``encode`` gives one id per character, a space as id 2."""

    def encode(self, text, add_special_tokens=False):
        return [2 if c == " " else 10 + ord(c) % 100 for c in text]


class _Words(_Letters):
    """Words as one token each, a leading space making another one (as byte-level BPE does)."""

    def encode(self, text, add_special_tokens=False):
        return [(50 if text.startswith(" ") else 10) + len(text.strip())]


def test_bad_words_given_as_text_become_token_sequences():
    from layerleap.decoding import check_processors, get_method

    greedy = get_method("greedy")
    a, b, c = (10 + ord(x) % 100 for x in "abc")
    got = check_processors(greedy, 128, 8, bad_words=["ab", " c"], tokenizer=_Letters())
    assert got["bad_words"] == ((a, b), (c,))  # a space makes a longer sequence here: the word alone
    got = check_processors(greedy, 128, 8, bad_words=["abc", [5, 6]], tokenizer=_Words())
    assert got["bad_words"] == ((13,), (53,), (5, 6))  # with and without the space; token ids as they are
    for bad, words in [
        ("ab", "bad_words must be a list of words"),
        ([""], "bad_words must be a list of words"),
        ([[]], "bad_words must be a list of words"),
        ([[500]], "a token id of this model"),
    ]:
        with pytest.raises(GenerationError, match=words):
            check_processors(greedy, 128, 8, bad_words=bad, tokenizer=_Words())
    with pytest.raises(GenerationError, match="this model has no tokenizer: add its tokenizer files, or give"):
        check_processors(greedy, 128, 8, bad_words=["ab"])
    for bad, words in [([], "non-empty list"), ([3, 128], "a token id of this model"), (5, "non-empty list")]:
        with pytest.raises(GenerationError, match=words):
            check_processors(greedy, 128, 8, allowed_token_ids=bad)
    with pytest.raises(GenerationError, match="allowed_token_ids and bad_words leave no token to choose"):
        check_processors(greedy, 128, 8, allowed_token_ids=[3, 4], bad_words=[[4], [3], [5, 3]])
    with pytest.raises(GenerationError, match="method 'ppd' cannot apply allowed_token_ids"):
        check_processors(get_method("ppd"), 128, 8, allowed_token_ids=[3])


FILTER_METHODS = [
    ("prompt-lookup", lambda m, o: {}),
    ("medusa", EXACT["medusa"][0][1]),
    ("auto", lambda m, o: {}),
    ("speculative", lambda m, o: {"draft": o}),
]


@pytest.mark.parametrize("method,options", FILTER_METHODS, ids=[m for m, _ in FILTER_METHODS])
def test_lossless_methods_equal_greedy_with_the_token_filters(models, method, options):
    """Every node of a drafted tree is filtered by the row's output and then its path: the output is greedy's."""
    m, other = models
    for seed, plen in [(1, 9), (2, 17)]:
        p = _prompt(m.config.vocab_size, plen, seed)
        for args in _filters(m, p, 28)[1]:
            want = generate(m, p, "greedy", 28, stop_at_eos=False, **args).token_ids
            got = generate(m, p, method, 28, stop_at_eos=False, **args, **options(m, other)).token_ids
            assert got == want, (method, seed, args)


@pytest.mark.parametrize(
    "method,options",
    [("greedy", {}), ("sample", {"seed": 1}), ("prompt-lookup", {}), ("medusa", None), ("speculative", {})],
)
def test_filters_that_leave_no_token_are_refused_by_name(models, method, options):
    """``allowed_token_ids`` whose every token ``min_tokens`` or ``bad_words`` forbids (at once, or after the
    output's first token) leaves nothing to choose: a ``GenerationError`` naming them, not a forbidden token
    (greedy's argmax of nothing) or a sampling crash."""
    m, other = models
    options = EXACT["medusa"][0][1](m, other) if options is None else options
    options = {"draft": other, **options} if method == "speculative" else options
    p, eos = _prompt(m.config.vocab_size, 9, 1), m.eos_ids()[0]
    for args, where in [
        ({"allowed_token_ids": [eos], "min_tokens": 3}, "after 0 output tokens: allowed_token_ids and min_tokens"),
        ({"allowed_token_ids": [5], "bad_words": [[5, 5]]}, "after 1 output tokens: allowed_token_ids and bad_words"),
    ]:
        with pytest.raises(GenerationError, match=f"no token is left to choose {where} forbid every token there"):
            generate(m, p, method, 6, **args, **options)
    args = {"allowed_token_ids": [5, 6], "bad_words": [[5, 5], [6, 6]]}  # always one of them left: no refusal
    assert generate(m, p, method, 6, **args, **options).token_ids in ([5, 6, 5, 6, 5, 6], [6, 5, 6, 5, 6, 5])


def test_a_finished_row_the_filters_leave_no_token_samples_on_beside_the_others(models):
    """After its end-of-sequence token a row's filters forbid everything (every bad word starts with it): a
    finished row chooses nothing, so its batch-mates sample on as they do alone."""
    m = models[0]
    eos = m.eos_ids()[0]
    prompts = [_prompt(m.config.vocab_size, 9, s) for s in range(6)]
    args = dict(allowed_token_ids=[5, 6, eos], bad_words=[[eos, 5], [eos, 6], [eos, eos]], logit_bias={eos: 2.0})
    rows = generate(m, prompts, "sample", 12, seed=1, **args)
    alone = [generate(m, p, "sample", 12, seed=row_seed(1, i), **args) for i, p in enumerate(prompts)]
    assert [r.token_ids for r in rows] == [r.token_ids for r in alone]
    assert len({len(r.token_ids) for r in rows}) > 1  # rows that end at different times


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_draft_that_ends_the_row_before_filters_leave_no_token_is_kept(models, do_sample):
    """After the end-of-sequence token the filters forbid everything: a round whose path drafts it has no token
    to choose after it, and keeps it, for the row ends there (greedy decoding never chooses after it)."""
    from layerleap.core.processors import asked
    from layerleap.core.tree import Candidates
    from layerleap.decoding import check_processors, get_method
    from layerleap.methods.draft_verify import EXACT as RULE

    m = models[0]
    eos = m.eos_ids()[0]
    args = dict(allowed_token_ids=[5, 6, eos], bad_words=[[eos, 5], [eos, 6], [eos, eos]])
    procs = check_processors(get_method("greedy"), m.config.vocab_size, 8, **args)
    gen = GenerationConfig(8, do_sample, seed=1 if do_sample else None, eos_ids=(eos,), **procs)
    assert asked(gen)
    run = Run(m, [_prompt(m.config.vocab_size, 9, 1)], gen)
    logits = torch.zeros(3, m.config.vocab_size)
    logits[:, eos] = 50.0  # the target's token: the drafts, 6 then the end-of-sequence token
    logits[0, 6] = 90.0
    path, _ = RULE.accept(run, 0, Candidates.chain(5, [6, eos]), logits)
    assert path == [0, 1]
    assert not run.emit(0, [6]) and run.emit(0, [eos])  # the row ends at the drafted end-of-sequence token


# -- transformers' typical_p, and stop_token_ids ------------------------------------------------------------------
@pytest.mark.parametrize("mass", [1e-6, 0.05, 0.3, 0.9, 0.999])
def test_typical_p_is_transformers_typical_warper(mass):
    """On random logits, alone and after temperature, top-k, top-p and min-p (`transformers`' order), the warp
    keeps the tokens `transformers`' warpers keep, with the same logits."""
    from transformers.generation import logits_process as hf

    for seed, scale in [(0, 0.5), (1, 3.0), (2, 12.0)]:
        x = torch.randn(3, 200, generator=torch.Generator().manual_seed(seed)) * scale
        assert torch.equal(sampling.process_logits(x, typical_p=mass), hf.TypicalLogitsWarper(mass)(None, x.clone()))
        want = x.clone()
        for w in [hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(50), hf.TopPLogitsWarper(0.95)]:
            want = w(None, want)
        want = hf.TypicalLogitsWarper(mass)(None, hf.MinPLogitsWarper(0.02)(None, want))
        got = sampling.process_logits(x, 0.7, 50, 0.95, 0.02, mass)
        assert torch.equal(got.isfinite(), want.isfinite()) and torch.allclose(got, want)


@pytest.mark.parametrize(
    "method,options",
    [("sample", {}), ("prompt-lookup", {}), ("speculative", {"draft_len": 4}), ("self-spec", {"exit_layer": 1})],
)
def test_typical_p_is_a_warp_every_sampling_method_takes(models, method, options):
    """A tiny ``typical_p`` keeps the one token nearest the entropy: every seed of every lossless sampler then
    decodes what the reference (that token at each step) decodes, which is not greedy's."""
    m, other = models
    options = {"draft": other, **options} if method == "speculative" else options
    p = _prompt(m.config.vocab_size, 9, 1)
    seq, want = list(p), []
    for _ in range(20):
        t = int(sampling.process_logits(full_logits(m, seq)[-1:], typical_p=1e-6).argmax())
        want.append(t)
        seq.append(t)
    assert want != generate(m, p, "greedy", 20, stop_at_eos=False).token_ids
    for seed in range(2):
        got = generate(m, p, method, 20, stop_at_eos=False, seed=seed, typical_p=1e-6, **options).token_ids
        assert got == want, (method, seed)
    with pytest.raises(GenerationError, match="method 'ppd' decodes greedily and would ignore typical_p"):
        generate(m, p, "ppd", 8, exit_layer=2, k=1, head="shared", typical_p=0.5)


@pytest.mark.parametrize(
    "method,options", [("greedy", {}), ("prompt-lookup", {}), ("speculative", None), ("ppd", "ppd")]
)
def test_stop_token_ids_end_the_output_before_them(models, method, options):
    """A row that chooses a stop token ends before it (not kept), finish_reason "stop", with ``stop_at_eos``
    False too; ``min_tokens`` holds them off as it holds off the end-of-sequence tokens."""
    m, other = models
    options = {"draft": other} if options is None else options
    options = {"exit_layer": 2, "k": 1, "head": "shared"} if options == "ppd" else options
    p = _prompt(m.config.vocab_size, 9, 1)
    plain = generate(m, p, "greedy", 28, stop_at_eos=False).token_ids
    stop = plain[7]
    cut = plain.index(stop)
    for stop_at_eos in (True, False):
        got = generate(m, p, method, 28, stop_at_eos=stop_at_eos, stop_token_ids=[999 % 97, stop], **options)
        assert got.token_ids == plain[:cut] and got.finish_reason == "stop", (method, got.token_ids)
        assert got.text == m.tokenizer.decode(plain[:cut]) if m.tokenizer is not None else True
    if method == "ppd":
        return
    held = generate(m, p, method, 28, stop_at_eos=False, stop_token_ids=[stop], min_tokens=cut + 2, **options)
    want = generate(m, p, "greedy", 28, stop_at_eos=False, min_tokens=cut + 2, logit_bias={stop: -100}).token_ids
    assert stop not in held.token_ids[: cut + 2] and held.token_ids[: cut + 2] == want[: cut + 2]
    assert held.finish_reason == "stop" and stop not in held.token_ids


def test_stop_token_ids_in_a_batch_end_each_row_alone(models):
    m = models[0]
    prompts = [_prompt(m.config.vocab_size, n, s) for s, n in [(1, 9), (2, 3), (3, 12)]]
    stops = [generate(m, q, "greedy", 10, stop_at_eos=False).token_ids[4] for q in prompts[:1]]
    rows = generate(m, prompts, "greedy", 16, stop_at_eos=False, stop_token_ids=stops)
    assert [r.token_ids for r in rows] == [
        generate(m, q, "greedy", 16, stop_at_eos=False, stop_token_ids=stops).token_ids for q in prompts
    ]
    assert rows[0].finish_reason == "stop" and len(rows[0].token_ids) <= 4


def test_a_stop_token_ends_a_drafted_path_before_the_filters_leave_no_token(models):
    """Greedy chooses the stop token first and ends: the token filters leave nothing after it, where a draft-and-verify
    round's path through it goes on, and greedy never chooses; the round ends there too, not refused."""
    m = models[0]
    p = _prompt(m.config.vocab_size, 6, 1)
    stop = generate(m, p, "greedy", 10, stop_at_eos=False).token_ids[0]
    args = dict(stop_at_eos=False, no_repeat_ngram_size=1, allowed_token_ids=sorted({*p, stop}), stop_token_ids=[stop])
    for method, options in [("greedy", {}), ("speculative", {"draft": m})]:
        got = generate(m, p, method, 10, **args, **options)
        assert got.token_ids == [] and got.finish_reason == "stop", method


@pytest.mark.parametrize(
    "args,words",
    [
        ({"typical_p": 0}, "typical_p must be a finite number in (0, 1], got 0 (1.0 = off)"),
        ({"typical_p": 1.5}, "typical_p must be a finite number in (0, 1]"),
        ({"typical_p": 0.5, "do_sample": False}, "do_sample=False decodes greedily and would ignore typical_p"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be an integer >= 0, got -1 (0 = off)"),
        ({"no_repeat_ngram_size": 1.5}, "no_repeat_ngram_size must be an integer >= 0"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids's token id 1000000 must be"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids's token id '2' must be an integer"),
        ({"eos_token_id": 2}, "use stop_token_ids= for more tokens that end the output"),
    ],
)
def test_transformers_arguments_are_checked_with_the_fix(models, args, words):
    with pytest.raises(GenerationError) as e:
        generate(models[0], [1, 2, 3], "sample" if "typical_p" in args else "greedy", 8, **args)
    assert words in str(e.value)


def test_methods_that_cannot_apply_processors_refuse_no_repeat_ngram_size(models):
    with pytest.raises(GenerationError, match="method 'ppd' cannot apply no_repeat_ngram_size"):
        generate(models[0], [1, 2, 3], "ppd", 8, exit_layer=2, k=1, head="shared", no_repeat_ngram_size=2)


def test_generate_command_takes_the_transformers_arguments(capsys, char_model_dir):
    import json

    import layerleap
    from layerleap.cli import main

    model = layerleap.load_folder(char_model_dir)
    plain = generate(model, "hello world", "greedy", 12)
    argv = ["generate", "--model", str(char_model_dir), "--prompt", "hello world", "--max-new-tokens", "12", "--json"]
    cases = [
        ("--no-repeat-ngram-size 2", dict(no_repeat_ngram_size=2)),
        (f"--stop-token-ids {plain.token_ids[3]} 0", dict(stop_token_ids=[plain.token_ids[3], 0])),
        ("--method sample --seed 2 --typical-p 0.4", dict(do_sample=True, seed=2, typical_p=0.4)),
    ]
    for flags, args in cases:
        assert main(argv + flags.split()) == 0
        got = json.loads(capsys.readouterr().out)
        method = "sample" if "sample" in flags else "greedy"
        want = generate(model, "hello world", method, 12, **args).token_ids
        unwarped = {"do_sample": True, "seed": 2} if method == "sample" else {}
        assert got["token_ids"] == want != generate(model, "hello world", method, 12, **unwarped).token_ids, flags
    for flags, words in [
        ("--typical-p 0", "--typical-p: must be a finite number in (0, 1]"),
        ("--no-repeat-ngram-size -1", "--no-repeat-ngram-size: must be an integer >= 0"),
        ("--stop-token-ids x", "--stop-token-ids: must be an integer >= 0"),
        ("--typical-p 0.5 --method ppd", "method 'ppd' decodes greedily and would ignore typical_p"),
        ("--no-repeat-ngram-size 2 --method skipdecode", "cannot apply --no-repeat-ngram-size"),
        ("--stop-token-ids 500", "token id 500"),  # after the model loads
    ]:
        assert main(argv + flags.split()) == 2, flags
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (flags, err)
