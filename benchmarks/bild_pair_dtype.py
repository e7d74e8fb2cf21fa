"""fp32 against bf16 for the Qwen2.5-Coder pair on this CPU (which dtype `sweep bild` should use).

    python benchmarks/bild_pair_dtype.py qwen2.5-coder-0.5b qwen2.5-coder-1.5b

One thread; per model and dtype: load time, then greedy on one short chat prompt, 24 new tokens
after a 4-token warm-up (tokens/s end to end, time to the first token)."""

import gc
import sys
import time

import torch

import layerleap

torch.set_num_threads(1)
PROMPT = (
    "Summarize in one sentence: The city council met on Tuesday to discuss the new budget, which includes "
    "more money for parks and less for roads."
)
for name in sys.argv[1:] or ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
    for dt in ("bfloat16", "float32"):
        t = time.time()
        m = layerleap.load(name, dtype=dt)
        lt = time.time() - t
        layerleap.generate(m, PROMPT, "greedy", 4, chat=True, stop_at_eos=False)
        r = layerleap.generate(m, PROMPT, "greedy", 24, chat=True, stop_at_eos=False)
        print(
            name,
            dt,
            f"load {lt:.1f}s",
            f"{r.stats['tokens_per_s']:.2f} tok/s",
            f"ttft {r.stats['ttft_s']:.2f}s",
            repr(r.text[:60]),
            flush=True,
        )
        del m
        gc.collect()
