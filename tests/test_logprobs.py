"""Log probabilities of the generated tokens (``generate(..., logprobs=N)``, ``Decoding.logprobs``,
``stream``, ``generate --logprobs``): the model's own log-softmax where each token was chosen, checked
against a full forward pass of prompt + output, and equal to greedy's for every lossless method."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import layerleap
from layerleap import Decoding, generate, stream
from layerleap.core.logprobs import MAX_TOP, TokenLogprob, capture, token_bytes
from layerleap.decoding import METHODS, GenerationError
from test_streaming import METHOD_NAMES, method_options
from tiny_models import full_logits

PROMPT = "Tell me a story about a cat. A cat"
LOSSLESS = [name for name, m in METHODS.items() if m.exact]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    """A tiny random model with the real SmolLM2 tokenizer (byte-level BPE)."""
    return layerleap.load_folder(tiny_hf_dir)


@pytest.fixture(scope="module")
def options(tiny):
    return method_options(tiny)


@pytest.fixture(scope="module")
def greedy(tiny):
    return generate(tiny, PROMPT, max_new_tokens=20, stop_at_eos=False, logprobs=5)


def reference(model, prompt_ids: list[int], out: list[int]) -> torch.Tensor:
    """``[len(out), V]``: the log-softmax of a full forward pass of prompt + output at each output token."""
    logits = full_logits(model, prompt_ids + out).float()  # [T, V]
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(out)], -1)


def check_against(ref: torch.Tensor, r, top: int, tol: float = 1e-4) -> None:
    assert len(r.logprobs) == len(r.token_ids)
    for k, (t, e) in enumerate(zip(r.token_ids, r.logprobs)):
        assert isinstance(e, TokenLogprob) and e.token == t
        assert e.logprob == pytest.approx(float(ref[k, t]), abs=tol), k
        assert len(e.top) == top
        vals = [x.logprob for x in e.top]
        assert vals == sorted(vals, reverse=True)
        for x in e.top:
            assert x.logprob == pytest.approx(float(ref[k, x.token]), abs=tol)
        if top:  # the likeliest really are: nothing outside them is likelier than the last
            assert float(ref[k].max()) == pytest.approx(vals[0], abs=tol)


def test_greedy_matches_a_full_forward_pass(tiny, greedy):
    ref = reference(tiny, greedy.prompt_ids, greedy.token_ids)
    check_against(ref, greedy, 5)
    tok = tiny.tokenizer
    assert [e.text for e in greedy.logprobs] == [tok.decode([t]) for t in greedy.token_ids]
    assert all(e.top[0].logprob >= e.logprob - 1e-6 for e in greedy.logprobs)  # greedy chose the argmax
    assert [e.top[0].token for e in greedy.logprobs] == greedy.token_ids


def test_off_by_default_and_zero_is_the_chosen_tokens_only(tiny, greedy):
    plain = generate(tiny, PROMPT, max_new_tokens=20, stop_at_eos=False)
    assert plain.logprobs is None and "logprobs" not in plain.to_dict()
    assert layerleap.TokenLogprob is TokenLogprob and isinstance(greedy.logprobs[0].top[0], layerleap.TopLogprob)
    assert plain.token_ids == greedy.token_ids
    r = generate(tiny, PROMPT, max_new_tokens=20, stop_at_eos=False, logprobs=0)
    assert [e.top for e in r.logprobs] == [()] * 20
    assert [e.logprob for e in r.logprobs] == [e.logprob for e in greedy.logprobs]
    d = r.to_dict()["logprobs"]
    assert d[0] == {"token": r.token_ids[0], "text": r.logprobs[0].text, "logprob": r.logprobs[0].logprob, "top": []}


@pytest.mark.filterwarnings("ignore:rest. no corpus ships")
@pytest.mark.parametrize("method", LOSSLESS)
def test_lossless_methods_report_greedys_logprobs(tiny, options, greedy, method):
    r = generate(tiny, PROMPT, method, max_new_tokens=20, stop_at_eos=False, logprobs=5, **options[method])
    assert r.token_ids == greedy.token_ids
    for a, b in zip(r.logprobs, greedy.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [x.logprob for x in a.top] == pytest.approx([x.logprob for x in b.top], abs=1e-4)
    check_against(reference(tiny, r.prompt_ids, r.token_ids), r, 5)


@pytest.mark.filterwarnings("ignore:rest. no corpus ships")
@pytest.mark.parametrize("method", [m for m in METHOD_NAMES if m not in LOSSLESS])
def test_every_other_method_reports_one_per_token(tiny, options, method):
    """Sampling and the lossy methods: one entry per token, the token's own, a log probability; BiLD's are
    the large model's (its verifying pass), so they equal a full forward pass's."""
    r = generate(tiny, PROMPT, method, max_new_tokens=20, stop_at_eos=False, logprobs=3, **options[method])
    assert [e.token for e in r.logprobs] == r.token_ids and len(r.token_ids) == 20
    assert all(e.logprob <= 0 and len(e.top) == 3 for e in r.logprobs)
    if method in ("sample", "bild"):
        check_against(reference(tiny, r.prompt_ids, r.token_ids), r, 3)
    if method == "early-exit":  # the exit layer's own distribution
        assert [e.top[0].token for e in r.logprobs] == r.token_ids


@pytest.mark.filterwarnings("ignore:rest. no corpus ships")
@pytest.mark.parametrize("method", ["speculative", "prompt-lookup", "eagle", "medusa", "auto"])
def test_sampled_lossless_methods_report_the_models_own(tiny, options, method):
    """Sampling (temperature, top-k, top-p): each token's log probability is the model's own at its
    position, before the warps (a full forward pass's), whichever draft or residual it came from."""
    kw = dict(temperature=0.7, top_k=50, top_p=0.9, seed=2)
    r = generate(tiny, PROMPT, method, max_new_tokens=20, stop_at_eos=False, logprobs=2, **kw, **options[method])
    check_against(reference(tiny, r.prompt_ids, r.token_ids), r, 2)


def test_bild_never_rolling_back_scores_its_last_chain(tiny, options):
    """alpha_rb = inf leaves a chain that fills the output unscored (it could change nothing); with
    logprobs it is scored, so every token has the large model's log probability."""
    opts = dict(options["bild"], alpha_rb=float("inf"))
    want = generate(tiny, PROMPT, "bild", max_new_tokens=20, stop_at_eos=False, **opts)
    r = generate(tiny, PROMPT, "bild", max_new_tokens=20, stop_at_eos=False, logprobs=1, **opts)
    assert r.token_ids == want.token_ids
    check_against(reference(tiny, r.prompt_ids, r.token_ids), r, 1)


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup", "speculative"])
def test_a_batch_reports_each_rows_own(tiny, options, method):
    prompts = [PROMPT, "Hello there", "1 2 3 4 1 2 3 4 1 2"]
    alone = [generate(tiny, p, max_new_tokens=12, stop_at_eos=False, logprobs=2) for p in prompts]
    rs = generate(tiny, prompts, method, max_new_tokens=12, stop_at_eos=False, logprobs=2, **options[method])
    for a, r in zip(alone, rs):
        assert r.token_ids == a.token_ids
        assert [e.logprob for e in r.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-4)


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup", "eagle"])
def test_a_row_that_ends_early_covers_its_tokens(tiny, options, greedy, method):
    """An end-of-sequence token, max_new_tokens, a stop string: the log probabilities cover exactly the
    tokens returned (a drafting round's tokens past the end are not)."""
    eos = greedy.token_ids[6]
    d = Decoding(tiny, PROMPT, method, 20, logprobs=1, **options[method])
    d.gen = dataclasses.replace(d.gen, eos_ids=(eos,))  # before the first round makes the run
    for _ in d:
        pass
    r = d.results[0]
    n = greedy.token_ids.index(eos) + 1
    assert r.token_ids == greedy.token_ids[:n] and r.finish_reason == "stop"
    assert [e.token for e in r.logprobs] == r.token_ids
    stop = greedy.text[len(greedy.text) // 2 :][:3]
    r = generate(tiny, PROMPT, method, max_new_tokens=20, stop_at_eos=False, logprobs=1, stop=stop, **options[method])
    assert r.finish_reason == "stop" and 0 < len(r.token_ids) < 20
    assert [e.token for e in r.logprobs] == r.token_ids == greedy.token_ids[: len(r.token_ids)]
    r = generate(tiny, PROMPT, method, max_new_tokens=3, stop_at_eos=False, logprobs=1, **options[method])
    assert [e.token for e in r.logprobs] == r.token_ids == greedy.token_ids[:3]


def test_a_grammar_reports_the_unmasked_logprobs(tiny):
    """Under a grammar the token is chosen from the allowed ones; its log probability is the model's own
    (before the mask), as vLLM reports by default."""
    grammar = layerleap.Grammar.regex("[ab]+")
    r = generate(tiny, PROMPT, max_new_tokens=8, logprobs=2, grammar=grammar)
    check_against(reference(tiny, r.prompt_ids, r.token_ids), r, 2)
    for method in ("prompt-lookup", "speculative"):
        opts = method_options(tiny)[method]
        g = generate(tiny, PROMPT, method, max_new_tokens=8, logprobs=2, grammar=grammar, **opts)
        assert g.token_ids == r.token_ids
        assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-4)


def test_decoding_and_stream_report_them_as_they_come(tiny, options, greedy):
    d = Decoding(tiny, PROMPT, "prompt-lookup", 20, stop_at_eos=False, logprobs=5, **options["prompt-lookup"])
    seen = []
    for _ in d:
        lps = d.logprobs(0)
        assert [e.token for e in lps] == d.tokens(0)
        assert lps[: len(seen)] == seen
        seen = lps
    assert seen == d.results[0].logprobs
    s = stream(tiny, PROMPT, "speculative", 20, stop_at_eos=False, logprobs=5, **options["speculative"])
    assert s.logprobs == []
    pieces, grown = [], []
    for piece in s:
        pieces.append(piece)
        grown.append(list(s.logprobs))
        assert [e.token for e in s.logprobs] == s.decoding.tokens(0)
    assert "".join(pieces) == greedy.text and [e.token for e in s.result.logprobs] == greedy.token_ids
    assert s.logprobs == s.result.logprobs and all(a == b[: len(a)] for a, b in zip(grown, grown[1:]))
    assert stream(tiny, PROMPT, max_new_tokens=2).logprobs is None
    assert Decoding(tiny, PROMPT, max_new_tokens=4).logprobs(0) is None


@pytest.mark.parametrize("bad", [-1, MAX_TOP + 1, 1.5, True, "3"])
def test_bad_logprobs_are_refused(tiny, bad):
    with pytest.raises(GenerationError, match="logprobs"):
        generate(tiny, PROMPT, max_new_tokens=4, logprobs=bad)


def test_token_bytes_of_a_part_of_a_character(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits it
    assert bytes(b for t in ids for b in token_bytes(tok, t)) == "😀".encode()
    assert token_bytes(tok, tok.encode(" cat", add_special_tokens=False)[0]) == list(b" cat")


def test_cli_generate_logprobs(capsys, tiny_hf_dir, tiny):
    from test_cli import cli

    args = ("generate", "--model", tiny_hf_dir, "--prompt", PROMPT, "--max-new-tokens", 5)
    want = generate(tiny, PROMPT, max_new_tokens=5, logprobs=2)
    rc, out, _ = cli(capsys, *args, "--logprobs", 2, "--json")
    assert rc == 0
    got = json.loads(out)["logprobs"]
    assert got == [e.to_dict() for e in want.logprobs]
    for extra in ((), ("--stream",)):
        rc, out, _ = cli(capsys, *args, "--logprobs", 2, *extra)
        lines = out.splitlines()
        assert rc == 0 and lines[0] == want.text and len(lines) == 1 + 5 + 1  # text, a line a token, stats
        for line, e in zip(lines[1:], want.logprobs):
            assert line.split()[0] == f"{e.logprob:.4f}" and repr(e.text) in line and "top:" in line
    rc, out, _ = cli(capsys, *args, "--json")
    assert "logprobs" not in json.loads(out)
    for bad in (-1, 21, "x"):
        rc, out, err = cli(capsys, *args, "--logprobs", bad)
        assert rc == 2 and "--logprobs" in err and "Traceback" not in err


# -- the server ------------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tiny):
    for module in ("openai", "fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(module)
    from layerleap.server import ServerConfig, ServerThread, create_app

    cfg = ServerConfig("tiny", method="greedy", max_tokens=16, max_batch=4)
    with ServerThread(create_app(tiny, cfg)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _chat_ids(tiny) -> list[int]:
    from layerleap.core.run import chat_token_ids

    return chat_token_ids(tiny.tokenizer, CHAT, add_generation_prompt=True)


def _check_chat_content(content, want, top: int) -> None:
    assert [c.token for c in content] == [e.text for e in want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    for c, e in zip(content, want.logprobs):
        assert bytes(c.bytes).decode("utf-8", "replace") == e.text or "\ufffd" in e.text
        assert [t.token for t in c.top_logprobs] == [t.text for t in e.top] and len(c.top_logprobs) == top


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup", "sample"])
def test_chat_logprobs_equal_generates(tiny, client, method):
    """Chat's logprobs (OpenAI's ``choices[0].logprobs.content``), through the continuous-batching pool
    (greedy, sample) and a batch (prompt lookup), streamed and not: each token's, as ``generate`` gives."""
    extra = {"layerleap": {"method": method}}
    sampled = {"temperature": 0.8, "seed": 5} if method == "sample" else {}
    want = generate(tiny, _chat_ids(tiny), method, 10, stop_at_eos=False, logprobs=3, **sampled)
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=3, **sampled)
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, **extra})
    assert r.choices[0].message.content == want.text
    _check_chat_content(r.choices[0].logprobs.content, want, 3)
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True, **extra}))
    content = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    _check_chat_content(content, want, 3)
    text = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
    assert text == want.text
    for ch in chunks:  # a chunk with text carries its tokens' log probabilities
        for choice in ch.choices:
            if choice.delta.content:
                assert choice.logprobs is not None and choice.logprobs.content


