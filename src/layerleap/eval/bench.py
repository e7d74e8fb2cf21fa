"""The benchmark harness: methods × prompts, interleaved per prompt, against our ``greedy`` and the
`transformers` ``generate`` on the same weights.

``run_bench(model, {"greedy": ("greedy", {}), "s": ("sample", {})}, prompts, 64, out="b.json")``
runs, for every prompt, every method and then the `transformers` baseline (same prompt ids, same
number of new tokens), records one ``Record`` per prompt and method, and rewrites the JSON report
atomically after every prompt, so an interrupted run leaves a valid report of what finished.

Every run generates exactly ``max_new_tokens`` tokens (``stop_at_eos=False`` for ours; for
`transformers` the EOS id is unset, so it neither stops nor masks EOS, and ``min_new_tokens`` pins
the length), which makes times comparable and greedy tokens comparable one for one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .. import validate as V
from ..datasets import Prompt
from ..core.run import GenerationResult
from ..decoding import generate, get_method
from ..errors import LayerleapError
from ..files import write_json
from ..methods.budget import LOSSY
from ..core.cpu import OtherLoad
from ..core.kernels import cpu_signature
from ..core.model import Transformer

HF_LABEL = "transformers"
# `transformers`' own faster decoding, run beside its greedy: label -> generate() keyword arguments
HF_EXTRAS = {
    "lookup": ("transformers-lookup", "prompt_lookup_num_tokens", 10),
    "early-exit": ("transformers-early-exit", "assistant_early_exit", None),
}


def parse_hf_extra(text: str, n_layers: int) -> tuple[str, dict]:
    """``lookup[:N]`` (prompt lookup, N draft tokens, default 10) or ``early-exit:E`` (`transformers`'
    self-speculative ``assistant_early_exit=E``) -> (label, generate() keyword arguments)."""
    name, _, value = text.partition(":")
    if name not in HF_EXTRAS:
        raise LayerleapError(f"unknown transformers baseline {text!r}: give lookup[:N] or early-exit:E")
    label, key, default = HF_EXTRAS[name]
    try:
        n = int(value) if value else default
    except ValueError:
        n = None
    limit = n_layers - 1 if name == "early-exit" else 64
    if n is None or not 1 <= n <= limit:
        raise LayerleapError(
            f"{text!r}: {key} must be an integer in [1, {limit}] (e.g. {name}:{default or n_layers // 2})"
        )
    return label, {key: n}


HF_LABELS = {HF_LABEL, *(label for label, _, _ in HF_EXTRAS.values())}  # the rows of `transformers`' runs
REFERENCE = "greedy"
WARMUP_TOKENS = 8

MethodSpecs = dict[str, tuple[str, dict]]  # label -> (method name, options)


# -- parsing method specs and option values --------------------------------------------------------
def parse_value(text: str):
    """``--opt`` value: bool (true/false), none, int, float; JSON when it starts with ``[`` or ``{``;
    a list of numbers when it has commas (``30,28,26``); else the string itself."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return json.loads(stripped)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: brackets nested too deep
            why = e.msg if isinstance(e, json.JSONDecodeError) else "brackets nested too deep"
            raise LayerleapError(
                f"option value {text[:40]!r}{'...' if len(text) > 40 else ''} starts like JSON but is not ({why}): "
                "fix it, e.g. [[0], [1], [0, 0]]"
            ) from None
    if "," in stripped:
        items = [parse_value(t) for t in stripped.split(",")]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            return items
    low = stripped.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_assignments(items: list[str] | None, form: str = "NAME=VALUE") -> dict[str, object]:
    """``--opt NAME=VALUE`` items -> ``{NAME: value}``; a name given twice is refused (the last would win
    silently)."""
    out: dict[str, object] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise LayerleapError(f"bad option {item!r}: write {form}")
        if key in out:
            times = sum(i.partition("=")[0].strip() == key for i in items)
            raise LayerleapError(f"--opt {key} is given {times} times: give each option once")
        out[key] = parse_value(value)
    return out


def required_options(method: str, options: dict) -> list[str]:
    """Options of ``method`` that have no default and are not in ``options``."""
    return [o.name for o in get_method(method).declared if o.required and o.name not in options]


def calibration_overlap(methods: dict, categories: list[str] | None, n: int, offset: int = 0) -> str | None:
    """A warning where a bench of the shipped Spec-Bench reaches the prompts the lossy methods' budgets were
    calibrated on (``calibrate.SPLITS``, from prompt 40 of a calibrated category) while a lossy method runs:
    its quality there is measured on the prompts that chose its setting; None otherwise.  ``methods``:
    label -> (method, options)."""
    from .calibrate import CATEGORIES, TABLE_PROMPTS

    lossy = [label for label, (name, _) in methods.items() if name in LOSSY]
    hit = [c for c in (categories or CATEGORIES) if c in CATEGORIES]
    if not lossy or not hit or offset + n <= TABLE_PROMPTS:
        return None
    return (
        f"prompts {max(offset, TABLE_PROMPTS) + 1}-{offset + n} of {', '.join(hit)} are the calibration and "
        f"held-out splits of the lossy methods' quality budgets ({', '.join(lossy)}): their quality there is "
        f"partly measured on the prompts that chose their settings; keep --offset + --prompts <= {TABLE_PROMPTS}"
    )


def check_spec(label: str, method: str, options: dict, config=None) -> dict:
    """The options of the run's ``label`` checked by ``method``'s declarations (``core.options.check``;
    the model-dependent bounds with the model's ``config``)."""
    try:
        return get_method(method).check_options(options, config, cli=f"{label}.")
    except LayerleapError as e:
        raise type(e)(f"{label}: {e}" if label != method else str(e)) from None


def parse_methods(text: str, opts: list[str] | None = None, check: bool = True) -> MethodSpecs:
    """``"greedy,p=prompt-lookup"`` and ``["p.draft_len=5"]`` ->
    ``{"greedy": ("greedy", {}), "p": ("prompt-lookup", {"draft_len": 5})}``.

    An item is ``METHOD`` or ``LABEL=METHOD`` (to run one method with several option sets); an
    option ``TARGET.NAME=VALUE`` applies to the label TARGET, or else to every label of method TARGET (a
    label's own option overrides its method's, whatever their order).  The rows of `transformers`' runs
    (``HF_LABELS``) are no labels of ours."""
    specs: MethodSpecs = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        label, eq, name = item.partition("=")
        label, name = label.strip(), (name if eq else label).strip()
        if not label:
            raise LayerleapError(f"method {item!r} has an empty label: write METHOD or LABEL=METHOD")
        if not name:
            raise LayerleapError(f"method {item!r} names no method after '=': write METHOD or LABEL=METHOD")
        get_method(name)
        if label in HF_LABELS:
            raise LayerleapError(
                f"method label {label!r} names a transformers baseline's row: give the method another label "
                f"(LABEL={name})"
            )
        if label in specs:
            raise LayerleapError(f"method label {label!r} is used twice: name them LABEL=METHOD")
        specs[label] = (name, {})
    if not specs:
        raise LayerleapError("no methods given: e.g. --methods greedy,sample")
    by_label = []  # a label's own option is set after its method's, which it overrides in any order
    for key, value in parse_assignments(opts, "METHOD.NAME=VALUE").items():
        target, dot, opt = key.partition(".")
        if not dot or not opt:
            raise LayerleapError(f"bad option {key!r}: write METHOD.NAME=VALUE (METHOD: a label or method name)")
        if target in specs:
            by_label.append((target, opt, value))
            continue
        hits = [lb for lb, (n, _) in specs.items() if n == target]
        if not hits:
            raise LayerleapError(f"option {key!r} names no method in the run: choose from {', '.join(specs)}")
        for lb in hits:
            specs[lb][1][opt] = value
    for lb, opt, value in by_label:
        specs[lb][1][opt] = value
    for lb, (name, options) in specs.items():
        if check:
            check_spec(lb, name, options)
    return specs


def runnable_methods() -> MethodSpecs:
    """Every registered method that runs with its defaults alone (no required option such as a
    draft model), labelled by name: what the demo and a default bench compare."""
    from ..decoding import METHODS

    return {name: (name, {}) for name in METHODS if not required_options(name, {})}


def probe_methods(model: Transformer, methods: MethodSpecs, prompt: str = "Hello") -> tuple[MethodSpecs, dict]:
    """Split ``methods`` into those that generate one token on ``model`` and those that refuse with a
    ``LayerleapError`` (e.g. an option that defaults to None but must be set): ``(usable, {label: why})``."""
    usable, skipped = {}, {}
    for label, (name, options) in methods.items():
        try:
            generate(model, prompt, name, 1, **options)
            usable[label] = (name, options)
        except LayerleapError as e:
            skipped[label] = str(e)
    return usable, skipped


def with_reference(methods: MethodSpecs) -> tuple[MethodSpecs, str]:
    """Make sure plain greedy (no options) runs, first: it is what speed-ups are measured against."""
    for label, (name, options) in methods.items():
        if name == REFERENCE and not options:
            return {label: methods[label], **methods}, label
    if REFERENCE in methods:
        raise LayerleapError(f"label {REFERENCE!r} is reserved for plain greedy decoding: rename it")
    return {REFERENCE: (REFERENCE, {}), **methods}, REFERENCE


# -- one measurement -------------------------------------------------------------------------------
@dataclass
class Record:
    """One method on one prompt."""

    prompt_index: int
    prompt_id: int
    category: str
    label: str
    method: str
    options: dict
    new_tokens: int
    prompt_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_s: float | None
    model_calls: int
    layers_per_token: float
    tokens_per_call: float
    greedy_type: bool  # decodes greedily, so its tokens should equal greedy's
    speedup_vs_greedy: float | None = None
    speedup_vs_hf: float | None = None
    matches_greedy: bool | None = None
    matches_hf: bool | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    acceptance: float | None = None  # kept / proposed draft tokens (drafting methods)
    drafted: int | None = None  # proposed draft tokens (``draft_counts``), None for a method that does not draft
    accepted: int | None = None  # the kept ones among them
    # quality of a lossy method's output (and greedy's, the reference): see ``_quality``
    agreement: float | None = None  # ROUGE-L F1 against greedy's text, 0..1
    reference_score: float | None = None  # against the data's reference (ROUGE-L, sentence BLEU, exact match), 0..1
    ppl: float | None = None  # the full model's perplexity of the output given the prompt


def _record(
    i: int, prompt: Prompt, label: str, method: str, options: dict, res: GenerationResult, greedy_type: bool
) -> Record:
    s = res.stats
    counts = draft_counts(s)
    return Record(
        i,
        prompt.id,
        prompt.category,
        label,
        method,
        plain_options(options),
        s["new_tokens"],
        len(res.prompt_ids),
        s["wall_s"],
        s["tokens_per_s"],
        s["ttft_s"],
        s["model_calls"],
        s["layers_per_token"],
        s["tokens_per_call"],
        greedy_type,
        text=res.text,
        token_ids=list(res.token_ids),
        acceptance=acceptance(s),
        drafted=counts[0] if counts else None,
        accepted=counts[1] if counts else None,
    )


def draft_counts(stats: dict) -> tuple[int, int] | None:
    """(proposed, accepted) draft tokens of a drafting method's run, from its stats: drafts for the
    speculative and tree methods, early predictions for ``ppd``, small-model tokens for ``bild``;
    None for a method that does not draft."""
    if "drafted" in stats and "accepted" in stats:
        return int(stats["drafted"]), int(stats["accepted"])
    if "trials" in stats and "matches" in stats:
        return int(stats["trials"]), int(stats["matches"])
    if "small_tokens" in stats and "rolled_back" in stats:
        return int(stats["small_tokens"]), int(stats["small_tokens"]) - int(stats["rolled_back"])
    return None


def acceptance(stats: dict) -> float | None:
    """The share of proposed draft tokens that were kept (``draft_counts``), or None."""
    counts = draft_counts(stats)
    return counts[1] / counts[0] if counts and counts[0] else None


def plain_options(options: dict) -> dict:
    """Options as a report shows them: a model given as an option (a draft) by its name, a number that
    is not finite as its text (``alpha_rb=inf`` as "inf", which ``--opt`` reads back; JSON has no inf)."""

    def plain(v):
        if isinstance(v, Transformer):
            return v.source or v.config.name
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in options.items()}


def finite(obj):
    """``obj`` with every float that is not finite (a perplexity that overflowed) as None: valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def calibrations(model: Transformer, methods: MethodSpecs) -> dict:
    """Each lossy method's calibration at the default budget (its frontier and chosen point), by
    label: ``{"file", "quality", "chosen", "settings", "guarantee"}`` from the calibration file."""
    from ..methods import budget

    out = {}
    for label, (name, _) in methods.items():
        if name not in LOSSY:
            continue
        for path in budget.calibration_files(model, name):
            data = budget.read_calibration(path)
            entry = (data or {}).get("budgets", {}).get(budget.budget_key(budget.DEFAULT_QUALITY))
            if entry:
                out[label] = {
                    "file": str(path),
                    "quality": entry["quality"],
                    "chosen": entry.get("chosen"),
                    "settings": entry.get("settings", []),
                    "guarantee": entry.get("guarantee"),
                    "faster_than_greedy": entry.get("faster_than_greedy"),
                }
                break
    return out


def _quality(records: list[Record], ref: Record, prompt: Prompt, model: Transformer, prompt_ids: list[int]) -> None:
    """Quality beside speed for every lossy method's record (``budget.LOSSY``) and greedy's: agreement
    with greedy's text, the reference score where the prompt has a reference, and the full model's
    perplexity of the output."""
    from . import calibrate as C

    for r in records:
        if r.method not in LOSSY and r is not ref:
            continue
        r.agreement = 1.0 if r is ref else C.agreement(r.text, ref.text)
        if prompt.reference:
            r.reference_score = C.reference_score(prompt.category, r.text, prompt.reference)
        r.ppl = C.perplexity(model, prompt_ids, r.token_ids)


def _compare(records: list[Record], ref: Record | None, hf: Record | None) -> None:
    """Each record against greedy's (``ref``) and `transformers`' runs on its prompt (None: that run failed)."""
    for r in records:
        if ref is not None:
            r.speedup_vs_greedy = ref.wall_s / r.wall_s if r.wall_s > 0 else None
            r.matches_greedy = r.token_ids == ref.token_ids if r.greedy_type else None
        if hf is not None:
            r.speedup_vs_hf = hf.wall_s / r.wall_s if r.wall_s > 0 else None
            r.matches_hf = r.token_ids == hf.token_ids if r.greedy_type and r is not hf else None


class _FirstToken:
    """A `transformers` streamer that notes when the first new token arrives (its first ``put`` is
    the prompt)."""

    def __init__(self):
        self.puts, self.t = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.t = time.perf_counter()

    def end(self):
        pass


class HFBaseline:
    """`transformers` ``generate(do_sample=False)`` on the same weights, dtype and threads."""

    def __init__(self, model: Transformer):
        from ..core.loading import to_hf

        self.model = model
        self.hf = to_hf(model)
        gc = self.hf.generation_config
        eos = model.config.eos_token_ids
        gc.pad_token_id = eos[0] if eos else 0
        gc.eos_token_id = None  # never stop or mask EOS: generate exactly max_new_tokens, as ours does

    def generate(self, prompt_ids: list[int], max_new_tokens: int, **options) -> GenerationResult:
        """Greedy `generate`; ``options`` adds e.g. ``prompt_lookup_num_tokens`` or ``assistant_early_exit``."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        streamer = _FirstToken()
        calls = [0]  # forward passes of the model: one a token in greedy, one a verification with lookup
        hook = self.hf.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                streamer=streamer,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                **options,
            )
        wall = time.perf_counter() - t0
        hook.remove()
        toks = out[0, ids.shape[1] :].tolist()
        n = len(toks)
        full = not any(k.startswith("assistant") for k in options)  # an early-exit assistant runs part of it
        stats = {
            "method": HF_LABEL,
            "new_tokens": n,
            "model_calls": calls[0] if full else None,
            "wall_s": wall,
            "tokens_per_s": n / wall if wall > 0 else 0.0,
            "ttft_s": (streamer.t - t0) if streamer.t else None,
            "layers_per_token": float(self.model.config.n_layers) * calls[0] / max(1, n) if full else None,
            "tokens_per_call": n / max(1, calls[0]) if full else None,
        }
        tok = self.model.tokenizer
        text = tok.decode(toks, skip_special_tokens=True) if tok is not None else ""
        return GenerationResult(text, toks, stats, list(prompt_ids))


