"""A 700-token prefill (all layers, logits of the last position) on our model and on `transformers`
with the same weights, one thread, best of 3 (docs/BENCHMARKS.md).

    python benchmarks/prefill_vs_hf.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

import layerleap
from layerleap.core.loading import to_hf


def best_ms(fn, n: int = 3) -> float:
    fn()
    out = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=700)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    hf = to_hf(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.tokens).unsqueeze(0)

    def ours():
        cache = model.new_cache(1, args.tokens + 8)
        return model.logits(model.run_layers(model.embed(ids), 0, model.config.n_layers, pos, cache)[:, -1:])

    with torch.inference_mode():
        print(
            f"{args.dtype}, {args.tokens} tokens: ours {best_ms(ours):.0f} ms, "
            f"transformers {best_ms(lambda: hf(ids, logits_to_keep=1).logits):.0f} ms"
        )


if __name__ == "__main__":
    main()
