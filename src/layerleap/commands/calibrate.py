"""``layerleap calibrate METHOD --quality Q``: a lossy method's fastest setting that keeps a quality budget
(Learn-then-Test on a calibration split), written to the calibration file that ``generate`` reads;
``--check`` measures a calibrated setting on the held-out split."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .. import validate as V, workload
from ..errors import LayerleapError
from ..eval import calibrate as C
from ..files import json_text, write_json
from ..core.loading import DEFAULT_MODEL
from ..methods import budget
from . import command
from .basic import _command_line, _load, _model_args, _positive_int, _refuse_unused, _say, _threads


@command(
    "calibrate",
    help="choose a lossy method's fastest setting that keeps a share of greedy's quality, with a "
    "stated confidence (Learn-then-Test); generate --quality uses it; with --variant, greedy's output and "
    "the perplexity are the base model's",
)
def _setup(p):
    p.add_argument(
        "method",
        type=_methods,
        help=f"the lossy method ({', '.join(budget.LOSSY)}), several "
        "comma-separated (greedy's outputs are measured once), or all",
    )
    _model_args(p)
    p.add_argument(
        "--quality",
        type=_quality,
        default=budget.DEFAULT_QUALITY,
        help=f"share of greedy's quality to keep (default {budget.DEFAULT_QUALITY})",
    )
    p.add_argument(
        "--prompts",
        type=V.int_arg(1, 20),
        default=8,
        help="prompts per category (summarization, translation, math_reasoning; default 8)",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument(
        "--epsilon",
        type=V.float_arg(0.0, 1.0, lo_open=True, hi_open=True),
        default=C.EPSILON,
        help=f"tolerated share of prompts that lose the budget (default {C.EPSILON})",
    )
    p.add_argument(
        "--delta",
        type=V.float_arg(0.0, 1.0, lo_open=True, hi_open=True),
        default=C.DELTA,
        help=f"1 - confidence (default {C.DELTA})",
    )
    p.add_argument(
        "--extra",
        type=V.int_arg(0, 20),
        default=2,
        help="settings measured past the first failure, for the frontier plot (default 2)",
    )
    p.add_argument("--data", type=V.in_file_arg, default=None, help="a Spec-Bench question.jsonl (default: shipped)")
    p.add_argument(
        "--report",
        metavar="RUN.json",
        type=V.report_arg,
        default=None,
        help="the run's per-prompt data, rewritten after each setting; rerunning resumes it (several "
        "methods: RUN.METHOD.json each)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        type=V.out_dir_arg,
        default=None,
        help="the folder of calibration files, FINGERPRINT/DTYPE/METHOD.json under it (default: the user "
        "cache's calibration folder, which generate reads first)",
    )
    p.add_argument(
        "--check",
        metavar="CHECK.json",
        type=V.report_arg,
        default=None,
        help="instead of calibrating: run the calibrated setting on the held-out split and write the "
        "measured violations here",
    )
    workload.add_args(p)


def _quality(text: str) -> float:
    """``--quality``: a share in (0, 1] in whole hundredths, as calibration files keep them (``--check`` of 0.954
    would otherwise measure the 0.95 budget's setting)."""
    q = V.float_arg(0.0, 1.0, lo_open=True)(text)
    try:
        return budget.check_quality(q)
    except LayerleapError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _methods(text: str) -> list[str]:
    names = list(budget.LOSSY) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in budget.LOSSY]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{V.show(text)}: choose lossy methods from {', '.join(budget.LOSSY)} (comma-separated) or all"
        )
    return list(dict.fromkeys(names))


@_setup
def run(args) -> int:
    if args.check:
        _refuse_unused(
            args, ("--report", "--extra", "--epsilon", "--delta"), "with --check (it reads the calibration's)"
        )
    threads = _threads(args.threads)
    split = "holdout" if args.check else "calibration"
    prompts = C.split_prompts(split, args.prompts, data=args.data)
    if not args.check:
        C.check_enough_prompts(len(prompts), args.epsilon, args.delta, per=len(C.CATEGORIES))
    model = _load(args)
    base = _load(args, args.model) if args.variant else None  # a variant keeps a share of its base model's quality
    settings = 1 + sum(1 if args.check else min(len(budget.PATHS[m](model.config.n_layers)), 3) for m in args.method)
    workload.check(args, workload.decoding(model, settings * len(prompts), args.max_new_tokens))
    if args.check:
        found = {m: _calibration(args, model, m) for m in args.method}  # each one there before any decoding
        greedy = C.greedy_outputs(base or model, prompts, args.max_new_tokens, _say)
        report = {
            "command": _command_line(args),
            "threads": threads,
            "split": split,
            "methods": {m: _check(args, model, prompts, m, found[m], greedy, base) for m in args.method},
        }
        write_json(args.check, report)
        print(f"wrote {args.check}")
        return 0
    _say(
        f"calibrating {', '.join(args.method)} at quality {args.quality} on {len(prompts)} prompts of the {split} "
        f"split (Spec-Bench {', '.join(C.CATEGORIES)}, from index {C.SPLITS[split]} per category), "
        f"{args.max_new_tokens} tokens, {threads} threads"
        + (f"; variant {args.variant} against the base model's greedy output and perplexity" if base else "")
    )
    greedy = None
    for method in args.method:
        cal = C.calibrate(
            model,
            method,
            args.quality,
            prompts=prompts,
            max_new_tokens=args.max_new_tokens,
            epsilon=args.epsilon,
            delta=args.delta,
            split=split,
            report=_report(args, method),
            extra=args.extra,
            progress=_say,
            config={"command": _command_line(args), "threads": threads},
            greedy=greedy,
            base=base,
        )
        greedy = cal.greedy
        path = C.write_calibration(cal, _out(args, model, method))
        print(f"{method}:\n{table(cal.budget_entry())}\nwrote {path}\n", flush=True)
    return 0


