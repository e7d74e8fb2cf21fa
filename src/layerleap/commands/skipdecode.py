"""SkipDecode subcommands: ``finetune skipdecode`` (train with the skipping policy) and ``eval
skipdecode`` / ``eval skipdecode-speed`` (the docs' Table 4/5 quality tables and the batched
speed measurement)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from ..eval import quality as evaluation
from ..eval.bench import machine_config
from ..files import save_figure, write_json, write_text
from . import command
from ..datasets import spec_bench
from ..decoding import generate, get_method
from ..errors import LayerleapError
from ..core import options as O
from ..methods.skipdecode import WARMUP, target_config
from .. import validate as V, workload
from .basic import (
    _model_arg,
    _command_line,
    _csv,
    _load,
    _model_args,
    _model_line,
    _positive_int,
    _refuse_unused,
    _say,
    _threads,
)

TARGETS = (2, 3, 4, 5)


def _speedups(text: str) -> list[int]:
    return V.int_list_arg(min(TARGETS), max(TARGETS))(text)


def _finetuned_arg(it: str) -> tuple[int, str]:
    k, eq, v = it.partition("=")
    if not eq or k.strip() not in tuple(map(str, TARGETS)):
        raise argparse.ArgumentTypeError(
            f"{V.show(it)}: write SPEEDUP=FOLDER with SPEEDUP one of {', '.join(map(str, TARGETS))}"
        )
    return int(k), _model_arg(v)


# -- finetune -----------------------------------------------------------------------------------------
@command(
    "finetune skipdecode", help="fine-tune the model with the SkipDecode skipping policy on (Table 2 configurations)"
)
def _setup_finetune(p):
    _model_args(p)
    p.add_argument(
        "--target-speedup",
        type=int,
        choices=TARGETS,
        default=2,
        help="Table 2 configuration (30 layers: 2x 10-20, 3x 7-13, 4x 6-9, 5x 5-7; warm-up 1)",
    )
    p.add_argument(
        "--min-exit-layer", type=O.MIN_EXIT_LAYER.arg(), default=None, help="override the configuration's minimum"
    )
    p.add_argument(
        "--max-exit-layer", type=O.MAX_EXIT_LAYER.arg(), default=None, help="override the configuration's maximum"
    )
    p.add_argument("--warmup", type=WARMUP.arg(), default=None, help="warm-up layers (default 1)")
    p.add_argument("--out", type=V.out_dir_arg, required=True, help="the fine-tuned model folder (rerun to resume)")
    p.add_argument(
        "--steps", type=V.int_arg(1, 1_000_000), default=30, help="optimizer steps (default 30: ~4 min on 1 CPU core)"
    )
    p.add_argument("--batch-size", type=V.int_arg(1, 1024), default=4)
    p.add_argument("--lr", type=V.lr_arg, default=5e-5)
    p.add_argument(
        "--loss",
        choices=["kd", "ce"],
        default="kd",
        help="kd: match the base model's distribution (default); ce: the paper's cross-entropy on the text",
    )
    p.add_argument(
        "--policy-prompt",
        choices=["own", "median"],
        default="own",
        help="where the decay starts: each example's own prompt length (as decoding) or the median (paper)",
    )
    p.add_argument("--gen-len", type=_positive_int, default=64, help="completion tokens = decay horizon (default 64)")
    p.add_argument("--max-prompt", type=_positive_int, default=96, help="skip longer prompts (default 96 tokens)")
    p.add_argument(
        "--examples", type=V.int_arg(1, 1_000_000), default=512, help="ShareGPT conversations to read (default 512)"
    )
    p.add_argument("--save-every", type=_positive_int, default=10)
    p.add_argument("--seed", type=V.seed_arg, default=0)
    workload.add_args(p)


@_setup_finetune
def run_finetune(args) -> int:
    from ..train.skipdecode import TrainConfig, finetune

    out = Path(args.out)
    if Path(args.model).is_dir() and out.resolve() == Path(args.model).resolve():
        raise LayerleapError(f"--out {out} is the --model folder: write the fine-tuned model to a new folder")
    threads = _threads(args.threads)
    print(f"$ {_command_line(args)}", flush=True)
    model = _load(args)
    teacher = _load(args) if args.loss == "kd" else None
    cfg = TrainConfig(
        target_speedup=args.target_speedup,
        min_exit_layer=args.min_exit_layer,
        max_exit_layer=args.max_exit_layer,
        warmup=args.warmup,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        loss=args.loss,
        policy_prompt=args.policy_prompt,
        gen_len=args.gen_len,
        max_prompt=args.max_prompt,
        n_examples=args.examples,
        save_every=args.save_every,
        seed=args.seed,
    )
    positions = cfg.steps * cfg.batch_size * (cfg.max_prompt + cfg.gen_len)
    workload.check(args, workload.training(model, positions, model.n_params()))
    print(_model_line(model, threads), flush=True)
    res = finetune(model, out, cfg, teacher=teacher, base_name=args.model)
    c = res.config
    first = sum(res.losses[:5]) / max(1, len(res.losses[:5]))
    last = sum(res.losses[-5:]) / max(1, len(res.losses[-5:]))
    print(
        f"trained {res.steps_done - res.resumed_from} steps (resumed from {res.resumed_from}) in "
        f"{res.seconds:.0f} s; "
        f"policy warm-up {c['warmup']}, exit layers {c['max_exit_layer']} -> {c['min_exit_layer']} over "
        f"{c['gen_len']} tokens; {c['loss']} loss {first:.3f} (first 5 steps) -> {last:.3f} (last 5)"
    )
    print(f"wrote {out} (load with layerleap.load({str(out)!r}))")
    return 0


@command(
    "finetune variant",
    help="train low-rank deltas (SkipDecode's policy fine-tune, or CALM's all-layer loss) "
    "on self-distilled data; the file loads as load(MODEL, variant=FILE)",
)
def _setup_variant(p):
    _model_args(p)
    p.add_argument(
        "--objective",
        choices=["skipdecode", "calm"],
        required=True,
        help="skipdecode: match the full model with the skipping policy on; calm: every layer predicts "
        "through the LM head, loss weighted by layer index",
    )
    p.add_argument(
        "--out",
        type=V.weights_out("variant", also=(("state", ".state.safetensors"),)),
        required=True,
        help="the variant file (.safetensors; rerun with the same settings to resume or extend)",
    )
    p.add_argument(
        "--data",
        type=V.in_path_arg,
        required=True,
        help="self-distilled JSON lines {prompt, completion, model} (token ids and the model's fingerprint): "
        "the model's greedy answers to ShareGPT prompts, decoded first where the file has fewer than --self-distill",
    )
    p.add_argument(
        "--self-distill",
        type=V.int_arg(0, 100_000),
        default=256,
        help="examples with the model's own greedy answers (default 256)",
    )
    p.add_argument(
        "--examples",
        type=V.int_arg(1, 100_000),
        default=1024,
        help="examples in all: the rest are ShareGPT prompts with ShareGPT's answers (default 1024)",
    )
    p.add_argument("--target-speedup", type=int, choices=TARGETS, default=2, help="skipdecode: Table 2 configuration")
    p.add_argument("--rank", type=V.int_arg(1, 256), default=16)
    p.add_argument("--steps", type=V.int_arg(1, 1_000_000), default=1000)
    p.add_argument("--batch-size", type=V.int_arg(1, 256), default=4)
    p.add_argument("--lr", type=V.lr_arg, default=2e-4)
    p.add_argument("--min-layer", type=_positive_int, default=4, help="calm: the lowest layer trained to predict")
    p.add_argument("--layers-per-step", type=_positive_int, default=4, help="calm: layers drawn per step (by weight)")
    p.add_argument(
        "--anchor",
        type=V.float_arg(0, 100),
        default=0.0,
        help="weight of KL(base || variant at full depth), which keeps the full model's own output (default 0)",
    )
    p.add_argument("--max-minutes", type=V.positive_float, default=None, help="stop (and save) after this long")
    workload.add_args(p)
    p.add_argument("--save-every", type=_positive_int, default=10)
    p.add_argument("--seed", type=V.seed_arg, default=0)


@_setup_variant
def run_variant(args) -> int:
    from ..train.data import prompt_completions, self_distilled
    from ..train.variant import VariantConfig, train_variant

    if not str(args.out).lower().endswith(".safetensors"):
        raise LayerleapError(f"--out {args.out}: a variant is one .safetensors file; name it NAME.safetensors")
    if args.variant:  # deltas trained on a variant would fit that variant alone, which nothing loads beneath another
        raise LayerleapError(
            f"--variant {args.variant}: finetune variant trains deltas for --model itself, which load as "
            "load(MODEL, variant=FILE), one variant at a time: drop --variant"
        )
    other = {"skipdecode": ("--min-layer", "--layers-per-step"), "calm": ("--target-speedup",)}[args.objective]
    _refuse_unused(args, other, f"with --objective {args.objective} (the other objective's)")
    threads = _threads(args.threads)
    cmd = _command_line(args)
    print(f"$ {cmd}", flush=True)
    model = _load(args)
    print(_model_line(model, threads), flush=True)
    if args.max_minutes is None:
        workload.check(
            args,
            workload.decoding(model, min(args.self_distill, args.examples), 64, "self-distilled examples"),
            workload.training(model, args.steps * args.batch_size * (96 + 64), model.n_params()),
        )
    n_own = min(args.self_distill, args.examples)
    own = self_distilled(model, args.data, n_own, what="--data") if args.self_distill else []
    seen = {tuple(p) for p, _ in own}
    rest = (
        []
        if len(own) >= args.examples
        else [e for e in prompt_completions(model.tokenizer, args.examples, 96, 64) if tuple(e[0]) not in seen]
    )
    examples = own + rest[: max(0, args.examples - len(own))]
    cfg = VariantConfig(
        objective=args.objective,
        rank=args.rank,
        alpha=2.0 * args.rank,
        target_speedup=args.target_speedup,
        min_layer=args.min_layer,
        layers_per_step=args.layers_per_step,
        anchor=args.anchor,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        save_every=args.save_every,
        seed=args.seed,
    )
    data = (
        f"{len(own)} ShareGPT prompts with {model.config.name}'s greedy answers, {len(examples) - len(own)} with "
        "ShareGPT's answers; targets: the base model's distributions"
    )
    res = train_variant(
        model,
        args.out,
        cfg,
        examples,
        data,
        cmd,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
    )
    first = sum(res.losses[:10]) / max(1, len(res.losses[:10]))
    last = sum(res.losses[-10:]) / max(1, len(res.losses[-10:]))
    print(
        f"trained {res.steps_done - res.resumed_from} steps (resumed from {res.resumed_from}; {res.steps_done} in all, "
        f"{res.seconds:.0f} s); loss {first:.3f} (first 10 steps) -> {last:.3f} (last 10)"
    )
    print(f"wrote {args.out} (load with layerleap.load({args.model!r}, variant={str(args.out)!r}))")
    return 0


# -- eval ---------------------------------------------------------------------------------------------
@command(
    "eval skipdecode",
    "eval skipdecode-speed",
    help="SkipDecode tables: quality (skipdecode, Table 4/5 form) or "
    "wall-clock speed-up by batch size (skipdecode-speed)",
)
def _setup_eval(p):
    _model_args(p)
    p.add_argument("--targets", type=_speedups, default="2,3,4,5", help="target speed-ups (default 2,3,4,5)")
    p.add_argument(
        "--finetuned",
        type=V.tagged(_finetuned_arg, "in", path_of=lambda v: v[1]),
        action="append",
        metavar="SPEEDUP=FOLDER",
        default=[],
        help="a model fine-tuned for a target (repeatable)",
    )
    p.add_argument("--categories", type=V.names_arg, default="summarization,translation")
    p.add_argument("--prompts", type=_positive_int, default=8, help="prompts per category (default 8)")
    p.add_argument("--offset", type=V.nonneg_int, default=0, help="skip this many prompts per category first")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument(
        "--calm-thresholds",
        type=V.float_list_arg(none=True),
        default="0.9,0.95,0.98",
        help="CALM cosine thresholds (quality; none: skip)",
    )
    p.add_argument(
        "--batch-sizes", type=V.int_list_arg(1, 256), default="1,4,16", help="speed: batch sizes (default 1,4,16)"
    )
    p.add_argument("--repeats", type=V.int_arg(1, 100), default=2, help="speed: interleaved repeats per batch size")
    p.add_argument(
        "--skip-base",
        action="store_true",
        help="quality: only greedy and the --finetuned models (to add fine-tuned rows to an earlier run)",
    )
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None)
    p.add_argument("--table", metavar="OUT.md", type=V.table_arg, default=None)
    p.add_argument("--plot", metavar="OUT.png", type=V.plot_arg, default=None)
    workload.add_args(p)


def _quality_runs(args, n_prompts: int, ft: int) -> int:
    """Decodings of one category in ``eval skipdecode`` (``ft`` fine-tuned targets): a batched method
    decodes the category's prompts in one call, another (CALM) one prompt at a time."""

    def runs(method: str) -> int:
        return 1 if get_method(method).batched else n_prompts

    base = 0 if args.skip_base else (runs("skipdecode") + runs("early-exit")) * len(args.targets)
    return runs("greedy") + ft * runs("skipdecode") + base + len(args.calm_thresholds) * runs("calm")


