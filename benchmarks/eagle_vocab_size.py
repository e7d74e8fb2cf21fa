"""Tokens per call of q4 ``eagle`` (or ``auto``) when the EAGLE chains score the shipped draft vocabulary's
first K ids (its most frequent), for several K: the output is q4 greedy whatever K is; only how many
drafts are kept changes (``methods.eagle.DRAFT_VOCAB_SIZE``).

    python benchmarks/eagle_vocab_size.py --sizes 12288,8192,6144,4096
    python benchmarks/eagle_vocab_size.py --method auto --threads 2 --sizes 12288,8192

Spec-Bench's first turns, ``--prompts`` per category after the first 3 (those the methods were tuned on),
64 new tokens each, chat template on."""

from __future__ import annotations

import argparse

import torch

import layerleap
from layerleap import datasets
from layerleap.drafters.draft_vocab import get_draft_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="12288,8192,6144,4096", help="draft-vocabulary sizes, comma-separated")
    ap.add_argument("--method", default="eagle", choices=["eagle", "auto"])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per Spec-Bench category")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype="q4")
    shipped = get_draft_vocab(model, "auto")
    sizes = [int(k) for k in args.sizes.split(",")]
    vocabs = {k: shipped.first(k) for k in sizes}
    prompts = [p.text for p in datasets.spec_bench(n=args.prompts, offset=3)]
    counts = {k: [0, 0] for k in sizes}
    for p in prompts:
        outs = set()
        for k in sizes:
            r = layerleap.generate(
                model, p, method=args.method, max_new_tokens=args.max_new_tokens, chat=True, draft_vocab=vocabs[k]
            )
            counts[k][0] += r.stats.new_tokens
            counts[k][1] += r.stats.model_calls
            outs.add(tuple(r.token_ids))
        assert len(outs) == 1, "the output depends on the draft vocabulary: a lossless method broke"
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, q4 {args.method}, {args.threads} thread(s)")
    for k, (tokens, calls) in counts.items():
        print(f"K={k}: tokens/call {tokens / calls:.4f} ({tokens} tokens, {calls} calls)")


if __name__ == "__main__":
    main()
