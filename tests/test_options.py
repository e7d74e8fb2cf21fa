"""Method options are declared once (``core.options``) and read by everything the same way: the Python
API (``generate``), the command line (``--opt``) and ``layerleap methods`` agree on every registered
method's option names, defaults and bounds, and refuse a bad value with the declaration's one message."""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from test_cli import cli

import layerleap
from layerleap.core import options as O
from layerleap.decoding import METHODS, GenerationError

SRC = Path(__file__).resolve().parent.parent / "src" / "layerleap"


@pytest.fixture(scope="module")
def tiny(char_model_dir):
    return layerleap.load_folder(char_model_dir)


def _bad(o: O.Option):
    """A value the declaration refuses on any model (None where nothing is refused without a model)."""
    return {
        "int": -1,
        "float": math.nan,
        "bool": "maybe",
        "text": 5,
        "choice": "weird",
        "tree": "a;b",
        "int_list": "x",
        "weights": "/no/such/weights.safetensors",
    }.get(o.kind)


def _text(value) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else str(value)


def _needed(m, model_name: str, skip: str) -> tuple[dict, list[str]]:
    """The required options of ``m`` other than ``skip``, for the API (values) and the CLI (--opt items)."""
    api, argv = {}, []
    for o in m.declared:
        if o.required and o.name != skip:
            api[o.name] = "MODEL" if o.kind == "model" else 1
            argv += ["--opt", f"{o.name}={model_name if o.kind == 'model' else 1}"]
    return api, argv


CASES = [(name, o.name) for name, m in METHODS.items() for o in m.declared if _bad(o) is not None]


def test_every_method_declares_its_signature():
    assert len(CASES) > 30
    for name, m in METHODS.items():
        params = list(inspect.signature(m.fn).parameters.values())[1:]
        assert {p.name: p.default for p in params} == m.options(), name
        assert all(o.kind != "any" for o in m.declared), f"{name}: every built-in option has a type"


@pytest.mark.parametrize("star", ["**options", "*args"])
def test_register_refuses_a_method_taking_options_no_declaration_names(star):
    """``fn(run, **options)`` read as one required option named ``options``: the method would need an
    option no caller can mean; registering it is refused with the fix instead."""
    from layerleap.core.run import register

    ns: dict = {}
    exec(f"def mine(run, {star}):\n    yield", ns)
    said = f"method 'starred': options are named keyword parameters, and {star} names none"
    with pytest.raises(TypeError, match=re.escape(said)):
        register("starred")(ns["mine"])
    assert "starred" not in METHODS


def test_every_default_is_a_value_its_option_accepts():
    """Passing an option's own default (``draft_len=None``, ``--opt draft_len=none``) is never refused: a
    None default says what None means."""
    for name, m in METHODS.items():
        for o in m.declared:
            if not o.required:
                given = {o.name: o.default}
                assert O.check(name, m.declared, given, partial=True) == given, (name, o.name)
                assert o.default is not None or o.none, f"{name}.{o.name}: a None default says what None means"


def test_methods_json_lists_the_declarations(capsys):
    rc, out, _ = cli(capsys, "methods", "--json")
    assert rc == 0
    table = json.loads(out)
    assert set(table) == set(METHODS)
    for name, m in METHODS.items():
        specs = table[name]["option_specs"]
        assert list(specs) == [o.name for o in m.declared], name
        for o in m.declared:
            assert specs[o.name]["bounds"] == o.bounds_text() and specs[o.name]["meaning"] == o.help
            assert specs[o.name]["required"] == o.required
            if not o.required:
                assert specs[o.name]["default"] == o.default == table[name]["options"][o.name]
    rc, out, _ = cli(capsys, "methods")
    for m in METHODS.values():
        for o in m.declared:
            assert f"--opt {o.name}=" in out and o.help in out


