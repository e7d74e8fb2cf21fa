"""``layerleap train data --self-distill`` (the model's own greedy answers to ShareGPT prompts, cached
by model fingerprint), ``layerleap train corpus`` (those answers as REST's datastore, with the tokens
per call it gives on held-out greedy text) and ``layerleap eval draft-vocab`` (a reduced draft
vocabulary: coverage and cost per size, and the chosen set written as a draft-vocabulary file)."""

from __future__ import annotations

import time
from pathlib import Path

from . import command
from .. import validate as V
from ..errors import LayerleapError
from ..files import write_json
from .basic import _model_args
from .heads import _start

DATA_ARG = V.name_or_file_arg(("self-distill",), "self-distilled data file (.jsonl)")


# -- train data -----------------------------------------------------------------------------------
@command(
    "train data",
    help="write training data: --self-distill decodes the model's own answers to ShareGPT prompts, greedy "
    "or sampled (--temperature; batched, resumable, cached by model fingerprint)",
)
def _setup_data(p):
    _model_args(p)
    p.add_argument(
        "--self-distill",
        type=V.int_arg(1, 1_000_000),
        required=True,
        metavar="N",
        help="ShareGPT prompts to answer (a rerun with a larger N decodes only the new ones)",
    )
    p.add_argument("--max-prompt", type=V.int_arg(4, 65_536), default=96, help="longest prompt kept (default 96)")
    p.add_argument("--gen-len", type=V.int_arg(1, 65_536), default=64, help="tokens per answer (default 64)")
    p.add_argument("--batch", type=V.int_arg(1, 1024), default=16, help="prompts decoded as one batch (default 16)")
    p.add_argument(
        "--temperature",
        type=V.temperature_arg,
        default=None,
        help="sample the answers at this temperature instead of decoding greedily (a cache file of their own)",
    )
    p.add_argument("--seed", type=V.seed_arg, default=0, help="sampling: prompt i samples with seed + i (default 0)")
    p.add_argument(
        "--out",
        type=V.jsonl_arg,
        default=None,
        help="the .jsonl to write, or to add answers to (default: the cache, where --data self-distill finds it)",
    )


@_setup_data
def run_data(args) -> int:
    from ..train.data import answers_kind, self_distill_path, self_distilled
    from .basic import _refuse_unused

    if args.temperature is None:
        _refuse_unused(args, ("--seed",), "without --temperature (greedy answers draw nothing)")
    _, model, _ = _start(args)
    path = args.out or self_distill_path(model, args.max_prompt, args.gen_len, args.temperature, args.seed)
    t = time.perf_counter()
    path = Path(path)
    before = _stamp(path)
    pairs = self_distilled(
        model,
        path,
        args.self_distill,
        args.max_prompt,
        args.gen_len,
        args.batch,
        temperature=args.temperature,
        seed=args.seed,
    )
    tokens = sum(len(c) for _, c in pairs)
    if before is not None and _stamp(path) == before:  # it held enough answers: nothing decoded, nothing written
        held = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        print(f"{path} already holds {held} {answers_kind(path)}: nothing to add (--self-distill {args.self_distill})")
        return 0
    print(f"wrote {path}: {len(pairs)} {answers_kind(path)}, {tokens} tokens ({time.perf_counter() - t:.0f} s)")
    return 0


def _stamp(path: Path) -> tuple[int, ...] | None:
    """What tells a rewritten file from the one that was there (``files.stamp``; None: no file)."""
    from ..files import stamp

    try:
        return stamp(path)
    except OSError:
        return None


# -- train corpus --------------------------------------------------------------------------------
@command(
    "train corpus",
    help="write a corpus for the rest method (REST's datastore) from the model's self-distilled answers, and "
    "measure the tokens per call it gives beside prompt lookup on held-out greedy answers",
)
def _setup_corpus(p):
    _model_args(p)
    p.add_argument(
        "--data",
        type=DATA_ARG,
        default="self-distill",
        help="the answers: 'self-distill' (the cached `train data --self-distill`) or a self-distilled .jsonl",
    )
    p.add_argument("--out", type=V.weights_out("corpus"), required=True, help="the corpus file to write (.safetensors)")
    p.add_argument(
        "--calibration-prompts",
        type=V.int_arg(0, 20),
        default=4,
        help="Spec-Bench calibration prompts per category whose greedy answers measure the corpus (default 4; 0: none)",
    )
    p.add_argument("--max-new-tokens", type=V.int_arg(1, 4096), default=64, help="tokens per calibration answer")
    p.add_argument("--draft-len", type=V.int_arg(1, 64), default=4, help="tokens drafted per round in the replay")
    p.add_argument("--json", type=V.report_arg, default=None, help="also write the measurement as JSON")