# -- summary and report ----------------------------------------------------------------------------
def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _speedup(rs: list[Record], by: dict, other: str) -> float | None:
    """Summed time of ``other`` over summed time of ``rs``, on the prompts both ran."""
    pairs = [(by[(other, r.prompt_index)].wall_s, r.wall_s) for r in rs if (other, r.prompt_index) in by]
    theirs, ours = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    return theirs / ours if pairs and ours > 0 else None


def _count(flags: list[bool | None]) -> str | None:
    flags = [f for f in flags if f is not None]
    return f"{sum(flags)}/{len(flags)}" if flags else None


def ratio_of_sums(pairs) -> float | None:
    """Summed numerators over summed denominators of ``(numerator, denominator)`` pairs; None without any
    or where the denominators sum to 0."""
    pairs = list(pairs)
    den = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / den if pairs and den > 0 else None


def summarize(records: list[Record], labels: list[str] | None = None, reference: str = REFERENCE) -> dict:
    """Per label: tokens/s (summed tokens over summed time; ``mean_tokens_per_s`` the mean over prompts),
    speed-ups as ratios of summed time over the same prompts, layers per token (summed over summed
    tokens), tokens per call (summed tokens over summed model calls), acceptance (summed kept draft
    tokens over summed proposed ones), and how many greedy-type runs matched the baseline tokens."""
    labels = labels or list(dict.fromkeys(r.label for r in records))
    by = {(r.label, r.prompt_index): r for r in records}
    out = {}
    for label in labels:
        rs = [r for r in records if r.label == label]
        if not rs:
            continue
        wall, tokens = sum(r.wall_s for r in rs), sum(r.new_tokens for r in rs)
        out[label] = {
            "method": rs[0].method,
            "options": rs[0].options,
            "prompts": len(rs),
            "new_tokens": tokens,
            "wall_s": wall,
            "mean_tokens_per_s": _mean([r.tokens_per_s for r in rs]),
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "speedup_vs_greedy": _speedup(rs, by, reference),
            "speedup_vs_hf": _speedup(rs, by, HF_LABEL),
            "layers_per_token": ratio_of_sums(
                (r.layers_per_token * r.new_tokens, r.new_tokens) for r in rs if r.layers_per_token is not None
            ),
            "tokens_per_call": ratio_of_sums(
                (r.new_tokens, max(1, r.model_calls))
                for r in rs
                if r.tokens_per_call is not None and r.model_calls is not None
            ),
            "acceptance": ratio_of_sums((r.accepted, r.drafted) for r in rs if r.drafted is not None),
            "mean_ttft_s": _mean([r.ttft_s for r in rs]),
            "matches_hf": _count([r.matches_hf for r in rs]),
            "matches_greedy": _count([r.matches_greedy for r in rs]),
            **_quality_summary(rs, by, reference),
        }
    return out