@pytest.mark.parametrize("method, option", CASES, ids=[f"{m}.{o}" for m, o in CASES])
def test_cli_and_api_refuse_a_bad_value_alike(capsys, char_model_dir, tiny, method, option):
    m = METHODS[method]
    o = next(x for x in m.declared if x.name == option)
    bad = _bad(o)
    api, argv = _needed(m, str(char_model_dir), option)
    api = {k: tiny if v == "MODEL" else v for k, v in api.items()}
    with pytest.raises(O.OptionError) as before:
        m.check_options({**api, option: bad})  # what the CLI checks before loading
    with pytest.raises(O.OptionError) as after:
        m.check_options({**api, option: bad}, tiny.config)
    with pytest.raises(GenerationError) as e:
        layerleap.generate(tiny, "hi", method, 2, **api, **{option: bad})
    assert str(e.value) == str(after.value) and option in str(e.value)
    rc, _, err = cli(
        capsys, "generate", "--model", char_model_dir, "--prompt", "hi", "--method", method, *argv,
        "--opt", f"{option}={_text(bad)}",
    )  # fmt: skip
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"layerleap generate: error: {before.value}"
    assert "loaded" not in err  # refused before the model loads


@pytest.mark.parametrize("method", list(METHODS))
def test_cli_and_api_refuse_an_unknown_option_alike(capsys, char_model_dir, tiny, method):
    with pytest.raises(GenerationError) as e:
        layerleap.generate(tiny, "hi", method, 2, nosuch=1)
    rc, _, err = cli(
        capsys, "generate", "--model", char_model_dir, "--prompt", "hi", "--method", method, "--opt", "nosuch=1"
    )
    assert rc == 2 and err.strip().splitlines()[-1] == f"layerleap generate: error: {e.value}"
    assert f"method {method!r} has no option nosuch; its options: " in str(e.value)


def test_model_bounds_are_resolved_on_the_model(tiny):
    n = tiny.config.n_layers
    with pytest.raises(GenerationError, match=rf"exit_layer must be an integer in \[1, {n - 1}\] \(n_layers-1 = "):
        layerleap.generate(tiny, "hi", "self-spec", 2, exit_layer=n)
    with pytest.raises(GenerationError, match=rf"in \[{(n + 1) // 2}, {n - 1}\] \(ceil\(n_layers/2\) = "):
        layerleap.generate(tiny, "hi", "ppd", 2, exit_layer=1)
    most = min(tiny.config.vocab_size, O.MAX_CANDIDATES)
    with pytest.raises(GenerationError, match=rf"k must be an integer in \[1, {most}\] \(min\(vocab_size, 64\) = "):
        layerleap.generate(tiny, "hi", "ppd", 2, k=most + 1)


def test_a_model_bound_with_a_most_is_checked_before_the_model():
    """PPD's k is at most 64 on any model (its masks grow with k²): refused without the model."""
    assert O.K.check(64) == 64
    with pytest.raises(O.OptionError, match=r"k must be an integer in \[1, min\(vocab_size, 64\)\], got 65"):
        O.K.check(65)
    assert O.EXIT_LAYER.check(10**6) == 10**6  # no most: left for the check with the model


def test_any_integral_is_an_integer_and_bool_is_not(tiny):
    ref = layerleap.generate(tiny, "hello hello", "self-spec", 6, exit_layer=2, draft_len=2, head="shared")
    for kind in (np.int64, np.int32, int):
        r = layerleap.generate(
            tiny, "hello hello", "self-spec", 6, exit_layer=kind(2), draft_len=kind(2), head="shared"
        )
        assert r.token_ids == ref.token_ids
    with pytest.raises(GenerationError, match="draft_len must be an integer .* got True"):
        layerleap.generate(tiny, "hi", "self-spec", 2, draft_len=True)
    with pytest.raises(GenerationError, match="max_ngram must be an integer .* got 2.0"):
        layerleap.generate(tiny, "hi", "prompt-lookup", 2, max_ngram=2.0)


def test_an_integer_beyond_floats_range_is_refused_by_a_float_option(capsys, char_model_dir, tiny):
    """``float(10**400)`` raises OverflowError: a float option (and ``temperature``) given such an integer
    refuses it with its one message, in Python and on the command line (``--opt`` reads it as an int)."""
    huge = 10**400
    with pytest.raises(GenerationError) as e:
        layerleap.generate(tiny, "hi", "calm", 2, threshold=huge)
    assert str(e.value).startswith("threshold must be a finite number, got 1000")
    with pytest.raises(GenerationError, match="min_confidence must be a finite number in .0, 1., got -1000"):
        layerleap.generate(tiny, "hi", "self-spec", 2, min_confidence=-huge)
    with pytest.raises(GenerationError, match="temperature must be a finite number >= 1e-06, got 1000"):
        layerleap.generate(tiny, "hi", "sample", 2, temperature=huge)
    rc, _, err = cli(
        capsys, "generate", "--model", char_model_dir, "--prompt", "hi", "--method", "calm", "--opt",
        f"threshold={huge}",
    )  # fmt: skip
    assert rc == 2 and "Traceback" not in err and "threshold must be a finite number, got 1000" in err


