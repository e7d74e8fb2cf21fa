"""Prompt sets read from files: Spec-Bench question.jsonl and prompts files (.jsonl, text)."""

from __future__ import annotations

import json

import pytest

from layerleap.datasets import read_prompts_file, spec_bench
from layerleap.errors import LayerleapError

ROW = {"question_id": 1, "category": "qa", "turns": ["What is a leap?"]}


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return str(path)


def test_a_broken_spec_bench_line_is_named(tmp_path):
    """The error names the file's line that is not JSON (json's own "line 1" is the line's, not the file's)."""
    f = _write(tmp_path / "question.jsonl", [ROW, {**ROW, "question_id": 2}, "{not json"])
    with pytest.raises(LayerleapError, match=r"question\.jsonl:3 is not a Spec-Bench question\.jsonl line"):
        spec_bench(f)


@pytest.mark.parametrize(
    "row,why",
    [
        ({**ROW, "turns": "What is a leap?"}, "turns a list of texts"),  # was read as the prompt "W"
        ({**ROW, "turns": [""]}, "the first non-empty"),
        ({**ROW, "turns": [{"text": "hi"}]}, "turns a list of texts"),
        ({**ROW, "category": ""}, "category non-empty text"),
        ([1, 2], "a JSON list, not an object"),
        ({"question_id": 1, "turns": ["hi"]}, "no category"),
    ],
)
def test_a_spec_bench_line_without_usable_fields_is_refused_with_its_number(tmp_path, row, why):
    f = _write(tmp_path / "question.jsonl", [ROW, row])
    with pytest.raises(LayerleapError, match=r"question\.jsonl:2 is not a Spec-Bench") as e:
        spec_bench(f)
    assert why in str(e.value)


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85", "\x0c", "\x0b", "\x1e"])
def test_a_line_separator_inside_a_prompt_keeps_the_prompt_whole(tmp_path, sep):
    """Lines end at line feeds (or CRs) only: a JSON string may hold U+2028 or U+0085 unescaped
    (``ensure_ascii=False`` writes them so), and a text prompt may hold a form feed."""
    text = f"first{sep}second"
    sb = _write(tmp_path / "question.jsonl", [{**ROW, "turns": [text]}])
    assert [p.text for p in spec_bench(sb)] == [text]
    assert read_prompts_file(_write(tmp_path / "p.jsonl", [json.dumps(text, ensure_ascii=False)])) == [text]
    (tmp_path / "p.txt").write_text(f"{text}\nthird\n")
    assert read_prompts_file(tmp_path / "p.txt") == [text, "third"]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_endings_of_every_kind_end_a_prompt(tmp_path, eol):
    (tmp_path / "p.txt").write_bytes(b"\xef\xbb\xbfone" + eol + b"two" + eol + eol)
    assert read_prompts_file(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "p.jsonl").write_bytes(b'"one"' + eol + eol + b"{bad" + eol)
    with pytest.raises(LayerleapError, match=r"p\.jsonl:3 is not JSON"):
        read_prompts_file(tmp_path / "p.jsonl")
    rows = [json.dumps({**ROW, "question_id": i}).encode() for i in (1, 2)]
    (tmp_path / "q.jsonl").write_bytes(eol.join(rows) + eol)
    assert [p.id for p in spec_bench(tmp_path / "q.jsonl")] == [1, 2]


# -- the splits of the shipped Spec-Bench that must never share a prompt -----------------------------------------
def _ids(prompts) -> set[int]:
    return {p.id for p in prompts}


@pytest.fixture
def fast_spec_bench(monkeypatch):
    """The shipped file read once for the many selections below."""
    import functools

    from layerleap import datasets

    monkeypatch.setattr(datasets, "_read_spec_bench", functools.lru_cache(datasets._read_spec_bench))


