"""Quality metrics for generated text: ROUGE-L (summarization), BLEU (translation) and exact match of
the final numeric answer (math).  Scores are on a 0-100 scale.

``rouge-score`` and ``sacrebleu`` are the `eval` extra (``pip install 'layerleap[eval]'``); a clear
error names it when missing.  Each metric takes candidate texts and reference texts of the same
length; ``score(category, candidates, references)`` picks the metric a Spec-Bench category is
measured with (``METRIC_FOR``).
"""

from __future__ import annotations

import importlib
import re

from ..errors import LayerleapError

# Spec-Bench category -> metric name
METRIC_FOR = {"summarization": "rougeL", "translation": "bleu", "math": "exact_match", "math_reasoning": "exact_match"}
METRICS = ("rougeL", "bleu", "exact_match")


class MetricError(LayerleapError, ValueError):
    pass


def _pairs(candidates: list[str], references: list[str]) -> None:
    if len(candidates) != len(references):
        raise MetricError(f"{len(candidates)} candidates but {len(references)} references: give one reference each")


def _library(module: str, package: str, metric: str):
    """Import a metric's library (on the command line a Ctrl-C during the import waits until it is
    done, as for every heavy library: ``interrupts.HEAVY``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MetricError(f"{metric} needs the package {package}: pip install 'layerleap[eval]'") from None


class _AnyScript:
    """Words and punctuation marks of any script, lower-cased: a tokenizer for ``RougeScorer``."""

    def tokenize(self, text: str) -> list[str]:
        return re.findall(r"\w+|[^\w\s]", text.lower())


def latin_words(text: str) -> bool:
    """Whether ROUGE's own tokenizer finds a word in ``text`` (it keeps a-z and 0-9 alone)."""
    return bool(re.search(r"[a-z0-9]", text.lower()))


def _rouge(kind: str, candidates: list[str], references: list[str], what: str, split=None) -> float:
    """Mean ROUGE F1 x 100 of kind ``kind`` (rouge-score, Porter stemmer) over the pairs.  Where ROUGE's
    own tokenizer finds no word in a text of the pair (Chinese, Cyrillic, only punctuation:
    ``latin_words``), the pair is compared by words and punctuation of any script instead; two empty
    texts score 100.  ``split`` turns a text into the form the scorer reads (ROUGE-Lsum's sentences)."""
    _pairs(candidates, references)
    rouge_scorer = _library("rouge_score.rouge_scorer", "rouge-score", what)
    if not candidates:
        return 0.0
    latin = rouge_scorer.RougeScorer([kind], use_stemmer=True)
    any_script = rouge_scorer.RougeScorer([kind], tokenizer=_AnyScript())
    total = 0.0
    for c, r in zip(candidates, references):
        if split is not None:
            c, r = split(c), split(r)
        if not c.strip() and not r.strip():
            total += 100.0
            continue
        scorer = latin if latin_words(c) and latin_words(r) else any_script
        total += 100.0 * scorer.score(r, c)[kind].fmeasure
    return total / len(candidates)


def rouge_l(candidates: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F1 x 100 (rouge-score, with its Porter stemmer; texts of other scripts: ``_rouge``)."""
    return _rouge("rougeL", candidates, references, "ROUGE-L")


def bleu(candidates: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu, default 13a tokenisation), 0-100."""
    _pairs(candidates, references)
    sacrebleu = _library("sacrebleu", "sacrebleu", "BLEU")
    if not candidates:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(candidates), [list(references)]).score)


_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")  # no minus inside a range ("2013-2014")
_MARKERS = ("####", "answer is", "Answer:", "answer:")


def final_answer(text: str) -> str | None:
    """The answer of a math response: the first number on the line after the last marker ('####',
    'answer is', 'Answer:') that has one, else the last number in the text; commas and trailing zeros
    after a decimal point removed."""
    at = sorted(((text.rfind(m), m) for m in _MARKERS if m in text), reverse=True)
    for i, marker in at:
        end = text.find("\n", i)
        m = _NUMBER.search(text, i + len(marker), len(text) if end < 0 else end)
        if m:
            return _normalise(m.group())
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(num: str) -> str:
    num = num.replace(",", "")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return num


def exact_match(candidates: list[str], references: list[str]) -> float:
    """The percentage of candidates whose final numeric answer equals the reference's (two texts
    without any number match when they are equal after stripping)."""
    _pairs(candidates, references)
    if not candidates:
        return 0.0
    hits = 0
    for c, r in zip(candidates, references):
        a, b = final_answer(c), final_answer(r)
        hits += (a == b) if (a is not None or b is not None) else (c.strip() == r.strip())
    return 100.0 * hits / len(candidates)


def score(metric: str, candidates: list[str], references: list[str]) -> float:
    if metric not in METRICS:
        raise MetricError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    return {"rougeL": rouge_l, "bleu": bleu, "exact_match": exact_match}[metric](candidates, references)


def metric_for(category: str) -> str:
    """The metric a category is scored with (ROUGE-L for categories without a specific one)."""
    return METRIC_FOR.get(category, "rougeL")


# -- SkipDecode's quality tables ------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])\s*|\n+")


def split_sentences(text: str) -> list[str]:
    """Sentences (split after . ! ? followed by a space, after the full-width 。！？ and at newlines):
    ROUGE-Lsum scores newline-separated sentences."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def rouge_lsum(candidates: list[str], references: list[str]) -> float:
    """Mean summary-level ROUGE-Lsum F1 x 100, sentences split by ``split_sentences``."""
    return _rouge("rougeLsum", candidates, references, "ROUGE-Lsum", lambda t: "\n".join(split_sentences(t)))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def compare(candidates: list[str], references: list[str]) -> dict:
    """ROUGE-L, ROUGE-Lsum and BLEU of ``candidates`` against ``references`` in one dict."""
    return {
        "rougeL": rouge_l(candidates, references),
        "rougeLsum": rouge_lsum(candidates, references),
        "bleu": bleu(candidates, references),
        "n": len(candidates),
    }
