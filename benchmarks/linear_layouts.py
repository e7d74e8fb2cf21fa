"""One product of each SmolLM2 shape, row- against column-major weights (fp32) and native bf16
against the fp32 detour, on this CPU, one thread; best of 3 interleaved rounds (docs/BENCHMARKS.md).

    python benchmarks/linear_layouts.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def ms(fn, n: int) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.set_num_threads(1)
    from layerleap.core.model import cpu_has_native_bf16

    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}")
    for rows in (1, 700):
        for name, (o, i) in SHAPES.items():
            x, w = torch.randn(rows, i), torch.randn(o, i)
            wc = w.t().contiguous().t()
            xb, wb = x.bfloat16(), w.bfloat16()
            n = 10 if name == "lm_head" or rows > 1 else 200
            cases = {
                "fp32 row": lambda x=x, w=w: F.linear(x, w),
                "fp32 col": lambda x=x, wc=wc: F.linear(x, wc),
                "bf16": lambda xb=xb, wb=wb: F.linear(xb, wb),
                "bf16 via fp32": lambda xb=xb, wb=wb: F.linear(xb.float(), wb.float()).bfloat16(),
            }
            best = {k: min(ms(f, n) for _ in range(3)) for k, f in cases.items()}
            print(f"rows {rows:4} {name:8} " + "  ".join(f"{k} {v:.3f} ms" for k, v in best.items()))


if __name__ == "__main__":
    main()