def _quality_summary(rs: list[Record], by: dict, reference: str) -> dict:
    """Mean agreement with greedy's text, the summed reference score over greedy's on the same
    prompts (the share of greedy's quality kept), and mean perplexity over greedy's; {} unmeasured."""
    pairs = [(r, by.get((reference, r.prompt_index))) for r in rs if r.agreement is not None]
    pairs = [(r, g) for r, g in pairs if g is not None]
    if not pairs:
        return {}
    refs = [
        (r.reference_score, g.reference_score)
        for r, g in pairs
        if r.reference_score is not None and g.reference_score is not None
    ]
    g_ref = sum(g for _, g in refs)
    ppl = [(r.ppl, g.ppl) for r, g in pairs if r.ppl is not None and g.ppl is not None]
    return {
        "agreement": sum(r.agreement for r, _ in pairs) / len(pairs),
        "reference_score": sum(m for m, _ in refs) / len(refs) if refs else None,
        "reference_kept": sum(m for m, _ in refs) / g_ref if refs and g_ref > 0 else None,
        "ppl_ratio": (sum(a for a, _ in ppl) / sum(b for _, b in ppl)) if ppl else None,
    }


def failure_lines(failures: list[dict]) -> list[str]:
    """One line per label whose runs raised: on how many prompts, and the first error."""
    by: dict[str, list[dict]] = {}
    for f in failures:
        by.setdefault(f["label"], []).append(f)
    lines = []
    for label, fs in by.items():
        first = fs[0]
        error = (str(first["error"]).strip().splitlines() or [""])[0][:300]
        prompts = len({f["prompt_index"] for f in fs})
        where = f"prompt {first['prompt_id']}" + (f" ({first['category']})" if first.get("category") else "")
        lines.append(f"{label} failed on {prompts} prompt{'' if prompts == 1 else 's'}, first on {where}: {error}")
    return lines


