"""Calibrating a lossy method to a quality budget: Learn-then-Test over its settings (CALM's procedure).

``calibrate(model, "skipdecode", quality=0.95)`` walks ``budget.PATHS[method]``, the method's
settings from the most conservative (greedy's own output) to the most aggressive, on the
calibration split, and keeps the fastest setting that meets the budget with a stated confidence.

**What a prompt keeps.**  For each prompt the method's output is compared with greedy's:

- where the data has a reference (Spec-Bench's CNN/DM summaries, WMT translations, GSM8K solutions)
  and greedy scores above zero on it, the method's score (ROUGE-L F1, sentence BLEU, the final
  answer's exact match) must be at least ``quality`` × greedy's;
- otherwise its agreement with greedy's own text (ROUGE-L F1 against it) must be at least ``quality``;
- everywhere, the full model's perplexity of the output (given the prompt) must be at most
  ``ppl_ratio`` (1.5) × its perplexity of greedy's output: the text must stay readable.

A prompt that fails any of these is a *loss* (1), else 0; a setting's risk is its share of lost prompts.

**A fine-tuned variant** (``drafters.variants``) is calibrated against its base model: greedy's outputs
are the base model's and the perplexity is the base model's (``calibrate(variant, ..., base=base)``),
since the budget promises a share of what the user would get without the method and its fine-tune.
The full-budget setting then decodes the variant's own greedy text, so it is measured, not copied.

**The guarantee (Learn-then-Test, fixed-sequence testing).**  For each setting j the null
hypothesis is "risk_j > epsilon"; its p-value from the n calibration prompts with k losses is the
binomial tail ``P(Binomial(n, epsilon) <= k)`` (exact for a 0/1 loss).  Settings are tested in the
path's order, each at level ``delta``, stopping at the first that is not rejected; every setting
before it is *valid*.  Fixed-sequence testing controls the family-wise error at ``delta``, so:
with probability at least ``1 - delta`` over the draw of the calibration prompts (exchangeable with
the prompts the method will see), every valid setting, and so the chosen one, loses at most an
``epsilon`` share of prompts in expectation.  The chosen setting is the valid one with the highest
modelled speed-up (``step_cost``): its layer passes per token (a pass over several positions counts
once: a call over 4 tokens costs about what a call over 1 does on this engine), model calls, CALM's
saturation checks, LM heads and filled KV layers per token, each priced as measured on this model,
dtype and thread count before the run, not wall time, which is noisy on a shared machine.  A
setting modelled no faster than the first (to 3 decimals) is never chosen over it, and where the
chosen one is modelled no faster than greedy the file says so (``faster_than_greedy``).
At least ``ln(delta) / ln(1 - epsilon)`` prompts are needed for even a perfect setting to be
certified (22 at epsilon = delta = 0.1).

The run is resumable: the report (greedy's outputs, every setting's per-prompt measures) is
rewritten atomically after each setting; a rerun with the same arguments on the same prompts (their
texts and references, not only their ids) continues it, pricing the settings again where it runs on
another CPU or thread count.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .. import validate as V
from ..datasets import Prompt, spec_bench
from ..decoding import generate, get_method
from ..errors import LayerleapError
from ..files import locked, number, read_report, write_json
from ..methods import bild, budget
from . import quality as Q
from . import step_cost as SC
from .step_cost import StepCost
from ..core.kernels import cpu_signature

# Spec-Bench categories with references; the tables use each category's first prompts, calibration
# and the held-out check the ones from these offsets on (the splits never overlap).
CATEGORIES = ("summarization", "translation", "math_reasoning")
SPLITS = {"calibration": 40, "holdout": 60}
TABLE_PROMPTS = 40  # bench tables draw from a category's first 40 prompts
EPSILON, DELTA, PPL_RATIO = 0.1, 0.1, 1.5


class CalibrationError(LayerleapError, ValueError):
    pass


def split_prompts(split: str, per_category: int, categories=CATEGORIES, data=None) -> list[Prompt]:
    """``per_category`` prompts of each category from the split's offset (``SPLITS``)."""
    if split not in SPLITS:
        raise CalibrationError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    V.integer(per_category, "prompts per category", 1, 20, hint=" (a split holds 20 per category)")
    prompts = spec_bench(data, list(categories), per_category, offset=SPLITS[split])
    held = {c: sum(p.category == c for p in prompts) for c in categories}
    short = {c: n for c, n in held.items() if n < per_category}
    if short:  # a smaller file: its split holds fewer (none at all when a category ends before the split)
        fewest = min(held.values())
        fix = f"give {fewest} prompts per category or fewer" if fewest else ""
        raise CalibrationError(
            f"the {split} split of {data or 'the shipped Spec-Bench'} (from index {SPLITS[split]} of each category) "
            f"holds {', '.join(f'{n} {c}' for c, n in short.items())} prompts, fewer than the {per_category} per "
            f"category asked: {fix + ', or ' if fix else ''}give a file with at least {SPLITS[split] + per_category} "
            f"questions in each of {', '.join(categories)}"
        )
    return prompts


