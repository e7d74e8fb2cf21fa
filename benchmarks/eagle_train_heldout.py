"""The EAGLE head's draft accuracy (steps 1 and 2, top-1 and top-3 over the shipped draft vocabulary,
teacher-forced as `benchmarks/eagle_accuracy.py` does) on answers it was trained on against held-out
greedy answers: how far the head generalises beyond its training text.

    PYTHONPATH=src python benchmarks/eagle_train_heldout.py SELF_DISTILL.jsonl[.gz]

SELF_DISTILL: the `layerleap train data --self-distill` file the head was trained on (every 200th
answer of 32 tokens or more, 20 answers, their first 96 tokens); held out: 10 Spec-Bench prompts (2
per category from the 11th) and their 96 greedy tokens.  fp32, 2 threads."""

import gzip
import json
import sys

import torch

import layerleap
from layerleap.datasets import spec_bench
from layerleap.drafters import medusa_transfer as weights
from layerleap.drafters.draft_vocab import get_draft_vocab
from layerleap.train.data import chat_token_ids

torch.set_num_threads(2)
model = layerleap.load("smollm2-135m")
head = weights.get_drafter(model, "eagle", "trained")
vocab = get_draft_vocab(model, "auto")


def acc(seqs):
    hits = {1: [0, 0], 2: [0, 0]}
    cnt = {1: 0, 2: 0}
    with torch.inference_mode():
        for ids, plen in seqs:
            ids = torch.tensor([ids])
            N = ids.shape[1]
            h = model.run_layers(model.embed(ids), 0, model.config.n_layers, torch.arange(N).unsqueeze(0))
            z = model.final_norm(h)
            for i in (1, 2):
                z = model.final_norm(head.step(z[:, : N - i], ids[:, i:]))
                top = vocab.token(vocab.logits(z[0]).topk(3, dim=-1).indices)
                js = torch.arange(plen - 1, N - i - 1)
                if len(js) == 0:
                    continue
                want = ids[0, js + i + 1].unsqueeze(1)
                hits[i][0] += int((top[js, :1] == want).any(-1).sum())
                hits[i][1] += int((top[js, :3] == want).any(-1).sum())
                cnt[i] += len(js)
    return {i: (round(hits[i][0] / cnt[i], 3), round(hits[i][1] / cnt[i], 3), cnt[i]) for i in hits}


train = []
path = sys.argv[1]
with gzip.open(path, "rt") if path.endswith(".gz") else open(path, encoding="utf-8") as f:
    for k, line in enumerate(f):
        if k % 200 != 0:
            continue
        r = json.loads(line)
        if len(r["completion"]) >= 32:
            train.append((r["prompt"] + r["completion"][:96], len(r["prompt"])))
        if len(train) >= 20:
            break
held = []
for p in spec_bench(categories="summarization,qa,translation,math_reasoning,writing", n=2, offset=10):
    ids = chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
    held.append((ids + list(layerleap.generate(model, ids, "greedy", 96).token_ids), len(ids)))
print("trained on, step: (top-1, top-3, positions)", acc(train))
print("held out (Spec-Bench greedy answers)", acc(held))
