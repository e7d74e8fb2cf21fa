"""Prompt (prefix) caching: ``generate(..., prompt_cache=PromptCache())`` reuses the keys and values of the
longest cached prefix and decodes exactly what the call decodes without it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model

from layerleap import METHODS, Decoding, GenerationError, PromptCache, generate, stream
from layerleap.core.prompt_cache import PromptCacheError


def _random_drafter(model, kind: str, seed: int = 0, scale: float = 0.05, **config):
    from layerleap.drafters import medusa_transfer as drafters

    d = drafters.new_drafter(model, kind, **config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return d


def _corpus(model):
    """REST's datastore: the greedy continuation of the first turn (drafts that are right), and a copy
    with every third token changed (drafts that are wrong)."""
    from layerleap.drafters.corpus import Corpus

    V = model.config.vocab_size
    p = _ids(V, 13, 1)
    s = p + generate(model, p, "greedy", 30, stop_at_eos=False).token_ids
    return Corpus([s, [(t + 1) % V if i % 3 == 2 else t for i, t in enumerate(s)]], V)


@pytest.fixture(scope="module")
def model():
    return random_model("llama-mha-untied", seed=11, scale=2.0)


@pytest.fixture(scope="module")
def other():
    return random_model("llama-mha-untied", seed=5, scale=2.0)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# method, options(model, other), generate's other arguments
CASES = {
    "greedy": ("greedy", lambda m, o: {}, {}),
    "sample": ("sample", lambda m, o: {}, {"seed": 7, "temperature": 0.8}),
    "prompt-lookup": ("prompt-lookup", lambda m, o: {"draft_len": 3}, {}),
    "prompt-lookup-sampled": ("prompt-lookup", lambda m, o: {}, {"do_sample": True, "seed": 3}),
    "medusa": ("medusa", lambda m, o: {"tree": "dynamic", "heads": _random_drafter(m, "medusa", steps=3)}, {}),
    "hidden-transfer": (
        "hidden-transfer",
        lambda m, o: {"tree": "dynamic", "transfer": _random_drafter(m, "transfer", layers=[1, 1])},
        {},
    ),
    "rest": ("rest", lambda m, o: {"corpus": _corpus(m)}, {}),
    "auto": ("auto", lambda m, o: {"transfer": None}, {}),
    "self-spec": ("self-spec", lambda m, o: {"exit_layer": 1, "draft_len": 3, "head": "shared"}, {}),
    "eagle": ("eagle", lambda m, o: {"eagle_head": _random_drafter(m, "eagle"), "draft_len": 3}, {}),
    "eagle-attending": (
        "eagle",
        lambda m, o: {"eagle_head": _random_drafter(m, "eagle", attention=True), "draft_len": 3, "width": 2},
        {},
    ),
    "speculative": ("speculative", lambda m, o: {"draft": o, "draft_len": 3, "min_confidence": 0.0}, {}),
    # methods that run without reuse: their KV cache does not hold the full model's keys and values
    "skipdecode": ("skipdecode", lambda m, o: {"min_exit_layer": 1, "max_exit_layer": 2, "warmup": 1}, {}),
    "early-exit": ("early-exit", lambda m, o: {"exit_layer": 1}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_second_turn_equals_the_call_without_the_cache(model, other, case):
    """A chat's second turn (the first turn's prompt and answer, then new text) decodes with the cache
    what it decodes without it, and reuses the first turn's tokens where the method reuses."""
    method, options, extra = CASES[case]
    opts = options(model, other)
    V = model.config.vocab_size
    first = _ids(V, 13, 1)
    pc = PromptCache()
    kw = dict(stop_at_eos=False, **extra, **opts)
    one = generate(model, first, method, 10, prompt_cache=pc, **kw)
    assert one.token_ids == generate(model, first, method, 10, **kw).token_ids
    assert one.stats.cached_prompt_tokens == 0
    second = first + one.token_ids + _ids(V, 6, 2)
    want = generate(model, second, method, 12, **kw)
    got = generate(model, second, method, 12, prompt_cache=pc, **kw)
    assert got.token_ids == want.token_ids
    if case == "eagle-attending":  # its head attends over every prompt position's state: the whole prompt runs
        assert got.stats.cached_prompt_tokens == 0 and len(pc) == 1
    elif METHODS[method].prompt_cache:
        # the first turn's prompt and every output token the method fed back (at least all but the last)
        assert len(first) + len(one.token_ids) - 1 <= got.stats.cached_prompt_tokens < len(second)
        assert got.stats.prompt_layer_evals == want.stats.prompt_layer_evals - (
            got.stats.cached_prompt_tokens * model.config.n_layers
        )
        assert got.stats["cached_prompt_tokens"] == got.stats.cached_prompt_tokens
    else:
        assert got.stats.cached_prompt_tokens == 0
        assert len(pc) == 0  # nothing stored: its keys and values are not the full model's