def _out(args, model, method: str):
    if not args.out:
        return None
    return budget.calibration_path(model.fingerprint, model.dtype_name, method, Path(args.out))


def _report(args, method: str) -> str | None:
    if not args.report or len(args.method) == 1:
        return args.report
    p = Path(args.report)
    return str(p.with_name(f"{p.stem}.{method}{p.suffix}"))


def _calibrate_command(args, model, method: str) -> str:
    """The ``calibrate`` command that writes the calibration ``--check`` looks for."""
    flags = [("--model", args.model if args.model != DEFAULT_MODEL else None), ("--variant", args.variant)]
    flags += [("--quality", args.quality), ("--dtype", model.dtype_name), ("--out", args.out)]
    return shlex.join(["layerleap", "calibrate", method, *(w for f, v in flags if v is not None for w in (f, str(v)))])


def _calibration(args, model, method: str) -> tuple[Path, dict]:
    """The calibration file ``--check`` measures and its entry for ``--quality``."""
    entries = [
        p for p in ([_out(args, model, method)] if args.out else budget.calibration_files(model, method)) if p.is_file()
    ]
    if not entries:
        raise LayerleapError(
            f"no calibration of {method} for {model.config.name} ({model.dtype_name}): run "
            f"`{_calibrate_command(args, model, method)}` first"
        )
    data = budget.read_calibration(entries[0])
    key = budget.budget_key(args.quality)
    if key not in data["budgets"]:
        raise LayerleapError(f"{entries[0]} has no budget {key}: run `{_calibrate_command(args, model, method)}`")
    return entries[0], data["budgets"][key]


def _check(args, model, prompts, method: str, found: tuple[Path, dict], greedy, base=None) -> dict:
    path, entry = found
    res = C.holdout_check(model, entry, method, prompts, args.max_new_tokens, greedy, progress=_say, base=base)
    res.update(method=method, quality=args.quality, calibration=str(path))
    print(
        json_text(
            {
                k: res[k]
                for k in (
                    "method",
                    "options",
                    "prompts",
                    "losses",
                    "loss_rate",
                    "epsilon",
                    "within_epsilon",
                    "agreement",
                    "reference_kept",
                    "ppl_ratio",
                )
            }
        ),
        flush=True,
    )
    return res


def table(entry: dict) -> str:
    """The settings a calibration measured, one a line, the chosen one marked."""
    chosen = (entry.get("chosen") or {}).get("options")
    lines = [f"{'setting':48} {'speed':>6} {'lost':>5} {'p':>6} {'agree':>6} {'ref':>6} {'ppl':>6}  status"]
    n = entry["prompts"]
    for s in entry["settings"]:
        status = (
            ("chosen" if s["options"] == chosen else "valid")
            if s["valid"]
            else ("stop" if s["tested"] else "frontier only")
        )
        ref = "-" if s["reference_kept"] is None else f"{s['reference_kept']:.0%}"
        opts = ", ".join(f"{k}={v}" for k, v in s["options"].items())
        lines.append(
            f"{opts:48} {s['modelled_speedup']:5.2f}x {s['losses']:>2}/{n:<2} {s['p_value']:6.3f} "
            f"{s['agreement']:6.2f} {ref:>6} {s['ppl_ratio']:5.2f}x  {status}"
        )
    lines.append(f"guarantee: {entry['guarantee']}")
    if entry.get("chosen") is None:
        lines.append("no setting meets the budget, not even the first: the method runs the first, with a warning")
    elif not entry["faster_than_greedy"]:
        lines.append("no setting faster than greedy meets the budget: the method runs the fastest one that does")
    return "\n".join(lines)