def min_prompts(epsilon: float, delta: float) -> int:
    """The fewest prompts with which a setting that loses none is certified at (epsilon, delta), by the
    p-value the test computes (``1 - epsilon`` rounds: 1 - 0.99 is a little over 0.01)."""
    n = max(1, math.ceil(math.log(delta) / math.log(1 - epsilon)))
    while binomial_p_value(0, n, epsilon) > delta:
        n += 1
    return n


def check_enough_prompts(n: int, epsilon: float, delta: float, per: int = 1) -> None:
    """Refuse ``n`` prompts, too few to certify any setting at (epsilon, delta), before any decoding;
    ``per``: prompts per ``--prompts`` (the split's categories), for the command line's fix."""
    need = min_prompts(epsilon, delta)
    if n < need:
        fix = f"give at least {need}" if per == 1 else f"give --prompts {math.ceil(need / per)} or more"
        raise CalibrationError(f"{n} prompts cannot certify any setting at epsilon={epsilon}, delta={delta}: {fix}")


def binomial_p_value(losses: int, n: int, epsilon: float) -> float:
    """``P(Binomial(n, epsilon) <= losses)``: the p-value of "risk > epsilon" after ``losses`` of ``n``."""
    return float(sum(math.comb(n, i) * epsilon**i * (1 - epsilon) ** (n - i) for i in range(losses + 1)))


# -- per-prompt measures ---------------------------------------------------------------------------------
def reference_score(category: str, text: str, reference: str) -> float:
    """One prompt's score against its reference, 0..1: ROUGE-L F1 (summarization), sentence BLEU
    (translation), exact match of the final answer (math)."""
    metric = Q.metric_for(category)
    if metric == "bleu":
        sacrebleu = Q._library("sacrebleu", "sacrebleu", "BLEU")
        return min(1.0, float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0)  # rounds past 100
    return Q.score(metric, [text], [reference]) / 100.0


def agreement(text: str, greedy_text: str) -> float:
    """ROUGE-L F1 of ``text`` against greedy's own text, 0..1 (1 for equal texts; texts of any script:
    ``quality.rouge_l``)."""
    return 1.0 if text == greedy_text else Q.rouge_l([text], [greedy_text]) / 100.0


def perplexity(model, prompt_ids: list[int], ids: list[int]) -> float:
    """The full model's perplexity of ``ids`` after ``prompt_ids`` (one forward, no cache)."""
    if not ids:
        return 1.0
    seq = torch.tensor([prompt_ids + ids], dtype=torch.long, device=model.device)  # [1, P+N]
    with torch.inference_mode():
        logits = model(seq, logits_from=len(prompt_ids) - 1)[:, :-1]  # [1, N, V]: the positions predicting ids
        nll = torch.nn.functional.cross_entropy(logits[0].float(), seq[0, len(prompt_ids) :], reduction="mean")
    return float(torch.exp(nll))


@dataclass
class Output:
    """One generation on one prompt, with its measures."""

    text: str
    token_ids: list[int]
    layer_passes: float  # per token
    wall_s: float
    ppl: float
    reference_score: float | None = None
    agreement: float | None = None
    # per token (``step_cost``); None: a report written before they were counted (priced as greedy's)
    calls: float | None = None
    checks: float | None = None
    heads: float | None = None
    filled: float | None = None
    rows: float | None = None
    drafts: float | None = None