@_setup_corpus
def run_corpus(args) -> int:
    from ..drafters import corpus as cp
    from ..drafters.prompt_lookup import lookup_index
    from ..eval.corpus import replay
    from ..methods.prompt_lookup import DEFAULT_MAX_NGRAM
    from ..train.data import answers_kind, load_self_distilled
    from .basic import _refuse_unused

    if not args.calibration_prompts:
        _refuse_unused(
            args, ("--max-new-tokens", "--draft-len"), "with --calibration-prompts 0 (they shape the replay)"
        )
    cmd, model, threads = _start(args)
    path, pairs = load_self_distilled(model, args.data)
    meta = {
        "data": f"self-distilled: {model.config.name}'s {answers_kind(path)} to {len(pairs)} ShareGPT prompts "
        f"({path.name})",
        "command": cmd,
    }
    out = cp.save(args.out, model, [c for _, c in pairs], meta)
    store = cp.read(model, out)
    print(f"wrote {out}: {store.sequences} answers, {len(store)} tokens")
    report = {"command": cmd, "threads": threads, "data": str(path), "sequences": store.sequences, "tokens": len(store)}
    if args.calibration_prompts:
        held = _calibration_sequences(model, args.calibration_prompts, args.max_new_tokens)
        report["replay"] = {}
        for name, store_ in (("prompt lookup", None), ("rest", store)):
            r = replay(held, lambda ids, s=store_: lookup_index(ids, 1, DEFAULT_MAX_NGRAM, s), args.draft_len)
            report["replay"][name] = r
            print(
                f"{name}: {r['tokens_per_call']:.3f} tokens per call on {len(held)} held-out greedy answers "
                f"({r['tokens']} tokens, draft length {args.draft_len})"
            )
    if args.json:
        write_json(args.json, report)
    return 0


def _calibration_sequences(model, per_category: int, max_new_tokens: int) -> list[tuple[int, list[int]]]:
    """``(prompt length, prompt and greedy answer ids)`` for the Spec-Bench calibration split (chat template)."""
    from ..decoding import generate
    from ..eval.calibrate import split_prompts

    prompts = [p.text for p in split_prompts("calibration", per_category)]
    results = generate(model, prompts, "greedy", max_new_tokens, chat=True, stop_at_eos=False)
    return [(len(r.prompt_ids), r.prompt_ids + r.token_ids) for r in results]


# -- eval draft-vocab -----------------------------------------------------------------------------
@command(
    "eval draft-vocab",
    help="a reduced draft vocabulary: coverage of the model's own tokens and the draft unembedding's cost "
    "per size K; --out writes the chosen set",
)
def _setup_vocab(p):
    _model_args(p)
    p.add_argument(
        "--data",
        type=DATA_ARG,
        default="self-distill",
        help="what the ids are counted on: 'self-distill' (the cached `train data --self-distill`) or a .jsonl",
    )
    p.add_argument(
        "--text-conversations",
        type=V.int_arg(0, 1_000_000),
        default=2000,
        help="ShareGPT conversations whose answers' token counts rank the ids the model's answers never "
        "used (default 2000; 0: those by id)",
    )
    p.add_argument(
        "--held-out",
        type=V.float_arg(0.0, 1.0, hi_open=True),
        default=0.2,
        help="the last share of the answers, not counted, on which coverage is measured (default 0.2)",
    )
    p.add_argument(
        "--calibration-prompts",
        type=V.int_arg(0, 20),
        default=4,
        help="Spec-Bench calibration prompts per category whose greedy answers are a second held-out set "
        "(default 4; 0: none)",
    )
    p.add_argument("--max-new-tokens", type=V.int_arg(1, 4096), default=64, help="tokens per calibration answer")
    p.add_argument(
        "--sizes",
        type=V.int_list_arg(1),
        default="1024,2048,4096,8192,16384,32768",
        help="draft vocabulary sizes K to measure (the full vocabulary is always measured too)",
    )
    p.add_argument(
        "--min-coverage",
        type=V.float_arg(0.0, 1.0),
        default=0.95,
        help="choose the smallest K whose held-out coverage reaches this (default 0.95)",
    )
    p.add_argument("--size", type=V.int_arg(1), default=None, help="write this K instead of the chosen one")
    p.add_argument("--rows", type=V.int_list_arg(1, 64), default="1,3", help="draft rows timed per call")
    p.add_argument("--reps", type=V.int_arg(1, 10_000), default=30, help="timed repetitions (median)")
    p.add_argument(
        "--out", type=V.weights_out("draft-vocab"), default=None, help="write the chosen ids here (.safetensors)"
    )
    p.add_argument("--json", type=V.report_arg, default=None, help="also write the table as JSON")


