"""What the full exit heads (PPD's "Y": own RMSNorm + V x D unembedding per layer) cost next to the
shipped lens heads on SmolLM2-135M, 1 thread (docs/HEADS.md):

1. one decode step: the layers up to 8 / 15 / 23, and the shared, lens and full heads on one row
   (``match_rate.head_cost``: medians of interleaved reps);
2. training: seconds per step of the shipped recipe (256 positions a step, KL over a sampled candidate
   set, AdamW) for all 8 layers at once, lens and full, on the same short ShareGPT cache, measured in
   one run; the shipped recipe is 236 steps;
3. sizes: parameters and bf16 file bytes.

PYTHONPATH=src python benchmarks/heads_full_cost.py [out.json]
"""

import os
import sys

import torch

import layerleap
from layerleap.train import exit_heads as th
from layerleap.train.data import conversation_seqs
from layerleap.drafters.exit_heads import get_head, new_head
from layerleap.eval.match_rate import head_cost

torch.set_num_threads(1)
LAYERS = (8, 10, 12, 15, 18, 20, 23, 25)
STEPS = 12  # timed training steps per kind
model = layerleap.load("smollm2-135m")
out = {"threads": 1, "torch": torch.__version__, "load_average_start": os.getloadavg()}

# 1. decode-step cost
heads = {
    "shared": new_head(model, 8, "shared"),
    "lens (shipped)": get_head(model, 8, "trained"),
    "full": new_head(model, 8, "full"),
}
cost = head_cost(model, [8, 15, 23], heads, context=128, reps=30)
out["step_cost"] = cost
print("one decode step, KV cache 128, medians of 30 interleaved reps")
for x in (8, 15, 23):
    print(f"layers [0, {x}): {1e3 * cost['layers_s'][x]:.3f} ms")
for name in heads:
    print(
        f"{name:<16} {1e3 * cost['heads_s'][name]:.3f} ms   overhead at 8/15/23: "
        + " / ".join(f"{100 * cost['overhead'][name][x]:.1f}%" for x in (8, 15, 23))
    )

# 2. training seconds per step, same cache for both kinds
seqs = conversation_seqs(model.tokenizer, 4096, 512)
train = {}
for kind in ("lens", "full"):
    cfg = th.HeadTrainConfig(layers=LAYERS, kind=kind, tokens=4096, epochs=1, batch_tokens=256)
    res = th.train_heads(model, cfg, seqs=seqs, progress=False, stop_after=STEPS)
    per_step = res.seconds / STEPS  # the training loop only (the cache is built before it)
    params = sum(p.numel() for h in res.heads.values() for p in h.parameters())
    train[kind] = {
        "seconds_per_step": per_step,
        "steps_timed": STEPS,
        "cache_s": res.cache_seconds,
        "params": params,
        "bf16_bytes": 2 * params,
        "shipped_recipe_steps": 236,
        "shipped_recipe_train_s_estimate": 236 * per_step,
    }
    print(
        f"train {kind} x {len(LAYERS)} layers: {per_step:.3f} s/step ({STEPS} steps), {params / 1e6:.1f} M "
        f"params ({2 * params / 1e6:.0f} MB bf16); 236 steps ~ {236 * per_step:.0f} s"
    )
out["train"] = train
out["train_ratio_full_over_lens"] = train["full"]["seconds_per_step"] / train["lens"]["seconds_per_step"]
out["load_average_end"] = os.getloadavg()
print(f"full / lens seconds per step: {out['train_ratio_full_over_lens']:.1f}x")
if len(sys.argv) > 1:
    from layerleap.files import write_json

    write_json(sys.argv[1], out)
