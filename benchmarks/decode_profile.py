"""Where a decode step's time goes: matrix products, attention, and everything else (per-op
dispatch), for our greedy step on the embedded model.

    python benchmarks/decode_profile.py --dtype float32 --context 256 --steps 20
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import layerleap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load(args.model, dtype=args.dtype)
    cache = model.new_cache(1, args.context + 3 * args.steps + 8)
    tok = torch.tensor([[42]])
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, args.context)), cache=cache)

        def step():
            model(tok, cache=cache)

        for _ in range(5):
            step()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        step_ms = (time.perf_counter() - t) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
    ev = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
    total = sum(ev.values())
    mm = ev.get("aten::mm", 0.0) + ev.get("aten::addmm", 0.0)
    attn = sum(v for k, v in ev.items() if "scaled_dot_product" in k)
    n_ops = sum(e.count for e in prof.key_averages()) / args.steps
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "context": args.context,
        "step_ms": round(step_ms, 2),
        "profiled_ms": round(total, 2),
        "matmul_ms": round(mm, 2),
        "attention_ms": round(attn, 2),
        "other_ms": round(total - mm - attn, 2),
        "aten_ops_per_step": round(n_ops),
        "weight_mb": round(model.weight_bytes() / 2**20, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
