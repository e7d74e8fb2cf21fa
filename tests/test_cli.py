"""The command line (generate, info, bench, demo) and the bench harness, on a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import layerleap
from layerleap.eval import bench
from layerleap.cli import main
from layerleap.decoding import METHODS, Method
from layerleap.methods.baseline import autoregressive


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run ``layerleap ARGV`` in-process -> (exit code, stdout, stderr)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


def add_method(monkeypatch, name: str, fn) -> None:
    """Register a method for one test only."""
    layerleap.get_method("greedy")  # the built-ins first
    monkeypatch.setitem(
        METHODS, name, Method(name, fn, batched=False, sampling=False, default_sample=False, description=name)
    )


# -- generate ---------------------------------------------------------------------------------------
def test_generate_json_matches_api(capsys, tiny_hf_dir, tiny):
    rc, out, _ = cli(
        capsys, "generate", "--model", tiny_hf_dir, "--prompt", "The sky is", "--max-new-tokens", 6, "--json"
    )
    assert rc == 0
    assert out.count("\n") == 1  # exactly one JSON object on stdout
    got = json.loads(out)
    assert set(got) == {"text", "token_ids", "stats", "finish_reason"}
    ref = layerleap.generate(tiny, "The sky is", max_new_tokens=6)
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
    assert got["finish_reason"] == ref.finish_reason and ref.finish_reason in ("stop", "length")
    assert got["stats"]["new_tokens"] == len(ref.token_ids) and got["stats"]["method"] == "greedy"


def test_generate_sampling_chat_matches_api(capsys, tiny_hf_dir, tiny):
    rc, out, _ = cli(
        capsys,
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompt",
        "Say hi",
        "--method",
        "sample",
        "--chat",
        "--seed",
        3,
        "--temperature",
        0.8,
        "--top-k",
        50,
        "--top-p",
        0.9,
        "--max-new-tokens",
        5,
        "--json",
    )
    assert rc == 0
    ref = layerleap.generate(
        tiny, "Say hi", method="sample", chat=True, seed=3, temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=5
    )
    assert json.loads(out)["token_ids"] == ref.token_ids


def test_generate_text_and_stats_line(capsys, tiny_hf_dir):
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompt", "Hello", "--max-new-tokens", 3)
    assert rc == 0
    assert "tok/s" in out.strip().splitlines()[-1] and "[greedy] 3 tokens" in out
    assert "loaded" in err and "loaded" not in out


def test_generate_passes_typed_options(capsys, monkeypatch, tiny_hf_dir):
    seen = {}

    def opty(run, k: int = 2, flag: bool = False, scale: float = 1.0, name: str = "x"):
        seen.update(k=k, flag=flag, scale=scale, name=name)
        autoregressive(run)

    add_method(monkeypatch, "opty", opty)
    rc, _, _ = cli(
        capsys,
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompt",
        "Hi",
        "--method",
        "opty",
        "--max-new-tokens",
        2,
        "--opt",
        "k=3",
        "--opt",
        "flag=true",
        "--opt",
        "scale=0.5",
        "--opt",
        "name=abc",
        "--json",
    )
    assert rc == 0
    assert seen == {"k": 3, "flag": True, "scale": 0.5, "name": "abc"}


def test_parse_value_and_methods(monkeypatch):
    assert [bench.parse_value(s) for s in ("3", "-2", "0.5", "1e-3", "true", "False", "none", "abc")] == [
        3,
        -2,
        0.5,
        1e-3,
        True,
        False,
        None,
        "abc",
    ]
    add_method(monkeypatch, "opty", lambda run, k=2, name="x": autoregressive(run))
    specs = bench.parse_methods("greedy, a=opty,b=opty", ["a.k=3", "opty.name=z"])
    assert specs == {"greedy": ("greedy", {}), "a": ("opty", {"k": 3, "name": "z"}), "b": ("opty", {"name": "z"})}
    with pytest.raises(layerleap.LayerleapError, match="--opt a.k is given 2 times: give each option once"):
        bench.parse_methods("greedy, a=opty,b=opty", ["a.k=3", "a.k=4"])  # the last one would win silently


def test_an_option_value_nested_past_the_json_parsers_depth_is_a_clear_error():
    with pytest.raises(layerleap.LayerleapError, match=r"starts like JSON but is not \(brackets nested too deep\)"):
        bench.parse_value("[" * 5000)


def test_a_labels_own_option_overrides_its_methods_in_either_order(monkeypatch):
    add_method(monkeypatch, "opty", lambda run, k=2: autoregressive(run))
    for opts in (["a.k=3", "opty.k=5"], ["opty.k=5", "a.k=3"]):  # a.k was 5 when opty.k came last
        assert bench.parse_methods("a=opty,b=opty", opts) == {"a": ("opty", {"k": 3}), "b": ("opty", {"k": 5})}


def test_a_method_label_may_not_name_a_transformers_row(tiny):
    for label in ("transformers", "transformers-lookup", "transformers-early-exit"):
        with pytest.raises(layerleap.LayerleapError, match=f"method label '{label}' names a transformers baseline"):
            bench.parse_methods(f"{label}=sample")
    # through the API: the method's runs were silently replaced by the baseline's of the same label
    with pytest.raises(layerleap.LayerleapError, match="'tl' names a transformers baseline's row"):
        bench.run_bench(tiny, {"tl": ("sample", {})}, ["Hi"], 2, progress=False, call_cost=False, hf_extra={"tl": {}})


def test_methods_with_required_options_are_skipped(monkeypatch):
    add_method(monkeypatch, "needs_draft", lambda run, draft: autoregressive(run))
    runnable = bench.runnable_methods()
    assert "greedy" in runnable and "sample" in runnable and "needs_draft" not in runnable
    with pytest.raises(layerleap.LayerleapError, match="needs the option draft"):
        bench.parse_methods("needs_draft")
    assert bench.parse_methods("needs_draft", ["needs_draft.draft=m"])["needs_draft"] == ("needs_draft", {"draft": "m"})


def test_probe_methods_skips_methods_that_refuse_their_defaults(monkeypatch, tiny):
    def picky(run, layer=None):
        if layer is None:
            raise layerleap.GenerationError("picky needs layer=L")
        autoregressive(run)

    add_method(monkeypatch, "picky", picky)
    usable, skipped = bench.probe_methods(
        tiny, {"greedy": ("greedy", {}), "picky": ("picky", {}), "p2": ("picky", {"layer": 2})}
    )
    assert list(usable) == ["greedy", "p2"] and skipped == {"picky": "picky needs layer=L"}


# -- bad input: exit code 2, one clear line, no traceback -------------------------------------------
BAD = [
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model"),
    (["generate", "--model", "{D}", "--method", "nope", "--prompt", "hi"], "unknown method"),
    (["generate", "--model", "{D}", "--prompt", "  "], "prompt is empty"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--max-new-tokens", "0"], "positive integer"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--max-new-tokens", "x"], "positive integer"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--opt", "k3"], "bad option"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--opt", "k=3"], "has no option k"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--temperature", "0"], "temperature"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--dtype", "int8"], "invalid choice"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--threads", "0"], "must be an integer in [1, "),
    (["info", "--model", "no-such-model"], "unknown model"),
    (["bench", "--model", "{D}", "--categories", "nope"], "unknown Spec-Bench categories"),
    (["bench", "--model", "{D}", "--methods", "greedy,nope"], "unknown method"),
    (["bench", "--model", "{D}", "--methods", "a=greedy,a=sample"], "used twice"),
    (["bench", "--model", "{D}", "--opt", "greedy.k"], "bad option"),
    (["bench", "--model", "{D}", "--opt", "k=1"], "METHOD.NAME=VALUE"),
    (["bench", "--model", "{D}", "--opt", "other.k=1"], "names no method"),
    (["bench", "--model", "{D}", "--opt", "greedy.k=1"], "has no option k"),
    (["bench", "--model", "{D}", "--prompts", "0"], "positive integer"),
    (["bench", "--model", "{D}", "--data", "/no/such/question.jsonl"], "not found"),
    (["bench", "--model", "{D}", "--data", "{GARBAGE}"], "not a Spec-Bench"),
    (["bench", "--model", "{D}", "--json", "{DIR}"], "is a folder"),
    (["bench", "--model", "no-such-model", "--categories", "qa"], "unknown model"),
    (["demo", "--model", "{D}", "--categories", "nope"], "unknown Spec-Bench categories"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[:1] + a[3:]) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, tiny_hf_dir, argv, message):
    garbage = tmp_path / "q.jsonl"
    garbage.write_text("{not json\n")
    subs = {"{D}": str(tiny_hf_dir), "{GARBAGE}": str(garbage), "{DIR}": str(tmp_path)}
    rc, out, err = cli(capsys, *[subs.get(a, a) for a in argv])
    assert rc == 2
    assert "Traceback" not in err + out
    last = err.strip().splitlines()[-1]
    assert "error" in last and message in last, err


def test_bad_input_subprocess_has_no_traceback():
    script = Path(sys.executable).with_name("layerleap")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "layerleap"]
    p = subprocess.run(
        cmd + ["generate", "--model", "no-such-model", "--prompt", "hi"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()]  # one line
    assert "unknown model 'no-such-model'" in p.stderr


# -- info -------------------------------------------------------------------------------------------
def test_info_json(capsys, tiny_hf_dir, tiny):
    rc, out, _ = cli(
        capsys, "info", "--model", tiny_hf_dir, "--json", "--buffer-mb", 8, "--repeats", 1, "--context", 100
    )
    assert rc == 0
    d = json.loads(out)
    c = tiny.config
    assert (d["layers"], d["hidden_size"], d["heads"], d["kv_heads"], d["vocab_size"]) == (
        c.n_layers,
        c.hidden_size,
        c.n_heads,
        c.n_kv_heads,
        c.vocab_size,
    )
    assert d["parameters"] == tiny.n_params()  # untied: no duplicate head
    assert d["weight_bytes"] == 4 * d["parameters"]
    assert d["kv_bytes_per_token"] == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    rl, bw = d["roofline"], d["bandwidth"]
    assert bw["sum_gbs"] > 0 and bw["gemv_gbs"] > 0
    assert rl["bytes_per_token"] == rl["weight_bytes_per_token"] + 100 * d["kv_bytes_per_token"]
    assert rl["tokens_per_s_gemv"] == pytest.approx(bw["gemv_gbs"] * 1e9 / rl["bytes_per_token"])


def test_info_text(capsys, tiny_hf_dir):
    rc, out, _ = cli(capsys, "info", "--model", tiny_hf_dir, "--buffer-mb", 8, "--repeats", 1)
    assert rc == 0
    for word in ("layers", "KV cache", "bandwidth", "roofline", "tok/s"):
        assert word in out


def test_info_call_cost_saves_the_curve_that_draft_lengths_use(capsys, tmp_path, monkeypatch, tiny_hf_dir, tiny):
    from layerleap.drafters.lengths import curve_for

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv("LAYERLEAP_CALL_COST")
    assert curve_for(tiny).source == "shipped"
    rc, out, _ = cli(capsys, "info", "--model", tiny_hf_dir, "--buffer-mb", 8, "--repeats", 1, "--call-cost")
    assert rc == 0 and "S=16" in out and "saved for this machine" in out
    (entry,) = json.loads((tmp_path / "call_cost.json").read_text()).values()
    assert sorted(map(int, entry["ratios"])) == [1, 2, 3, 4, 5, 6, 7, 8, 16] and entry["ms_one_token"] > 0
    curve = curve_for(tiny)
    assert curve.source == "measured" and curve(1) == 1.0
    assert all(a <= b for a, b in zip(curve.costs, curve.costs[1:]))  # held at its running maximum
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "a-file"))  # a cache that cannot be written: said so
    rc, out, _ = cli(capsys, "info", "--model", tiny_hf_dir, "--buffer-mb", 8, "--repeats", 1, "--call-cost")
    where = tmp_path / "a-file" / "call_cost.json"
    assert rc == 0 and f"not saved: {where} cannot be written; set LAYERLEAP_CACHE to a writable folder" in out


def test_info_call_cost_measured_while_others_run_keeps_the_saved_curve(capsys, tmp_path, monkeypatch, tiny_hf_dir):
    from layerleap.eval import roofline

    class Busy:  # other processes held half the CPUs during the measurement
        share = 0.5

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv("LAYERLEAP_CALL_COST")
    args = ("info", "--model", tiny_hf_dir, "--buffer-mb", 8, "--repeats", 1, "--call-cost")
    monkeypatch.setattr(roofline, "OtherLoad", Busy)
    rc, out, _ = cli(capsys, *args)  # nothing saved yet: the busy measurement is saved
    assert rc == 0 and "saved for this machine" in out and "other processes used 50% of the CPUs" in out
    path = tmp_path / "call_cost.json"
    path.write_text(path.read_text().replace('"1": 1.0,', '"1": 0.999,'))  # mark the saved curve
    before = path.read_text()
    rc, out, _ = cli(capsys, *args, "--json")
    assert rc == 0 and path.read_text() == before
    d = json.loads(out)["call_cost"]
    assert d["saved"] is False and d["kept_saved"] is True and d["other_cpu_share"] == 0.5
    rc, out, _ = cli(capsys, *args)
    assert "not saved: other processes were running" in out and path.read_text() == before


# -- bench ------------------------------------------------------------------------------------------
def test_bench_json(capsys, tmp_path, tiny_hf_dir, tiny):
    out_file = tmp_path / "b.json"
    rc, out, err = cli(
        capsys,
        "bench",
        "--model",
        tiny_hf_dir,
        "--methods",
        "greedy,sample",
        "--categories",
        "qa",
        "--prompts",
        1,
        "--max-new-tokens",
        4,
        "--seed",
        0,
        "--threads",
        1,
        "--json",
        out_file,
    )
    assert rc == 0
    assert out.startswith("$ layerleap bench --model")
    assert "transformers" in out and "vs HF" in out and "bench" in err  # table on stdout, progress on stderr
    d = json.loads(out_file.read_text())
    cfg = d["config"]
    assert cfg["command"].startswith("layerleap bench") and cfg["threads"] == 1 and cfg["dtype"] == "float32"
    assert {"torch", "date", "cpu_cores", "model", "max_new_tokens"} <= set(cfg)
    assert cfg["other_cpu_share"] is None or 0 <= cfg["other_cpu_share"] <= 1  # (None: no /proc/stat)
    assert 0 <= d["call_cost"]["other_cpu_share"] <= 1 or d["call_cost"]["other_cpu_share"] is None
    assert d["complete"] and not d["interrupted"] and d["prompts_done"] == 1
    recs = {r["label"]: r for r in d["records"]}
    assert set(recs) == {"greedy", "sample", "transformers"}
    assert all(r["new_tokens"] == 4 for r in recs.values())
    g = recs["greedy"]
    assert g["matches_hf"] is True and g["token_ids"] == recs["transformers"]["token_ids"]
    assert recs["sample"]["matches_hf"] is None  # sampling: no token check
    assert g["speedup_vs_greedy"] == 1.0 and g["speedup_vs_hf"] > 0
    prompt = layerleap.datasets.spec_bench(categories=["qa"], n=1)[0]
    ref = layerleap.generate(tiny, prompt.text, max_new_tokens=4, stop_at_eos=False)
    assert g["token_ids"] == ref.token_ids and g["prompt_id"] == prompt.id
    s = d["summary"]
    assert set(s) == {"greedy", "sample", "transformers"}
    assert s["greedy"]["matches_hf"] == "1/1" and s["transformers"]["speedup_vs_hf"] == pytest.approx(1.0)


def test_bench_offset_takes_later_prompts_of_each_category(capsys, tmp_path, tiny_hf_dir):
    out_file = tmp_path / "b.json"
    args = ["bench", "--model", tiny_hf_dir, "--methods", "greedy", "--categories", "qa,translation"]
    args += ["--prompts", 1, "--offset", 2, "--max-new-tokens", 2, "--no-baseline-hf", "--no-call-cost"]
    rc, out, err = cli(capsys, *args, "--threads", 1, "--json", out_file)
    assert rc == 0
    want = [p.id for c in ("qa", "translation") for p in layerleap.datasets.spec_bench(categories=[c], n=3)[2:]]
    got = sorted({r["prompt_id"] for r in json.loads(out_file.read_text())["records"]})
    assert got == sorted(want) and len(got) == 2
    rc, out, err = cli(capsys, "bench", "--model", tiny_hf_dir, "--offset", "-1")
    assert rc == 2 and "--offset" in err and "Traceback" not in err


def test_bench_says_which_rows_sample(capsys, tiny_hf_dir):
    """A sampling flag applies to the methods that sample by default; --do-sample to every method that
    can; the header names them and how they sample."""
    args = ["bench", "--model", tiny_hf_dir, "--methods", "sample,prompt-lookup", "--categories", "qa"]
    args += ["--prompts", 1, "--max-new-tokens", 2, "--no-baseline-hf", "--no-call-cost", "--no-quality"]
    rc, out, err = cli(capsys, *args, "--threads", 1, "--temperature", "0.7", "--seed", 4)
    assert rc == 0, err
    assert "sampling (temperature 0.7, seed 4): sample; the other rows decode greedily" in out
    rc, out, err = cli(capsys, *args, "--threads", 1, "--do-sample")
    assert rc == 0, err
    assert "sampling (defaults): sample, prompt-lookup;" in out
    rc, out, err = cli(capsys, *args[:4], "greedy", *args[5:], "--threads", 1)
    assert rc == 0 and "sampling" not in out


def test_bench_call_cost_and_transformers_extras(capsys, tmp_path, tiny_hf_dir, tiny):
    out_file = tmp_path / "b.json"
    rc, out, _ = cli(
        capsys,
        "bench",
        "--model",
        tiny_hf_dir,
        "--methods",
        "greedy,prompt-lookup",
        "--categories",
        "summarization",
        "--prompts",
        1,
        "--max-new-tokens",
        6,
        "--threads",
        1,
        "--hf-extra",
        "lookup:4",
        "--hf-extra",
        "early-exit:1",
        "--json",
        out_file,
    )
    assert rc == 0
    d = json.loads(out_file.read_text())
    recs = {r["label"]: r for r in d["records"]}
    assert {"transformers-lookup", "transformers-early-exit", "prompt-lookup"} <= set(recs)
    want = recs["greedy"]["token_ids"]
    labels = ("transformers-lookup", "transformers-early-exit", "prompt-lookup")
    assert all(recs[k]["token_ids"] == want for k in labels)
    cc = d["call_cost"]
    assert [p["new_tokens"] for p in cc["points"]] == [1, 2, 4, 8, 16] and cc["points"][0]["ratio"] == 1.0
    assert all(p["ms"] > 0 for p in cc["points"]) and d["config"]["cpu"] and len(d["config"]["load_average"]) == 3
    rc, _, err = cli(capsys, "bench", "--model", tiny_hf_dir, "--hf-extra", "early-exit:99", "--no-call-cost")
    assert rc == 2 and "assistant_early_exit" in err
    short = ("--methods", "greedy", "--categories", "qa", "--max-new-tokens", 2, "--no-call-cost")
    rc, _, err = cli(
        capsys, "bench", "--model", tiny_hf_dir, *short, "--hf-extra", "lookup:3", "--hf-extra", "lookup:5"
    )
    assert rc == 2 and "transformers-lookup is given twice" in err  # lookup:3 was dropped silently


def test_bench_interrupted_keeps_finished_prompts(capsys, monkeypatch, tmp_path, tiny_hf_dir):
    calls = []

    def boom(run):  # warm-up, prompt 1, then Ctrl-C during prompt 2
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        autoregressive(run)

    add_method(monkeypatch, "boom", boom)
    out_file = tmp_path / "b.json"
    rc, out, err = cli(
        capsys,
        "bench",
        "--model",
        tiny_hf_dir,
        "--methods",
        "greedy,boom",
        "--categories",
        "qa",
        "--prompts",
        2,
        "--max-new-tokens",
        3,
        "--no-baseline-hf",
        "--json",
        out_file,
    )
    assert rc == 130 and "interrupted: 1 of 2 prompts" in err
    d = json.loads(out_file.read_text())
    assert d["interrupted"] and not d["complete"] and d["prompts_done"] == 1
    assert [(r["prompt_index"], r["label"]) for r in d["records"]] == [(0, "greedy"), (0, "boom")]
    assert set(d["summary"]) == {"greedy", "boom"}
    assert "boom" in out  # the table of what finished


def test_run_bench_writes_after_every_prompt(tmp_path, tiny):
    out_file = tmp_path / "b.json"
    seen = []

    def check(result):
        d = json.loads(out_file.read_text())  # valid JSON on disk after each prompt
        seen.append((d["prompts_done"], len(d["records"]), d["complete"]))

    res = bench.run_bench(
        tiny,
        {"s": ("sample", {})},
        ["Hello", "Tell me more"],
        3,
        hf_baseline=False,
        sampling={"seed": 0},
        out=out_file,
        progress=False,
        on_prompt=check,
    )
    assert res.labels == ["greedy", "s"]  # plain greedy added as the reference
    assert seen == [(1, 2, False), (2, 4, True)]
    assert "greedy" in res.table() and res.summary["s"]["prompts"] == 2


def test_run_bench_repeat_keeps_each_methods_fastest_round(tiny, monkeypatch):
    walls = iter([5.0, 1.0, 2.0, 9.0, 3.0, 4.0])  # greedy, s; greedy, s; greedy, s
    real = bench._record

    def timed(*a, **kw):
        rec = real(*a, **kw)
        rec.wall_s = next(walls)
        return rec

    monkeypatch.setattr(bench, "_record", timed)
    res = bench.run_bench(
        tiny, {"s": ("prompt-lookup", {})}, ["Hello"], 3, hf_baseline=False, progress=False, repeat=3, call_cost=False
    )
    assert {r.label: r.wall_s for r in res.records} == {"greedy": 2.0, "s": 1.0}
    assert res.config["repeat"] == 3 and res.summary["s"]["speedup_vs_greedy"] == 2.0


# -- demo -------------------------------------------------------------------------------------------
def test_demo_on_tiny_model(capsys, tiny_hf_dir, tmp_path):
    html = tmp_path / "demo.html"
    rc, out, _ = cli(
        capsys, "demo", "--model", tiny_hf_dir, "--max-new-tokens", 3, "--categories", "qa", "--html", html
    )
    assert rc == 0
    for method in bench.probe_methods(layerleap.load_folder(tiny_hf_dir), bench.runnable_methods())[0]:
        assert f"\n{method}: 3 tokens" in out  # every built-in method that runs without a second model
    assert "transformers" in out and "demo finished" in out and str(html) in out
    assert "<svg" in html.read_text()


def test_demo_interrupted_in_its_bench(capsys, tiny_hf_dir, tmp_path, monkeypatch):
    """Ctrl-C during the demo's bench: exit 130 with bench's line on the prompts it finished (its page
    written), and no "demo finished" after it."""
    real = bench.run_bench

    def interrupted(*a, **kw):
        result = real(*a, **kw)
        result.interrupted = True  # as a KeyboardInterrupt inside run_bench leaves it
        return result

    monkeypatch.setattr(bench, "run_bench", interrupted)
    html = tmp_path / "demo.html"
    rc, out, err = cli(
        capsys, "demo", "--model", tiny_hf_dir, "--max-new-tokens", 2, "--categories", "qa", "--html", html
    )
    assert rc == 130 and "demo finished" not in out and html.exists()
    assert err.strip().splitlines()[-1].startswith("interrupted: ")


def test_command_groups_and_duplicate_names(capsys):
    from layerleap import cli, commands

    parser = cli.build_parser()
    args = parser.parse_args(["eval", "skipdecode-speed", "--targets", "2"])
    assert (args._name, args.what) == ("eval skipdecode-speed", "skipdecode-speed")
    with pytest.raises(SystemExit) as e:  # a group needs a member
        parser.parse_args(["sweep"])
    assert e.value.code == 2
    with pytest.raises(RuntimeError, match="registered twice"):
        commands.command("sweep bild", help="again")(lambda p: None)(lambda a: 0)


def test_other_load_counts_another_process_cpu_time():
    import subprocess
    import sys

    from layerleap.core.cpu import OtherLoad

    spin = "import time\nwhile time.process_time() < 0.6: pass"  # 0.6 s of CPU time, however long it takes
    with OtherLoad() as other:
        subprocess.run([sys.executable, "-c", spin], check=True)
    if other.share is None:
        pytest.skip("this system does not report its CPUs' busy time (/proc/stat)")
    assert other.seconds >= 0.55 and 0 < other.share <= 1.0


def test_a_label_with_dots_takes_its_options_after_the_last_dot(monkeypatch):
    """An option's name has no dot, so ``LABEL.NAME`` splits at the last one: a label may hold dots."""
    add_method(monkeypatch, "opty", lambda run, k=2, name="x": autoregressive(run))
    specs = bench.parse_methods("a=opty,a.b=opty,v1.5=opty", ["a.b.k=3", "a.k=4", "v1.5.name=5", "opty.k=7"])
    assert specs == {
        "a": ("opty", {"k": 4}),
        "a.b": ("opty", {"k": 3}),
        "v1.5": ("opty", {"k": 7, "name": "5"}),  # an undeclared text option keeps a numeric-looking text
    }
    for bad in ("a.b.=3", ".k=3", "k=3"):
        with pytest.raises(layerleap.LayerleapError, match="write METHOD.NAME=VALUE"):
            bench.parse_methods("a.b=opty", [bad])
