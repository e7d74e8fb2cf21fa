"""A q4 model's one-token call with its block weights on transparent huge pages (as loaded: read
there from the packed cache, ``gguf_q4.load_packed``) against a twin whose weights are copied to
ordinary 4 KB pages, the two taking turns in one process (thread CPU time; each round keeps the best
of 3 calls).

    python benchmarks/q4_huge_pages.py --model qwen2.5-coder-1.5b --threads 1 --context 256 --rounds 40
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch

import layerleap
from layerleap.core.kernels import BlockWeight, StackWeight


def on_small_pages(model) -> None:
    """Every block weight's codes and scales copied to ordinary memory (4 KB pages), in place."""
    seen = set()
    for mod in model.modules():
        fmt = getattr(mod, "packed", None)
        for part in fmt.parts if isinstance(fmt, StackWeight) else [fmt]:
            if isinstance(part, BlockWeight) and id(part) not in seen:
                seen.add(id(part))
                part.codes, part.dm = part.codes.clone(), part.dm.clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    models = {"huge pages": layerleap.load(a.model, dtype="q4")}
    print(f"load: {time.perf_counter() - t0:.1f} s")
    models["4 KB pages"] = layerleap.load(a.model, dtype="q4")
    on_small_pages(models["4 KB pages"])
    print(re.search(r"AnonHugePages:\s+\d+ kB", open("/proc/self/smaps_rollup", encoding="utf-8").read()).group())
    ms: dict[str, list[float]] = {k: [] for k in models}
    tok = torch.tensor([[42]])
    with torch.inference_mode():
        caches = {}
        for name, m in models.items():
            caches[name] = m.new_cache(1, a.context + 8)
            m(torch.randint(0, 1000, (1, a.context)), cache=caches[name])
        for r in range(a.rounds):
            for name in list(models)[:: -1 if r % 2 else 1]:
                best = float("inf")
                for _ in range(3):
                    t = time.thread_time()
                    models[name](tok, cache=caches[name])
                    caches[name].lengths -= 1  # the same context every call
                    best = min(best, time.thread_time() - t)
                ms[name].append(best * 1e3)
    for name, v in ms.items():
        print(f"{name}: min {min(v):.2f} ms, median {statistics.median(v):.2f} ms")


if __name__ == "__main__":
    main()