@_setup_vocab
def run_vocab(args) -> int:
    from ..drafters import draft_vocab as dv
    from ..eval.draft_vocab import choose_size, coverage_by_size, draft_cost
    from ..train.data import answer_tokens, answers_kind, load_self_distilled

    cmd, model, threads = _start(args)
    V_ = model.config.vocab_size
    if args.size is not None and args.size >= V_:
        raise LayerleapError(f"--size {args.size}: a draft vocabulary is smaller than the vocabulary ({V_})")
    if args.out and args.size is None and all(s >= V_ for s in args.sizes):
        raise LayerleapError(
            f"--sizes {','.join(map(str, args.sizes))}: none is below the vocabulary ({V_}), so none could be "
            "written to --out: give smaller --sizes, or --size"
        )
    sizes = sorted({min(s, V_) for s in args.sizes} | {V_})
    path, pairs = load_self_distilled(model, args.data)
    cut = len(pairs) - int(round(args.held_out * len(pairs)))
    text = answer_tokens(model.tokenizer, args.text_conversations) if args.text_conversations else []
    order, counts = dv.rank_tokens([c for _, c in pairs[:cut]], V_, text)
    n_counted, seen = int(counts.sum()), int((counts > 0).sum())
    held = _held_out(model, pairs[cut:], args)
    if not held:
        raise LayerleapError(
            f"no held-out tokens to measure coverage on: --held-out {args.held_out:g} keeps none of the "
            f"{len(pairs)} answers back and --calibration-prompts gives none; raise --held-out or give "
            "--calibration-prompts"
        )
    cover = {name: coverage_by_size(order, sizes, toks) for name, toks in held.items()}
    costs = [draft_cost(model, sizes, rows, reps=args.reps) for rows in args.rows]
    print(
        f"ids ranked on {n_counted} tokens of {cut} answers ({seen} distinct ids) from {path}, then on "
        f"{sum(map(len, text))} tokens of {len(text)} ShareGPT answers"
    )
    print(_table(sizes, cover, costs, held))
    gate = cover.get("self-distill held out") or next(iter(cover.values()), {V_: 1.0})
    chosen = args.size or choose_size(gate, args.min_coverage)
    how = "--size" if args.size else f"the smallest with coverage >= {args.min_coverage}"
    print(f"chosen K = {chosen} ({how})")
    report = {
        "command": cmd,
        "threads": threads,
        "data": str(path),
        "answers_counted": cut,
        "tokens_counted": n_counted,
        "distinct_ids": seen,
        "text_tokens": sum(map(len, text)),
        "held_out_tokens": {k: sum(map(len, v)) for k, v in held.items()},
        "coverage": {k: {str(s): round(c, 4) for s, c in v.items()} for k, v in cover.items()},
        "cost": costs,
        "chosen": chosen,
    }
    if args.out:
        if chosen >= V_:
            raise LayerleapError(
                f"no size below the vocabulary reaches --min-coverage {args.min_coverage}: lower it or give --size"
            )
        meta = {
            "data": f"self-distilled: {model.config.name}'s {answers_kind(path)} to the first {cut} usable ShareGPT "
            f"prompts ({path.name}); ids they never used ranked by their count in the answers of the first "
            f"{args.text_conversations} ShareGPT conversations, then by id",
            "tokens": str(n_counted),
            "ids_by_count": str(min(chosen, seen)),
            "coverage": ", ".join(f"{k} {coverage_by_size(order, [chosen], v)[chosen]:.4f}" for k, v in held.items()),
            "command": cmd,
        }
        out = dv.save(args.out, model, order[:chosen], meta)
        print(f"wrote {out} (K = {chosen})")
        report["out"] = str(out)
    if args.json:
        write_json(args.json, report)
    return 0


def _held_out(model, pairs, args) -> dict[str, list[list[int]]]:
    """The token lists coverage is measured on: the held-out answers, and greedy answers to Spec-Bench
    calibration prompts (``--calibration-prompts``); empty sets left out."""
    held = {"self-distill held out": [c for _, c in pairs]}
    if args.calibration_prompts:
        held["spec-bench calibration"] = _calibration_answers(model, args.calibration_prompts, args.max_new_tokens)
    return {k: v for k, v in held.items() if any(v)}


def _calibration_answers(model, per_category: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids) to the Spec-Bench calibration split's prompts (chat template)."""
    from ..decoding import generate
    from ..eval.calibrate import split_prompts

    prompts = [p.text for p in split_prompts("calibration", per_category)]
    return [r.token_ids for r in generate(model, prompts, "greedy", max_new_tokens, chat=True)]


def _table(sizes, cover, costs, held) -> str:
    names = list(cover)
    head = "| K | " + " | ".join(f"coverage: {n} ({sum(map(len, held[n]))} tokens)" for n in names)
    head += " | " + " | ".join(f"draft ms, {c['rows']} row(s)" for c in costs) + " | share of a step |"
    lines = [head, "|---" * (2 + len(names) + len(costs)) + "|"]
    for k in sizes:
        cells = [f"{100 * cover[n][k]:.1f}%" for n in names] + [f"{c['draft_ms'][k]:.3f}" for c in costs]
        share = f"{100 * costs[0]['draft_ms'][k] / costs[0]['step_ms']:.1f}%"
        lines.append(f"| {k:,} | " + " | ".join(cells) + f" | {share} |")
    lines.append(f"one decode step (KV cache {costs[0]['context']}): {costs[0]['step_ms']:.2f} ms")
    return "\n".join(lines)