def test_calibration_holdout_and_table_prompts_never_overlap(fast_spec_bench):
    """`calibrate` (its largest --prompts), `calibrate --check` and a `bench` within the table prompts use
    disjoint prompts; `bench` says so exactly when its selection reaches the calibration or held-out split
    (lossy methods are what these splits calibrate)."""
    from layerleap.cli import build_parser
    from layerleap.eval import bench
    from layerleap.eval import calibrate as C

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "skipdecode", "--prompts", "21"])  # a split holds 20 per category
    with pytest.raises(LayerleapError):
        C.split_prompts("calibration", 21)
    most = parser.parse_args(["calibrate", "skipdecode", "--prompts", "20"]).prompts
    calibration = _ids(C.split_prompts("calibration", most))
    holdout = _ids(C.split_prompts("holdout", most))
    assert len(calibration) == len(holdout) == most * len(C.CATEGORIES) and not calibration & holdout
    lossy = {"skipdecode": ("skipdecode", {})}
    for cats in (None, ["summarization"], ["qa", "translation"], ["qa"]):
        for offset in (0, 1, 19, 20, 39, 40, 41, 59, 60, 79, 80):
            for n in (1, 2, 20, 39, 40, 41, 80):
                table = _ids(spec_bench(None, cats, n, offset))
                if not table:  # `bench` refuses an empty selection before it says anything else
                    continue
                hit = bool(table & (calibration | holdout))
                warned = bench.calibration_overlap(lossy, cats, n, offset) is not None
                assert hit == warned, (cats, offset, n)
                if offset + n <= C.TABLE_PROMPTS:
                    assert not hit


def test_bild_align_calibrates_on_prompts_sweep_does_not_measure(fast_spec_bench):
    """`align`'s calibration prompts and `sweep bild`'s evaluation prompts, at their defaults."""
    from layerleap.cli import build_parser

    parser = build_parser()
    align = parser.parse_args(["align", "--out", "head.safetensors", "--exit-layer", "2"])
    sweep = parser.parse_args(["sweep", "bild", "--exit-layer", "2"])
    calibrated = _ids(spec_bench(None, align.categories, align.prompts, align.offset))
    measured = _ids(spec_bench(None, sweep.categories, sweep.prompts))
    assert calibrated and measured and not calibrated & measured


def test_bild_sweep_and_align_say_when_their_prompts_overlap(fast_spec_bench, tmp_path):
    """Off their defaults, `sweep bild` (of an aligned form: an exit head file or a small model) and `align`
    note exactly when the sweep's evaluation prompts reach the other's default selection."""
    from layerleap.cli import build_parser
    from layerleap.commands.bild import _align_overlap, _sweep_overlap

    parser = build_parser()
    align = parser.parse_args(["align", "--out", "head.safetensors", "--exit-layer", "2"])
    calibrated = _ids(spec_bench(None, align.categories, align.prompts, align.offset))
    (tmp_path / "aligned.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")  # parsing looks no further
    for form in (["--head", str(tmp_path / "aligned.safetensors")], ["--small", str(tmp_path)]):
        for n in (1, 7, 8, 9, 10, 24, 30):
            sweep = parser.parse_args(["sweep", "bild", *form, "--prompts", str(n)])
            hit = bool(calibrated & _ids(spec_bench(None, sweep.categories, sweep.prompts)))
            note = _sweep_overlap(sweep)
            assert hit == (note is not None), (form, n)
            assert not note or f"prompts 9-{n} of each category" in note
    sweep = parser.parse_args(["sweep", "bild", "--prompts", "10"])  # the shipped trained head: not align's
    assert _sweep_overlap(sweep) is None
    measured = _ids(spec_bench(None, sweep.categories, 8))
    for offset in (0, 3, 7, 8, 9, 20):
        align = parser.parse_args(["align", "--out", "h.safetensors", "--exit-layer", "2", "--offset", str(offset)])
        hit = bool(measured & _ids(spec_bench(None, align.categories, align.prompts, align.offset)))
        assert hit == (_align_overlap(align) is not None), offset


def _calibration_data(tmp_path, per_category: dict) -> str:
    rows = [
        {"question_id": 1000 * k + i, "category": c, "turns": [f"question {i}"], "reference": ["an answer"]}
        for k, (c, n) in enumerate(per_category.items())
        for i in range(n)
    ]
    return _write(tmp_path / "question.jsonl", rows)


def test_a_split_that_holds_fewer_prompts_than_asked_is_refused(tmp_path):
    """A smaller --data file: the split (from index 40 or 60 of each category) holds fewer prompts than asked,
    or none (the held-out check then divided by zero after decoding greedy's outputs)."""
    from layerleap.eval import calibrate as C

    data = _calibration_data(tmp_path, {"summarization": 50, "translation": 65, "math_reasoning": 70})
    with pytest.raises(C.CalibrationError, match="holdout split .* holds 0 summarization, 5 translation prompts"):
        C.split_prompts("holdout", 8, data=data)
    with pytest.raises(C.CalibrationError, match="give 10 prompts per category or fewer, or give a file with at le"):
        C.split_prompts("calibration", 20, data=data)
    assert len(C.split_prompts("calibration", 10, data=data)) == 30


