"""``layerleap train transfer`` / ``train medusa`` (the drafters of Hidden Transfer and Medusa) and
``layerleap eval drafters`` (draft accuracy per step, the paper's Figure 3, and the layer study of
Figures 5-6).  See train/medusa_transfer.py for the method."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..drafters import medusa_transfer as drafters
from ..drafters import weights
from ..train import medusa_transfer as train_drafters
from ..train.distributed import init_from_env
from ..train.data import DATA_CHOICES, answers_kind, load_self_distilled, self_distilled_chunks, stream_chunks
from . import command
from ..datasets import spec_bench
from ..decoding import generate
from ..errors import LayerleapError
from .. import validate as V, workload
from ..files import json_text, save_figure, save_safetensors, write_json
from .basic import _command_line, _load, _model_args, _positive_int, _state_cache_arg, _threads


DRAFTER_ARG = V.name_or_file_arg(("trained",), "drafter weights file")
TRANSFER_LAYERS = (15, 20, 25)  # train transfer's default t_i
MEDUSA_HEADS = 3  # train medusa's default heads
EAGLE_UNROLL = 3  # train eagle's default draft steps unrolled
TRAIN_DATA_ARG = V.name_or_file_arg(DATA_CHOICES, "self-distilled data file (.jsonl)")


@command(
    "train transfer",
    "train medusa",
    "train eagle",
    help="train Hidden Transfer projections (--layers t1,t2,..), Medusa heads (--heads k) or the EAGLE head "
    "(--unroll k) on ShareGPT or self-distilled data, backbone frozen",
)
def _setup_train(p):
    _model_args(p)
    p.add_argument(
        "--layers",
        type=V.int_list_arg(1),
        default=None,
        help=f"train transfer only: the layer t_i of each step (default {','.join(map(str, TRANSFER_LAYERS))})",
    )
    p.add_argument(
        "--heads",
        type=V.int_arg(1, 64),
        default=None,
        help=f"train medusa only: heads = steps ahead (default {MEDUSA_HEADS})",
    )
    p.add_argument(
        "--unroll",
        type=V.int_arg(1, 64),
        default=None,
        help=f"train eagle only: draft steps unrolled, each fed the head's own state (default {EAGLE_UNROLL})",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="train eagle only: EAGLE's attention layer over the earlier positions before the head's block "
        "(--init may name a head without it: the attention starts at zero output)",
    )
    p.add_argument(
        "--out",
        type=V.weights_out(lambda a: a.what, also=(("checkpoint", ".ckpt.safetensors"),)),
        required=True,
        help="weights file to write (safetensors); its checkpoint <out>.ckpt.safetensors makes a rerun resume",
    )
    p.add_argument("--steps", type=V.int_arg(1, 1_000_000), default=60, help="optimizer steps (default 60)")
    p.add_argument("--batch-size", type=V.int_arg(1, 1024), default=1, help="chunks per step (default 1)")
    p.add_argument("--seq-len", type=V.int_arg(4, 65_536), default=128, help="tokens per chunk (default 128)")
    p.add_argument("--lr", type=V.lr_arg, default=1e-3)
    p.add_argument("--seed", type=V.seed_arg, default=0)
    p.add_argument(
        "--conversations",
        type=V.int_arg(1, 10_000_000),
        default=2000,
        help="ShareGPT conversations read (default 2000)",
    )
    p.add_argument(
        "--data",
        type=TRAIN_DATA_ARG,
        default="sharegpt",
        help="sharegpt (default), self-distill (the model's own answers: `layerleap train data --self-distill`) "
        "or a self-distilled .jsonl",
    )
    p.add_argument(
        "--chunks",
        type=V.in_file_arg,
        default=None,
        help="pre-tokenized chunks (a file from --save-chunks) instead of ShareGPT",
    )
    p.add_argument(
        "--save-chunks",
        type=V.weights_out("token-chunks"),
        default=None,
        help="write the tokenized ShareGPT chunks here (.safetensors) and exit",
    )
    p.add_argument(
        "--init",
        type=V.in_file_arg,
        default=None,
        help="start from this weights file (same kind, model and --layers/--heads) instead of fresh weights; "
        "the written file's budget adds to its",
    )
    p.add_argument("--save-every", type=_positive_int, default=20)
    p.add_argument("--max-seconds", type=V.positive_float, default=None, help="stop and save after this many seconds")
    _state_cache_arg(
        p,
        "train medusa and train eagle only (Hidden Transfer's pseudo states run through the layers above t_1 at "
        "every step, so its projections cannot train from cached states)",
    )
    workload.add_args(p)


def _read_chunks(path: str, vocab: int) -> list[list[int]]:
    """The token chunks of a ``--save-chunks`` file: a 2-D integer tensor of ids in the vocabulary."""
    from safetensors.torch import load_file

    try:
        t = load_file(path)["chunks"]
    except Exception as e:  # safetensors raises its own kinds for a foreign or truncated file
        raise LayerleapError(
            f"cannot read chunks {path} ({type(e).__name__}: {str(e)[:80]}): write them with --save-chunks"
        ) from None
    if t.dim() != 2 or t.is_floating_point() or not t.numel() or int(t.min()) < 0 or int(t.max()) >= vocab:
        raise LayerleapError(
            f"{path} does not hold token chunks for this model (a 2-D tensor of ids below {vocab}): "
            "write them with --save-chunks"
        )
    return t.long().tolist()


KIND_FLAGS = {"transfer": "--layers", "medusa": "--heads", "eagle": "--unroll"}


def _kind_flags(args) -> str:
    """The drafter kind of ``train transfer`` / ``medusa`` / ``eagle``; another kind's flag is refused, not ignored."""
    kind = args.what
    for other, flag in KIND_FLAGS.items():
        if other != kind and getattr(args, flag[2:]) is not None:
            raise LayerleapError(
                f"{flag} is for `layerleap train {other}`; train {kind} takes {KIND_FLAGS[kind]}: drop {flag}"
            )
    if args.attention and kind != "eagle":
        raise LayerleapError(f"--attention is for `layerleap train eagle`, not train {kind}: drop --attention")
    return kind