def _quality_rows(model, prompts, refs, label, method, opts, max_new, rows, kind, bar=None):
    """Decode ``prompts`` (one batch, or one at a time for CALM) and score against ``refs``."""
    t = time.perf_counter()
    texts = [p.text for p in prompts]
    if get_method(method).batched:
        res = generate(model, texts, method, max_new, chat=True, **opts)
    else:  # CALM decodes one prompt at a time
        res = [generate(model, text, method, max_new, chat=True, **opts) for text in texts]
    texts = [r.text for r in res]
    avg = sum(r.stats["layers_per_token"] for r in res) / len(res)
    row = {
        "label": label,
        "kind": kind,
        "method": method,
        "options": opts,
        "category": prompts[0].category,
        "avg_layers": avg,
        "rougeL": evaluation.rouge_l(texts, refs),
        "rougeLsum": evaluation.rouge_lsum(texts, refs),
        "bleu": evaluation.bleu(texts, refs),
        "tokens": sum(r.stats["new_tokens"] for r in res),
        "seconds": time.perf_counter() - t,
        "texts": texts,
    }
    rows.append(row)
    if bar is not None:
        bar.update()
    _say(
        f"  {row['category']:<13} {label:<28} layers {avg:5.1f}  ROUGE-L {row['rougeL']:5.1f}  BLEU "
        f"{row['bleu']:5.1f}  "
        f"({row['seconds']:.0f} s)"
    )
    return row