def layer_passes(stats: dict, n_layers: int) -> float:
    """Layer passes per generated token: a model call over several positions counts once per layer.
    BiLD: its small steps run ``exit_layer`` layers, its large passes the rest."""
    n = max(1, stats["new_tokens"])
    if _eagle_form(stats):  # every call runs every layer, over its root and drafts
        return n_layers * stats["layer_calls"] / n
    if "small_steps" in stats and "large_calls" in stats:
        e = int(stats.get("exit_layer") or n_layers)
        return (stats["small_steps"] * e + stats["large_calls"] * (n_layers - e) + n_layers) / n
    return float(stats["layers_per_token"])


def _eagle_form(stats: dict) -> bool:
    """BiLD with the EAGLE head as its small model."""
    return "small_steps" in stats and stats.get("head") == "eagle"


def step_counts(stats: dict) -> dict:
    """Per generated token: model calls over a range of layers, CALM's saturation checks, LM heads (BiLD's
    small steps and large passes each predict), the layers whose KV entries CALM filled, and for BiLD's
    EAGLE form the drafts its calls scored beside their roots and its head's steps."""
    n = max(1, stats["new_tokens"])
    heads, rows, drafts = 1.0, 0.0, 0.0
    if _eagle_form(stats):  # one LM head a call, over its rows
        heads = stats["layer_calls"] / n
        rows, drafts = stats.get("scored_drafts", stats["small_tokens"]) / n, stats["small_steps"] / n
    elif "small_steps" in stats and "large_calls" in stats:
        heads = (stats["small_steps"] + stats["large_calls"] + 1) / n
    return {
        "calls": stats["layer_calls"] / n,
        "checks": (stats.get("exit_checks") or 0) / n,
        "heads": heads,
        "filled": (stats.get("kv_filled_layers") or 0) / n,
        "rows": rows,
        "drafts": drafts,
    }


def kept(out: Output, greedy: Output, quality: float, ppl_ratio: float) -> bool:
    """Whether ``out`` keeps ``quality`` of greedy's quality on its prompt (see the module doc)."""
    if not out.ppl <= ppl_ratio * greedy.ppl:  # a NaN perplexity is not readable text
        return False
    if out.reference_score is not None and greedy.reference_score:
        return out.reference_score >= quality * greedy.reference_score - 1e-9
    return (out.agreement if out.agreement is not None else 0.0) >= quality - 1e-9


# -- running -----------------------------------------------------------------------------------------------
def run_outputs(
    model,
    method: str,
    options: dict,
    prompts: list[Prompt],
    max_new_tokens: int,
    greedy: list[Output] | None = None,
    progress: Callable[[str], None] | None = None,
    base=None,
) -> list[Output]:
    """``method`` with ``options`` on every prompt, measured against ``greedy``'s outputs when given,
    the perplexity by ``base`` (default: ``model``).
    In fp32 a method that batches decodes each category as one batch (its rows decode as they would
    alone, tested); in other dtypes every prompt decodes alone, as a user's request does (bf16 logits
    tie often enough for a padded batch to break a tie differently)."""
    m = get_method(method)
    batch = m.batched and model.dtype_name == "float32"
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.category if batch else str(i), []).append(i)
    outs: list[Output | None] = [None] * len(prompts)
    for idx in groups.values():
        t0 = time.perf_counter()
        res = generate(
            model, [prompts[i].text for i in idx], method, max_new_tokens, chat=True, stop_at_eos=False, **options
        )
        wall = (time.perf_counter() - t0) / len(idx)
        for i, r in zip(idx, res):
            p = prompts[i]
            o = Output(
                r.text,
                list(r.token_ids),
                layer_passes(r.stats, model.config.n_layers),
                wall,
                perplexity(base or model, r.prompt_ids, list(r.token_ids)),
                **step_counts(r.stats),
            )
            if p.reference:
                o.reference_score = reference_score(p.category, r.text, p.reference)
            if greedy is not None:
                o.agreement = agreement(r.text, greedy[i].text)
            outs[i] = o
        if progress:
            progress(f"{method} {_show(options)}: {sum(o is not None for o in outs)}/{len(prompts)} prompts")
    return outs  # type: ignore[return-value]


def greedy_outputs(
    model, prompts: list[Prompt], max_new_tokens: int, progress: Callable[[str], None] | None = None
) -> list[Output]:
    outs = run_outputs(model, "greedy", {}, prompts, max_new_tokens, progress=progress)
    for g in outs:
        g.agreement = 1.0
    return outs


