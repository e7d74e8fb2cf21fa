"""The EAGLE head's draft length and width, interleaved with greedy (and other methods) per prompt:
8 Spec-Bench prompts, 2 from the 11th of each category that has them (writing has 10; none of
the benchmark table's), chat template, 64 new tokens, the shipped head; prints each setting's speed
against greedy, acceptance and tokens per call, and checks every output against greedy's.

  PYTHONPATH=src python benchmarks/eagle_tuning.py HEAD DTYPE DRAFT_LENS [OTHER_METHODS]
  e.g. benchmarks/eagle_tuning.py trained float32 1,2 hidden-transfer,medusa"""

import sys
import time

import layerleap
from layerleap.datasets import spec_bench

head, dtype, dls = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
extra = sys.argv[4].split(",") if len(sys.argv) > 4 else []
m = layerleap.load("smollm2-135m", dtype=dtype)
ps = spec_bench(categories="summarization,qa,translation,math_reasoning,writing", n=2, offset=10)
runs = [("greedy", {})]
runs += [(f"eagle{d}w{w}", dict(eagle_head=head, draft_len=d, width=w)) for d in dls for w in (1, 3, 5)]
runs += [(e, {}) for e in extra]
T = {k: 0.0 for k, _ in runs}
A = {k: [0, 0, 0, 0] for k, _ in runs}  # accepted, drafted, new tokens, model calls
for p in ps:
    ref = None
    for k, o in runs:
        t = time.perf_counter()
        r = layerleap.generate(m, p.text, "eagle" if k.startswith("eagle") else k, 64, chat=True, **o)
        T[k] += time.perf_counter() - t
        ref = ref or r.token_ids
        assert r.token_ids == ref, k
        s = r.stats
        A[k][0] += s.get("accepted") or 0
        A[k][1] += s.get("drafted") or 0
        A[k][2] += s["new_tokens"]
        A[k][3] += s["model_calls"]
print(f"{len(ps)} prompts x 64 tokens, {dtype}, {m.config.name}")
for k, _ in runs:
    a = A[k]
    print(
        f"{k:16} {T['greedy'] / T[k]:.2f}x greedy  acceptance {a[0] / max(1, a[1]):.3f}  tokens/call {a[2] / a[3]:.2f}"
    )
