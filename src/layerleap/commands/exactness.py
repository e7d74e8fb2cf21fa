"""``layerleap eval exactness``: every lossless method against plain greedy on Spec-Bench prompts (and
`transformers` greedy with ``--transformers``), a resumable JSON report of every divergence.  See
``layerleap.eval.exactness``.  Exit code 0 when every divergence is a near-tie (or there is none), 1 when
one is not, 130 when interrupted (the report keeps the finished prompts)."""

from __future__ import annotations

import argparse

from ..eval import bench
from .. import validate as V, workload
from . import command
from ..errors import LayerleapError
from ..eval.exactness import NEAR_TIE, check_methods, format_summary, lossless_methods, run_exactness
from ..decoding import get_method
from .basic import (
    _command_line,
    _csv,
    _model_arg,
    _model_args,
    _model_line,
    _positive_int,
    _read_prompts,
    _say,
    _start_with_methods,
)


def _prompts(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        return V.positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be all or a positive integer (prompts per category), got {V.show(text)}"
        ) from None


@command(
    "eval exactness",
    help="every lossless method against plain greedy (and transformers) on Spec-Bench "
    "prompts: a resumable report of every divergence and its logit gap",
)
def _setup(p):
    _model_args(p)
    p.add_argument(
        "--methods",
        type=V.names_arg,
        default="all",
        help="all: every method whose registry entry claims greedy-"
        "exactness; or a comma list of METHOD or LABEL=METHOD (default all)",
    )
    p.add_argument("--opt", action="append", metavar="METHOD.NAME=VALUE", help="a method option (repeatable)")
    p.add_argument(
        "--draft",
        type=_model_arg,
        default=None,
        help="the draft model of two-model methods "
        "(speculative), a name or folder; without it --methods all lists them as skipped and a method named in "
        "--methods is refused",
    )
    p.add_argument("--prompts", type=_prompts, default="all", help="all, or N prompts per category (default all)")
    p.add_argument(
        "--categories", type=V.names_arg, default=None, help="comma-separated Spec-Bench categories (default: all)"
    )
    p.add_argument(
        "--data",
        type=V.in_file_arg,
        default=None,
        help="a Spec-Bench question.jsonl (default: the shipped copy, 480 prompts)",
    )
    p.add_argument(
        "--transformers",
        action="store_true",
        help="also compare transformers greedy generate on the same weights with our greedy",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap prompts in the chat template (default on)",
    )
    p.add_argument(
        "--near-tie",
        type=V.float_arg(0.0),
        default=NEAR_TIE,
        help=f"a divergence whose logit gap is below this is a near-tie (default {NEAR_TIE:g})",
    )
    p.add_argument(
        "--json",
        metavar="OUT.json",
        type=V.report_arg,
        default=None,
        help="the report (rewritten after every prompt; rerunning with the same settings resumes)",
    )
    workload.add_args(p)


def _methods(args) -> tuple[dict, dict]:
    """-> (label -> (method, options) to run, label -> why skipped)."""
    every = args.methods.strip().lower() == "all"
    text = ",".join(lossless_methods()) if every else args.methods
    specs = bench.parse_methods(text, args.opt, check=False)
    check_methods(specs)
    skipped, drafted = {}, False
    for label, (name, options) in list(specs.items()):
        missing = bench.required_options(name, options)
        models = get_method(name).models
        for k in [k for k in missing if k in models and args.draft]:
            options[k] = args.draft
            missing.remove(k)
            drafted = True
        if missing:
            need = (
                "a second model: give --draft NAME"
                if set(missing) & set(models)
                else f"the option {missing[0]}: give --opt {label}.{missing[0]}=VALUE"
            )
            if not every:  # asked for by name: refused, not skipped
                raise LayerleapError(f"method {label} needs {need}")
            skipped[label] = f"needs {need}"
            del specs[label]
    if args.draft and not drafted:
        raise LayerleapError(
            f"--draft: not used: no method of this run takes a draft model ({', '.join(specs)}): drop it, or add "
            "a method that does (speculative)"
        )
    for label, (name, options) in specs.items():
        bench.check_spec(label, name, options)
    return specs, skipped


@_setup
def run(args) -> int:
    methods, skipped = _methods(args)
    prompts = _read_prompts(args.data, _csv(args.categories), args.prompts)
    threads, model, methods = _start_with_methods(args, methods)
    usable, refused = bench.probe_methods(model, methods)
    for label, why in refused.items():  # a method asked for by name, or given options, must run
        name, options = methods[label]
        if args.methods.strip().lower() != "all" or set(options) - set(get_method(name).models):
            raise LayerleapError(f"method {label}: {why}")
    skipped.update(refused)
    runs = (len(usable) + 1 + bool(args.transformers)) * len(prompts)
    workload.check(args, workload.decoding(model, runs, args.max_new_tokens))
    for label, why in skipped.items():
        _say(f"skipping {label}: {why}")
    print(
        f"{_model_line(model, threads)}\n{len(prompts)} Spec-Bench prompts × {args.max_new_tokens} tokens, chat "
        f"{args.chat}: {', '.join(usable) or 'no method'} against greedy"
        f"{' and transformers' if args.transformers else ''}",
        flush=True,
    )
    report = run_exactness(
        model,
        usable,
        prompts,
        args.max_new_tokens,
        chat=args.chat,
        hf=args.transformers,
        out=args.json,
        near_tie=args.near_tie,
        skipped=skipped,
        config={"command": _command_line(args), "data": args.data or "shipped Spec-Bench"},
    )
    print(format_summary(report))
    if args.json:
        print(f"wrote {args.json}")
    if report.get("interrupted"):
        _say(f"interrupted: {report['prompts_done']} of {len(prompts)} prompts finished")
        return 130
    return 1 if any(s["unexplained"] for s in report["summary"].values()) else 0
