"""The HTML bench report: self-contained, every section, the call-cost curve when measured; a headless
Chromium screenshot when Chromium is installed."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

import layerleap
from layerleap.eval import bench
from layerleap.cli import main
from layerleap.eval.report import html_report

CALL_COST = {
    "context": 256,
    "threads": 2,
    "dtype": "float32",
    "points": [
        {"new_tokens": n, "ms": 14.8 + 0.9 * (n - 1), "ratio": (14.8 + 0.9 * (n - 1)) / 14.8} for n in (1, 2, 4, 8, 16)
    ],
}


@pytest.fixture(scope="module")
def report(tiny_hf_dir) -> dict:
    model = layerleap.load_folder(tiny_hf_dir)
    methods = {
        "greedy": ("greedy", {}),
        "skipdecode": ("skipdecode", {"min_exit_layer": 2, "max_exit_layer": 3}),
        "self-spec": ("self-spec", {"exit_layer": 2, "head": "shared"}),
    }
    res = bench.run_bench(
        model,
        methods,
        layerleap.datasets.spec_bench(categories=["qa", "writing"], n=1),
        6,
        progress=False,
        config={"command": "layerleap bench --model tiny --html r.html"},
        call_cost=False,
    )
    return res.to_dict()


def test_report_is_self_contained_and_complete(report):
    page = html_report(report)
    assert page.startswith("<!doctype html>") and page.count("<svg") >= 4
    assert not re.search(r"<script|<link|<img|\bsrc=|\bhref=|url\(|@import", page)
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"] * page.count("<svg")
    cfg = report["config"]
    for text in (
        "layerleap bench --model tiny --html r.html",
        cfg["dtype"],
        f"{cfg['threads']} of",
        cfg["cpu"],
        "transformers",
        "self-spec",
        "skipdecode",
        "qa",
        "writing",
        "Layers per token",
    ):
        assert text in page, text
    s = report["summary"]["self-spec"]
    assert f"{s['tokens_per_s']:.1f}" in page and f"{s['tokens_per_call']:.2f}" in page
    assert s["acceptance"] is not None and f"{s['acceptance']:.0%}" in page


def test_call_cost_curve_when_measured(report):
    absent = html_report(report)
    assert "Not measured" in absent and "milliseconds per model call" not in absent
    with_cost = copy.deepcopy(report)
    with_cost["call_cost"] = CALL_COST
    page = html_report(with_cost)
    assert "Not measured" not in page and "milliseconds per model call" in page
    assert page.count("<circle") == 2 * len(CALL_COST["points"]) and "context of 256 tokens, 2 threads, float32" in page


def test_bench_html_flag(capsys, tiny_hf_dir, tmp_path):
    out, html = tmp_path / "b.json", tmp_path / "b.html"
    rc = main(
        [
            "bench",
            "--model",
            str(tiny_hf_dir),
            "--methods",
            "greedy,sample",
            "--categories",
            "qa",
            "--max-new-tokens",
            "3",
            "--json",
            str(out),
            "--html",
            str(html),
            "--no-baseline-hf",
            "--threads",
            "1",
        ]
    )
    assert rc == 0 and f"wrote {html}" in capsys.readouterr().out
    page = html.read_text()
    assert "<svg" in page and json.loads(out.read_text())["config"]["command"] in page


def _png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the decompressed image data) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + n]
        pos += 12 + n
    return width, height, len(set(zlib.decompress(idat)))


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_report_renders_in_headless_chromium(report, tmp_path):
    if CHROMIUM is None:
        missing = "Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("LAYERLEAP_REQUIRE_CHROMIUM") == "1":  # CI: the browser test must run
            pytest.fail(f"{missing}; LAYERLEAP_REQUIRE_CHROMIUM=1 asks for it")
        print(f"SKIPPED: {missing}")
        pytest.skip(missing)
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    with_cost = dict(report, call_cost=CALL_COST)
    page.write_text(html_report(with_cost))
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1000,1400",
        f"--screenshot={png}",
        page.as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    width, height, colours = _png_size_and_colours(png.read_bytes())
    assert (width, height) == (1000, 1400) and colours > 20  # drawn, not a blank page
    dom = subprocess.run([*cmd[:-2], "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180).stdout
    assert dom.count("<svg") == page.read_text().count("<svg") and "milliseconds per model call" in dom


def test_the_bar_shows_a_prompts_last_run_only_once_it_is_saved():
    class Bar:
        n = 0

        def update(self):
            self.n += 1

    bar = Bar()
    held = bench._LastRunAfterSave(bar, 3)
    for _ in range(3):
        held.update()
    assert bar.n == 2  # the third run waits for the save
    held.saved()
    assert bar.n == 3
    held.update()
    assert bar.n == 4 and held.runs == 1


def _register_flaky(monkeypatch, name: str, longer_than: int) -> None:
    """A method that decodes greedily but raises a RuntimeError on a prompt of more than ``longer_than`` tokens."""
    from layerleap.core.run import register
    from layerleap.methods.baseline import autoregressive_rounds

    monkeypatch.setitem(layerleap.METHODS, name, None)  # removed again after the test

    @register(name, batched=True)
    def flaky(run):
        """Fails on long prompts."""
        if len(run.prompts[0]) > longer_than:
            raise RuntimeError(f"{name} failed on a long prompt")
        yield from autoregressive_rounds(run)


def test_a_method_failing_on_one_prompt_is_reported_and_the_bench_goes_on(capsys, tiny_hf_dir, tmp_path, monkeypatch):
    _register_flaky(monkeypatch, "flaky", 12)
    data = tmp_path / "question.jsonl"
    texts = ["Hi there", "A much longer prompt, with a good many more words in it than the others <b>", "Bye"]
    data.write_text(
        "".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n" for i, t in enumerate(texts))
    )
    out, html = tmp_path / "b.json", tmp_path / "b.html"
    args = ["bench", "--model", str(tiny_hf_dir), "--methods", "greedy,flaky", "--data", str(data), "--prompts", "3"]
    args += ["--max-new-tokens", "3", "--json", str(out), "--html", str(html), "--no-call-cost", "--threads", "1"]
    assert main(args) == 1  # the table and report of every prompt, then a failure's exit code
    captured = capsys.readouterr()
    assert (
        "flaky failed on 1 prompt, first on prompt 1 (qa): RuntimeError: flaky failed on a long prompt" in captured.err
    )
    assert "Traceback" not in captured.err and "flaky" in captured.out
    report = json.loads(out.read_text())
    assert report["complete"] and report["prompts_done"] == 3
    assert [(f["label"], f["prompt_id"]) for f in report["failures"]] == [("flaky", 1)]
    s = report["summary"]
    assert s["greedy"]["prompts"] == 3 and s["transformers"]["prompts"] == 3 and s["flaky"]["prompts"] == 2
    assert s["flaky"]["matches_greedy"] == "2/2"
    assert "flaky failed on 1 prompt" in html.read_text()


def test_a_report_written_through_the_api_can_be_rewritten(tiny_hf_dir, tmp_path):
    model = layerleap.load_folder(tiny_hf_dir)
    out = tmp_path / "b.json"
    for _ in range(2):  # the second run refused the first's file: "not a layerleap report"
        res = bench.run_bench(
            model, {"greedy": ("greedy", {})}, ["Hi"], 2, progress=False, call_cost=False, hf_baseline=False, out=out
        )
    assert json.loads(out.read_text())["records"][0]["new_tokens"] == 2 and res.prompts_done == 1
    assert "(command not recorded)" in html_report(res.to_dict())


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_the_json_report_is_strict_json_with_an_option_of_inf(tiny_hf_dir, tmp_path):
    model = layerleap.load_folder(tiny_hf_dir)
    out = tmp_path / "b.json"
    methods = {"bild": ("bild", {"alpha_rb": float("inf"), "head": "shared"})}  # inf: never roll back
    res = bench.run_bench(model, methods, ["Hi"], 2, progress=False, call_cost=False, hf_baseline=False, out=out)
    report = _strict_json(out.read_text())  # was "alpha_rb": Infinity
    assert report["config"]["methods"]["bild"]["options"]["alpha_rb"] == "inf"
    assert bench.parse_value(report["records"][-1]["options"]["alpha_rb"]) == float("inf")  # --opt reads it back
    res.records[0].ppl = float("inf")  # a perplexity that overflowed
    assert _strict_json(json.dumps(res.to_dict()))["records"][0]["ppl"] is None


def test_a_bench_that_reaches_the_calibration_split_with_a_lossy_method_says_so():
    """Prompts 41+ of summarization, translation and math_reasoning chose the lossy methods' calibrated
    settings: a bench that measures a lossy method there is told, naming the prompts and the fix."""
    from layerleap.eval.bench import calibration_overlap

    lossy = {"calm": ("calm", {}), "greedy": ("greedy", {})}
    lossless = {"medusa": ("medusa", {})}
    assert calibration_overlap(lossy, None, 40) is None  # the table prompts
    assert calibration_overlap(lossy, ["qa", "writing"], 80) is None  # no calibrated category
    assert calibration_overlap(lossless, None, 80) is None  # no lossy method
    said = calibration_overlap(lossy, ["summarization", "qa"], 5, offset=38)
    assert said is not None and "prompts 41-43 of summarization" in said and "(calm)" in said
    assert "--offset + --prompts <= 40" in said


def _rec(i: int, label: str, method: str, calls: int, drafted: int | None, accepted: int | None, wall: float = 1.0):
    acc = accepted / drafted if drafted else None
    return bench.Record(
        i, i, "qa", label, method, {}, 8, 5, wall, 8 / wall, 0.1, calls, 4.0 * calls / 8, 8 / calls, True,
        acceptance=acc, drafted=drafted, accepted=accepted,
    )  # fmt: skip


def test_acceptance_and_tokens_per_call_are_ratios_of_sums_in_table_json_and_html():
    """A drafter that keeps 1 of 10 drafts on one prompt and 2 of 2 on another kept 3 of 12 (25%), not the
    mean of 10% and 100%; 16 tokens in 8 + 2 calls are 1.6 tokens per call, not the mean of 1.0 and 4.0."""
    records = [
        _rec(0, "greedy", "greedy", 8, None, None),
        _rec(0, "pl", "prompt-lookup", 8, 10, 1),
        _rec(1, "greedy", "greedy", 8, None, None),
        _rec(1, "pl", "prompt-lookup", 2, 2, 2),
    ]
    res = bench.BenchResult({"n_prompts": 2}, records, ["greedy", "pl"])
    s = res.summary["pl"]
    assert s["acceptance"] == pytest.approx(3 / 12)
    assert s["tokens_per_call"] == pytest.approx(16 / 10)
    assert s["layers_per_token"] == pytest.approx(4.0 * 10 / 16)  # layer evaluations over tokens
    assert res.to_dict()["summary"]["pl"]["acceptance"] == pytest.approx(0.25)
    row = res.table().splitlines()[-1].split()
    assert "1.60" in row and "25%" in row
    page = html_report(res.to_dict())
    assert "<td>25%</td>" in page and "<td>1.60</td>" in page


def test_bench_records_keep_the_draft_counts_of_their_runs(tiny_hf_dir):
    model = layerleap.load_folder(tiny_hf_dir)
    methods = {"ss": ("self-spec", {"exit_layer": 2, "head": "shared"})}
    res = bench.run_bench(
        model, methods, ["Hi", "Tell me a story"], 6, progress=False, call_cost=False, hf_baseline=False
    )
    rs = [r for r in res.records if r.label == "ss"]
    assert all(r.drafted and r.accepted is not None and r.acceptance == r.accepted / r.drafted for r in rs)
    assert res.summary["ss"]["acceptance"] == pytest.approx(sum(r.accepted for r in rs) / sum(r.drafted for r in rs))


def test_the_full_depth_line_follows_the_greedy_reference_under_any_label():
    """The layers-per-token chart's full-depth line is the greedy reference's, whatever bench labelled it
    (``--methods g=greedy``: ``g``)."""
    records = [
        _rec(i, lb, m, 8 if m == "greedy" else 2, None, None)
        for i in (0, 1)
        for lb, m in (("g", "greedy"), ("pl", "prompt-lookup"))
    ]
    res = bench.BenchResult({"n_prompts": 2}, records, ["g", "pl"], reference="g")
    assert res.summary["g"]["layers_per_token"] == pytest.approx(4.0)
    assert "4 layers (full depth)" in html_report(res.to_dict())


def test_the_html_report_is_utf8_under_a_non_utf8_locale(tmp_path):
    """The page declares charset=utf-8 and holds "×" and the user's text (a non-ASCII label): it is
    written as UTF-8 where the locale's encoding is ASCII, not refused with a UnicodeEncodeError after
    the whole bench ran."""
    path = tmp_path / "r.html"
    script = (
        "import sys; from layerleap.eval import bench; from layerleap.eval.report import write_html_report\n"
        "label = 'caf\\u00e9 \\u65e5\\u672c'\n"  # the script's own text stays ASCII (the command line is)
        "r = bench.Record(0, 0, 'qa', label, 'greedy', {}, 8, 5, 1.0, 8.0, 0.1, 8, 4.0, 1.0, True)\n"
        "res = bench.BenchResult({'n_prompts': 1, 'command': 'x'}, [r], [label])\n"
        "write_html_report(res.to_dict(), sys.argv[1])\n"
    )
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C", "LANG": "C"}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(layerleap.__file__)), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    page = path.read_bytes().decode("utf-8")
    assert "café 日本" in page and 'charset="utf-8"' in page
