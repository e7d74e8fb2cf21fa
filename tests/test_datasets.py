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
