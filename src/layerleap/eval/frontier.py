"""The quality-speed frontier of the lossy methods (SkipDecode's Table 4/5 and Figure 4, BiLD's
Figures 5 and 7), on one or more models (the base and its fine-tuned variants).

For every category the prompts decode one at a time (batch 1 for every method), interleaved: for
each prompt the base model's greedy decoding, then every point ``(model, method, options)``, back to
back, so that speed-ups are ratios measured in one run under the same load (a change of load hits
greedy and every point alike).  Per point and
category:

- ``score``: the category's measure against Spec-Bench's references (``quality.metric_for``:
  ROUGE-L for summarization, BLEU for translation, exact match of the final number for math);
  ``score_share`` = score / greedy's score (None where greedy scores 0);
- ``agreement``: ROUGE-L of the output against the base model's greedy output (100 = the same text);
- ``ppl_ratio``: the base model's perplexity of the output over its perplexity of greedy's output
  (teacher-forced after the prompt; 1 = as fluent to the full model as greedy's own text);
- ``layers_per_token`` (decoder layers run per generated token) and ``implied_speedup`` =
  n_layers / layers_per_token; ``speedup`` = greedy's wall time / the point's (generation, prompt
  included, both decoded the same way: each stops at its end-of-sequence token, so a point that ends
  sooner gains by it) and ``speedup_per_token``, the same per generated token.  Every point decodes
  once before the timed runs (its first call's one-time work is not timed).

``summary`` averages over categories: ``quality`` = the mean of ``score_share`` (the categories where
greedy scores above 0), ``agreement`` and ``ppl_ratio`` likewise, and the speed-ups as ratios of
summed times.  ``frontier`` keeps the points no other point beats on both speed and quality.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


from ..core.run import chat_token_ids
from ..datasets import spec_bench
from ..decoding import generate
from ..errors import LayerleapError
from . import quality as evaluation
from .calibrate import perplexity


@dataclass(frozen=True)
class Point:
    label: str
    model: str  # a key of the models given to ``run``
    method: str
    options: dict = field(default_factory=dict)
    group: str = ""  # the curve the point belongs to (e.g. "bild-no-rollback"); default: the method


def references(categories: list[str], n: int, offset: int = 0) -> dict[str, list[tuple[str, str]]]:
    """``{category: [(prompt text, reference text)]}`` from the shipped Spec-Bench questions."""
    import json

    from ..datasets import SHIPPED_SPEC_BENCH

    refs = {}
    for r in map(json.loads, SHIPPED_SPEC_BENCH.read_text(encoding="utf-8").splitlines()):
        ref = r.get("reference")
        if ref:
            refs[int(r["question_id"])] = ref[0] if isinstance(ref[0], str) else str(ref[0])
    out = {}
    for c in categories:
        ps = spec_bench(None, [c], n, offset)
        if not ps:
            raise LayerleapError(f"no Spec-Bench prompts in category {c} after offset {offset}")
        missing = [p.id for p in ps if p.id not in refs]
        if missing:
            raise LayerleapError(
                f"Spec-Bench category {c} has no references (questions {missing[:3]}): choose "
                "summarization, translation or math_reasoning"
            )
        out[c] = [(p.text, refs[p.id]) for p in ps]
    return out


def perplexities(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[float]:
    """The model's perplexity of each output after its prompt (teacher-forced, one row at a time; NaN for
    an empty output)."""
    return [perplexity(model, p, o) if o else float("nan") for p, o in zip(prompts, outputs)]


def _decode_interleaved(models: dict, points: list, prompts: list[list[int]], max_new: int, progress=None):
    """For each prompt every point in turn (batch 1): -> ``{label: (results, seconds)}``."""
    out = {pt.label: ([], 0.0) for pt in points}
    for pt in points:  # warm-up, untimed
        generate(models[pt.model], prompts[0], pt.method, min(4, max_new), **pt.options)
    for i, p in enumerate(prompts):
        for pt in points:
            t = time.perf_counter()
            r = generate(models[pt.model], p, pt.method, max_new, **pt.options)
            res, secs = out[pt.label]
            out[pt.label] = (res + [r], secs + time.perf_counter() - t)
        if progress:
            progress(f"prompt {i + 1}/{len(prompts)}: {len(points)} points decoded")
    return out


def run(
    models: dict,
    points: list[Point],
    categories: list[str],
    n: int,
    max_new: int,
    offset: int = 0,
    progress=None,
    partial=None,
) -> dict:
    """Decode every point on every category (see the module's docstring); -> the report's rows.
    ``partial(report)`` is called with the rows so far after every category (to save them)."""
    base = models["base"]
    data = references(categories, n, offset)
    rows: list[dict] = []
    all_points = [Point("greedy", "base", "greedy"), *points]
    for cat, items in data.items():
        prompts = [
            chat_token_ids(base.tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True)
            for q, _ in items
        ]
        refs = [r for _, r in items]
        metric = evaluation.metric_for(cat)
        decoded = _decode_interleaved(models, all_points, prompts, max_new, progress)
        greedy, g_s = decoded["greedy"]
        g_text = [r.text for r in greedy]
        g_score = evaluation.score(metric, g_text, refs)
        g_ppl = perplexities(base, prompts, [list(r.token_ids) for r in greedy])
        for pt in all_points:
            res, secs = decoded[pt.label]
            texts = [r.text for r in res]
            ppl = perplexities(base, prompts, [list(r.token_ids) for r in res])
            ratios = [a / b for a, b in zip(ppl, g_ppl) if not math.isnan(a) and not math.isnan(b) and b > 0]
            lpt = sum(r.stats["layer_evals"] for r in res) / max(1, sum(r.stats["new_tokens"] for r in res))
            score = evaluation.score(metric, texts, refs)
            rows.append(
                {
                    "label": pt.label,
                    "model": pt.model,
                    "method": pt.method,
                    "group": pt.group or pt.method,
                    "options": pt.options,
                    "category": cat,
                    "metric": metric,
                    "score": score,
                    "greedy_score": g_score,
                    "score_share": score / g_score if g_score > 0 else None,
                    "agreement": evaluation.rouge_l(texts, g_text),
                    "identical": sum(a == b for a, b in zip(texts, g_text)),
                    "ppl_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                    "layers_per_token": lpt,
                    "n_layers": base.config.n_layers,
                    "implied_speedup": base.config.n_layers / lpt if lpt else None,
                    "seconds": secs,
                    "greedy_seconds": g_s,
                    "speedup": g_s / secs,
                    "tokens": sum(r.stats["new_tokens"] for r in res),
                    "greedy_tokens": sum(r.stats["new_tokens"] for r in greedy),
                    "n": len(prompts),
                    "texts": texts,
                }
            )
            if progress:
                r = rows[-1]
                progress(
                    f"{cat:<14} {pt.label:<34} {metric} {score:5.1f} (greedy {g_score:5.1f})  agree "
                    f"{r['agreement']:5.1f}  ppl x{r['ppl_ratio'] or float('nan'):.2f}  layers {lpt:4.1f}  "
                    f"speed-up {r['speedup']:.2f}x"
                )
        if partial:
            partial({"rows": rows, "n_prompts": n, "max_new_tokens": max_new, "categories": categories})
    return {"rows": rows, "n_prompts": n, "max_new_tokens": max_new, "categories": categories}


def _per_token(rs: list[dict]) -> float | None:
    """Greedy's summed seconds per generated token over the point's (rows that record greedy's tokens)."""
    rs = [r for r in rs if r.get("greedy_tokens")]
    if not rs or not sum(r["tokens"] for r in rs):
        return None
    greedy = sum(r["greedy_seconds"] for r in rs) / sum(r["greedy_tokens"] for r in rs)
    return greedy / (sum(r["seconds"] for r in rs) / sum(r["tokens"] for r in rs))


def summary(rows: list[dict]) -> list[dict]:
    """One line per point: qualities averaged over categories, speed-ups as ratios of summed times."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        rs = [r for r in rows if r["label"] == label]
        shares = [r["score_share"] for r in rs if r["score_share"] is not None]
        ppl = [r["ppl_ratio"] for r in rs if r["ppl_ratio"] is not None]
        evals = sum(r["layers_per_token"] * r["tokens"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        out.append(
            {
                "label": label,
                "model": rs[0]["model"],
                "method": rs[0]["method"],
                "group": rs[0].get("group", rs[0]["method"]),
                "options": rs[0]["options"],
                "quality": 100 * sum(shares) / len(shares) if shares else None,
                "agreement": sum(r["agreement"] for r in rs) / len(rs),
                "ppl_ratio": math.exp(sum(map(math.log, ppl)) / len(ppl)) if ppl else None,
                "speedup": sum(r["greedy_seconds"] for r in rs) / sum(r["seconds"] for r in rs),
                "speedup_per_token": _per_token(rs),
                "layers_per_token": evals / tokens,
                "implied_speedup": rs[0]["n_layers"] * tokens / evals,
                "scores": {r["category"]: round(r["score"], 1) for r in rs},
            }
        )
    return out


def frontier(lines: list[dict], key: str = "quality", speed: str = "speedup") -> list[str]:
    """Labels of the points no other point dominates: none is at least as fast and as good and better in
    one of ``speed`` and ``key`` (points equal in both are all kept)."""
    ok = [s for s in lines if s[key] is not None and s[speed] is not None]

    def beats(o, s):
        return o[speed] >= s[speed] and o[key] >= s[key] and (o[speed] > s[speed] or o[key] > s[key])

    return [s["label"] for s in ok if not any(beats(o, s) for o in ok)]


def best_at(lines: list[dict], budget: float, key: str = "quality", speed: str = "speedup") -> dict | None:
    """The fastest point whose ``key`` keeps ``budget`` (a share, 0.95) of greedy's (100)."""
    ok = [s for s in lines if s[key] is not None and s[speed] is not None and s[key] >= 100 * budget]
    return max(ok, key=lambda s: s[speed]) if ok else None


__all__ = ["Point", "best_at", "frontier", "perplexities", "references", "run", "summary"]