@pytest.mark.parametrize("case", [c for c in CASES if METHODS[CASES[c][0]].prompt_cache])
def test_stored_keys_and_values_are_a_fresh_prompt_pass(model, other, case):
    """What a method stores is what a prompt pass over its tokens computes (the method's cache held the
    keys and values of the prompt and output, nothing else in their slots)."""
    method, options, extra = CASES[case]
    pc = PromptCache()
    prompts = [_ids(model.config.vocab_size, 11, 3)]
    if METHODS[method].batched:
        prompts.append(_ids(model.config.vocab_size, 5, 4))
    generate(model, prompts, method, 14, prompt_cache=pc, stop_at_eos=False, **extra, **options(model, other))
    assert len(pc) == len(prompts)
    for tokens in pc.entries():
        entry, _ = pc.lookup(model, list(tokens) + [0], torch.float32, "cpu")
        cache = model.new_cache(1, len(tokens))
        with torch.inference_mode():
            n = len(tokens)
            positions = torch.arange(n).unsqueeze(0)
            model.run_layers(model.embed(torch.tensor([tokens])), 0, model.config.n_layers, positions, cache)
        torch.testing.assert_close(entry.k, cache.k[:, 0, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(entry.v, cache.v[:, 0, :, :n], atol=1e-4, rtol=1e-4)


def test_batch_rows_reuse_their_own_prefixes(model):
    """Each row of a batch reuses its own entry, as far as one pass over the same last slots of every
    row allows: a row without a cached prefix makes every row run as many tokens as it has."""
    V = model.config.vocab_size
    a, b = _ids(V, 20, 5), _ids(V, 9, 6)
    pc = PromptCache()
    ra, rb = generate(model, [a, b], "greedy", 6, stop_at_eos=False, prompt_cache=pc)
    a2, b2 = a + ra.token_ids + [1, 2], b + rb.token_ids + [3]
    want = generate(model, [a2, b2], "greedy", 8, stop_at_eos=False)
    got = generate(model, [a2, b2], "greedy", 8, stop_at_eos=False, prompt_cache=pc)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # each row runs 3 tokens (b2's uncached remainder: its last output token and [3])... and a2 its own 3
    assert [r.stats.cached_prompt_tokens for r in got] == [len(a2) - 3, len(b2) - 3]
    c = _ids(V, 4, 7)  # a row with nothing cached: every row runs its last 4 tokens
    want = generate(model, [a2, c], "greedy", 5, stop_at_eos=False)
    got = generate(model, [a2, c], "greedy", 5, stop_at_eos=False, prompt_cache=pc)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.cached_prompt_tokens for r in got] == [len(a2) - 4, 0]


def test_a_prompt_equal_to_or_shorter_than_an_entry_runs_its_last_token(model):
    V = model.config.vocab_size
    p = _ids(V, 15, 8)
    pc = PromptCache()
    r = generate(model, p, "greedy", 6, stop_at_eos=False, prompt_cache=pc)
    for prompt in (p, p[:7], p + r.token_ids[:3], [p[0]]):
        want = generate(model, prompt, "greedy", 6, stop_at_eos=False)
        got = generate(model, prompt, "greedy", 6, stop_at_eos=False, prompt_cache=pc)
        assert got.token_ids == want.token_ids
        assert got.stats.cached_prompt_tokens == len(prompt) - 1
        if prompt == p:  # the same call again: its entry is held already
            assert len(pc) == 1


def test_an_entry_is_evicted_past_the_bound(model):
    V = model.config.vocab_size
    pc = PromptCache(max_tokens=40)
    first, second, third = _ids(V, 15, 9), _ids(V, 15, 10), _ids(V, 15, 11)
    generate(model, first, "greedy", 5, stop_at_eos=False, prompt_cache=pc)  # 19 tokens held
    generate(model, second, "greedy", 5, stop_at_eos=False, prompt_cache=pc)  # 38
    assert len(pc) == 2 and pc.tokens == 38
    generate(model, first + [1], "greedy", 2, stop_at_eos=False, prompt_cache=pc)  # first: the newest
    generate(model, third, "greedy", 5, stop_at_eos=False, prompt_cache=pc)  # second goes (least recent)
    held = pc.entries()
    assert [t[:15] for t in held] == [tuple(first), tuple(third)] and pc.tokens <= 40
    assert generate(model, second, "greedy", 2, prompt_cache=pc).stats.cached_prompt_tokens == 0
    per_token = 2 * model.config.n_layers * model.config.n_kv_heads * model.config.head_dim * 4
    small = PromptCache(max_bytes=10 * per_token)  # an entry over the bound alone is not stored
    generate(model, first, "greedy", 5, stop_at_eos=False, prompt_cache=small)
    assert len(small) == 0 and small.nbytes == 0


def test_another_model_or_dtype_never_hits(model, other):
    V = model.config.vocab_size
    p = _ids(V, 12, 12)
    pc = PromptCache()
    generate(model, p, "greedy", 4, prompt_cache=pc)
    twin = random_model("llama-mha-untied", seed=11, scale=2.0)  # the same weights, another object
    for m in (other, twin):
        got = generate(m, p + [1], "greedy", 4, prompt_cache=pc)
        assert got.stats.cached_prompt_tokens == 0
        assert got.token_ids == generate(m, p + [1], "greedy", 4).token_ids
    # the same model object converted in place (on this CPU its cache may stay fp32: the weights differ)
    m = random_model("llama-mha-untied", seed=11, scale=2.0)
    generate(m, p, "greedy", 4, prompt_cache=pc)
    assert generate(m, p + [1], "greedy", 4, prompt_cache=pc).stats.cached_prompt_tokens == len(p)
    m.to(torch.bfloat16)
    got = generate(m, p + [1], "greedy", 4, prompt_cache=pc)
    assert got.stats.cached_prompt_tokens == 0
    assert got.token_ids == generate(m, p + [1], "greedy", 4).token_ids
    # ... also where its KV cache stays fp32 (a CPU with bf16 instructions keeps an fp32 cache: ``cache_dtype``)
    pc3, kv = PromptCache(), torch.zeros(m.config.n_layers, m.config.n_kv_heads, len(p), m.config.head_dim)
    m.to(torch.float32)
    pc3.store(m, p, kv, kv)
    assert pc3.lookup(m, p + [1], torch.float32, "cpu")[1] == len(p)
    m.to(torch.bfloat16)
    assert pc3.lookup(m, p + [1], torch.float32, "cpu") == (None, 0)


def test_stream_and_decoding_take_the_cache(char_model_dir):
    from layerleap import load

    model = load(str(char_model_dir))
    p = model.tokenizer("a b c d e f")["input_ids"]
    pc = PromptCache()
    d = Decoding(model, p, "greedy", 5, stop_at_eos=False, prompt_cache=pc)
    for _ in d:
        pass
    s = stream(model, p + d.results[0].token_ids, "greedy", 5, stop_at_eos=False, prompt_cache=pc)
    list(s)
    assert s.result.stats.cached_prompt_tokens == len(p) + 4


def test_a_stop_string_keeps_the_tokens_before_it(char_model_dir):
    """A row a stop string ended stores its kept tokens only (those a round accepted past it are not its text)."""
    from layerleap import load

    m = load(str(char_model_dir))
    pc = PromptCache()
    r = generate(m, "abc", "greedy", 20, stop_at_eos=False, prompt_cache=pc)
    text = r.text
    stop = text[3:5]
    cut = generate(m, "abc", "greedy", 20, stop_at_eos=False, stop=stop, prompt_cache=PromptCache())
    pc2 = PromptCache()
    generate(m, "abc", "greedy", 20, stop_at_eos=False, stop=stop, prompt_cache=pc2)
    (held,) = pc2.entries()
    assert list(held) == cut.prompt_ids + cut.token_ids[: len(held) - len(cut.prompt_ids)]
    assert len(held) <= len(cut.prompt_ids) + len(cut.token_ids)


def test_bad_arguments_are_refused(model):
    with pytest.raises(GenerationError, match="prompt_cache must be a layerleap.PromptCache"):
        generate(model, [1, 2], "greedy", 2, prompt_cache={})
    for bad in (0, -5, 1.5, True, "1"):
        with pytest.raises(PromptCacheError, match="max_bytes"):
            PromptCache(max_bytes=bad)
    with pytest.raises(PromptCacheError, match="max_tokens"):
        PromptCache(max_tokens=0)
    with pytest.raises(GenerationError, match="did you mean prompt_cache"):
        generate(model, [1, 2], "greedy", 2, prompt_cahce=PromptCache())


def test_methods_say_whether_they_reuse():
    assert {n for n, m in METHODS.items() if m.prompt_cache} >= {
        "greedy", "sample", "prompt-lookup", "medusa", "hidden-transfer", "auto", "self-spec", "eagle", "speculative",
    }  # fmt: skip
    assert not any(METHODS[n].prompt_cache for n in ("skipdecode", "early-exit", "calm", "bild", "ppd"))


def test_its_sizes_are_read_while_another_thread_stores(model):
    """``tokens``, ``nbytes`` and ``repr`` are read under the lock: a server's worker thread may store meanwhile."""
    import threading

    pc = PromptCache(max_tokens=64)
    kv = torch.zeros(1, 1, 2, 1)
    done = threading.Event()

    def store():
        i = 0
        while not done.is_set():
            i += 1
            pc.store(model, [i, i + 1], kv, kv)

    worker = threading.Thread(target=store)
    worker.start()
    try:
        for _ in range(20000):
            assert pc.tokens <= 64 and pc.nbytes <= 64 * 8
            repr(pc)
    finally:
        done.set()
        worker.join()


def test_its_counters_count_what_each_row_reuses(model):
    """``hits``, ``misses`` and ``reused_tokens`` count the tokens a row reuses, not those it found: a batch
    row with nothing cached makes its batch-mates run their whole prompts, and that is a miss for each."""
    V = model.config.vocab_size
    a = _ids(V, 20, 5)
    pc = PromptCache()
    r = generate(model, a, "greedy", 6, stop_at_eos=False, prompt_cache=pc)
    assert (pc.hits, pc.misses, pc.reused_tokens) == (0, 1, 0)
    a2 = a + r.token_ids + [1, 2]
    got = generate(model, [a2, _ids(V, 40, 7)], "greedy", 2, stop_at_eos=False, prompt_cache=pc)
    assert [x.stats.cached_prompt_tokens for x in got] == [0, 0]
    assert (pc.hits, pc.misses, pc.reused_tokens) == (0, 3, 0)
    got = generate(model, [a2, _ids(V, 4, 8)], "greedy", 2, stop_at_eos=False, prompt_cache=pc)
    assert (pc.hits, pc.misses, pc.reused_tokens) == (1, 4, got[0].stats.cached_prompt_tokens)
    assert got[0].stats.cached_prompt_tokens == len(a2) - 4


def test_a_decoding_kept_after_its_end_holds_no_kv_cache(model):
    """The run keeps its KV cache for the prompt cache until it stores (or breaks off), not as long as the
    ``Decoding`` (a stream's ``result`` read later) lives."""
    import gc

    from layerleap.core.kv_cache import KVCache

    def caches() -> list:
        gc.collect()
        return [o for o in gc.get_objects() if type(o) is KVCache]

    before = caches()  # (others' that live on: a fixture's)

    def held() -> list:
        return [o for o in caches() if not any(o is b for b in before)]

    p = _ids(model.config.vocab_size, 20, 5)
    pc = PromptCache()
    d = Decoding(model, p, "greedy", 6, stop_at_eos=False, prompt_cache=pc)
    list(d)
    assert len(pc) == 1 and held() == []
    closed = Decoding(model, p + [1, 2], "greedy", 30, stop_at_eos=False, prompt_cache=pc)
    next(iter(closed))
    closed.close()  # a stream left early: nothing stored, and its cache goes too
    assert len(pc) == 1 and held() == []
    assert d.results[0].token_ids