def test_an_integer_past_pythons_digit_limit_is_refused_with_the_message():
    """``repr`` of an int of more than 4,300 digits raises ValueError: the message names its size instead."""
    with pytest.raises(O.OptionError, match="draft_len must be an integer in .1, 256. .*got an integer of 16610 bits"):
        METHODS["self-spec"].check_options({"draft_len": 10**5000})


@pytest.mark.parametrize("value", ["", "  ", "a\0b"])
def test_a_file_option_given_no_usable_path_is_an_option_error_naming_its_choices(capsys, char_model_dir, value):
    """A weights or model option given an empty text (or a path no file can have) raises ``OptionError``
    like any bad option value; an empty one names the option's choices, not only "give a path"."""
    for method, option, choices in (
        ("self-spec", "head", "head must be one of auto, shared, trained or an existing weights file, got "),
        ("rest", "corpus", "corpus must be one of auto, an existing weights file or none (no corpus), got "),
        ("speculative", "draft", "draft must be a model (layerleap.load(...); on the command line a model name "),
    ):
        with pytest.raises(O.OptionError) as e:
            METHODS[method].check_options({option: value})
        want = choices if not value.strip() else f"{option} contains a NUL character: give a plain path"
        assert str(e.value).startswith(want)
    if not value.strip():
        rc, _, err = cli(
            capsys, "generate", "--model", char_model_dir, "--prompt", "hi", "--method", "self-spec", "--opt",
            f"head={value}",
        )  # fmt: skip
        assert rc == 2 and "head must be one of auto, shared, trained or an existing weights file, got " in err


def test_a_tree_option_refusing_a_shape_names_its_named_trees_too():
    """A misspelt 'dynamic' is no tree shape: the message names 'dynamic' beside the shapes (medusa,
    hidden-transfer), and only the shapes where the option has no named tree (auto)."""
    for method in ("medusa", "hidden-transfer"):
        with pytest.raises(O.OptionError, match=r"cannot read the tree shape 'dynamc': .* \(or 'dynamic'\)$"):
            METHODS[method].check_options({"tree": "dynamc"})
    with pytest.raises(O.OptionError) as e:
        METHODS["auto"].check_options({"tree": "dynamic"})
    assert "cannot read the tree shape 'dynamic'" in str(e.value) and "(or " not in str(e.value)


def test_the_heuristic_schedule_is_listed_as_growing_past_draft_len():
    """With schedule='heuristic' draft_len is the first round's γ, which grows past it: `layerleap methods`
    says so (it read as if draft_len stayed the most)."""
    from tiny_models import random_model

    model = random_model(vocab_size=16)
    r = layerleap.generate(
        model, [1, 2, 3], "speculative", 40, stop_at_eos=False, draft=model, draft_len=2, schedule="heuristic",
        min_confidence=0.0,
    )  # fmt: skip
    assert r.stats.draft.drafted > 2 * r.stats.draft.rounds  # a self-draft is always accepted: γ grows
    for method in ("speculative", "self-spec"):
        schedule = next(o for o in METHODS[method].declared if o.name == "schedule")
        assert "γ starts at draft_len" in schedule.help and "no upper limit" in schedule.help


def test_no_method_checks_its_options_by_hand():
    """The per-method ``check_options`` copies are gone: the declarations are the one checker."""
    for path in (SRC / "methods").glob("*.py"):
        text = path.read_text()
        assert "def check_options" not in text and "isinstance(exit_layer" not in text, path.name
        assert "isinstance(draft_len" not in text and "isinstance(min_confidence" not in text, path.name