def format_table(summary: dict) -> str:
    """The summary as a fixed-width text table, one row per method."""

    def num(x, spec, suffix=""):
        return "-" if x is None else format(x, spec) + suffix

    width = max([16] + [len(label) for label in summary])
    cols = [
        ("method", width, lambda s: s["label"]),
        ("prompts", 7, lambda s: str(s["prompts"])),
        ("tok/s", 7, lambda s: num(s["tokens_per_s"], ".1f")),
        ("vs greedy", 9, lambda s: num(s["speedup_vs_greedy"], ".2f", "x")),
        ("vs HF", 6, lambda s: num(s["speedup_vs_hf"], ".2f", "x")),
        ("layers/tok", 10, lambda s: num(s["layers_per_token"], ".1f")),
        ("tok/call", 8, lambda s: num(s["tokens_per_call"], ".2f")),
        ("accept", 6, lambda s: num(s.get("acceptance"), ".0%")),
        ("ttft s", 7, lambda s: num(s["mean_ttft_s"], ".3f")),
        ("=HF", 5, lambda s: s["matches_hf"] or "-"),
    ]
    if any(s.get("agreement") is not None for s in summary.values()):  # quality beside speed
        cols += [
            ("agree", 5, lambda s: num(s.get("agreement"), ".2f")),
            ("ref kept", 8, lambda s: num(s.get("reference_kept"), ".0%")),
            ("ppl x", 6, lambda s: num(s.get("ppl_ratio"), ".2f", "x")),
        ]

    def row(cells):
        return " ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, (_, w, _)) in enumerate(zip(cells, cols)))

    head = row([name for name, _, _ in cols])
    lines = [head, "-" * len(head)]
    lines += [row([get({"label": label, **s}) for _, _, get in cols]) for label, s in summary.items()]
    return "\n".join(lines)


