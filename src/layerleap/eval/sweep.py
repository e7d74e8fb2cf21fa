"""BiLD's quality-latency trade-off (the paper's Figures 4 and 9, Table 1), measured here.

For every prompt, in turn: the large model's greedy decoding (the reference for speed AND quality),
every BiLD point ``(alpha_fb, alpha_rb)``, then greedy speculative decoding for every draft length
and every adaptive setting (``SpecSetting``: schedule, first γ, confidence stop),
then (optionally) `transformers` greedy and assisted generation on the same weights as yardsticks.
All runs of one prompt are back to back (interleaved), generate exactly ``max_new_tokens`` tokens
(EOS does not stop them), and are timed by ``generate`` itself.

Per point:

- ``latency``: summed wall time over the prompts / summed wall time of greedy over the same prompts
  (the paper's normalised latency); ``speedup`` = 1 / latency;
- ``quality`` per category against the large model's own greedy output on the same prompt:
  ROUGE-L for summarization, BLEU for translation, exact match of the final number for math
  (``evaluation.metric_for``); greedy scores 100 against itself, so ``100 - quality`` is the loss;
- ``fallback_rate`` (small-model steps at or below ``alpha_fb`` per small-model step) and ``rollback_rate``
  (rollbacks per large-model pass), from the summed counters.

``table`` gives the paper's Table 1 form per category: the best speed-up with no quality loss
(quality >= 100 - ``NO_LOSS``) and with at most 1 point lost, next to speculative decoding (which is
lossless: quality 100 by construction, verified here).

The JSON report is rewritten atomically after every prompt; rerunning with the same settings and
the same ``out`` resumes after the last finished prompt.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import quality as evaluation
from .. import validate as V
from .bench import machine_config
from ..files import read_report, save_figure, strict, write_json
from ..datasets import Prompt
from ..decoding import generate
from ..errors import LayerleapError

NO_LOSS = 0.05  # "no loss": the score rounds to 100.0 against greedy's own output
ONE_POINT = 1.0
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Point:
    label: str
    method: str  # "greedy", "bild", "speculative", "eagle" or "transformers"
    options: dict = field(default_factory=dict)  # JSON-able options (no models)
    alpha_fb: float | None = None
    alpha_rb: float | None = None
    draft_len: int | None = None


def bild_grid(alpha_fbs: list[float], alpha_rbs: list[float]) -> list[Point]:
    return [
        Point(f"bild fb={fb:g} rb={rb:g}", "bild", {"alpha_fb": fb, "alpha_rb": rb}, fb, rb)
        for rb in alpha_rbs
        for fb in alpha_fbs
    ]


def speculative_points(gammas: list[int]) -> list[Point]:
    """Fixed-γ speculative decoding (constant schedule, no confidence stop, whatever the defaults)."""
    return [
        Point(
            f"speculative γ={g}",
            "speculative",
            {"draft_len": g, "schedule": "constant", "min_confidence": 0.0},
            draft_len=g,
        )
        for g in gammas
    ]


def eagle_points() -> list[Point]:
    """The ``eagle`` method at its defaults: the lossless yardstick of BiLD's EAGLE form (the same head)."""
    return [Point("eagle", "eagle")]


@dataclass(frozen=True)
class SpecSetting:
    """One speculative decoding setting: ``schedule``, the (first) draft length γ, ``min_confidence``."""

    schedule: str
    draft_len: int
    min_confidence: float = 0.0

    def point(self) -> Point:
        label = f"speculative {self.schedule} γ={self.draft_len}"
        if self.min_confidence:
            label += f" conf={self.min_confidence:g}"
        return Point(
            label,
            "speculative",
            {"draft_len": self.draft_len, "schedule": self.schedule, "min_confidence": self.min_confidence},
            draft_len=self.draft_len,
        )