@_setup_train
def run_train(args) -> int:
    from .basic import _refuse_unused

    kind = _kind_flags(args)
    if args.chunks:
        _refuse_unused(args, ("--data", "--conversations"), "with --chunks (the chunks are the data)")
    elif args.data != "sharegpt":
        _refuse_unused(args, ("--conversations",), f"with --data {args.data} (it counts ShareGPT conversations)")
    ranks = init_from_env(args.device)  # under torchrun: data-parallel, rank 0 writes
    threads = _threads(args.threads or ranks.threads())
    model = _load(args)
    cfg = train_drafters.TrainConfig(
        kind=kind,
        layers=args.layers or list(TRANSFER_LAYERS),
        steps_ahead=(args.unroll or EAGLE_UNROLL) if kind == "eagle" else (args.heads or MEDUSA_HEADS),
        train_steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        n_conversations=args.conversations,
        save_every=args.save_every,
        max_seconds=args.max_seconds,
        init=args.init,
        state_cache=args.state_cache,
        attention=args.attention,
    )
    train_drafters.check_config(cfg, model)
    if not args.save_chunks and args.max_seconds is None:
        workload.check(args, workload.training(model, cfg.train_steps * cfg.batch_size * cfg.seq_len))
    eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    data = None
    if args.chunks:
        saved = _read_chunks(args.chunks, model.config.vocab_size)
        if len(saved[0]) < cfg.seq_len:
            raise LayerleapError(
                f"the chunks in {args.chunks} hold {len(saved[0])} tokens each, fewer than --seq-len {cfg.seq_len}: "
                f"give --seq-len {len(saved[0])} or less, or save chunks with --save-chunks --seq-len {cfg.seq_len}"
            )
        chunks = [c[: cfg.seq_len] for c in saved]
        data = f"pre-tokenized chunks {Path(args.chunks).name}"
    elif args.data != "sharegpt":
        path, pairs = load_self_distilled(model, args.data)
        chunks = self_distilled_chunks(pairs, cfg.seq_len, cfg.seed, eos)
        kind = answers_kind(path)
        data = f"self-distilled: {len(pairs)} {kind} of {model.config.name} to ShareGPT prompts ({path.name})"
    else:
        chunks = stream_chunks(model.tokenizer, cfg.n_conversations, cfg.seq_len, cfg.seed, eos)
        data = weights.SHAREGPT  # the budget adds "N chunks of L tokens"
    if args.save_chunks:
        if not ranks.main:  # under torchrun: rank 0 writes the chunks
            return 0
        save_safetensors(
            args.save_chunks, {"chunks": torch.tensor(chunks, dtype=torch.int32)}, {"kind": "token-chunks"}
        )
        print(f"wrote {len(chunks)} chunks of {cfg.seq_len} tokens to {args.save_chunks}")
        return 0
    t = time.perf_counter()
    report = train_drafters.train(model, args.out, cfg, chunks=chunks, data=data, command=_command_line(args))
    report.update(command=_command_line(args), threads=threads, wall_s=time.perf_counter() - t, device=args.device)
    if not ranks.main:
        return 0
    report["processes"] = ranks.world
    losses = report.pop("losses")
    first = sum(losses[:5]) / max(1, len(losses[:5]))
    last = sum(losses[-5:]) / max(1, len(losses[-5:]))
    print(json_text({**report, "loss_first5": first, "loss_last5": last}, indent=1))
    return 0