def test_completions_logprobs_have_the_legacy_shape(tiny, client, server):
    """Legacy completions' ``logprobs: N``: tokens, token_logprobs, top_logprobs (text -> log probability)
    and text_offset, streamed and not."""
    want = generate(tiny, PROMPT, max_new_tokens=8, stop_at_eos=False, logprobs=2)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert lp.tokens == [e.text for e in want.logprobs]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[t.text for t in e.top] for e in want.logprobs]
    offsets = [len("".join(e.text for e in want.logprobs[:k])) for k in range(len(want.logprobs))]
    assert lp.text_offset == offsets and r.choices[0].text == want.text
    chunks = list(client.completions.create(**kw, stream=True))
    tokens = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    got_offsets = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.text_offset]
    assert tokens == lp.tokens and got_offsets == offsets
    assert "".join(c.text for ch in chunks for c in ch.choices) == want.text


def test_completions_top_logprobs_hold_the_chosen_token(tiny, client):
    """Legacy completions' ``top_logprobs`` hold the chosen token's log probability where it is not one of the
    likeliest (a logit_bias forces it), as OpenAI and vLLM send it: up to logprobs + 1 entries, streamed, not,
    and in the echoed prompt's."""
    forced = tiny.tokenizer.encode(" cat", add_special_tokens=False)[0]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1)
    body = {"logit_bias": {str(forced): 100}, "ignore_eos": True}
    for r in (
        client.completions.create(**kw, extra_body=body),
        client.completions.create(**kw, echo=True, extra_body=body),
    ):
        lp = r.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            if top is not None:  # (the echoed prompt's first token has none)
                assert top[token] == logprob and len(top) <= 2 and max(top.values()) >= logprob
        assert lp.tokens[-3:] == [" cat"] * 3 and len(lp.top_logprobs[-1]) == 2
    chunks = list(client.completions.create(**kw, stream=True, extra_body=body))
    tops = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.top_logprobs]
    assert tops == client.completions.create(**kw, extra_body=body).choices[0].logprobs.top_logprobs


