"""BiLD's subcommands: ``sweep bild`` (the quality-latency trade-off) and ``align`` (prediction
alignment).  Results go to stdout, loading messages and progress to stderr; bad input raises
``LayerleapError`` (exit code 2 with one line)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..train import align as align_mod
from ..eval import sweep as sweep_mod
from . import command
from ..drafters.companion import truncated
from ..errors import LayerleapError
from ..files import check_replace, json_text, write_text
from .. import validate as V, workload
from ..drafters.early_exit import HEADS, exit_head
from ..core import options as O
from ..methods.bild import ALPHA_FB, ALPHA_RB, MAX_SMALL, OPTIONS as BILD_OPTIONS
from .basic import (
    _command_line,
    _given,
    _refuse_unused,
    _model_arg,
    _csv,
    _load,
    _model_args,
    _model_line,
    _positive_int,
    _read_prompts,
    _say,
    _threads,
)

SWEEP_CATEGORIES = "summarization,translation,math_reasoning"
# the paper's ranges: fallback [0.2, 0.6] (summarization) to [0.5, 0.9] (translation), rollback [1, 10];
# early exit: fallback [0.2, 0.8], rollback [0.5, 1.5]
DEFAULT_FB = "0.2,0.4,0.6,0.8"
DEFAULT_RB = "0.5,1,2,4"


BILD_EXIT = next(o for o in BILD_OPTIONS if o.name == "exit_layer")
SWEEP_PROMPTS = 8  # sweep's default --prompts: its evaluation prompts are the first N of each category
ALIGN_OFFSET = SWEEP_PROMPTS  # align's default --offset: its calibration prompts start after sweep's


def _sweep_overlap(args) -> str | None:
    """A note where a sweep of an aligned form (``--small``, or an exit head file) evaluates prompts that
    ``align`` calibrates on at its default ``--offset``; None otherwise."""
    aligned = args.small or (not getattr(args, "eagle", None) and args.head not in HEADS)
    if not aligned or args.prompts <= ALIGN_OFFSET:
        return None
    return (
        f"prompts {ALIGN_OFFSET + 1}-{args.prompts} of each category are `layerleap align`'s calibration prompts at "
        f"its default --offset {ALIGN_OFFSET}: a head or small model aligned on them is partly evaluated on its "
        f"training prompts; align with --offset {args.prompts} or more, or keep --prompts <= {ALIGN_OFFSET}"
    )


def _align_overlap(args) -> str | None:
    """A note where ``align`` calibrates on prompts that ``sweep bild`` evaluates at its default
    ``--prompts``; None otherwise."""
    if args.offset >= SWEEP_PROMPTS:
        return None
    return (
        f"calibration prompts {args.offset + 1}-{min(SWEEP_PROMPTS, args.offset + args.prompts)} of each category "
        f"are `layerleap sweep bild`'s evaluation prompts at its default --prompts {SWEEP_PROMPTS}: a sweep of "
        f"what this writes is partly evaluated on its training prompts; keep --offset >= the sweep's --prompts "
        f"(default {SWEEP_PROMPTS})"
    )


MAX_POINTS = 200  # BiLD grid points (fallback x rollback thresholds) in one sweep


def _form_args(p, eagle: bool = False) -> None:
    form = p.add_mutually_exclusive_group()
    if eagle:
        form.add_argument(
            "--eagle",
            metavar="HEAD",
            default=None,
            help="EAGLE form: the EAGLE head is the small model: trained (the one shipped for the model) or a file "
            "from `layerleap train eagle`; the lossless yardstick is then the eagle method",
        )
    form.add_argument(
        "--exit-layer",
        # sweep: none is BiLD's default exit layer (three quarters of the depth); align trains a head for a layer
        type=(BILD_EXIT if eagle else O.EXIT_LAYER.but(none="")).arg(),
        default=None,
        help="early-exit form: layers [0, E) and an exit head are the small model",
    )
    form.add_argument("--small", type=_model_arg, default=None, help="two-model form: the small model (name or folder)")
    p.add_argument(
        "--head",
        type=O.HEAD.arg(),
        default="auto",
        help=f"exit head: {', '.join(HEADS)} or a file from `layerleap align` "
        "(default auto: a shipped trained head if there is one, else shared)"
        if eagle
        else argparse.SUPPRESS,  # align trains a new head: refused there with the reason
    )


def _load_small(args, large):
    small = _load(args, args.small)
    if small.config.vocab_size != large.config.vocab_size:
        raise LayerleapError(
            f"--small {args.small} has another vocabulary than --model {args.model}: "
            "choose models with the same tokenizer"
        )
    return small


def _exit_layer(args, model) -> int:
    try:
        return O.EXIT_LAYER.check(args.exit_layer, model.config)
    except LayerleapError as e:
        raise LayerleapError(f"--exit-layer: {e}") from None


def _device_name(model) -> str:
    import torch

    dev = model.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _spec_settings(text: str) -> list:
    items = _csv(text) or []
    V.at_most(len(items), V.MAX_LIST, "--speculative settings", "give fewer")
    try:
        return [sweep_mod.parse_spec_setting(t) for t in items]
    except LayerleapError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- sweep ------------------------------------------------------------------------------------------
@command(
    "sweep bild", help="BiLD over (alpha_fb, alpha_rb): quality against latency, the paper's Figures 4/9 and Table 1"
)
def _setup_sweep(p):
    _model_args(p)
    _form_args(p, eagle=True)
    p.add_argument(
        "--alpha-fb",
        type=ALPHA_FB.list_arg(none=True),
        default=DEFAULT_FB,
        help=f"fallback thresholds (default {DEFAULT_FB}; none: no BiLD points)",
    )
    p.add_argument(
        "--alpha-rb",
        type=ALPHA_RB.list_arg(none=True),
        default=DEFAULT_RB,
        help=f"rollback thresholds; inf = never (default {DEFAULT_RB}; none: no BiLD points)",
    )
    p.add_argument("--max-small", type=MAX_SMALL.arg(), default=10, help="longest small-model run (default 10; none)")
    p.add_argument(
        "--draft-lens",
        type=O.DRAFT_LEN.list_arg(none=True),
        default="2,4",
        help="speculative decoding draft lengths γ; its draft is the small "
        "model, or in the early-exit form the same first E layers and head; constant schedule, no "
        "confidence stop (default 2,4; none: skip)",
    )
    p.add_argument(
        "--speculative",
        type=_spec_settings,
        default="",
        metavar="SETTINGS",
        help="more speculative decoding points, each "
        "SCHEDULE:γ[:MIN_CONFIDENCE], e.g. heuristic:4,heuristic:4:0.4,constant:20:0.4 (schedule constant "
        "or heuristic, γ the first draft length, min_confidence the confidence stop; default none)",
    )
    p.add_argument(
        "--transformers",
        action="store_true",
        help="add `transformers` generate on the same weights as "
        "yardsticks: greedy, and assisted generation (assistant_model=the small model; early-exit form: "
        "assistant_early_exit=E, its own LM head)",
    )
    p.add_argument(
        "--categories",
        type=V.names_arg,
        default=SWEEP_CATEGORIES,
        help=f"Spec-Bench categories (default {SWEEP_CATEGORIES})",
    )
    p.add_argument(
        "--prompts",
        type=_positive_int,
        default=SWEEP_PROMPTS,
        help=f"prompts per category (default {SWEEP_PROMPTS}; more reach `align`'s calibration prompts at its "
        f"default --offset {ALIGN_OFFSET})",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument(
        "--data", type=V.in_file_arg, default=None, help="a Spec-Bench question.jsonl (default: the shipped copy)"
    )
    workload.add_args(p)
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap prompts in the chat template (default on)",
    )
    p.add_argument(
        "--json",
        metavar="OUT.json",
        type=V.report_arg,
        default=None,
        help="the report (rewritten after every prompt; rerunning with the same settings resumes)",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        type=V.plot_arg,
        default=None,
        help="quality against latency, one panel per category",
    )
    p.add_argument(
        "--table", metavar="OUT.md", type=V.table_arg, default=None, help="write the markdown tables here too"
    )


@_setup_sweep
def run_sweep(args) -> int:
    fbs, rbs = args.alpha_fb, args.alpha_rb
    if not fbs or not rbs:
        fbs = rbs = []  # none: no BiLD points
    V.at_most(len(fbs) * len(rbs), MAX_POINTS, "--alpha-fb × --alpha-rb points", "give fewer thresholds")
    gammas, settings = args.draft_lens, args.speculative
    if (args.small or args.eagle) and args.head != "auto":
        given = "--small" if args.small else "--eagle"
        raise LayerleapError(f"--head chooses the exit head of the early-exit form: drop it with {given}")
    if args.eagle and (args.transformers or settings):
        raise LayerleapError(
            "--eagle has no draft model for speculative decoding or transformers' assisted generation: "
            "drop --transformers and --speculative (the eagle method is its lossless yardstick)"
        )
    prompts = _read_prompts(args.data, _csv(args.categories), args.prompts)
    overlap = _sweep_overlap(args)
    if overlap:
        _say(f"note: {overlap}")
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    large = _load(args)
    fixed: dict = {"max_small": args.max_small}
    models: dict = {}
    if args.small:
        small = _load_small(args, large)
        models = {"bild": {"small": small}, "speculative": {"draft": small}}
        if args.transformers:
            models["transformers"] = sweep_mod.HFRunner(large, small=small)
        form = f"two models: small {args.small}"
    elif args.eagle:
        head = _eagle_head(large, args.eagle)
        models = {"bild": {"eagle": head}, "eagle": {"eagle_head": head}}
        form = f"EAGLE head {'shipped' if args.eagle == 'trained' else Path(args.eagle).name}"
    else:
        E = args.exit_layer if args.exit_layer is not None else None
        if E is None:
            from ..methods.bild import default_exit_layer

            E = default_exit_layer(large)
        else:
            E = _exit_layer(args, large)
        head, label = exit_head(large, E, args.head)
        fixed.update(exit_layer=E, head=args.head)
        models = {"speculative": {"draft": truncated(large, E, head)}}
        if args.transformers:
            models["transformers"] = sweep_mod.HFRunner(large, exit_layer=E)
        shown = Path(label).name if label not in HEADS + ("custom",) else label
        form = f"early exit at layer {E} of {large.config.n_layers}, head {shown}"
    print(
        f"{_model_line(large, threads)}, device {_device_name(large)}\nBiLD {form}; max_small {args.max_small}\n"
        f"{len(prompts)} Spec-Bench prompts ({args.categories}, {args.prompts} each) × {args.max_new_tokens} "
        f"new tokens, chat {args.chat}; {len(fbs) * len(rbs)} BiLD points + {len(gammas) + len(settings)} "
        f"speculative "
        f"+ greedy, "
        f"interleaved per prompt",
        flush=True,
    )
    lossless = sweep_mod.eagle_points() if args.eagle and gammas else sweep_mod.speculative_points(gammas)
    points = sweep_mod.bild_grid(fbs, rbs) + lossless + [t.point() for t in settings]
    if args.transformers:
        points += sweep_mod.transformers_points()
    workload.check(args, workload.decoding(large, (len(points) + 1) * len(prompts), args.max_new_tokens))
    report = sweep_mod.run_sweep(
        large,
        points,
        prompts,
        args.max_new_tokens,
        models=models,
        fixed=fixed,
        chat=args.chat,
        out=args.json,
        config={"command": _command_line(args), "form": form, "threads": threads, "device": _device_name(large)},
    )
    summary = report["summary"]
    text = (
        f"## Table 1 form (quality vs the large model's greedy output / speed-up over it)\n\n"
        f"{sweep_mod.table(summary)}\n\n## Every point\n\n{sweep_mod.points_table(summary)}\n"
    )
    print(text)
    if args.table:
        write_text(args.table, f"`{_command_line(args)}`\n\n{form}\n\n{text}")
        print(f"wrote {args.table}")
    if args.plot and report["prompts_done"]:
        sweep_mod.plot(
            summary,
            args.plot,
            title=f"BiLD on {large.config.name} ({form}); {report['prompts_done']} "
            f"prompts × {args.max_new_tokens} tokens",
        )
        print(f"wrote {args.plot}")
    if args.json:
        print(f"wrote {args.json}")
    if report.get("interrupted"):
        _say(f"interrupted: {report['prompts_done']} of {len(prompts)} prompts finished")
        return 130
    return 0


def _eagle_head(large, spec: str):
    """The EAGLE head ``--eagle`` names, as a CLI error where it cannot be had."""
    from ..drafters import medusa_transfer

    try:
        return medusa_transfer.get_drafter(large, "eagle", spec)
    except LayerleapError as e:
        raise LayerleapError(f"--eagle: {e}") from None


# -- align ------------------------------------------------------------------------------------------
@command(
    "align",
    help="BiLD prediction alignment: train the small model (or an exit head) on the large model's greedy outputs",
)
def _setup_align(p):
    _model_args(p)
    _form_args(p)
    p.add_argument(
        "--out",
        type=V.tagged(
            V.path_arg, "out", also=(("calibration file", ".calib.json"), ("checkpoint", ".ckpt.safetensors"))
        ),
        required=True,
        help="the exit head file (.safetensors) or the small model's new folder",
    )
    p.add_argument(
        "--categories",
        type=V.names_arg,
        default=SWEEP_CATEGORIES,
        help=f"calibration categories (default {SWEEP_CATEGORIES})",
    )
    p.add_argument("--prompts", type=_positive_int, default=16, help="calibration prompts per category (default 16)")
    p.add_argument(
        "--offset",
        type=V.nonneg_int,
        default=ALIGN_OFFSET,
        help="skip this many prompts per category first, to keep "
        f"calibration apart from `sweep`'s evaluation prompts (default {ALIGN_OFFSET} = sweep's default --prompts)",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument(
        "--data", type=V.in_file_arg, default=None, help="a Spec-Bench question.jsonl (default: the shipped copy)"
    )
    workload.add_args(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--work",
        type=V.out_path_arg,
        default=None,
        help="the calibration outputs JSON (default OUT.calib.json); reused on rerun",
    )
    p.add_argument("--epochs", type=V.int_arg(1, 10_000), default=4)
    p.add_argument("--lr", type=V.lr_arg, default=None, help="learning rate (default 1e-3 exit head, 1e-5 small model)")
    p.add_argument("--batch-tokens", type=_positive_int, default=256, help="output tokens per step (default 256)")
    p.add_argument("--seed", type=V.seed_arg, default=0)
    p.add_argument("--save-every", type=_positive_int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--rank", type=V.nonneg_int, default=64, help="exit head adapter rank (default 64; 0 = full matrix)")
    p.add_argument(
        "--val-every",
        type=V.nonneg_int,
        default=4,
        help="hold out every n-th calibration prompt to measure agreement (default 4; 0 = none)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


@_setup_align
def run_align(args) -> int:
    if args.exit_layer is None and not args.small:
        raise LayerleapError("choose the form: --exit-layer E (train an exit head) or --small MODEL (fine-tune it)")
    if _given(args, "--head"):  # neither form reads an exit head: the early-exit form starts from the shared one
        raise LayerleapError("--head is not used by align: it trains a new head (from the shared head): drop it")
    if args.small:
        _refuse_unused(args, ("--rank", "--val-every"), "with --small (exit-head settings, for --exit-layer)")
    from ..datasets import spec_bench

    prompts = spec_bench(args.data, _csv(args.categories), args.prompts, offset=args.offset)
    if not prompts:
        raise LayerleapError("no calibration prompts selected: lower --offset or add --categories")
    overlap = _align_overlap(args)
    if overlap:
        _say(f"note: {overlap}")
    out = V.weights_file(args.out, "--out") if args.exit_layer is not None else V.output_dir(args.out, "--out")
    if args.exit_layer is not None:
        check_replace(out, "exit-heads", "--out")
    if args.small and out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise LayerleapError(f"--out {out} exists and is not a model folder: choose another --out")
    work = V.output_file(args.work or out.with_name(out.name + ".calib.json"), "--work", (".json",))
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    large = _load(args)
    if args.exit_layer is not None:
        _exit_layer(args, large)
    trained = large.n_params() if args.small else 0  # the small model: about the large one's size at most
    workload.check(
        args,
        workload.decoding(large, len(prompts), args.max_new_tokens, "calibration prompts"),
        workload.training(large, args.epochs * len(prompts) * args.max_new_tokens, trained, "positions × epochs"),
    )
    print(
        f"{_model_line(large, threads)}\ncalibration: {len(prompts)} Spec-Bench prompts ({args.categories}, "
        f"{args.prompts} each after {args.offset}) × {args.max_new_tokens} greedy tokens -> {work}",
        flush=True,
    )
    records = align_mod.calibrate(large, [p.text for p in prompts], work, args.max_new_tokens, chat=args.chat)
    if args.small:
        small = _load_small(args, large)
        cfg = align_mod.TrainConfig(args.epochs, args.lr or 1e-5, args.batch_tokens, 0.0, args.seed, args.save_every)
        rep = align_mod.align_small(small, records, out, cfg)
    else:
        E = _exit_layer(args, large)
        cfg = align_mod.TrainConfig(
            args.epochs, args.lr or 1e-3, args.batch_tokens, 0.0, args.seed, args.save_every, args.rank, args.val_every
        )
        rep = align_mod.align_exit_head(large, E, records, out, cfg, command=_command_line(args))
    rep["command"] = _command_line(args)
    if args.json:
        print(json_text(rep))
    else:
        held = (
            f"; held-out {rep['heldout_before']:.3f} before, {rep['heldout_after']:.3f} after"
            if rep.get("heldout_after") is not None
            else ""
        )
        loss = rep["final_loss"] if rep["final_loss"] is None else round(rep["final_loss"], 4)
        print(
            f"agreement with the large model's greedy tokens (training prompts): "
            f"{rep['agreement_before']:.3f} before, {rep['agreement_after']:.3f} after{held}; "
            f"{rep['steps_run']} steps run, final loss {loss}"
        )
        print(f"wrote {rep['out']}")
    return 0