def machine_config(model: Transformer) -> dict:
    import transformers

    return {
        "model": model.config.name,
        "source": model.source,
        "fingerprint": model.fingerprint,
        "dtype": model.dtype_name,
        "threads": torch.get_num_threads(),
        "cpu": cpu_signature(),
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class BenchResult:
    config: dict
    records: list[Record] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    reference: str = REFERENCE
    prompts_done: int = 0
    interrupted: bool = False
    call_cost: dict | None = None  # roofline.CallCost.to_dict(), when measured
    # runs that raised: {"prompt_index", "prompt_id", "category", "label", "round", "error"}, one a run
    failures: list[dict] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        return summarize(self.records, self.labels, self.reference)

    def table(self) -> str:
        return format_table(self.summary)

    def summary_by_category(self) -> dict:
        cats = dict.fromkeys(r.category for r in self.records)
        return {c: summarize([r for r in self.records if r.category == c], self.labels, self.reference) for c in cats}

    def to_dict(self) -> dict:
        """The JSON report: strict JSON (options that are not finite as text, other such numbers null)."""
        return finite(
            {
                "config": self.config,
                "call_cost": self.call_cost,
                "prompts_done": self.prompts_done,
                "interrupted": self.interrupted,
                "complete": self.prompts_done == self.config.get("n_prompts"),
                "failures": self.failures,
                "summary": self.summary,
                "summary_by_category": self.summary_by_category(),
                "records": [asdict(r) for r in self.records],
            }
        )


# -- the harness -----------------------------------------------------------------------------------
def _as_prompts(prompts) -> list[Prompt]:
    return [
        p if isinstance(p, Prompt) else Prompt(i, "", V.text(p, "a prompt"))
        for i, p in enumerate(V.items(prompts, "prompts"))
    ]


def check_specs(methods) -> None:
    """``methods`` must map labels to (method name, options dict)."""
    ok = isinstance(methods, dict) and all(
        isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict) for v in methods.values()
    )
    if not ok:
        raise LayerleapError(
            f"methods must map labels to (method, options) pairs, e.g. {{'g': ('greedy', {{}})}}, got {V.show(methods)}"
        )


