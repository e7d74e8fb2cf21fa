"""How often the model keeps the EAGLE head's first draft when it samples, by how the draft is proposed:
drawn from the head's own distribution (speculative sampling, min(1, p/q)), the head's argmax as a
one-hot proposal, the head's top 3 as one-hot siblings (a fan), or a drawn draft followed by the two
best other tokens as one-hot siblings (what ``eagle`` does in fp32 when sampling).

For each prompt the model samples 64 tokens (chat template, the given temperature, seed 3); at every
generated position the head drafts the next token from the model's own state, teacher-forced as
``benchmarks/eagle_accuracy.py`` does.  The first three rules' acceptance is computed exactly from
the model's distribution p and the head's q (both warped by the temperature, q over the shipped draft
vocabulary): sum(min(p, q)), p(argmax q) and the sum of p over q's top 3.  The last is estimated with
8 draws per position (``verify.accept_sampled``'s rule, seeded).  fp32, 2 threads.

    PYTHONPATH=src python benchmarks/eagle_sampled_acceptance.py [--temperatures 0.7,1.0] [--prompts 2] [--head FILE]

Prompts: Spec-Bench summarization, qa, translation, math_reasoning and writing, ``--prompts`` per
category from the 21st on (none of the benchmark tables' prompts)."""

from __future__ import annotations

import argparse

import torch

import layerleap
from layerleap.core import sampling, verify
from layerleap.datasets import spec_bench
from layerleap.drafters import medusa_transfer as weights
from layerleap.drafters.draft_vocab import get_draft_vocab

CATEGORIES = "summarization,qa,translation,math_reasoning,writing"
DRAWS = 8  # per position, for the drawn draft with one-hot siblings


def drawn_then_fan(p: torch.Tensor, q: torch.Tensor, top: list[int], g: torch.Generator) -> float:
    """The share of ``DRAWS`` rounds in which the model keeps one of: a draft drawn from ``q``, then the
    best two other tokens of ``q`` (``top``), one-hot, tried in that order."""
    kept = 0
    for _ in range(DRAWS):
        x = int(sampling.sample(q, g))
        fan = [t for t in top if t != x][:2]
        tokens = torch.tensor([x, *fan])
        qs = torch.stack([q, *(torch.nn.functional.one_hot(torch.tensor(t), q.shape[0]).to(q.dtype) for t in fan)])
        rows = p.unsqueeze(0).expand(1 + len(tokens), -1)  # the walk reads a row per node it reaches
        path, _ = verify.accept_sampled(tokens, torch.full((len(tokens),), -1), rows, qs, g)
        kept += bool(path)
    return kept / DRAWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category (default 2)")
    ap.add_argument("--head", default="trained", help="the EAGLE head: trained (shipped) or a weights file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = layerleap.load("smollm2-135m")
    head = weights.get_drafter(model, "eagle", args.head)
    vocab = get_draft_vocab(model, "auto")
    prompts = spec_bench(categories=CATEGORIES, n=args.prompts, offset=20)
    print(
        f"{len(prompts)} Spec-Bench prompts x 64 sampled tokens, fp32, EAGLE head {args.head}, shipped draft vocabulary"
    )
    print("| temperature | positions | drawn from q | argmax, one-hot | top 3, one-hot | drawn, then 2 one-hot |")
    print("|---|---|---|---|---|---|")
    for T in (float(t) for t in args.temperatures.split(",")):
        sums, n = [0.0, 0.0, 0.0, 0.0], 0
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for pr in prompts:
                out = layerleap.generate(model, pr.text, "sample", 64, temperature=T, seed=3, chat=True)
                ids = torch.tensor([out.prompt_ids + out.token_ids])  # [1, N]
                N, P = ids.shape[1], len(out.prompt_ids)
                h = model.run_layers(model.embed(ids), 0, model.config.n_layers, torch.arange(N).unsqueeze(0))
                z = model.final_norm(h)  # [1, N, D]
                target = model.unembed(z)[0]  # [N, V]: position i predicts token i + 1
                drafts = vocab.scatter(vocab.logits(model.final_norm(head.step(z[:, :-1], ids[:, 1:]))[0]))
                for i in range(P - 2, N - 2):  # the draft from position i (root ids[i + 1]) predicts token i + 2
                    p = sampling.probs(target[i + 1], T).double()
                    q = sampling.probs(drafts[i], T).double()
                    top = q.topk(3).indices.tolist()
                    sums[0] += float(torch.minimum(p, q).sum())
                    sums[1] += float(p[top[0]])
                    sums[2] += float(p[top].sum())
                    sums[3] += drawn_then_fan(p, q, top, g)
                    n += 1
        cells = " | ".join(f"{s / n:.1%}" for s in sums)
        print(f"| {T} | {n} | {cells} |")


if __name__ == "__main__":
    main()