@command(
    "eval drafters",
    help="draft accuracy per step (top-1/3/5) of Hidden Transfer and Medusa weights on the "
    "model's greedy text (Figure 3)",
)
def _setup_eval(p):
    _model_args(p)
    p.add_argument(
        "--transfer",
        type=DRAFTER_ARG,
        action="append",
        default=[],
        help="transfer weights file(s) ('trained': shipped)",
    )
    p.add_argument(
        "--medusa", type=DRAFTER_ARG, action="append", default=[], help="Medusa heads file(s) ('trained': shipped)"
    )
    p.add_argument("--categories", type=V.names_arg, default="summarization,math_reasoning")
    p.add_argument("--prompts", type=_positive_int, default=4, help="prompts per category")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--json", type=V.report_arg, default=None)
    p.add_argument("--plot", type=V.plot_arg, default=None, help="a PNG of top-1 accuracy per step")
    workload.add_args(p)


def greedy_sequences(model, prompts, max_new_tokens: int) -> list[tuple[int, list[int]]]:
    from tqdm.auto import tqdm

    out = []
    for pr in tqdm(prompts, desc="greedy references", unit="prompt", leave=False):
        res = generate(model, pr.text, "greedy", max_new_tokens, chat=True, stop_at_eos=False)
        out.append((len(res.prompt_ids), res.prompt_ids + res.token_ids))
    return out


@_setup_eval
def run_eval(args) -> int:
    if not args.transfer and not args.medusa:
        raise LayerleapError(
            "no drafter to evaluate: add --transfer trained and/or --medusa trained (or a weights file)"
        )
    threads = _threads(args.threads)
    model = _load(args)
    cats = [c for c in args.categories.split(",") if c]
    prompts = spec_bench(None, cats, args.prompts)
    n = len(args.transfer) + len(args.medusa)  # then one forward of every greedy reference per drafter
    workload.check(
        args,
        workload.decoding(model, len(prompts), args.max_new_tokens, "greedy references"),
        workload.training(model, n * len(prompts) * args.max_new_tokens, what="drafted positions"),
    )
    chosen = [
        (kind, spec, drafters.get_drafter(model, kind, spec))
        for kind, specs in (("transfer", args.transfer), ("medusa", args.medusa))
        for spec in specs
    ]
    seqs = greedy_sequences(model, prompts, args.max_new_tokens)
    rows = {}
    for kind, spec, d in chosen:
        label = f"{kind}:{Path(spec).stem if spec != 'trained' else 'shipped'}"
        if kind == "transfer":
            label += f"@{','.join(map(str, d.layers))}"
        rows[label] = train_drafters.draft_accuracy(model, d, seqs)
    report = {
        "command": _command_line(args),
        "threads": threads,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "accuracy": rows,
    }
    print(accuracy_table(rows))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        accuracy_plot(rows, args.plot)
    return 0


def accuracy_table(rows: dict) -> str:
    lines = [f"{'drafter':40} step  top1   top3   top5   n"]
    for label, acc in rows.items():
        for i, a in acc.items():
            top = "  ".join("  -  " if a[k] is None else f"{a[k]:.3f}" for k in (1, 3, 5))  # None: no position
            lines.append(f"{label:40} {i:>4} {top}  {a['n']}")
    return "\n".join(lines)


def accuracy_plot(rows: dict, path: str) -> None:
    from ..files import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for ax, k in zip(axes, (1, 3, 5)):
        for label, acc in rows.items():
            steps = sorted(acc, key=int)
            ax.plot([int(s) + 1 for s in steps], [acc[s][k] for s in steps], marker="o", label=label)
        ax.set_title(f"top-{k} draft accuracy")
        ax.set_xlabel("N (token ahead; 2 = first draft)")
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
