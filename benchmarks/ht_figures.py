"""The Hidden Transfer paper's analysis figures on a model's own greedy text (teacher-forced, one pass
per reference, the decoding pass of ``train.medusa_transfer.transfer_outputs``):

- Figure 3: top-1/3/5 accuracy of the token ``N`` ahead (N = 2 is the first draft) for Hidden
  Transfer, Medusa and the paper's early-exit baseline: LM heads on one intermediate layer, head
  ``i`` trained to predict the token ``i + 1`` ahead (lens heads, the recipe of the shipped lens
  heads with the target moved ``i`` positions on: ``train.exit_heads.ahead_cache``);
- Figure 4: cosine similarity of each pseudo state with the real state of the token it stands for,
  after every layer from ``t_i`` to the last (and the same for a copy of the source state);
- Figure 7: accuracy with the earlier pseudo states masked in the attention, against unmasked.

Writes ``ht_figures.json`` and ``fig3_accuracy.png``, ``fig4_cosine.png``, ``fig7_masked.png`` into
``--out``.  On other projections: ``--transfer FILE`` (and ``--out`` elsewhere to keep these);
``--replot`` redraws the PNGs from ``--out``'s JSON.

PYTHONPATH=src python benchmarks/ht_figures.py --threads 1 --prompts 6 --max-new-tokens 96 \\
    --transfer trained --out docs/hidden_transfer
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

import layerleap
from layerleap.commands.hidden_transfer import accuracy_plot, accuracy_table, greedy_sequences
from layerleap.core.kernels import cpu_signature
from layerleap.datasets import spec_bench
from layerleap.drafters import medusa_transfer as drafters
from layerleap.errors import LayerleapError
from layerleap.files import pyplot, save_figure, write_json
from layerleap.train import exit_heads as eh
from layerleap.train import medusa_transfer as mt
from layerleap.train.data import conversation_seqs


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--transfer", default="trained", help="transfer weights file ('trained': shipped)")
    p.add_argument("--medusa", default="trained", help="Medusa heads file ('trained': shipped; 'none': skip)")
    p.add_argument("--categories", default="summarization,math_reasoning")
    p.add_argument("--prompts", type=int, default=6, help="Spec-Bench prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--exit-layers", default=None, help="early-exit layers (default: the transfer layers)")
    p.add_argument(
        "--exit-tokens", type=int, default=30000, help="ShareGPT positions the early exit trains on (0: skip)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/hidden_transfer"))
    p.add_argument("--replot", action="store_true", help="redraw the PNGs from --out's ht_figures.json, run nothing")
    return p.parse_args(argv)


def _int_keys(d):
    """A report read back from JSON: its step, K and layer keys as integers again."""
    if not isinstance(d, dict):
        return d
    return {(int(k) if k.isdigit() else k): _int_keys(v) for k, v in d.items()}


def plots(report: dict, out: Path) -> None:
    cos = report["figure4_cosine"]
    layers = [min(by_layer) for _, by_layer in sorted(cos["pseudo"].items())]  # t_i: each step's first layer
    accuracy_plot(report["figure3_accuracy"], str(out / "fig3_accuracy.png"))
    cosine_plot(cos, layers, out / "fig4_cosine.png")
    masked_plot(report["figure7_masked"], out / "fig7_masked.png")


def early_exit(model, layers: list[int], steps: int, tokens: int) -> tuple[dict, dict]:
    """One lens head per (layer, step ``i``), the target the final state ``i`` positions on; the
    shipped lens heads' recipe (ShareGPT, 512-token conversations, ridge init, 2 epochs of KL).
    -> ({layer: EarlyExit}, training report)."""
    t0 = time.perf_counter()
    seqs = conversation_seqs(model.tokenizer, tokens, 512)
    L = model.config.n_layers
    cache = eh.cache_hidden(model, seqs, layers, progress=False)
    cache[eh.TOP_KEY] = eh.final_top_ids(model, cache[L], eh.HeadTrainConfig().candidates)
    report = {"positions": len(cache[L]), "cache_s": time.perf_counter() - t0, "steps": {}}
    heads: dict[int, list] = {x: [] for x in layers}
    for i in range(1, steps + 1):
        cfg = eh.HeadTrainConfig(layers=tuple(layers), tokens=tokens)
        res = eh.train_heads(model, cfg, cache=eh.ahead_cache(cache, list(map(len, seqs)), i, L), progress=False)
        report["steps"][i] = {"train_s": res.seconds, "train_steps": res.steps, "final_loss": res.losses[-1]}
        for x in layers:
            heads[x].append(res.heads[x])
    return {x: mt.EarlyExit(x, hs) for x, hs in heads.items()}, report


def cosine_plot(cos: dict, layers: list[int], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, by_layer in cos["pseudo"].items():
        xs = sorted(by_layer)
        line = ax.plot(xs, [by_layer[x] for x in xs], marker="o", ms=3, label=f"pseudo state, step {i}")
        copy = cos["copy"][i]
        ax.plot(xs, [copy[x] for x in xs], ls=":", color=line[0].get_color(), label=f"copy of the source, step {i}")
    ax.set_xlabel("layer (state after it)")
    ax.set_ylabel("cosine with the real state")
    ax.set_title(f"pseudo vs real hidden states (transfer at {','.join(map(str, layers))})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def masked_plot(rows: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = sorted(next(iter(rows.values())), key=int)
    width = 0.8 / len(rows)
    for r, (label, acc) in enumerate(rows.items()):
        for k, hatch in ((5, "//"), (1, "")):  # top-5 behind top-1
            xs = [int(s) + 1 + (r - (len(rows) - 1) / 2) * width for s in steps]
            ax.bar(
                xs,
                [acc[s][k] for s in steps],
                width,
                hatch=hatch,
                alpha=1.0 if k == 1 else 0.35,
                color=f"C{r}",
                label=f"{label} top-{k}",
            )
    ax.set_xlabel("N (token ahead; 2 = first draft)")
    ax.set_ylabel("accuracy")
    ax.set_xticks([int(s) + 1 for s in steps])
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse(argv)
    if args.replot:
        path = args.out / "ht_figures.json"
        if not path.is_file():
            raise LayerleapError(f"no {path} to redraw: run without --replot first, or give its folder as --out")
        report = _int_keys(json.loads(path.read_text(encoding="utf-8")))
        plots(report, args.out)
        return 0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = layerleap.load(args.model)
    proj = drafters.get_drafter(model, "transfer", args.transfer)
    prompts = spec_bench(None, args.categories, args.prompts)
    seqs = greedy_sequences(model, prompts, args.max_new_tokens)
    tag = f"transfer@{','.join(map(str, proj.layers))}"
    acc = {tag: mt.draft_accuracy(model, proj, seqs)}
    if args.medusa != "none":
        acc["medusa"] = mt.draft_accuracy(model, drafters.get_drafter(model, "medusa", args.medusa), seqs)
    exit_report = None
    if args.exit_tokens:
        layers = [int(x) for x in args.exit_layers.split(",")] if args.exit_layers else proj.layers
        exits, exit_report = early_exit(model, layers, proj.steps, args.exit_tokens)
        for x, d in exits.items():
            acc[f"early-exit@{x}"] = mt.draft_accuracy(model, d, seqs)
    masked = {f"{tag} unmasked": acc[tag], f"{tag} masked": mt.draft_accuracy(model, proj, seqs, see_earlier=False)}
    cos = mt.pseudo_cosine(model, proj, seqs)
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": f"{cpu_signature()}, {args.threads} thread(s)",
        "model": args.model,
        "transfer": args.transfer,
        "medusa": args.medusa,
        "prompts": len(prompts),
        "categories": args.categories,
        "max_new_tokens": args.max_new_tokens,
        "figure3_accuracy": acc,
        "early_exit_training": exit_report,
        "figure7_masked": masked,
        "figure4_cosine": cos,
        "wall_s": time.perf_counter() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "ht_figures.json", report)
    plots(report, args.out)
    print(accuracy_table(acc))
    print(accuracy_table(masked))
    for key in ("pseudo", "copy"):
        for i, by_layer in cos[key].items():
            print(f"cosine {key} step {i}: " + " ".join(f"{x}:{c:.3f}" for x, c in by_layer.items()))
    print(f"wrote {args.out}/ht_figures.json and 3 PNGs ({report['wall_s']:.0f} s): {report['command']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (LayerleapError, OSError) as e:  # bad input: one line naming the problem, exit code 2
        print(f"ht_figures: {e}", file=sys.stderr)
        sys.exit(2)