def _show(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


@dataclass
class Setting:
    """One setting of the path, measured on the split."""

    index: int
    options: dict
    outputs: list[Output]
    layer_passes: float = 0.0  # mean per token
    calls: float = 1.0  # the means per token of step_counts
    checks: float = 0.0
    heads: float = 1.0
    filled: float = 0.0
    rows: float = 0.0
    drafts: float = 0.0
    modelled_speedup: float = 1.0  # greedy's step time over the setting's, priced by ``step_cost``
    losses: int = 0
    p_value: float = 1.0
    valid: bool = False  # rejected "risk > epsilon" within the fixed sequence
    tested: bool = True  # False: measured after the sequence stopped (for the frontier only)
    agreement: float = 0.0  # mean
    reference_kept: float | None = None  # the method's mean reference score / greedy's
    ppl_ratio: float = 1.0  # mean perplexity / greedy's mean perplexity
    wall_ratio: float = 1.0  # greedy's wall time / this setting's, same run (noisy)

    def counts(self) -> dict:
        """What ``StepCost.speedup`` prices: the setting's means per token."""
        return {
            "passes": self.layer_passes,
            "calls": self.calls,
            "checks": self.checks,
            "heads": self.heads,
            "filled": self.filled,
            "rows": self.rows,
            "drafts": self.drafts,
        }


def summarize(outputs: list[Output], greedy: list[Output], quality: float, ppl_ratio: float) -> dict:
    refs = [(o.reference_score, g.reference_score) for o, g in zip(outputs, greedy) if g.reference_score is not None]
    g_ref = sum(g for _, g in refs)
    return {
        "layer_passes": sum(o.layer_passes for o in outputs) / len(outputs),
        **{k: sum(_count(o, k) for o in outputs) / len(outputs) for k in _GREEDY_COUNTS},
        "losses": sum(not kept(o, g, quality, ppl_ratio) for o, g in zip(outputs, greedy)),
        "agreement": sum(o.agreement or 0.0 for o in outputs) / len(outputs),
        "reference_kept": (sum(o for o, _ in refs) / g_ref) if refs and g_ref > 0 else None,
        "ppl_ratio": (sum(o.ppl for o in outputs) / len(outputs)) / (sum(g.ppl for g in greedy) / len(greedy)),
        "wall_ratio": sum(g.wall_s for g in greedy) / max(1e-9, sum(o.wall_s for o in outputs)),
    }


_GREEDY_COUNTS = {"calls": 1.0, "checks": 0.0, "heads": 1.0, "filled": 0.0, "rows": 0.0, "drafts": 0.0}


def _count(o: Output, k: str) -> float:
    v = getattr(o, k)
    return _GREEDY_COUNTS[k] if v is None else v


def measure(
    setting: Setting, greedy: list[Output], quality: float, ppl_ratio: float, epsilon: float, cost: StepCost
) -> None:
    for k, v in summarize(setting.outputs, greedy, quality, ppl_ratio).items():
        setattr(setting, k, v)
    setting.p_value = binomial_p_value(setting.losses, len(setting.outputs), epsilon)
    setting.modelled_speedup = cost.speedup(**setting.counts()) if setting.layer_passes else 1.0


def learn_then_test(settings: list[Setting], delta: float) -> list[Setting]:
    """Fixed-sequence testing: mark settings valid in order until the first p-value above ``delta``."""
    for s in settings:
        s.valid = False
    for s in settings:
        if not s.tested or s.p_value > delta:
            break
        s.valid = True
    return [s for s in settings if s.valid]


def choose(settings: list[Setting]) -> Setting | None:
    """The valid setting with the highest modelled speed-up to 3 decimals (the earlier one on a tie, so
    that one modelled no faster than the path's first is never chosen over it)."""
    valid = [s for s in settings if s.valid]
    return min(valid, key=lambda s: (-round(s.modelled_speedup, 3), s.index)) if valid else None


def faster_than_greedy(s: Setting | None) -> bool:
    """Whether ``s`` is modelled faster than greedy's own step (to 3 decimals)."""
    return s is not None and round(s.modelled_speedup, 3) > 1.0


@dataclass
class Calibration:
    method: str
    quality: float
    epsilon: float
    delta: float
    ppl_ratio: float
    split: str
    config: dict
    greedy: list[Output] = field(default_factory=list)
    settings: list[Setting] = field(default_factory=list)
    done: bool = False

    @property
    def chosen(self) -> Setting | None:
        return choose(self.settings)

    def budget_entry(self) -> dict:
        """What a calibration file keeps for this budget."""
        c = self.chosen
        return {
            "quality": self.quality,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "ppl_ratio": self.ppl_ratio,
            "guarantee": guarantee(self),
            "split": self.split,
            "prompts": len(self.greedy),
            "config": self.config,
            "chosen": None
            if c is None
            else {"options": c.options, "modelled_speedup": c.modelled_speedup, **_setting_summary(c)},
            "faster_than_greedy": faster_than_greedy(c),
            "settings": [
                {
                    "options": s.options,
                    "tested": s.tested,
                    "valid": s.valid,
                    "modelled_speedup": s.modelled_speedup if s.layer_passes else None,
                    **_setting_summary(s),
                }
                for s in self.settings
            ],
            "complete": self.done,
        }

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "quality": self.quality,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "ppl_ratio": self.ppl_ratio,
            "split": self.split,
            "config": self.config,
            "done": self.done,
            "greedy": [asdict(o) for o in self.greedy],
            "settings": [
                {**{k: v for k, v in asdict(s).items() if k != "outputs"}, "outputs": [asdict(o) for o in s.outputs]}
                for s in self.settings
            ],
        }


