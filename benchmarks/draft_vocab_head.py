"""An exit head's cost with all 49,152 ids and cut to the shipped draft vocabulary: one row (a
self-spec draft step's head), the shipped lens head at layer 15, medians of interleaved calls.  The
cut head is timed in the layout this CPU measured fastest (``DraftRows``: 8-bit blocks where
``kernels.draft_head_q8`` says so) and, beside it, with the rows kept dense in fp32.

PYTHONPATH=src python benchmarks/draft_vocab_head.py [LAYER] [REPS] [THREADS]
"""

import sys
import time

import torch

import layerleap
from layerleap.core import kernels
from layerleap.core.cpu import cpu_signature
from layerleap.drafters import draft_vocab as dv
from layerleap.drafters.exit_heads import get_head

layer = int(sys.argv[1]) if len(sys.argv) > 1 else 15
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
model = layerleap.load("smollm2-135m")
full = get_head(model, layer, "auto")
ids = dv.get_draft_vocab(model, "auto").ids
cut = dv.with_draft_vocab(full, dv.DraftVocab(model, ids))
real_q8 = kernels.draft_head_q8
kernels.draft_head_q8 = lambda weight: False
dense = dv.with_draft_vocab(full, dv.DraftVocab(model, ids))
kernels.draft_head_q8 = real_q8
layout = "8-bit blocks" if cut.rows.q8 is not None else "dense"
heads = {"full": full, f"K={len(ids)}, {layout}": cut, f"K={len(ids)}, dense fp32": dense}
x = torch.randn(1, 1, model.config.hidden_size)
times = {name: [] for name in heads}
with torch.inference_mode():
    for _ in range(reps + 5):
        for name, head in heads.items():
            t = time.perf_counter()
            head(x)[0, -1].argmax()
            times[name].append(time.perf_counter() - t)
print(f"{cpu_signature()}, {torch.get_num_threads()} thread(s)")
for name, ts in times.items():
    ts = sorted(ts[5:])  # after 5 warm-up calls
    print(f"{full.kind} head at layer {layer}, {name}: {1e3 * ts[len(ts) // 2]:.2f} ms (median of {reps})")
