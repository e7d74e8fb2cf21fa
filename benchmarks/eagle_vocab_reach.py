"""What the EAGLE head's first draft can reach, per Spec-Bench category: its top-1 accuracy over the
shipped draft vocabulary, over that vocabulary plus the prompt's own ids, and over the full
vocabulary; and how many of the answer's tokens lie outside the draft vocabulary, and of those how
many occur in the prompt (tokens a copy could give, that the draft vocabulary cannot).

Teacher-forced on the model's own greedy answers, as ``benchmarks/eagle_accuracy.py``: at every answer
position the head's first step is fed the model's state and the greedy token after it.

    PYTHONPATH=src python benchmarks/eagle_vocab_reach.py [--prompts 2] [--tokens 64] [--dtype float32]

Spec-Bench first turns from the 11th of each category (the categories that have them), chat template,
fp32 model; ``--dtype q4`` scores the q4 EAGLE chains' draft vocabulary (its first 8,192 ids)."""

from __future__ import annotations

import argparse

import torch

import layerleap
from layerleap.core.cpu import cpu_signature
from layerleap.datasets import spec_bench, spec_bench_categories
from layerleap.drafters import medusa_transfer as weights
from layerleap.drafters.draft_vocab import get_draft_vocab
from layerleap.methods.eagle import DRAFT_VOCAB_SIZE
from layerleap.train.data import chat_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category")
    ap.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "q4"], help="whose draft vocabulary")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = layerleap.load("smollm2-135m", dtype="float32")
    head = weights.get_drafter(model, "eagle", "trained")
    vocab = get_draft_vocab(model, "auto")
    if DRAFT_VOCAB_SIZE.get(args.dtype):
        vocab = vocab.first(DRAFT_VOCAB_SIZE[args.dtype])
    in_vocab = set(vocab.ids.tolist())
    V = model.config.vocab_size
    outside = torch.full((V,), float("-inf"))
    outside[vocab.ids] = 0  # added to logits: -inf outside the draft vocabulary
    rows: dict[str, list[int]] = {}
    with torch.inference_mode():
        for p in spec_bench(categories=spec_bench_categories(), n=args.prompts, offset=10):
            ids = chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
            t = torch.tensor([ids + layerleap.generate(model, ids, "greedy", args.tokens).token_ids])  # [1, N]
            N = t.shape[1]
            h = model.run_layers(model.embed(t), 0, model.config.n_layers, torch.arange(N).unsqueeze(0))
            z = model.final_norm(h)  # [1, N, D]
            first = model.final_norm(head.step(z[:, :-1], t[:, 1:]))  # [1, N - 1, D]: predicts token j + 2
            js = torch.arange(len(ids) - 1, N - 2)
            want = t[0, js + 2]
            logits = model.unembed(first)[0, js]  # [n, V]
            with_prompt = outside.clone()
            with_prompt[torch.tensor(sorted(set(ids)))] = 0
            answer = want.tolist()
            r = rows.setdefault(p.category, [0] * 6)
            r[0] += int(((logits + outside).argmax(-1) == want).sum())
            r[1] += int(((logits + with_prompt).argmax(-1) == want).sum())
            r[2] += int((logits.argmax(-1) == want).sum())
            r[3] += len(answer)
            r[4] += sum(w not in in_vocab for w in answer)
            r[5] += sum(w not in in_vocab and w in set(ids) for w in answer)
    print(f"{cpu_signature()}; EAGLE head shipped; draft vocabulary {vocab.size} ids; {args.tokens} tokens a prompt")
    print(
        "| category | positions | top-1 over the draft vocabulary | with the prompt's ids | over all ids "
        "| answer tokens outside the draft vocabulary | of them in the prompt |"
    )
    print("|---|---|---|---|---|---|---|")
    total = [0] * 6
    for name, r in sorted(rows.items()) + [("all", None)]:
        r = r or total
        if name != "all":
            total = [a + b for a, b in zip(total, r)]
        n = r[3]
        print(f"| {name} | {n} | {r[0] / n:.1%} | {r[1] / n:.1%} | {r[2] / n:.1%} | {r[4] / n:.1%} | {r[5] / n:.1%} |")


if __name__ == "__main__":
    main()