def _setting_summary(s: Setting) -> dict:
    return {
        "layer_passes": s.layer_passes,
        **{k: v for k, v in s.counts().items() if k != "passes"},
        "losses": s.losses,
        "p_value": s.p_value,
        "agreement": s.agreement,
        "reference_kept": s.reference_kept,
        "ppl_ratio": s.ppl_ratio,
        "wall_ratio": s.wall_ratio,
    }


def guarantee(cal: Calibration) -> str:
    return (
        f"with probability >= {_exact(1 - cal.delta, 2)} over the {len(cal.greedy)} calibration prompts, the chosen "
        f"setting keeps {cal.quality:.2f} of greedy's quality (reference score, else agreement with greedy's "
        f"text; perplexity within {cal.ppl_ratio}x greedy's) on all but at most {_exact(cal.epsilon * 100, 0)}% of "
        "prompts in expectation (Learn-then-Test, fixed-sequence, binomial p-values)"
    )


def _exact(x: float, places: int) -> str:
    """``x`` with at least ``places`` decimals and as many more as it needs (0.999 is not "1.00", 12.5 not "12")."""
    while places < 10 and round(x, places) != round(x, 10):
        places += 1
    return f"{x:.{places}f}"


def _output(o: dict) -> Output:
    """An output of a report (a perplexity past float range is "inf" there: ``files.strict``)."""
    return Output(**{k: number(v) for k, v in o.items()})


def _from_dict(d: dict) -> Calibration:
    cal = Calibration(
        d["method"],
        d["quality"],
        d["epsilon"],
        d["delta"],
        d["ppl_ratio"],
        d["split"],
        d["config"],
        [_output(o) for o in d["greedy"]],
        done=d.get("done", False),
    )
    known = Setting.__dataclass_fields__
    for s in d["settings"]:
        outs = [_output(o) for o in s.pop("outputs")]
        cal.settings.append(Setting(outputs=outs, **{k: number(v) for k, v in s.items() if k in known}))
    return cal