# -- sampling flags are used or refused --------------------------------------------------------------
def test_a_temperature_makes_a_sampling_method_sample(capsys, char_model_dir, tiny):
    prompt = "the cat sat on the mat"
    rc, out, _ = cli(
        capsys, "generate", "--model", char_model_dir, "--prompt", prompt, "--method", "self-spec",
        "--temperature", "0.9", "--seed", "1", "--max-new-tokens", "12", "--json",
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out)["token_ids"]
    api = layerleap.generate(tiny, prompt, "self-spec", 12, temperature=0.9, seed=1)
    sampled = layerleap.generate(tiny, prompt, "self-spec", 12, do_sample=True, temperature=0.9, seed=1)
    greedy = layerleap.generate(tiny, prompt, "greedy", 12)
    assert got == api.token_ids == sampled.token_ids != greedy.token_ids
    rc, out, _ = cli(
        capsys, "generate", "--model", char_model_dir, "--prompt", prompt, "--method", "self-spec",
        "--do-sample", "--seed", "1", "--max-new-tokens", "12", "--json",
    )  # fmt: skip
    assert (
        rc == 0 and json.loads(out)["token_ids"] == layerleap.generate(tiny, prompt, "self-spec", 12, seed=1).token_ids
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "greedy", "--temperature", "1.5"], "'greedy' decodes greedily and would ignore temperature"),
        (["--method", "greedy", "--seed", "3"], "would ignore seed: use method 'sample' to sample (--method sample)"),
        (["--method", "ppd", "--top-k", "5", "--top-p", "0.5"], "'ppd' decodes greedily and would ignore top_k, top_p"),
        (
            ["--method", "early-exit", "--opt", "exit_layer=2", "--do-sample", "--method", "ppd"],
            "decodes greedily only",
        ),
    ],
)
def test_ignored_sampling_flags_are_refused(capsys, char_model_dir, argv, message):
    rc, _, err = cli(capsys, "generate", "--model", char_model_dir, "--prompt", "hi", *argv)
    assert rc == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err


def test_training_chains_are_not_draft_trees():
    """A training pass over a long sequence is a chain of any length, not a draft tree (its node limit)."""
    from layerleap.core import tree

    c = tree.chain(600)
    assert c.n == 601 and c.depth == 600 and bool((c.mask == c.mask.new_ones(601, 601).tril()).all())
    small = tree.chain(3)
    assert small.paths == tree.build([1, 1, 1]).paths and bool((small.mask == tree.build([1, 1, 1]).mask).all())


def test_a_command_line_value_is_read_by_its_options_declaration(capsys, tmp_path, monkeypatch):
    """``--opt`` reads a value as its option is declared: a weights, model, choice or text option keeps
    its text (a heads file named ``1`` is a file, not the integer 1), one number is a list of one for a
    list option, and numeric, bool and none values still read as before."""
    from layerleap.commands.basic import _method_options
    from layerleap.eval import bench

    monkeypatch.chdir(tmp_path)
    (tmp_path / "1").write_bytes(b"weights")
    assert _method_options("self-spec", ["head=1", "draft_len=3", "min_confidence=0.5"]) == {
        "head": "1",
        "draft_len": 3,
        "min_confidence": 0.5,
    }
    assert O.HEAD.arg()("1") == "1"  # a command's --head flag reads it the same way
    assert bench.parse_assignments(["schedule=30", "power=2"], method="skipdecode") == {"schedule": [30], "power": 2}
    rest = bench.parse_assignments(["adaptive=false", "corpus=none", "min_ngram=none"], method="rest")
    assert rest == {"adaptive": False, "corpus": None, "min_ngram": None}
    assert bench.parse_assignments(["alpha_rb=inf"], method="bild") == {"alpha_rb": math.inf}
    assert bench.parse_methods("p=self-spec", ["p.head=1", "self-spec.draft_len=2"]) == {
        "p": ("self-spec", {"head": "1", "draft_len": 2})
    }
    with pytest.raises(O.OptionError, match="draft_len must be an integer in .1, 256. .*got 'x'"):
        _method_options("self-spec", ["draft_len=x"])
    rc, _, err = cli(capsys, "generate", "--method", "skipdecode", "--prompt", "hi", "--opt", "schedule=0")
    assert rc == 2 and "schedule must be a list of integers in [1, n_layers]" in err and "got [0]" in err
