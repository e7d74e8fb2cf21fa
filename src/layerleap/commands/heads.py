"""Exit-head subcommands: ``train heads`` (train lens/full heads at some layers, backbone frozen) and
``match-rate`` (PPD Table 2: how often an early top-k holds the final layer's top-1)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..cli import command
from ..errors import LayerleapError
from .basic import _check_writable, _command_line, _load, _model_args, _model_line, _positive_int, _say, _threads


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out:
        raise LayerleapError(f"{what} must be a comma list of integers, e.g. 10,15,20, got {text!r}")
    return out


# -- train heads ------------------------------------------------------------------------------------
@command("train heads", help="train exit heads (tuned lens or full LM head) at some layers, the backbone frozen")
def _setup_train(p):
    from ..train_heads import HeadTrainConfig
    d = HeadTrainConfig()
    _model_args(p)
    p.add_argument("--layers", required=True, help="comma list of layers, e.g. 8,15,23 (1 .. n_layers-1)")
    p.add_argument("--kind", choices=["lens", "full"], default="lens",
                   help="lens: a D x D affine map before the frozen final norm and unembedding (small, default); "
                        "full: a trainable norm and V x D unembedding per layer (PPD's)")
    p.add_argument("--loss", choices=["kl", "ce"], default="kl",
                   help="kl: match the final layer's distribution (default); ce: its argmax")
    p.add_argument("--tokens", type=_positive_int, default=d.tokens, help=f"ShareGPT positions to train on (default {d.tokens})")
    p.add_argument("--epochs", type=_positive_int, default=d.epochs)
    p.add_argument("--batch-tokens", type=_positive_int, default=d.batch_tokens, help="positions per step")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3 lens, 2e-5 full = Appendix A)")
    p.add_argument("--init", choices=["lstsq", "identity"], default=d.init,
                   help="lens start: ridge regression onto the final state (default) or the identity (shared head)")
    p.add_argument("--candidates", type=int, default=d.candidates,
                   help=f"per position, the final layer's top-k ids that join the step's softmax set (default "
                        f"{d.candidates}; 0: full-vocabulary softmax, ~10x slower)")
    p.add_argument("--negatives", type=int, default=d.negatives, help="random ids added to each step's set")
    p.add_argument("--seq-len", type=_positive_int, default=d.seq_len, help="cut conversations after this many tokens")
    p.add_argument("--skip-conversations", type=int, default=0, help="ShareGPT conversations to pass over first")
    p.add_argument("--eval-tokens", type=int, default=4000,
                   help="held-out ShareGPT positions (after the training ones) for the agreement check (0: none)")
    p.add_argument("--out", required=True, help="the heads file (.safetensors) to write")
    p.add_argument("--work", default=None, help="folder for the hidden-state cache and resumable state "
                   "(default OUT.work; rerun the same command to resume)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder after success")
    p.add_argument("--storage", choices=["float32", "bfloat16"], default="float32", help="weights dtype in the file")
    p.add_argument("--save-every", type=_positive_int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the training report (losses, agreement) as JSON")


@_setup_train
def run_train(args) -> int:
    import torch

    from ..bench import write_json_atomic
    from ..train_heads import HeadTrainConfig, agreement, cache_hidden, save_trained, sharegpt_token_seqs, train_heads
    from ..heads import new_head
    out = Path(args.out)
    if out.is_dir():
        raise LayerleapError(f"--out {out} is a folder: give a .safetensors file name")
    _check_writable(str(out))
    _check_writable(args.json)
    cfg = HeadTrainConfig(layers=tuple(_int_list(args.layers, "--layers")), kind=args.kind, loss=args.loss,
                          tokens=args.tokens, epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr,
                          init=args.init, candidates=args.candidates, negatives=args.negatives, seq_len=args.seq_len,
                          skip_conversations=args.skip_conversations, save_every=args.save_every, seed=args.seed)
    threads = _threads(args.threads)
    cmd = _command_line(args)
    print(f"$ {cmd}", flush=True)
    model = _load(args)
    cfg.check(model)
    print(_model_line(model, threads), flush=True)
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    t0 = time.perf_counter()
    res = train_heads(model, cfg, work=work)
    wall = time.perf_counter() - t0
    report = {"command": cmd, "model": model.config.name, "layers": list(cfg.layers), "kind": cfg.kind,
              "tokens": res.tokens, "steps": res.steps, "resumed_from": res.resumed_from,
              "cache_s": round(res.cache_seconds, 1), "train_s": round(res.seconds, 1), "wall_s": round(wall, 1),
              "threads": threads, "losses": res.losses}
    if args.eval_tokens > 0:  # held out: the conversations after those trained on
        _, seen = sharegpt_token_seqs(model.tokenizer, cfg.tokens, cfg.seq_len, cfg.skip_conversations, return_seen=True)
        val = sharegpt_token_seqs(model.tokenizer, args.eval_tokens, cfg.seq_len, seen)
        cv = cache_hidden(model, val, cfg.layers)
        final = cv[model.config.n_layers]
        rows = {}
        for layer in cfg.layers:
            sh = agreement(new_head(model, layer, "shared"), cv[layer], final, (1, 3, 5))
            tr = agreement(res.heads[layer], cv[layer], final, (1, 3, 5))
            rows[layer] = {"shared": sh, "trained": tr}
            print(f"layer {layer:>3}: top-1 agreement with the final layer  shared {sh['top1']:.3f}  trained "
                  f"{tr['top1']:.3f}   top-5 {sh['top5']:.3f} -> {tr['top5']:.3f}   KL {sh['kl']:.2f} -> {tr['kl']:.2f}",
                  flush=True)
        report["held_out"] = {"tokens": len(final), "by_layer": rows}
    meta = {"command": cmd, "wall_s": round(wall, 1), "threads": threads, "torch": torch.__version__}
    if "held_out" in report:
        meta["held_out_top1"] = json.dumps({k: [v["shared"]["top1"], v["trained"]["top1"]]
                                            for k, v in report["held_out"]["by_layer"].items()})
    save_trained(res, out, meta, dtype=getattr(torch, args.storage))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {cfg.kind} heads at layers "
          f"{', '.join(map(str, cfg.layers))}, {res.tokens} tokens x {cfg.epochs} epochs, {res.steps} steps, "
          f"cache {res.cache_seconds:.0f} s + training {res.seconds:.0f} s", flush=True)
    if args.json:
        write_json_atomic(args.json, report)
    if not args.keep_work and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0