def _eval_quality(args, model, threads) -> dict:
    targets = args.targets
    fts = dict(args.finetuned)
    cats = _csv(args.categories) or ["summarization", "translation"]
    thresholds = args.calm_thresholds
    d = model.config.n_layers
    by_cat = {c: spec_bench(None, [c], args.prompts, args.offset) for c in cats}
    for c, ps in by_cat.items():
        if not ps:
            raise LayerleapError(f"no prompts left in category {c} after --offset {args.offset}: lower --offset")
    rows: list[dict] = []
    report = {
        "command": _command_line(args),
        "machine": machine_config(model),
        "rows": rows,
        "n_prompts": {c: len(v) for c, v in by_cat.items()},
        "max_new_tokens": args.max_new_tokens,
    }
    ft = sum(s in fts for s in targets)
    runs = sum(_quality_runs(args, len(ps), ft) for ps in by_cat.values())
    workload.check(args, workload.decoding(model, runs, args.max_new_tokens))
    ft_models = {s: _load(args, f) for s, f in fts.items()}
    from tqdm.auto import tqdm

    per_cat = 1 + len(thresholds) + sum((0 if args.skip_base else 2) + (s in ft_models) for s in targets)
    bar = tqdm(total=len(by_cat) * per_cat, desc="eval skipdecode", unit="row", leave=False)
    for c, prompts in by_cat.items():
        ref = generate(model, [p.text for p in prompts], "greedy", args.max_new_tokens, chat=True)
        bar.update()
        refs = [r.text for r in ref]
        rows.append(
            {
                "label": "greedy (base)",
                "kind": "greedy",
                "category": c,
                "avg_layers": float(d),
                "rougeL": 100.0,
                "rougeLsum": 100.0,
                "bleu": 100.0,
                "texts": refs,
                "target": 1,
            }
        )
        for s in targets:
            cfg = target_config(d, s)
            if not args.skip_base:
                r = _quality_rows(
                    model,
                    prompts,
                    refs,
                    f"skipdecode {s}x",
                    "skipdecode",
                    cfg.options(),
                    args.max_new_tokens,
                    rows,
                    "skipdecode",
                    bar,
                )
                r["target"] = s
            if s in ft_models:
                r = _quality_rows(
                    ft_models[s],
                    prompts,
                    refs,
                    f"skipdecode {s}x fine-tuned",
                    "skipdecode",
                    cfg.options(),
                    args.max_new_tokens,
                    rows,
                    "skipdecode-ft",
                    bar,
                )
                r["target"] = s
            if args.skip_base:
                continue
            E = max(1, round(d / s))
            r = _quality_rows(
                model,
                prompts,
                refs,
                f"early-exit E={E}",
                "early-exit",
                {"exit_layer": E},
                args.max_new_tokens,
                rows,
                "early-exit",
                bar,
            )
            r["target"] = s
        for th in thresholds:
            r = _quality_rows(
                model,
                prompts,
                refs,
                f"calm cos>={th:g}",
                "calm",
                {"threshold": th},
                args.max_new_tokens,
                rows,
                "calm",
                bar,
            )
            r["target"] = None
        if args.json:
            write_json(args.json, report)
    bar.close()
    return report