def samples(method: str, sampling: dict) -> bool:
    """Whether ``method`` samples in a run with ``sampling`` (``generate``'s temperature, top_k, top_p,
    seed, do_sample): a method that samples by default does, and with ``do_sample=True`` every method
    that can; the others decode greedily (the greedy reference among them) and get none of ``sampling``."""
    m = get_method(method)
    return m.default_sample or (m.sampling and bool(sampling.get("do_sample")))


def run_bench(
    model: Transformer,
    methods: MethodSpecs,
    prompts,
    max_new_tokens: int,
    *,
    hf_baseline: bool = True,
    chat: bool = False,
    sampling: dict | None = None,
    out: str | Path | None = None,
    config: dict | None = None,
    warmup: bool = True,
    progress: bool = True,
    on_prompt: Callable[[BenchResult], None] | None = None,
    call_cost: bool = True,
    hf_extra: dict[str, dict] | None = None,
    repeat: int = 1,
    quality: bool = True,
) -> BenchResult:
    """Benchmark ``methods`` (label -> (method, options)) on ``prompts`` (``Prompt``s or strings).

    For each prompt every method runs, then the `transformers` baseline; plain ``greedy`` is added
    first when missing (the speed-up reference).  ``sampling`` holds ``generate``'s temperature,
    top_k, top_p, seed, do_sample.  With ``out`` the JSON report is rewritten after every prompt.
    Ctrl-C (KeyboardInterrupt) stops the run: the result (and report) holds the finished prompts,
    with ``interrupted=True``.  ``on_prompt(result)`` is called after each prompt.  ``call_cost``
    first measures ``roofline.call_cost`` (about 5 s) into the report's ``call_cost``.  ``hf_extra``
    (label -> `generate` options, see ``parse_hf_extra``) times `transformers`' own faster decoding
    too, after its greedy.  ``repeat`` runs every prompt's methods that many rounds (round-robin) and
    keeps each method's fastest run: on a shared machine a burst of other work then spoils one run,
    not the comparison.  A run that raises (a method failing on one prompt) is recorded in
    ``failures`` and the bench goes on; the summary compares each method on the prompts it finished.
    ``quality`` measures each lossy method's output beside its speed (agreement with greedy's text,
    the reference score where the data has one, perplexity; ``_quality``) and records each one's
    calibration (``calibration`` in the report: the quality-speed frontier)."""
    from tqdm.auto import tqdm

    prompts = _as_prompts(prompts)
    check_specs(methods)
    if not prompts:
        raise LayerleapError("no prompts to benchmark")
    V.integer(max_new_tokens, "max_new_tokens", 1)
    V.integer(repeat, "repeat", 1, 20)
    if out is not None:
        V.report_file(out, "out")
    methods, ref = with_reference(methods)
    taken = [label for label in methods if label == HF_LABEL or label in (hf_extra or {})]
    if hf_baseline and taken:
        raise LayerleapError(
            f"method label {taken[0]!r} names a transformers baseline's row: give the method another label"
        )
    for label, (name, options) in methods.items():
        check_spec(label, name, options, model.config)
    sampling = dict(sampling or {})
    cfg = {
        "command": None,  # the command line that ran it (``config``); the key marks the file as a report
        **machine_config(model),
        **(config or {}),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "sampling": sampling,
        "hf_baseline": hf_baseline,
        "hf_extra": dict(hf_extra or {}),
        "warmup": warmup,
        "repeat": repeat,
        "n_prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "methods": {lb: {"method": n, "options": plain_options(o)} for lb, (n, o) in methods.items()},
    }
    if quality:
        cfg["calibration"] = calibrations(model, methods)
    extras = dict(hf_extra or {}) if hf_baseline else {}
    result = BenchResult(cfg, labels=list(methods) + ([HF_LABEL] if hf_baseline else []) + list(extras), reference=ref)
    save = (lambda: write_json(out, result.to_dict())) if out else (lambda: None)
    save()
    runner = _Runner(model, methods, ref, chat, sampling, extras, repeat, quality, result.failures)
    bar = tqdm(
        total=len(prompts) * len(result.labels) * repeat, desc="bench", unit="run", disable=not progress, leave=False
    )
    with OtherLoad() as others:  # other processes' share of the CPUs during the run
        try:
            if hf_baseline:
                bar.set_postfix_str(f"{HF_LABEL} model")
                runner.hf = HFBaseline(model)
            if call_cost:
                bar.set_postfix_str("call cost")
                from .roofline import call_cost as measure_call_cost

                result.call_cost = measure_call_cost(model).to_dict()
                save()
            if warmup:
                bar.set_postfix_str("warm-up")
                runner.warmup(min(prompts, key=lambda p: len(p.text)), min(WARMUP_TOKENS, max_new_tokens))
            held = _LastRunAfterSave(bar, len(result.labels) * repeat)
            for i, prompt in enumerate(prompts):
                result.records.extend(runner.prompt(i, prompt, max_new_tokens, held))
                result.prompts_done += 1
                save()
                held.saved()
                if on_prompt is not None:
                    on_prompt(result)
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            bar.close()
    result.config["load_average_end"] = list(os.getloadavg())
    result.config["other_cpu_share"] = None if others.share is None else round(others.share, 3)
    save()
    return result


