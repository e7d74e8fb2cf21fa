"""How many of the tokens SmolLM2 emits on docs/HEADS.md's greedy prompts lie in a sub-vocabulary
heads file's id set: the ceiling on that head's p̂_correct (a token outside the set is never in its
top-k).  Same prompts and settings as the match-rate runs (first 8 Spec-Bench prompts of each
category, chat template, 48 greedy tokens).

PYTHONPATH=src python benchmarks/sub_vocab_cover.py OUT.json HEADS.safetensors [HEADS.safetensors ...]
"""

import sys

import torch

import layerleap
from layerleap.datasets import spec_bench
from layerleap.decoding import generate
from layerleap.files import write_json
from layerleap.drafters.exit_heads import load_heads

torch.set_num_threads(1)
out, files = sys.argv[1], sys.argv[2:]
model = layerleap.load("smollm2-135m")
sets = {f: set(next(iter(load_heads(model, f).values())).vocab.tolist()) for f in files}
report = {"command": "PYTHONPATH=src python benchmarks/sub_vocab_cover.py " + " ".join(sys.argv[1:]), "by_category": {}}
for cat in ("summarization", "qa", "translation"):
    toks = [
        t for p in spec_bench(categories=[cat], n=8) for t in generate(model, p.text, "greedy", 48, chat=True).token_ids
    ]
    report["by_category"][cat] = {
        "tokens": len(toks),
        "in_set": {f: sum(t in s for t in toks) for f, s in sets.items()},
    }
tot = sum(r["tokens"] for r in report["by_category"].values())
report["all"] = {
    "tokens": tot,
    "cover": {f: sum(r["in_set"][f] for r in report["by_category"].values()) / tot for f in files},
}
for cat, r in report["by_category"].items():
    print(cat, r["tokens"], {f: f"{100 * n / r['tokens']:.1f}%" for f, n in r["in_set"].items()})
print("all", tot, {f: f"{100 * c:.1f}%" for f, c in report["all"]["cover"].items()})
write_json(out, report)