def quality_tables(report: dict) -> str:
    rows = report["rows"]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    n = report["n_prompts"]
    out = [
        "### Table 4 form: SkipDecode, quality against the base model's greedy output\n",
        "| category | target speed-up | model | avg generated layers | implied speed-up | ROUGE-L | ROUGE-Lsum "
        "| BLEU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cats:
        for r in rows:
            if r["category"] == c and r["kind"] in ("greedy", "skipdecode", "skipdecode-ft"):
                model = {"greedy": "base, greedy", "skipdecode": "base", "skipdecode-ft": "fine-tuned"}[r["kind"]]
                d = rows[0]["avg_layers"]
                out.append(
                    f"| {c} ({n[c]} prompts) | {r['target']}x | {model} | {r['avg_layers']:.1f} | "
                    f"{d / r['avg_layers']:.2f} | {r['rougeL']:.1f} | {r['rougeLsum']:.1f} | {r['bleu']:.1f} |"
                )
    out += [
        "",
        "### Table 5 form: SkipDecode against fixed early exit and CALM-style exit (ROUGE-L / BLEU vs greedy)\n",
        "| category | target | SkipDecode (base) | SkipDecode (fine-tuned) | early-exit (truncation) |",
        "|---|---|---|---|---|",
    ]
    for c in cats:
        targets = sorted(
            {r["target"] for r in rows if r["category"] == c and r["kind"] in ("skipdecode", "skipdecode-ft")}
        )
        for s in targets:
            cell = {}
            for k in ("skipdecode", "skipdecode-ft", "early-exit"):
                hit = [r for r in rows if r["category"] == c and r["kind"] == k and r["target"] == s]
                cell[k] = (
                    f"{hit[0]['rougeL']:.1f} / {hit[0]['bleu']:.1f} ({hit[0]['avg_layers']:.1f} layers)" if hit else "-"
                )
            out.append(f"| {c} | {s}x | {cell['skipdecode']} | {cell['skipdecode-ft']} | {cell['early-exit']} |")
    calm = [r for r in rows if r["kind"] == "calm"]
    if calm:
        out += [
            "",
            "CALM-style per-token exit (batch 1; its average layers is not controlled, it follows the threshold):\n",
            "| category | threshold | avg generated layers | implied speed-up | ROUGE-L | BLEU |",
            "|---|---|---|---|---|---|",
        ]
        for r in calm:
            d = rows[0]["avg_layers"]
            out.append(
                f"| {r['category']} | {r['options']['threshold']} | {r['avg_layers']:.1f} | "
                f"{d / r['avg_layers']:.2f} | {r['rougeL']:.1f} | {r['bleu']:.1f} |"
            )
    return "\n".join(out)


def quality_plot(report: dict, path: str) -> None:
    from ..files import pyplot

    plt = pyplot()
    rows = report["rows"]
    d = rows[0]["avg_layers"]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    fig, axes = plt.subplots(1, len(cats), figsize=(5.5 * len(cats), 4), squeeze=False)
    style = {
        "skipdecode": ("SkipDecode (base)", "o-"),
        "skipdecode-ft": ("SkipDecode (fine-tuned)", "s-"),
        "early-exit": ("early exit (truncation)", "^--"),
        "calm": ("CALM-style (batch 1)", "x:"),
    }
    for ax, c in zip(axes[0], cats):
        for k, (name, st) in style.items():
            pts = sorted((d / r["avg_layers"], r["rougeL"]) for r in rows if r["category"] == c and r["kind"] == k)
            if pts:
                ax.plot([1.0] + [x for x, _ in pts], [100.0] + [y for _, y in pts], st, label=name)
        ax.set_title(f"{c} ({report['n_prompts'][c]} prompts × ≤{report['max_new_tokens']} tokens)")
        ax.set_xlabel("budget-implied speed-up (layers / avg active layers)")
        ax.set_ylabel("ROUGE-L vs base greedy output")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _eval_speed(args, model, threads) -> dict:
    targets = args.targets
    d = model.config.n_layers
    sizes = args.batch_sizes
    cats = _csv(args.categories) or None
    pool = spec_bench(None, cats, None, args.offset)
    if args.max_new_tokens < 2:
        raise LayerleapError(
            f"--max-new-tokens {args.max_new_tokens}: skipdecode-speed times decoding after the first token, so "
            "give at least 2"
        )
    need = max(sizes)
    if len(pool) < need:
        raise LayerleapError(f"only {len(pool)} prompts in {cats}: the largest batch needs {need}")
    step = max(1, len(pool) // need)
    pool = pool[::step][:need]
    labels = ["greedy"] + [f"skipdecode {s}x" for s in targets]
    opts = {"greedy": ("greedy", {})}
    for s in targets:
        opts[f"skipdecode {s}x"] = ("skipdecode", target_config(d, s).options())
    runs: list[dict] = []
    report = {
        "command": _command_line(args),
        "machine": machine_config(model),
        "runs": runs,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [p.id for p in pool],
    }

    def batches(B: int) -> list:
        if B == 1:
            return [[p] for p in pool[:4]]
        return [pool[i : i + B] for i in range(0, need, B)][: max(1, 4 // B) if B < 4 else 1]

    n_runs = sum(len(batches(B)) for B in sizes) * args.repeats * len(labels)  # a batch decodes its prompts together
    workload.check(args, workload.decoding(model, n_runs, args.max_new_tokens, "batched runs"))
    generate(model, pool[0].text, "greedy", 8, chat=True)  # warm-up
    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(len(batches(B)) for B in sizes) * args.repeats * len(labels),
        desc="eval skipdecode-speed",
        unit="run",
        leave=False,
    )
    for B in sizes:
        groups = batches(B)
        for rep in range(args.repeats):
            for g in groups:
                for lab in labels:  # interleaved: every method on the same batch back to back
                    m, o = opts[lab]
                    res = generate(
                        model, [p.text for p in g], m, args.max_new_tokens, chat=True, stop_at_eos=False, **o
                    )
                    s0 = res[0].stats
                    runs.append(
                        {
                            "batch": B,
                            "repeat": rep,
                            "label": lab,
                            "wall_s": s0["wall_s"],
                            "decode_s": s0["wall_s"] - s0["ttft_s"],
                            "tokens": sum(r.stats["new_tokens"] for r in res),
                            "avg_layers": sum(r.stats["layers_per_token"] for r in res) / len(res),
                        }
                    )
                    bar.update()
            _say(f"  batch {B} repeat {rep + 1}/{args.repeats} done")
        if args.json:
            write_json(args.json, report)
    bar.close()
    summary = []
    for B in sizes:
        rb = [r for r in runs if r["batch"] == B]
        g = [r for r in rb if r["label"] == "greedy"]
        for lab in labels[1:]:
            rs = [r for r in rb if r["label"] == lab]
            avg = sum(r["avg_layers"] for r in rs) / len(rs)
            implied = d / avg
            sp_dec = sum(r["decode_s"] for r in g) / sum(r["decode_s"] for r in rs)
            sp_all = sum(r["wall_s"] for r in g) / sum(r["wall_s"] for r in rs)
            greedy_ms = 1e3 * sum(r["decode_s"] for r in g) / sum(r["tokens"] / B - 1 for r in g)
            summary.append(
                {
                    "batch": B,
                    "label": lab,
                    "avg_layers": avg,
                    "implied": implied,
                    "speedup_decode": sp_dec,
                    "speedup_total": sp_all,
                    "fraction": sp_dec / implied,
                    "runs": len(rs),
                    "tokens": sum(r["tokens"] for r in rs),
                    "greedy_ms_per_step": greedy_ms,
                }
            )
    report["summary"] = summary
    if args.json:
        write_json(args.json, report)
    return report


def speed_table(report: dict) -> str:
    out = [
        "| batch | setting | avg active layers | implied speed-up (d/avg) | measured decode speed-up | "
        "measured / implied | total speed-up (with prefill) | greedy ms per step | runs × tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["summary"]:
        out.append(
            f"| {s['batch']} | {s['label']} | {s['avg_layers']:.2f} | {s['implied']:.2f} | "
            f"{s['speedup_decode']:.2f} | "
            f"{100 * s['fraction']:.0f}% | {s['speedup_total']:.2f} | {s['greedy_ms_per_step']:.0f} | "
            f"{s['runs']} runs, {s['tokens']} tokens |"
        )
    return "\n".join(out)


def speed_plot(report: dict, path: str) -> None:
    from ..files import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for B in sorted({s["batch"] for s in report["summary"]}):
        pts = [s for s in report["summary"] if s["batch"] == B]
        ax.plot([s["implied"] for s in pts], [s["speedup_decode"] for s in pts], "o-", label=f"batch {B}")
    lim = max(s["implied"] for s in report["summary"]) + 0.3
    ax.plot([1, lim], [1, lim], "k:", label="= budget-implied")
    ax.plot([1, lim], [0.8, 0.8 * lim], "k--", alpha=0.4, label="80% of implied")
    ax.set_xlabel("budget-implied speed-up (layers / avg active layers)")
    ax.set_ylabel("measured decode speed-up vs greedy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"SkipDecode wall clock, {report['max_new_tokens']} new tokens")
    fig.tight_layout()
    save_figure(fig, path)


@_setup_eval
def run_eval(args) -> int:
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    model = _load(args)
    print(_model_line(model, threads), flush=True)
    if args.what == "skipdecode":
        report = _eval_quality(args, model, threads)
        text = quality_tables(report)
        plot = quality_plot
    else:
        report = _eval_speed(args, model, threads)
        text = speed_table(report)
        plot = speed_plot
    print(text)
    if args.table:
        write_text(args.table, f"`{_command_line(args)}`\n\n{_model_line(model, threads)}\n\n{text}\n")
        print(f"wrote {args.table}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


# -- eval frontier --------------------------------------------------------------------------------------
def _grids(n_layers: int) -> dict:
    """Each method's points (label suffix, options) for the frontier: from near-greedy settings to the
    SkipDecode paper's 2x and 3x budgets (Table 5's matched speed-ups: an exit layer and CALM thresholds
    at about the same layer count), and BiLD's ablations (its paper's Figure 5: no rollback at the same
    fallback thresholds; no fallback, the large model called after every k small tokens, k in [3, 10]), in
    BiLD's early-exit form (``eagle="none"``), as its paper compares it with CALM."""
    d = n_layers
    sd = [(d - 2, d, 4), (d - 6, d, 4), (d - 10, d - 2, 4), *(table2(d, t) for t in (2, 3) if t <= d)]
    sd = [(lo, hi, min(w, lo)) for lo, hi, w in dict.fromkeys(sd) if lo >= 1]
    exits = [e for e in dict.fromkeys((d - 2, d - 6, d // 2, d // 3)) if 1 <= e < d]
    fbs = (0.3, 0.5, 0.7)
    ee = {"eagle": "none"}  # BiLD's early-exit form, the setting of its paper's comparison with CALM
    return {
        "skipdecode": [
            (f"{lo}-{hi} w{w}", {"min_exit_layer": lo, "max_exit_layer": hi, "warmup": w}) for lo, hi, w in sd
        ],
        "early-exit": [(f"E{e}", {"exit_layer": e}) for e in exits],
        "calm": [(f"cos{t:g}", {"threshold": t}) for t in (0.99, 0.97, 0.95)],
        "bild": [(f"fb{fb:g} rb1.5", {**ee, "alpha_fb": fb, "alpha_rb": 1.5}) for fb in fbs],
        "bild-no-rollback": [(f"fb{fb:g} rb inf", {**ee, "alpha_fb": fb, "alpha_rb": math.inf}) for fb in fbs],
        "bild-no-fallback": [
            (f"every {k}", {**ee, "alpha_fb": 0.0, "alpha_rb": 1.5, "max_small": k}) for k in (3, 6, 10)
        ],
    }


def table2(n_layers: int, target: int) -> tuple[int, int, int]:
    """(min, max, warmup) of Table 2's configuration for ``target``x at this depth."""
    c = target_config(n_layers, target)
    return c.min_exit_layer, c.max_exit_layer, c.warmup


def _grid_arg(text: str) -> tuple[str, str]:
    model, colon, method = text.partition(":")
    if not colon or not model or not method:
        raise argparse.ArgumentTypeError(f"{V.show(text)}: write MODEL:METHOD, e.g. base:skipdecode or calm:early-exit")
    return model.strip(), method.strip()


@command(
    "eval frontier",
    help="quality against speed of the lossy methods on the base model and fine-tuned variants "
    "(references, agreement with greedy, the full model's perplexity)",
)
def _setup_frontier(p):
    _model_args(p)
    p.add_argument(
        "--with-variant",
        action="append",
        default=[],
        metavar="NAME=FILE",
        type=V.tagged(_variant_arg, "in", path_of=lambda v: v[1]),
        help="a fine-tuned variant to compare (repeatable); the base model is 'base', and every point is "
        "measured against the base model's greedy output and perplexity",
    )
    p.add_argument(
        "--grid",
        action="append",
        type=_grid_arg,
        required=True,
        metavar="MODEL:METHOD",
        help="points to run: MODEL (base or a variant's NAME) and METHOD (skipdecode, early-exit, calm, "
        "bild, bild-no-rollback, bild-no-fallback); repeatable",
    )
    p.add_argument("--categories", type=V.names_arg, default="summarization,translation,math_reasoning")
    p.add_argument("--prompts", type=_positive_int, default=4, help="prompts per category (default 4)")
    p.add_argument("--offset", type=V.nonneg_int, default=0, help="skip this many prompts per category first")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, required=True)
    p.add_argument("--plot", metavar="OUT.png", type=V.plot_arg, default=None)
    workload.add_args(p)


def _variant_arg(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name.strip() or name.strip() == "base":
        raise argparse.ArgumentTypeError(f"{V.show(text)}: write NAME=FILE (NAME other than base)")
    return name.strip(), path.strip()


@_setup_frontier
def run_frontier(args) -> int:
    from ..drafters.variants import apply
    from ..eval import frontier as fr

    threads = _threads(args.threads)
    cmd = _command_line(args)
    print(f"$ {cmd}", flush=True)
    models = {"base": _load(args)}
    for name, path in args.with_variant:
        models[name] = apply(_load(args), path)
    print(_model_line(models["base"], threads), flush=True)
    grids = _grids(models["base"].config.n_layers)
    points = []
    for model, method in args.grid:
        if model not in models:
            raise LayerleapError(
                f"--grid {model}:{method}: no model {model!r}: give --with-variant {model}=FILE or use base"
            )
        if method not in grids:
            raise LayerleapError(f"--grid {model}:{method}: choose a method of {', '.join(grids)}")
        real = "bild" if method.startswith("bild") else method
        points += [
            fr.Point(f"{method} {suffix}" + ("" if model == "base" else f" [{model}]"), model, real, opts, method)
            for suffix, opts in grids[method]
        ]
    runs = (len(points) + len(models)) * args.prompts * len(_csv(args.categories) or [""])  # + greedy per model
    workload.check(args, workload.decoding(models["base"], runs, args.max_new_tokens))
    report = fr.run(
        models,
        points,
        _csv(args.categories),
        args.prompts,
        args.max_new_tokens,
        args.offset,
        progress=_say,
        partial=lambda rep: write_json(args.json, {**rep, "command": cmd, "partial": True}),
    )
    report.update(
        command=cmd,
        machine=machine_config(models["base"]),
        summary=fr.summary(report["rows"]),
        variants=dict(args.with_variant),
    )
    write_json(args.json, report)
    for s in report["summary"]:
        q = "  n/a" if s["quality"] is None else f"{s['quality']:5.1f}"
        print(
            f"{s['label']:<40} quality {q}%  agreement {s['agreement']:5.1f}  "
            f"ppl x{s['ppl_ratio'] or float('nan'):.2f}  "
            f"speed-up {s['speedup']:.2f}x (implied {s['implied_speedup']:.2f}x)"
        )
    if args.plot:
        save_figure(_frontier_figure(report), args.plot)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _frontier_figure(report: dict, only: list[str] | None = None):
    """Quality, agreement and perplexity against speed-up, one curve per method (and model); ``only``
    keeps those curves (and greedy)."""
    from ..files import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, key, name in zip(
        axes,
        ("quality", "agreement", "ppl_ratio"),
        (
            "quality vs references (% of greedy)",
            "agreement with greedy (ROUGE-L)",
            "full model's perplexity / greedy's",
        ),
    ):
        groups: dict[str, list] = {}
        for s in report["summary"]:
            if s[key] is not None and (only is None or s.get("group", s["method"]) in ("greedy", *only)):
                curve = s.get("group", s["method"]) + ("" if s["model"] == "base" else f" [{s['model']}]")
                groups.setdefault(curve, []).append(s)
        for g, ss in groups.items():
            ss = sorted(ss, key=lambda s: s["speedup"])
            ax.plot([s["speedup"] for s in ss], [s[key] for s in ss], "o-", label=g, ms=4)
        ax.axvline(1.0, color="grey", lw=0.5)
        if key == "quality":
            for b in (95, 90):
                ax.axhline(b, color="grey", lw=0.5, ls="--")
        ax.set_xlabel("speed-up over greedy (wall clock, same run)")
        ax.set_title(name, fontsize=10)
        if key == "ppl_ratio":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{', '.join(report['categories'])}: {report['n_prompts']} prompts each, {report['max_new_tokens']} new tokens",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
