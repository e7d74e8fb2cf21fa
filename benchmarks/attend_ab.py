"""The native attention (``attend_rows``) of two builds of the extension, timed in turn on the same inputs.

Each build is loaded from its ``.so`` (``layerleap native --build --json`` prints a build's library; with
``LAYERLEAP_NATIVE_MARCH=x86-64-v3`` the AVX2 build's).  For every case (dtype, cached keys Tk, heads,
new tokens S: g * S query rows a key/value head, a causal mask over the last S keys) both builds' outputs
are first compared bit for bit, then each is timed in turn within each round, the best round kept.

    python benchmarks/attend_ab.py --a A.so --b B.so --dtypes float32,bfloat16 --tks 256,1024 \\
        --heads 3:3,9:3 --sizes 1,3,8 --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch


def _load(path: str, tag: str):
    spec = importlib.util.spec_from_file_location(f"{tag}.layerleap_decoder", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable library")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the first build's .so")
    ap.add_argument("--b", required=True, help="the second build's .so")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tks", default="256,1024", help="cached keys")
    ap.add_argument("--heads", default="3:3,9:3", help="query heads:key/value heads, comma-separated")
    ap.add_argument("--sizes", default="1,3,8", help="new tokens a call")
    ap.add_argument("--hd", type=int, default=64, help="head dimension")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--budget", type=float, default=0.02, help="seconds a timing, about")
    args = ap.parse_args()
    for p in (args.a, args.b):
        if not Path(p).is_file():
            raise SystemExit(f"{p}: no such library")
    mods = [_load(args.a, "a"), _load(args.b, "b")]
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    cases = []
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        for tk in map(int, args.tks.split(",")):
            for heads in args.heads.split(","):
                h, hkv = map(int, heads.split(":"))
                for s in map(int, args.sizes.split(",")):
                    q = torch.randn(1, h, s, args.hd, generator=g).to(dt)
                    k = torch.randn(1, hkv, tk, args.hd, generator=g).to(dt)
                    v = torch.randn(1, hkv, tk, args.hd, generator=g).to(dt)
                    mask = torch.ones(s, tk, dtype=torch.bool).tril(tk - s).view(1, 1, s, tk) if s > 1 else None
                    cases.append((name, tk, h // hkv * s, s, (q, k, v, mask)))
    print(
        f"attend_rows, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, best of "
        f"{args.rounds} rounds (A and B in turn), hd {args.hd}; A={args.a}, B={args.b}"
    )
    print(f"{'dtype':9s} {'Tk':>5s} {'rows':>4s} {'S':>2s} {'A us':>9s} {'B us':>9s}  A/B")
    for name, tk, rows, s, inputs in cases:
        outs = [m.attend_rows(*inputs) for m in mods]
        if not torch.equal(_bits(outs[0]), _bits(outs[1])):
            raise SystemExit(f"{name} Tk={tk} rows={rows}: the builds' results differ")
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.budget:
            mods[0].attend_rows(*inputs)
            n += 1
        best = [float("inf")] * 2
        for _ in range(args.rounds):
            for i, m in enumerate(mods):
                c0 = clock()
                for _ in range(n):
                    m.attend_rows(*inputs)
                best[i] = min(best[i], (clock() - c0) / n)
        a, b = (x * 1e6 for x in best)
        print(f"{name:9s} {tk:5d} {rows:4d} {s:2d} {a:9.1f} {b:9.1f}  {a / b:.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