def parse_spec_setting(text: str) -> SpecSetting:
    """``SCHEDULE:γ[:MIN_CONFIDENCE]``, e.g. ``heuristic:4`` or ``constant:20:0.4``."""
    from ..decoding import get_method

    parts = text.strip().split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        setting = SpecSetting(parts[0], int(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0)
        get_method("speculative").check_options(
            {"draft_len": setting.draft_len, "schedule": setting.schedule, "min_confidence": setting.min_confidence},
            partial=True,
        )
    except (ValueError, LayerleapError) as e:
        why = f": {e}" if isinstance(e, LayerleapError) else ""
        raise LayerleapError(
            f"speculative setting {text!r} is not SCHEDULE:γ[:MIN_CONFIDENCE] "
            f"(e.g. heuristic:4 or constant:20:0.4){why}"
        ) from None
    return setting


HF_GREEDY = "transformers greedy"
HF_ASSISTED = "transformers assisted"


def transformers_points() -> list[Point]:
    """`transformers` ``generate`` on the same weights: plain greedy, and assisted generation (the
    small model as ``assistant_model``, or in the early-exit form ``assistant_early_exit=E``)."""
    return [
        Point(HF_GREEDY, "transformers", {"assisted": False}),
        Point(HF_ASSISTED, "transformers", {"assisted": True}),
    ]


def hf_view(model):
    """A `transformers` causal LM on ``model``'s weights: views of our tensors where they are dense
    (no copy: the pair fits in memory twice over only this way), dense copies of packed ones (a
    kernel's layout is not `transformers`').  Built on the meta device, then given the tensors; the
    rotary tables (buffers, not weights) are rebuilt on the model's device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..core.loading import ours_to_hf

    d = model.config.to_hf()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    sd = ours_to_hf(model, contiguous=False)
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    hf.load_state_dict(sd, strict=True, assign=True)
    with torch.device(model.device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise LayerleapError(f"transformers model for {model.config.name}: no tensor for {left[:3]}")
    return hf.eval()


class HFRunner:
    """Times `transformers` ``generate(do_sample=False)`` of the large model, alone or assisted.

    Same input ids as ours, exactly ``max_new_tokens`` new tokens (the EOS id is unset, as in
    ``bench.HFBaseline``).  Assisted generation keeps `transformers`' own defaults for the assistant
    (its number of draft tokens and its schedule), which is what a user of it gets."""

    def __init__(self, large, small=None, exit_layer: int | None = None):
        self.large, self.hf = large, hf_view(large)
        self.assistant = hf_view(small) if small is not None else None
        self.exit_layer = exit_layer
        eos = large.config.eos_token_ids
        for m in (self.hf, self.assistant):
            if m is not None:
                m.generation_config.pad_token_id = eos[0] if eos else 0
                m.generation_config.eos_token_id = None

    def generate(self, prompt_ids: list[int], max_new_tokens: int, assisted: bool):
        import time

        import torch

        from ..core.run import GenerationResult

        kw = {}
        if assisted:
            kw = (
                {"assistant_model": self.assistant}
                if self.assistant is not None
                else {"assistant_early_exit": self.exit_layer}
            )
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.large.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                **kw,
            )
        wall = time.perf_counter() - t0
        toks = out[0, ids.shape[1] :].tolist()
        tok = self.large.tokenizer
        text = tok.decode(toks, skip_special_tokens=True) if tok is not None else ""
        stats = {
            "method": "transformers",
            "assisted": assisted,
            "new_tokens": len(toks),
            "wall_s": wall,
            "tokens_per_s": len(toks) / wall if wall > 0 else 0.0,
        }
        return GenerationResult(text, toks, stats, list(prompt_ids))


@dataclass
class Run1:
    """One point on one prompt."""

    prompt_index: int
    category: str
    label: str
    wall_s: float
    new_tokens: int
    text: str
    token_ids: list[int]
    stats: dict


def _json_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, type(None)))}


def run_sweep(
    large,
    points: list[Point],
    prompts: list[Prompt],
    max_new_tokens: int,
    *,
    models: dict,
    fixed: dict | None = None,
    chat: bool = True,
    out: str | Path | None = None,
    config: dict | None = None,
    progress: bool = True,
) -> dict:
    """Run greedy and ``points`` on every prompt; -> the report (also written to ``out``).

    ``models`` holds the model options (``small`` / ``draft``) per method name; ``fixed`` holds
    JSON-able options added to every BiLD point (``exit_layer``, ``head``, ``max_small``)."""
    from tqdm.auto import tqdm

    prompts = V.items(prompts, "prompts", "Spec-Bench prompts")
    if not prompts or not all(isinstance(p, Prompt) for p in prompts):
        raise LayerleapError("prompts must be a non-empty list of Spec-Bench prompts (layerleap.datasets.spec_bench)")
    V.integer(max_new_tokens, "max_new_tokens", 1)
    if out is not None:
        V.output_file(out, "out", (".json",))
    fixed = dict(fixed or {})
    points = [Point("greedy", "greedy")] + list(points)
    labels = [p.label for p in points]
    if len(set(labels)) != len(labels):
        raise LayerleapError("two sweep points have the same label: remove duplicate thresholds")
    cfg = {
        **machine_config(large),
        **(config or {}),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "n_prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "fixed": fixed,
        "points": [asdict(p) for p in points],
        "prompt_ids": [p.id for p in prompts],
    }
    report = {"config": cfg, "records": [], "prompts_done": 0}
    if out and Path(out).is_file():
        report = _resume(Path(out), cfg, report)

    def options(p: Point) -> dict:
        o = dict(p.options)
        if p.method == "bild":
            o.update(fixed)
        o.update(models.get(p.method) or {})
        return o

    prompt_ids: dict[str, list[int]] = {}  # our encoding of each prompt (greedy runs first)

    def one(p: Point, prompt: Prompt, n: int):
        if p.method == "transformers":
            if models.get("transformers") is None:
                raise LayerleapError("transformers points need models['transformers'] (an HFRunner)")
            return models["transformers"].generate(prompt_ids[prompt.id], n, p.options["assisted"])
        r = generate(large, prompt.text, p.method, n, chat=chat, stop_at_eos=False, **options(p))
        prompt_ids[prompt.id] = list(r.prompt_ids)
        return r

    total = len(prompts) * len(points)
    bar = tqdm(
        total=total,
        initial=report["prompts_done"] * len(points),
        desc="sweep bild",
        unit="run",
        disable=not progress,
        leave=False,
    )
    try:
        bar.set_postfix_str("warm-up")
        for p in points:
            one(p, prompts[0], min(WARMUP_TOKENS, max_new_tokens))
        for i in range(report["prompts_done"], len(prompts)):
            prompt = prompts[i]
            runs = []
            for p in points:
                bar.set_postfix_str(f"{prompt.category} {prompt.id} {p.label}")
                r = one(p, prompt, max_new_tokens)
                runs.append(
                    Run1(
                        i,
                        prompt.category,
                        p.label,
                        r.stats["wall_s"],
                        r.stats["new_tokens"],
                        r.text,
                        list(r.token_ids),
                        _json_stats(r.stats),
                    )
                )
                if len(runs) < len(points):  # the prompt's last run counts once it is saved
                    bar.update()
            report["records"].extend(asdict(r) for r in runs)
            report["prompts_done"] = i + 1
            report["summary"] = summarize(report)
            if out:
                write_json(out, report)
            bar.update()
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        bar.close()
    report["summary"] = summarize(report)
    report["complete"] = report["prompts_done"] == len(prompts)
    if out:
        write_json(out, report)
    return report


def _resume(path: Path, cfg: dict, fresh: dict) -> dict:
    old = read_report(path, "a sweep report")
    if old is None:
        return fresh
    same = all(  # as JSON holds them: alpha_rb=inf is "inf" there (``files.strict``)
        strict(old["config"].get(k)) == strict(cfg[k])
        for k in ("model", "fingerprint", "max_new_tokens", "chat", "fixed", "points", "prompt_ids")
    )
    if not same:
        raise LayerleapError(f"{path} holds a sweep with other settings: choose another --json or delete it")
    done = int(old.get("prompts_done", 0))
    return {
        "config": cfg,
        "records": [r for r in old["records"] if r["prompt_index"] < done],
        "prompts_done": done,
        "resumed_from": done,
    }


# -- summary --------------------------------------------------------------------------------------------
def summarize(report: dict) -> dict:
    """Per point: overall and per-category latency, speed-up, quality and rates."""
    recs = report["records"]
    points = [p["label"] for p in report["config"]["points"]]
    info = {p["label"]: p for p in report["config"]["points"]}
    greedy = {r["prompt_index"]: r for r in recs if r["label"] == "greedy"}
    cats = sorted({r["category"] for r in recs})
    out = {}
    for label in points:
        rs = [r for r in recs if r["label"] == label and r["prompt_index"] in greedy]
        if not rs:
            continue
        entry = {
            "method": info[label]["method"],
            "alpha_fb": info[label]["alpha_fb"],
            "alpha_rb": info[label]["alpha_rb"],
            "draft_len": info[label]["draft_len"],
            **_measure(rs, greedy),
            "categories": {},
        }
        for c in cats:
            rc = [r for r in rs if r["category"] == c]
            if rc:
                entry["categories"][c] = {**_measure(rc, greedy), **_quality(c, rc, greedy)}
        qs = [v["quality"] for v in entry["categories"].values()]
        entry["quality"] = sum(qs) / len(qs) if qs else None  # mean over categories
        out[label] = entry
    return out


def _unsure_steps(rs: list[dict]) -> int:
    """The small steps at or below ``alpha_fb`` over the rows: each row's ``fallback_rate`` over its small
    steps (a first token the small model was unsure of is one, though no fallback: the prompt pass gave it)."""
    return sum(round((r["stats"].get("fallback_rate") or 0) * (r["stats"].get("small_steps") or 0)) for r in rs)


def _measure(rs: list[dict], greedy: dict) -> dict:
    wall = sum(r["wall_s"] for r in rs)
    ref = sum(greedy[r["prompt_index"]]["wall_s"] for r in rs)
    tokens = sum(r["new_tokens"] for r in rs)
    sums = {
        k: sum(r["stats"].get(k) or 0 for r in rs)
        for k in (
            "small_steps",
            "rollbacks",
            "large_calls",
            "small_tokens",
            "rolled_back",
            "large_tokens",
            "drafted",
            "accepted",
            "layer_evals",
            "rounds",
            "draft_calls",
            "model_calls",
            "confidence_stops",
        )
    }
    return {
        "prompts": len(rs),
        "new_tokens": tokens,
        "wall_s": wall,
        "greedy_wall_s": ref,
        "latency": wall / ref if ref > 0 else None,
        "speedup": ref / wall if wall > 0 else None,
        "fallback_rate": _unsure_steps(rs) / sums["small_steps"] if sums["small_steps"] else None,
        "rollback_rate": sums["rollbacks"] / sums["large_calls"] if sums["large_calls"] else None,
        "large_calls_per_token": sums["large_calls"] / tokens if tokens and sums["large_calls"] else None,
        "small_share": (
            (sums["small_tokens"] - sums["rolled_back"]) / tokens if tokens and sums["small_tokens"] else None
        ),
        "acceptance": sums["accepted"] / sums["drafted"] if sums["drafted"] else None,
        "draft_len_mean": sums["drafted"] / sums["rounds"] if sums["rounds"] else None,  # speculative: mean γ used
        "tokens_per_round": tokens / sums["rounds"] if tokens and sums["rounds"] else None,
        "draft_calls_per_token": sums["draft_calls"] / tokens if tokens and sums["draft_calls"] else None,
        "model_calls_per_token": sums["model_calls"] / tokens if tokens and sums["model_calls"] else None,
        "confidence_stops": sums["confidence_stops"] if sums["rounds"] else None,
        # None: not metered (transformers)
        "layers_per_token": sums["layer_evals"] / tokens if tokens and sums["layer_evals"] else None,
        "identical": sum(r["token_ids"] == greedy[r["prompt_index"]]["token_ids"] for r in rs),
    }


def _quality(category: str, rs: list[dict], greedy: dict) -> dict:
    metric = evaluation.metric_for(category)
    cand = [r["text"] for r in rs]
    refs = [greedy[r["prompt_index"]]["text"] for r in rs]
    return {"metric": metric, "quality": evaluation.score(metric, cand, refs)}


# -- Table 1 -------------------------------------------------------------------------------------------
def best_within(summary: dict, category: str | None, max_loss: float, method: str = "bild") -> tuple[str, dict] | None:
    """The fastest point of ``method`` whose quality (in ``category``, or the mean over categories) is
    at least ``100 - max_loss``."""
    best = None
    for label, e in summary.items():
        if e["method"] != method:
            continue
        m = e["categories"].get(category) if category else e
        if not m or m.get("quality") is None or m.get("speedup") is None:
            continue
        if m["quality"] >= 100 - max_loss - 1e-9 and (best is None or m["speedup"] > best[1]["speedup"]):
            best = (label, m)
    return best


def table(summary: dict) -> str:
    """Markdown: rows greedy / BiLD (no loss) / BiLD (<= 1 point) / speculative (best γ); per category
    and for the mean over categories, the quality and the speed-up (label of the point below)."""
    cats = sorted({c for e in summary.values() for c in e["categories"]})
    cols = cats + ["mean"]

    def cell(hit):
        if hit is None:
            return "— (none)"
        label, m = hit
        return f"{m['quality']:.1f} / {m['speedup']:.2f}× <br><sub>{label}</sub>"

    metric = {c: evaluation.metric_for(c) for c in cats}
    head = "| | " + " | ".join(f"{c} ({metric.get(c, 'mean of the columns')})" for c in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    lines.append("| greedy (large model) | " + " | ".join("100.0 / 1.00×" for _ in cols) + " |")
    lossless = "eagle" if any(e["method"] == "eagle" for e in summary.values()) else "speculative"
    for name, loss, method in (
        ("BiLD, no loss", NO_LOSS, "bild"),
        ("BiLD, ≤ 1 point loss", ONE_POINT, "bild"),
        (f"{lossless} (lossless)", NO_LOSS, lossless),
    ):
        lines.append(
            f"| {name} | "
            + " | ".join(cell(best_within(summary, None if c == "mean" else c, loss, method)) for c in cols)
            + " |"
        )
    for label in (HF_GREEDY, HF_ASSISTED):  # yardsticks: whatever their quality, at their speed
        e = summary.get(label)
        if e is not None:
            cells = [
                cell((label, e["categories"][c] if c != "mean" else e)) if c == "mean" or c in e["categories"] else "—"
                for c in cols
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def points_table(summary: dict) -> str:
    """Markdown: every point with its overall speed-up, quality per category, rates."""
    cats = sorted({c for e in summary.values() for c in e["categories"]})
    head = (
        "| point | speed-up | " + " | ".join(cats) + " | identical | fallback rate | rollback rate | "
        "small-model share | layers/token | acceptance | mean γ | tokens/round |"
    )
    lines = [head, "|---" * (len(cats) + 10) + "|"]

    def f(x, spec):
        return "–" if x is None else format(x, spec)

    for label, e in summary.items():
        qs = " | ".join(f(e["categories"].get(c, {}).get("quality"), ".1f") for c in cats)
        lines.append(
            f"| {label} | {f(e['speedup'], '.2f')}× | {qs} | {e['identical']}/{e['prompts']} | "
            f"{f(e['fallback_rate'], '.2f')} | {f(e['rollback_rate'], '.2f')} | "
            f"{f(e['small_share'], '.2f')} | {f(e['layers_per_token'], '.1f')} | "
            f"{f(e.get('acceptance'), '.2f')} | {f(e.get('draft_len_mean'), '.2f')} | "
            f"{f(e.get('tokens_per_round'), '.2f')} |"
        )
    return "\n".join(lines)


# -- the plot -----------------------------------------------------------------------------------------
def plot(summary: dict, path: str | Path, title: str = "") -> Path:
    """Quality against normalised latency, one panel per category (Figures 4 and 9): a line per
    alpha_rb through its alpha_fb points (marker size grows with alpha_fb), greedy as X, speculative
    decoding as squares, lines at greedy's score and 1 point below."""
    from ..files import pyplot

    plt = pyplot()

    cats = sorted({c for e in summary.values() for c in e["categories"]})
    if not cats:
        raise LayerleapError("nothing to plot: the sweep has no finished prompt")
    fig, axes = plt.subplots(1, len(cats), figsize=(5.2 * len(cats), 4.2), squeeze=False)
    rbs = sorted({e["alpha_rb"] for e in summary.values() if e["method"] == "bild"}, key=lambda x: (math.isinf(x), x))
    cmap = plt.get_cmap("viridis")
    for ax, c in zip(axes[0], cats):
        for j, rb in enumerate(rbs):
            pts = sorted(
                (
                    (e["alpha_fb"], e["categories"][c])
                    for e in summary.values()
                    if e["method"] == "bild" and e["alpha_rb"] == rb and c in e["categories"]
                ),
                key=lambda t: t[0],
            )
            if not pts:
                continue
            x = [m["latency"] for _, m in pts]
            y = [m["quality"] for _, m in pts]
            color = cmap(j / max(1, len(rbs) - 1))
            ax.plot(x, y, "-", color=color, alpha=0.6, label=f"BiLD α_rb={rb:g}")
            ax.scatter(x, y, s=[20 + 120 * fb for fb, _ in pts], color=color, zorder=3)
        spec = [
            (e["draft_len"], e["categories"][c])
            for e in summary.values()
            if e["method"] == "speculative" and c in e["categories"]
        ]
        if spec:
            ax.scatter(
                [m["latency"] for _, m in spec],
                [m["quality"] for _, m in spec],
                marker="s",
                color="tab:red",
                label="speculative (γ or first γ = " + ", ".join(str(g) for g, _ in spec) + ")",
                zorder=4,
            )
        for label, marker in ((HF_GREEDY, "^"), (HF_ASSISTED, "v"), ("eagle", "s")):
            e = summary.get(label)
            if e is not None and c in e["categories"]:
                m = e["categories"][c]
                ax.scatter(
                    [m["latency"]], [m["quality"]], marker=marker, s=70, color="tab:orange", label=label, zorder=4
                )
        ax.scatter([1.0], [100.0], marker="X", s=120, color="black", label="greedy (large)", zorder=5)
        ax.axhline(100.0, color="gray", lw=0.8, ls="--")
        ax.axhline(99.0, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("latency / greedy latency")
        ax.set_ylabel(f"{evaluation.metric_for(c)} vs greedy output")
        ax.set_title(c)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
