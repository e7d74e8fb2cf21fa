"""An exit head's cost with all 49,152 ids and cut to the shipped draft vocabulary: one row (a
self-spec draft step's head), the shipped lens head at layer 15, medians of interleaved calls.

PYTHONPATH=src python benchmarks/draft_vocab_head.py [LAYER] [REPS]
"""

import sys
import time

import torch

import layerleap
from layerleap.drafters import draft_vocab as dv
from layerleap.drafters.exit_heads import get_head

torch.set_num_threads(1)
layer, reps = (int(sys.argv[1]) if len(sys.argv) > 1 else 15), (int(sys.argv[2]) if len(sys.argv) > 2 else 60)
model = layerleap.load("smollm2-135m")
full = get_head(model, layer, "auto")
cut = dv.with_draft_vocab(full, dv.get_draft_vocab(model, "auto"))
x = torch.randn(1, 1, model.config.hidden_size)
times = {"full": [], f"K={cut.vocab.size}": []}
with torch.inference_mode():
    for _ in range(reps + 5):
        for name, head in zip(times, (full, cut)):
            t = time.perf_counter()
            head(x)[0, -1].argmax()
            times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    ts = sorted(ts[5:])  # after 5 warm-up calls
    print(f"{full.kind} head at layer {layer}, {name}: {1e3 * ts[len(ts) // 2]:.2f} ms (median of {reps})")