class _LastRunAfterSave:
    """The progress bar, with each prompt's last run shown only once the prompt is saved (``saved``): an
    interrupt after the bar moved finds the prompt in the report."""

    def __init__(self, bar, per_prompt: int):
        self.bar, self.per_prompt, self.runs = bar, per_prompt, 0

    def set_postfix_str(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def update(self) -> None:
        self.runs += 1
        if self.runs < self.per_prompt:
            self.bar.update()

    def saved(self) -> None:
        if self.runs >= self.per_prompt:
            self.bar.update()
        self.runs = 0


class _Runner:
    """Runs every method, then the baseline, on one prompt."""

    def __init__(
        self,
        model: Transformer,
        methods: MethodSpecs,
        ref: str,
        chat: bool,
        sampling: dict,
        hf_extra: dict[str, dict] | None = None,
        repeat: int = 1,
        quality: bool = True,
        failures: list[dict] | None = None,
    ):
        self.model, self.methods, self.ref, self.chat, self.sampling = model, methods, ref, chat, sampling
        self.failures = [] if failures is None else failures
        self.quality, self.prompt_ids = quality, []
        self.repeat = repeat
        self.hf_extra = hf_extra or {}
        self.greedy_type = {label: not samples(name, sampling) for label, (name, _) in methods.items()}
        self.hf: HFBaseline | None = None

    def ours(self, label: str, prompt: Prompt, n: int) -> GenerationResult:
        name, options = self.methods[label]
        sampling = self.sampling if samples(name, self.sampling) else {}
        return generate(self.model, prompt.text, name, n, stop_at_eos=False, chat=self.chat, **sampling, **options)

    def warmup(self, prompt: Prompt, n: int) -> None:
        """Every run once, untimed; one that raises here is left to the timed runs to report."""
        prompt_ids = None
        for label in self.methods:
            res, _ = _attempt(self.ours, label, prompt, n)
            prompt_ids = res.prompt_ids if res is not None else prompt_ids
        if self.hf is not None and prompt_ids is not None:
            for options in ({}, *self.hf_extra.values()):
                _attempt(self.hf.generate, prompt_ids, n, **options)

    def run(self, i: int, prompt: Prompt, label: str, round_: int, fn: Callable[..., GenerationResult], *args, **kw):
        """``fn(*args, **kw)``, or None after recording its failure (``BenchResult.failures``): one method failing
        on one prompt leaves the others' runs and the rest of the bench to finish."""
        res, error = _attempt(fn, *args, **kw)
        if error is not None:
            self.fail(i, prompt, label, round_, error)
        return res

    def fail(self, i: int, prompt: Prompt, label: str, round_: int, error: str) -> None:
        self.failures.append(
            {
                "prompt_index": i,
                "prompt_id": prompt.id,
                "category": prompt.category,
                "label": label,
                "round": round_,
                "error": error,
            }
        )

    def prompt(self, i: int, prompt: Prompt, n: int, bar) -> list[Record]:
        runs: dict[str, Record] = {}
        for r in range(self.repeat):
            for label, rec in self.round(
                i,
                prompt,
                n,
                bar,
                f"{prompt.category or 'prompt'} {prompt.id}" + (f" #{r + 1}" if self.repeat > 1 else ""),
                r,
            ):
                if label not in runs or rec.wall_s < runs[label].wall_s:  # the fastest of the rounds
                    runs[label] = rec
        ref = runs.get(self.ref)
        _compare(list(runs.values()), ref, runs.get(HF_LABEL))
        if self.quality and ref is not None and any(name in LOSSY for name, _ in self.methods.values()):
            _quality(list(runs.values()), ref, prompt, self.model, self.prompt_ids)
        return list(runs.values())

    def round(self, i: int, prompt: Prompt, n: int, bar, where: str, round_: int = 0):
        """Every method once on ``prompt``, then the baseline: (label, Record) pairs of the runs that
        finished (a failed run is recorded in ``failures``)."""
        prompt_ids = None
        for label, (name, options) in self.methods.items():
            bar.set_postfix_str(f"{where} {label}")
            res = self.run(i, prompt, label, round_, self.ours, label, prompt, n)
            if res is not None:
                prompt_ids = self.prompt_ids = res.prompt_ids  # the same for every method: generate's own encoding
                yield label, _record(i, prompt, label, name, options, res, self.greedy_type[label])
            bar.update()
        if self.hf is not None:
            hf_runs = {HF_LABEL: {}, **self.hf_extra}
            for label, options in hf_runs.items():
                bar.set_postfix_str(f"{where} {label}")
                if prompt_ids is None:  # every method of ours failed on the prompt: no encoding to give
                    res = None
                    self.fail(i, prompt, label, round_, "every method of ours failed, so no encoded prompt to give")
                else:
                    res = self.run(i, prompt, label, round_, self.hf.generate, prompt_ids, n, **options)
                if res is not None:
                    yield label, _record(i, prompt, label, "transformers.generate", options, res, True)
                bar.update()


def _attempt(fn, *args, **kw) -> tuple[object, str | None]:
    """``(fn(*args, **kw), None)``, or ``(None, "Type: message")`` where it raises; a Ctrl-C that a library
    turned into another error stays an interrupt."""
    try:
        return fn(*args, **kw), None
    except Exception as e:  # noqa: BLE001 - any failure of the run is reported, not raised
        from .. import interrupts

        if interrupts.interrupted():
            raise KeyboardInterrupt from e
        return None, f"{type(e).__name__}: {e}"