def test_calibrate_check_on_a_file_without_a_holdout_split_exits_2(tmp_path, capsys, char_model_dir, monkeypatch):
    from layerleap.cli import main

    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))
    data = _calibration_data(tmp_path, {"summarization": 60, "translation": 60, "math_reasoning": 60})
    argv = ["calibrate", "early-exit", "--model", str(char_model_dir), "--data", data, "--prompts", "2"]
    rc = main([*argv, "--check", str(tmp_path / "check.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "the holdout split of" in err
    assert not (tmp_path / "check.json").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--offset", "75", "--prompts", "10", "--categories", "writing,qa"], "no prompts of writing left in the "),
        (["--offset", "100"], "no prompts left in the shipped Spec-Bench after --offset 100 (its categories hold at"),
    ],
)
def test_bench_refuses_a_named_category_with_no_prompts_left(capsys, char_model_dir, flags, message):
    """`bench --categories writing,qa --offset 75` measured qa alone: writing (10 questions) gave none, unsaid."""
    from layerleap.cli import main

    argv = ["bench", "--model", str(char_model_dir), "--methods", "greedy", "--no-baseline-hf", "--no-call-cost"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "lower --offset" in err and "Traceback" not in err


def test_bench_says_when_a_category_gives_fewer_prompts_than_asked(capsys, char_model_dir):
    from layerleap.cli import main

    argv = ["bench", "--model", str(char_model_dir), "--methods", "greedy", "--no-baseline-hf", "--no-call-cost"]
    argv += ["--categories", "writing,qa", "--offset", "5", "--prompts", "10", "--max-hours", "1e-9"]
    assert main(argv) == 2  # refused by the time estimate, after the selection
    err = capsys.readouterr().err
    assert "note: writing gives 5 of the 10 prompts per category asked" in err


def test_bench_on_a_copy_of_the_shipped_file_says_it_reaches_the_calibration_split(capsys, tmp_path, char_model_dir):
    """`--data` naming a copy of the shipped questions (the shared one, or one saved with CRLF) has the same
    splits: reaching past the table prompts is said as it is without `--data`; another file's is not."""
    from layerleap.cli import main
    from layerleap.datasets import SHIPPED_SPEC_BENCH

    copy = tmp_path / "question.jsonl"
    copy.write_bytes(SHIPPED_SPEC_BENCH.read_bytes().replace(b"\n", b"\r\n"))
    other = tmp_path / "other.jsonl"
    other.write_text(SHIPPED_SPEC_BENCH.read_text().replace("Summarize", "Sum up"))
    argv = ["bench", "--model", str(char_model_dir), "--methods", "skipdecode", "--no-baseline-hf", "--no-call-cost"]
    argv += ["--categories", "summarization", "--offset", "39", "--prompts", "2", "--max-hours", "1e-9"]
    for data, said in ((None, True), (copy, True), (other, False)):
        assert main(argv + (["--data", str(data)] if data else [])) == 2  # the time estimate stops it
        err = capsys.readouterr().err
        assert ("prompts 41-41 of summarization are the calibration" in err) is said, data


def test_a_json_line_nested_past_the_parsers_depth_is_named_not_a_traceback(tmp_path):
    """A line of brackets nested deeper than json can parse (RecursionError) is refused as any line that is
    not JSON: the file, the line and the fix."""
    from layerleap.train.data import TrainDataError, read_records

    deep = "[" * 100_000
    with pytest.raises(LayerleapError, match=r"p\.jsonl:2 is not JSON \(RecursionError: .*\): write one JSON value"):
        read_prompts_file(_write(tmp_path / "p.jsonl", ['"one"', deep]))
    with pytest.raises(LayerleapError, match=r"question\.jsonl:2 is not a Spec-Bench question\.jsonl line \(Recur"):
        spec_bench(_write(tmp_path / "question.jsonl", [ROW, deep]))
    with pytest.raises(TrainDataError, match=r"line 1 is not a self-distilled record"):
        read_records(_write(tmp_path / "data.jsonl", [deep]))