def test_server_logprobs_cover_the_answer_to_a_stop(tiny, client):
    """A stop string or a stop token ends the answer: its log probabilities are those of the answer's
    tokens (``usage.completion_tokens``), none past them, streamed or not."""
    full = generate(tiny, PROMPT, max_new_tokens=16, stop_at_eos=False, logprobs=0)
    stop = full.text[len(full.text) // 2 :][:3]
    for how in ({"stop": stop}, {"extra_body": {"ignore_eos": True, "stop_token_ids": [full.token_ids[7]]}}):
        extra = how.get("extra_body", {"ignore_eos": True})
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=0, extra_body=extra)
        if "stop" in how:
            kw["stop"] = how["stop"]
        r = client.completions.create(**kw)
        n = r.usage.completion_tokens
        assert 0 < n < 16 and r.choices[0].finish_reason == "stop"
        assert r.choices[0].logprobs.tokens == [e.text for e in full.logprobs[:n]]
        assert r.choices[0].logprobs.top_logprobs is None
        chunks = list(client.completions.create(**kw, stream=True))
        tokens = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
        assert tokens == r.choices[0].logprobs.tokens, how


def test_server_refusals_name_the_field(server):
    import urllib.error
    import urllib.request

    def post(body, path):
        req = urllib.request.Request(
            server + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    chat, text = "/v1/chat/completions", "/v1/completions"
    for body, path, param in (
        ({"messages": CHAT, "top_logprobs": 2}, chat, "top_logprobs"),
        ({"messages": CHAT, "logprobs": False, "top_logprobs": 2}, chat, "top_logprobs"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, chat, "top_logprobs"),
        ({"messages": CHAT, "logprobs": 3}, chat, "logprobs"),
        ({"prompt": "a", "logprobs": 2, "top_logprobs": 2}, text, "top_logprobs"),
        ({"prompt": "a", "logprobs": True}, text, "logprobs"),
    ):
        status, got = post(body | {"max_tokens": 2}, path)
        assert status == 400 and got["error"]["param"] == param, (body, got)
        assert param in got["error"]["message"]
    status, got = post({"messages": CHAT, "max_tokens": 2, "logprobs": True}, chat)
    assert status == 200 and [c["top_logprobs"] for c in got["choices"][0]["logprobs"]["content"]] == [[], []]


def test_a_method_that_chooses_its_own_tokens_is_refused_clearly(tiny, monkeypatch):
    """A registered method that emits tokens it chose itself (not by ``Run.choose`` or ``Run.capture``) has
    no log probabilities to give: asked for them, it fails naming the fix, not with wrong numbers."""
    from test_cli import add_method

    def mine(run):
        run.emit(0, [5, 6])

    add_method(monkeypatch, "mine", mine)
    assert generate(tiny, PROMPT, "mine", max_new_tokens=4).token_ids == [5, 6]
    with pytest.raises(GenerationError, match="Run.capture"):
        generate(tiny, PROMPT, "mine", max_new_tokens=4, logprobs=1)


@pytest.mark.parametrize("name", ["prompt-lookup", "medusa", "auto"])
def test_with_penalties_a_lossless_method_reports_greedys_raw_logprobs(tiny, options, name):
    """Logits processors change the tokens chosen, not the log probabilities reported (the model's own, before
    them): a lossless method with a penalty gives greedy's tokens and log probabilities under the same penalty,
    and they match a full forward pass of its output."""
    procs = dict(repetition_penalty=1.5, presence_penalty=0.5, logit_bias={5: 3.0})
    want = generate(tiny, PROMPT, max_new_tokens=16, stop_at_eos=False, logprobs=2, **procs)
    assert want.token_ids != generate(tiny, PROMPT, max_new_tokens=16, stop_at_eos=False).token_ids
    got = generate(tiny, PROMPT, name, max_new_tokens=16, stop_at_eos=False, logprobs=2, **procs, **options[name])
    assert got.token_ids == want.token_ids
    assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    check_against(reference(tiny, want.prompt_ids, want.token_ids), got, 2)


def test_equal_log_probabilities_are_listed_by_id_lowest_first():
    """Tokens as likely as each other are listed by id, lowest first: greedy's pick among equals (the first
    largest) leads its list, and the ones at the last place are the same whatever ``topk``'s kernel does."""
    torch.manual_seed(0)
    logits = torch.randn(3, 49152) - 5
    for row, ids in enumerate(([100, 7, 40000], [40000, 100, 7], [5, 4, 3, 2, 1])):
        logits[row, ids] = 9.0
    logits[2, 30000] = 10.0
    got = capture(logits, [7, 7, 30000], 4)
    assert [[i for i, _ in tops][:3] for _, _, tops in got[:2]] == [[7, 100, 40000]] * 2
    assert [i for i, _ in got[2][2]] == [30000, 1, 2, 3]  # the likeliest, then the lowest of its equals
    for _, _, tops in got:
        vals = [v for _, v in tops]
        assert vals == sorted(vals, reverse=True) and len(tops) == 4
    assert [i for i, _ in capture(logits[:1], [7], 2)[0][2]] == [7, 100]


def test_a_bfloat16_models_greedy_token_leads_its_likeliest(tiny_hf_dir):
    """bfloat16 logits often tie at the top: greedy's token (the first largest) is the first of its list."""
    model = layerleap.load_folder(tiny_hf_dir, dtype="bfloat16")
    rs = generate(model, [PROMPT, "Hello there", "1 2 3 4"], max_new_tokens=40, stop_at_eos=False, logprobs=3)
    assert [[e.top[0].token for e in r.logprobs] for r in rs] == [r.token_ids for r in rs]


def test_decoding_logprobs_from_a_start_cover_the_tokens_a_stop_string_kept(tiny):
    """``Decoding.logprobs(i, start)`` after a stop string cut a round's tokens: from ``start`` (from the end
    when negative) to the last token kept, not into the round's tokens past it; a start that is no integer is
    refused naming it."""
    opts = dict(draft=tiny, draft_len=4, min_confidence=0.0)  # the model drafts for itself: whole rounds kept
    full = generate(tiny, PROMPT, "speculative", max_new_tokens=16, stop_at_eos=False, **opts)
    stop = tiny.tokenizer.decode(full.token_ids[6:7])  # the 7th token, in the second round of 5
    d = Decoding(tiny, PROMPT, "speculative", 16, stop_at_eos=False, logprobs=1, stop=stop, **opts)
    for _ in d:
        pass
    toks = d.results[0].token_ids
    assert toks == full.token_ids[:7] and len(d._where[0][0].logprobs[0]) > 7
    assert [e.token for e in d.logprobs(0, -1)] == toks[-1:] and [e.token for e in d.logprobs(0, -3)] == toks[-3:]
    assert [e.token for e in d.logprobs(0, 5)] == toks[5:] and d.logprobs(0, -100) == d.logprobs(0)
    assert d.logprobs(0, 7) == [] == d.logprobs(0, 50)
    for bad in (1.5, "1", None, True):
        with pytest.raises(GenerationError, match="start"):
            d.logprobs(0, bad)


def test_reading_them_every_round_types_each_token_once(tiny, monkeypatch):
    """``Decoding.logprobs(i)`` read after every round, as a streaming caller does: each token's text is looked
    up once in all (not once a read: a long answer read token by token would cost its length squared)."""
    import layerleap.core.logprobs as L

    calls = []
    monkeypatch.setattr(L, "token_text", lambda tok, t: calls.append(t) or tok.decode([t]))
    d = Decoding(tiny, PROMPT, max_new_tokens=60, stop_at_eos=False, logprobs=0)
    reads = []
    for _ in d:
        reads.append(d.logprobs(0))
    assert [e.token for e in reads[-1]] == d.results[0].token_ids and len(reads) == 60
    assert all(a == b[: len(a)] for a, b in zip(reads, reads[1:]))
    assert len(calls) <= 60 + 60  # each token once in the reads, once more for the result
    s = stream(tiny, PROMPT, max_new_tokens=60, stop_at_eos=False, logprobs=0)
    calls.clear()
    grown = [s.logprobs for _ in s]
    assert len(calls) <= 60 + 60 and grown[-1] == s.logprobs == d.results[0].logprobs


def test_token_filters_change_the_tokens_not_the_log_probabilities(tiny):
    """allowed_token_ids and bad_words choose among fewer tokens; the log probabilities reported are still the
    model's own over the whole vocabulary (the filtered-out likeliest token stays in the top list)."""
    free = generate(tiny, PROMPT, max_new_tokens=1, stop_at_eos=False, logprobs=2)
    first, second = (t.token for t in free.logprobs[0].top)
    got = generate(tiny, PROMPT, max_new_tokens=6, stop_at_eos=False, logprobs=2, bad_words=[[first]])
    assert got.token_ids[0] != first and got.logprobs[0].top[0].token == first
    check_against(reference(tiny, got.prompt_ids, got.token_ids), got, 2)
    got = generate(tiny, PROMPT, max_new_tokens=6, stop_at_eos=False, logprobs=2, allowed_token_ids=[second, 3])
    assert set(got.token_ids) <= {second, 3} and got.logprobs[0].top[0].token == first
    check_against(reference(tiny, got.prompt_ids, got.token_ids), got, 2)
