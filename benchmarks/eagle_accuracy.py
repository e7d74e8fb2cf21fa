"""The EAGLE head's draft accuracy by step on the model's own greedy text (as `layerleap eval drafters`
measures Hidden Transfer's and Medusa's, the Hidden Transfer paper's Figure 3): at every answer
position ``j``, step ``i`` is fed the greedy tokens up to ``x_{j+i}`` and the head's own state of the
step before, as a round's chain is when its earlier drafts were right; its top-1 and top-3 over the
shipped draft vocabulary are checked against greedy's token ``x_{j+i+1}``.

  PYTHONPATH=src python benchmarks/eagle_accuracy.py [PROMPTS_PER_CATEGORY] [STEPS] [HEAD_FILE]

Spec-Bench prompts from the 11th of each category that has them (none of the benchmark table's), chat template,
64 greedy tokens each, fp32."""

import sys

import torch

import layerleap
from layerleap.datasets import spec_bench
from layerleap.drafters import medusa_transfer as weights
from layerleap.drafters.draft_vocab import get_draft_vocab
from layerleap.train.data import chat_token_ids

n, steps = (int(sys.argv[1]) if len(sys.argv) > 1 else 2), (int(sys.argv[2]) if len(sys.argv) > 2 else 4)
model = layerleap.load("smollm2-135m")
head = weights.get_drafter(model, "eagle", sys.argv[3] if len(sys.argv) > 3 else "trained")
vocab = get_draft_vocab(model, "auto")
prompts = spec_bench(categories="summarization,qa,translation,math_reasoning,writing", n=n, offset=10)
hits = {i: {1: 0, 3: 0} for i in range(1, steps + 1)}
count = dict.fromkeys(hits, 0)
with torch.inference_mode():
    for p in prompts:
        ids = chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
        plen = len(ids)
        ids = torch.tensor([ids + layerleap.generate(model, ids, "greedy", 64).token_ids])
        N = ids.shape[1]
        h = model.run_layers(model.embed(ids), 0, model.config.n_layers, torch.arange(N).unsqueeze(0))
        z = model.final_norm(h)  # [1, N, D]
        for i in hits:
            z = model.final_norm(head.step(z[:, : N - i], ids[:, i:]))  # state of position j + i
            top = vocab.token(vocab.logits(z[0]).topk(3, dim=-1).indices)  # [N - i, 3]
            js = torch.arange(plen - 1, N - i - 1)
            want = ids[0, js + i + 1].unsqueeze(1)
            for k in (1, 3):
                hits[i][k] += int((top[js, :k] == want).any(-1).sum())
            count[i] += len(js)
which = sys.argv[3] if len(sys.argv) > 3 else "shipped"
print(f"{len(prompts)} prompts, fp32, EAGLE head {which}, shipped draft vocabulary")
print("| step | top-1 | top-3 | positions |")
print("|---|---|---|---|")
for i in hits:
    print(f"| {i} | {hits[i][1] / count[i]:.1%} | {hits[i][3] / count[i]:.1%} | {count[i]} |")