def calibrate(
    model,
    method: str,
    quality: float = budget.DEFAULT_QUALITY,
    *,
    prompts: list[Prompt],
    max_new_tokens: int = 64,
    epsilon: float = EPSILON,
    delta: float = DELTA,
    ppl_ratio: float = PPL_RATIO,
    split: str = "calibration",
    report: str | Path | None = None,
    extra: int = 2,
    progress: Callable[[str], None] | None = None,
    config: dict | None = None,
    greedy: list[Output] | None = None,
    base=None,
    step_cost: StepCost | None = None,
) -> Calibration:
    """Learn-then-Test calibration of ``method`` at ``quality`` on ``prompts`` (see the module doc).
    ``extra`` settings past the first failure are measured for the quality-speed frontier (never
    chosen).  With ``report`` the run is rewritten there after each setting and resumed from it.
    ``greedy``: greedy's outputs on these prompts, when already measured (another method's run).
    ``base``: the model whose greedy output and perplexity the budget keeps a share of, when
    ``model`` is a fine-tuned variant of it (default: ``model`` itself).  ``step_cost``: the prices of
    a token's parts (default: the resumed report's where it was priced on this CPU at this thread count, else
    measured here now, ``step_cost.measure``)."""
    if method not in budget.PATHS:
        raise CalibrationError(
            f"method {method!r} is not a lossy method with a quality budget: choose one of {', '.join(budget.LOSSY)}"
        )
    quality = budget.check_quality(quality)
    for name, v in (("epsilon", epsilon), ("delta", delta)):
        V.number(v, name, 0, 1, lo_open=True, hi_open=True)
    V.number(ppl_ratio, "ppl_ratio", 1)
    check_enough_prompts(len(prompts), epsilon, delta)
    d = model.config.n_layers
    path = budget.PATHS[method](d)
    judge = _judge(model, base)
    cfg = {
        "model": model.config.name,
        "fingerprint": model.fingerprint,
        "dtype": model.dtype_name,
        "n_layers": d,
        "max_new_tokens": max_new_tokens,
        "prompt_ids": [p.id for p in prompts],
        "prompts_sha256": _prompts_digest(prompts),  # the prompts' texts and references, not only their ids
        "categories": sorted({p.category for p in prompts}),
        "cpu": cpu_signature(),  # the step costs that priced the settings are this machine's, at this thread count
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **({} if judge is model else {"base_fingerprint": judge.fingerprint}),
        **(config or {}),
    }
    key = {
        k: cfg.get(k)
        for k in (
            "fingerprint",
            "dtype",
            "max_new_tokens",
            "prompt_ids",
            "prompts_sha256",
            "base_fingerprint",
        )
    }
    cal = None
    old = read_report(report, "calibration report", ("config", "settings")) if report else None
    if (
        old
        and {k: old["config"].get(k) for k in key} == key
        and old.get("method") == method
        and old.get("quality") == quality
        and (old.get("epsilon"), old.get("delta")) == (epsilon, delta)
        and old.get("ppl_ratio", ppl_ratio) == ppl_ratio
    ):
        cal = _from_dict(old)
        if any(cal.config.get(k) != cfg.get(k) for k in ("cpu", "threads")):
            cal.config.pop("step_cost", None)  # priced on another CPU or thread count: priced again here
        cal.config.update({k: v for k, v in cfg.items() if k not in key})
    if cal is None:
        cal = Calibration(method, quality, epsilon, delta, ppl_ratio, split, cfg)
    cost = _step_cost(cal, model, step_cost)
    save = (lambda: write_json(report, cal.to_dict())) if report else (lambda: None)
    if not cal.greedy:
        cal.greedy = greedy or greedy_outputs(judge, prompts, max_new_tokens, progress)
        save()
    stopped_at = None
    for j, options in enumerate(path):
        if j < len(cal.settings):
            s = cal.settings[j]
        else:
            if stopped_at is not None and j - stopped_at > extra:
                break
            if j == 0 and method in budget.FIRST_IS_GREEDY and judge is model:
                outs = [Output(**asdict(g)) for g in cal.greedy]
            else:
                outs = run_outputs(model, method, options, prompts, max_new_tokens, cal.greedy, progress, judge)
            s = Setting(j, dict(options), outs)
            cal.settings.append(s)
        measure(s, cal.greedy, quality, ppl_ratio, epsilon, cost)
        s.tested = stopped_at is None
        if stopped_at is None and s.p_value > delta:
            stopped_at = j
        save()
        if progress:
            progress(
                f"{method} {_show(s.options)}: {s.losses}/{len(prompts)} lost, p={s.p_value:.3f}, "
                f"modelled {s.modelled_speedup:.2f}x greedy ({s.layer_passes:.2f} layer passes, {s.calls:.2f} calls "
                f"per token), agreement {s.agreement:.2f}, ppl x{s.ppl_ratio:.2f}"
            )
        if stopped_at is not None and j - stopped_at >= extra:
            break
    learn_then_test(cal.settings, delta)
    cal.done = True
    cal.config["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    return cal


def _prompts_digest(prompts: list[Prompt]) -> str:
    """A short hash of the prompts' ids, categories, texts and references: a report measured on another data
    file whose question ids match is not resumed."""
    rows = [[p.id, p.category, p.text, p.reference] for p in prompts]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()[:16]


def _step_cost(cal: Calibration, model, given: StepCost | None) -> StepCost:
    """The prices the run's settings are modelled with, recorded in its config: ``given``, else the
    resumed report's, else measured on ``model`` now."""
    old = cal.config.get("step_cost")
    draft = bild.eagle_step(model) if cal.method == "bild" else None  # its EAGLE form's head step
    cost = given or (StepCost.from_dict(old) if isinstance(old, dict) else SC.measure(model, draft_step=draft))
    cal.config["step_cost"] = cost.to_dict()
    return cost


def _judge(model, base):
    """The model whose greedy output and perplexity define quality: ``base`` (a variant's base model,
    checked to be the same architecture and dtype) or ``model``."""
    if base is None or base is model:
        return model
    if base.config.n_layers != model.config.n_layers or base.dtype_name != model.dtype_name:
        raise CalibrationError(
            f"base model {base.config.name} ({base.config.n_layers} layers, {base.dtype_name}) is not the base of "
            f"{model.config.name} ({model.config.n_layers} layers, {model.dtype_name}): load both with the same "
            "--model and --dtype"
        )
    return base


def write_calibration(cal: Calibration, path: Path | None = None) -> Path:
    """Add ``cal``'s budget to the method's calibration file (atomic; other budgets kept, also those that
    calibrations of other budgets running at once add)."""
    cfg = cal.config
    path = path or budget.calibration_path(cfg["fingerprint"], cfg["dtype"], cal.method)
    with locked(path):  # read under the lock: budgets that calibrations running at once wrote are kept
        data = budget.read_calibration(path) or {
            "format": budget.FORMAT,
            "method": cal.method,
            "model": cfg["model"],
            "fingerprint": cfg["fingerprint"],
            "dtype": cfg["dtype"],
            "budgets": {},
        }
        data["budgets"][budget.budget_key(cal.quality)] = cal.budget_entry()
        write_json(path, data)
    return path


# -- the held-out check ---------------------------------------------------------------------------------
def holdout_check(
    model,
    cal_entry: dict,
    method: str,
    prompts: list[Prompt],
    max_new_tokens: int,
    greedy: list[Output] | None = None,
    progress: Callable[[str], None] | None = None,
    base=None,
) -> dict:
    """The chosen setting of a calibration file's budget on other prompts: its share of lost prompts
    against the stated epsilon, its mean agreement, reference score kept and perplexity ratio
    (against ``base``'s greedy output and perplexity when ``model`` is a variant of it)."""
    chosen = cal_entry.get("chosen")
    if not chosen:
        raise CalibrationError("the calibration chose no setting: nothing to check")
    q, ppl_ratio = cal_entry["quality"], cal_entry["ppl_ratio"]
    judge = _judge(model, base)
    greedy = greedy or greedy_outputs(judge, prompts, max_new_tokens, progress)
    outs = run_outputs(model, method, chosen["options"], prompts, max_new_tokens, greedy, progress, judge)
    s = summarize(outs, greedy, q, ppl_ratio)
    s["loss_rate"] = s["losses"] / len(prompts)
    s.update(
        prompts=len(prompts),
        prompt_ids=[p.id for p in prompts],
        epsilon=cal_entry["epsilon"],
        delta=cal_entry["delta"],
        options=chosen["options"],
        within_epsilon=s["loss_rate"] <= cal_entry["epsilon"],
        greedy_reference={
            c: _mean([g.reference_score for g, p in zip(greedy, prompts) if p.category == c])
            for c in sorted({p.category for p in prompts})
        },
        method_reference={
            c: _mean([o.reference_score for o, p in zip(outs, prompts) if p.category == c])
            for c in sorted({p.category for p in prompts})
        },
        samples=[
            {"prompt_id": p.id, "greedy": g.text[:200], "method": o.text[:200]}
            for p, g, o in list(zip(prompts, greedy, outs))[:3]
        ],
    )
    return s


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None
