"""Exactness at scale: every lossless method against plain greedy decoding on many prompts.

``run_exactness(model, methods, prompts, max_new_tokens, out="report.json")`` decodes each prompt
with plain ``greedy`` (the reference), optionally with `transformers` greedy ``generate`` on the same
weights (``hf=True``), and with every method in ``methods`` (label -> (method, options); each must be
registered with ``exact=True``), all with ``stop_at_eos=False`` so every run has exactly
``max_new_tokens`` tokens.  A run whose tokens differ from the reference is a *divergence*: the
report keeps the prompt, the method, the first differing position, the two tokens and their logit gap
at that position under the reference model (one plain forward over the prompt and the reference
tokens before it): ``logit[reference token] - logit[method token]``.  A gap below ``near_tie``
(1e-4) marks a near-tie, where float rounding may pick either token; any other divergence is a bug.

The JSON report is rewritten atomically after every prompt; a rerun with the same settings and
report resumes after the prompts already done (other settings are refused).  Ctrl-C stops the run
with the report holding the finished prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import validate as V
from .bench import HF_LABEL, HFBaseline, check_specs, machine_config, plain_options
from ..datasets import Prompt
from ..decoding import METHODS, generate, get_method
from ..errors import LayerleapError
from ..files import number, read_report, write_json
from ..core.model import Transformer

NEAR_TIE = 1e-4
REFERENCE = "greedy"
SETTINGS = ("fingerprint", "dtype", "max_new_tokens", "chat", "methods", "transformers", "prompt_ids", "near_tie")

MethodSpecs = dict[str, tuple[str, dict]]


class ExactnessError(LayerleapError, ValueError):
    """Bad input to the exactness run: the message names the problem and the fix."""


def lossless_methods() -> list[str]:
    """The registered methods that claim greedy-exactness (``register(..., exact=True)``), the
    reference itself left out."""
    return [name for name, m in METHODS.items() if m.exact and name != REFERENCE]


@dataclass
class Divergence:
    prompt_id: int
    category: str
    label: str
    method: str
    position: int  # the first generated position where the tokens differ
    reference_token: int | None  # None: the run is shorter than the reference (or longer: method_token)
    method_token: int | None
    reference_text: str
    method_text: str
    logit_gap: float | None  # logit[reference] - logit[method] under the reference model
    near_tie: bool


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def logit_gap(model: Transformer, prefix: list[int], a: int, b: int) -> float:
    """``logit[a] - logit[b]`` at the position after ``prefix``, one plain no-cache forward."""
    ids = torch.tensor([prefix], dtype=torch.long, device=model.device)
    logits = model(ids, logits_from=-1)[0, -1].float()
    return float(logits[a] - logits[b])


def _divergence(
    model,
    prompt: Prompt,
    label: str,
    method: str,
    prompt_ids: list[int],
    ref: list[int],
    got: list[int],
    near_tie: float,
) -> Divergence | None:
    i = first_difference(ref, got)
    if i is None:
        return None
    a = ref[i] if i < len(ref) else None
    b = got[i] if i < len(got) else None
    gap = logit_gap(model, prompt_ids + ref[:i], a, b) if a is not None and b is not None else None
    tok = model.tokenizer

    def text(t):
        return tok.decode([t]) if tok is not None and t is not None else ""

    return Divergence(
        prompt.id,
        prompt.category,
        label,
        method,
        i,
        a,
        b,
        text(a),
        text(b),
        gap,
        gap is not None and abs(gap) < near_tie,
    )


def check_methods(methods: MethodSpecs) -> None:
    exact = lossless_methods()
    for label, (name, _) in methods.items():
        if not get_method(name).exact:
            raise ExactnessError(
                f"method {name!r} ({label}) does not claim greedy-exactness: choose from {', '.join(exact)}"
            )


def _resume(path: Path, cfg: dict) -> dict | None:
    old = read_report(path, "an exactness report", ("config", "records", "divergences"))
    if old is None:
        return None
    if any(old["config"].get(k) != cfg.get(k) for k in SETTINGS):
        raise ExactnessError(
            f"{path} holds an exactness run with other settings: choose another --json (or delete "
            "it), or rerun with its settings to resume"
        )
    for d in old["divergences"]:  # a NaN logit gap is "nan" there (``files.strict``)
        if isinstance(d, dict):
            d["logit_gap"] = number(d.get("logit_gap"))
    return old


def summarize(report: dict) -> dict:
    labels = list(report["config"]["methods"]) + ([HF_LABEL] if report["config"]["transformers"] else [])
    out = {}
    for label in labels:
        recs = [r for r in report["records"] if r["label"] == label]
        divs = [d for d in report["divergences"] if d["label"] == label]
        ties = sum(d["near_tie"] for d in divs)
        out[label] = {
            "prompts": len(recs),
            "equal": sum(r["equal"] for r in recs),
            "divergences": len(divs),
            "near_ties": ties,
            "unexplained": len(divs) - ties,
        }
    return out


def run_exactness(
    model: Transformer,
    methods: MethodSpecs,
    prompts: list[Prompt],
    max_new_tokens: int,
    *,
    chat: bool = True,
    hf: bool = False,
    out: str | Path | None = None,
    near_tie: float = NEAR_TIE,
    config: dict | None = None,
    skipped: dict | None = None,
    progress: bool = True,
) -> dict:
    """Compare ``methods`` with plain greedy (and `transformers` greedy with ``hf``) on ``prompts``;
    -> the report (also written to ``out`` after every prompt).  See the module docstring."""
    from tqdm.auto import tqdm

    with V.raising(ExactnessError):
        V.integer(max_new_tokens, "max_new_tokens", 1, model.config.max_position - 1)
        V.number(near_tie, "near_tie", 0)
        V.flag(chat, "chat")
        V.flag(hf, "hf")
        if out is not None:
            V.output_file(out, "out", (".json",))
    with V.raising(ExactnessError):
        prompts = V.items(prompts, "prompts", "Spec-Bench prompts (layerleap.datasets.spec_bench)")
    if not prompts or not all(isinstance(p, Prompt) for p in prompts):
        raise ExactnessError("prompts must be a non-empty list of Spec-Bench prompts (layerleap.datasets.spec_bench)")
    check_specs(methods)
    check_methods(methods)
    cfg = {
        **machine_config(model),
        **(config or {}),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "methods": {lb: {"method": n, "options": plain_options(o)} for lb, (n, o) in methods.items()},
        "skipped": dict(skipped or {}),
        "transformers": hf,
        "near_tie": near_tie,
        "n_prompts": len(prompts),
        "prompt_ids": [p.id for p in prompts],
        "categories": sorted({p.category for p in prompts}),
    }
    report = {"config": cfg, "prompts_done": 0, "records": [], "divergences": []}
    old = _resume(Path(out), cfg) if out else None
    if old is not None:
        done = int(old.get("prompts_done", 0))
        report.update(prompts_done=done, resumed_from=done, records=old["records"], divergences=old["divergences"])

    def save(**flags):
        report.update(summary=summarize(report), complete=report["prompts_done"] == len(prompts), **flags)
        if out:
            write_json(out, report)

    runs = len(methods) + 1 + int(hf)
    bar = tqdm(
        total=len(prompts) * runs,
        initial=report["prompts_done"] * runs,
        desc="eval exactness",
        unit="run",
        disable=not progress,
        leave=False,
    )
    try:
        hf_model = HFBaseline(model) if hf else None
        save(interrupted=False)
        for prompt in prompts[report["prompts_done"] :]:
            bar.set_postfix_str(f"{prompt.category} {prompt.id} {REFERENCE}")
            ref = generate(model, prompt.text, REFERENCE, max_new_tokens, chat=chat, stop_at_eos=False)
            found = {}
            if hf_model is not None:
                bar.set_postfix_str(f"{prompt.category} {prompt.id} {HF_LABEL}")
                found[(HF_LABEL, "transformers.generate")] = hf_model.generate(ref.prompt_ids, max_new_tokens).token_ids
                bar.update()
            for label, (name, options) in methods.items():
                bar.set_postfix_str(f"{prompt.category} {prompt.id} {label}")
                found[(label, name)] = generate(
                    model, prompt.text, name, max_new_tokens, chat=chat, stop_at_eos=False, **options
                ).token_ids
                bar.update()
            for (label, name), got in found.items():
                d = _divergence(model, prompt, label, name, ref.prompt_ids, ref.token_ids, got, near_tie)
                report["records"].append(
                    {
                        "prompt_id": prompt.id,
                        "category": prompt.category,
                        "label": label,
                        "equal": d is None,
                        "tokens": len(got),
                    }
                )
                if d is not None:
                    report["divergences"].append(asdict(d))
            report["prompts_done"] += 1
            save(interrupted=False)
            bar.update()  # the reference run counts once the prompt is saved
    except KeyboardInterrupt:
        save(interrupted=True)
    finally:
        bar.close()
    return report


def format_summary(report: dict) -> str:
    rows = [f"{'method':<20} {'prompts':>7} {'equal':>6} {'diverge':>7} {'near-tie':>8} {'unexplained':>11}"]
    for label, s in report["summary"].items():
        rows.append(
            f"{label:<20} {s['prompts']:>7} {s['equal']:>6} {s['divergences']:>7} {s['near_ties']:>8} "
            f"{s['unexplained']:>11}"
        )
    for lb, why in report["config"]["skipped"].items():
        rows.append(f"{lb:<20} skipped: {why}")
    for d in report["divergences"]:
        gap = "-" if d["logit_gap"] is None else f"{d['logit_gap']:.3g}"
        rows.append(
            f"  {d['label']} on prompt {d['prompt_id']} ({d['category']}): token {d['position']} is "
            f"{d['method_token']} {d['method_text']!r}, greedy has {d['reference_token']} "
            f"{d['reference_text']!r}; logit gap {gap}{' (near-tie)' if d['near_tie'] else ''}"
        )
    return "\n".join(rows)
