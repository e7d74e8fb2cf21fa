"""Two builds of the native layers timed against each other in one process: model calls of S new tokens
after a cached prompt (as ``call_cost_any.py``) and the attention alone (``attend_rows`` over the cache's
keys, one layer's shapes), the builds in turn within every round, the best of the rounds kept.  Each
build's outputs are compared first (the same bits, or the difference is printed).

    python benchmarks/native_ab.py --a OLD/layerleap_decoder.so --b NEW/layerleap_decoder.so \\
        --dtype q4 --threads 1 --clock cpu --sizes 1,4,8

A build's library is the ``.so`` in its folder (``layerleap native --build`` prints it; its
``LAYERLEAP_NATIVE_MARCH`` target is the library's own, whatever the environment says).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import torch

from call_cost_any import primed_calls

import layerleap
from layerleap.core import native


def load_library(path: str, tag: str):
    """The extension module in the file ``path`` as a module of its own, named ``<tag>.layerleap_decoder``
    (pybind11 hands out one module object per name)."""
    lib = Path(path)
    if not lib.is_file():
        raise SystemExit(f"no such library: {lib}")
    spec = importlib.util.spec_from_file_location(f"{tag}.layerleap_decoder", lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attention_inputs(model, S: int, context: int, g: torch.Generator):
    """Random q, k, v (the cache's dtype) and causal mask (none for one token) of one layer's attention
    for S new tokens after ``context`` cached keys."""
    c = model.config
    dt = model.new_cache(1, 1).k.dtype
    T = context + S
    q = torch.randn(1, c.n_heads, S, c.head_dim, generator=g).to(dt)
    k, v = (torch.randn(1, c.n_kv_heads, T, c.head_dim, generator=g).to(dt) for _ in range(2))
    mask = torch.ones(S, T, dtype=torch.bool).tril(context).view(1, 1, S, T) if S > 1 else None
    return q, k, v, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the first build's layerleap_decoder*.so")
    ap.add_argument("--b", required=True, help="the second build's layerleap_decoder*.so")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--attention-reps", type=int, default=200, help="attend_rows calls per timing (0: none)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    builds = {"A": load_library(args.a, "build_a"), "B": load_library(args.b, "build_b")}
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    sizes = [int(s) for s in args.sizes.split(",")]
    g = torch.Generator().manual_seed(1)
    att = {s: attention_inputs(model, s, args.context, g) for s in sizes}
    times = {(k, what, s): [] for k in builds for what in ("call", "attend") for s in sizes}
    original = native.module
    try:
        with torch.inference_mode():
            call = primed_calls(model, sizes, args.context)
            for s in sizes:
                outs, atts = [], []
                for mod in builds.values():
                    native.module = lambda mod=mod: mod
                    outs.append(call(s))
                    atts.append(mod.attend_rows(*att[s]))
                for name, (x, y) in (("call", outs), ("attend", atts)):
                    if not torch.equal(x, y):
                        print(f"  S={s} {name}: A and B differ, max |A - B| {(x - y).abs().max().item():.3g}")
            for _ in range(args.rounds):
                for s in sizes:
                    for key, mod in builds.items():
                        native.module = lambda mod=mod: mod
                        t = clock()
                        call(s)
                        times[key, "call", s].append(clock() - t)
                        if args.attention_reps:
                            t = clock()
                            for _ in range(args.attention_reps):
                                mod.attend_rows(*att[s])
                            times[key, "attend", s].append((clock() - t) / args.attention_reps)
    finally:
        native.module = original
    print(
        f"A {args.a}\nB {args.b}\n{args.dtype}, {args.threads} threads, context {args.context}, best of "
        f"{args.rounds} rounds, {args.clock} clock, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for s in sizes:
        a, b = (min(times[k, "call", s]) * 1e3 for k in builds)
        line = f"  S={s:<3} call A {a:7.3f} ms  B {b:7.3f} ms  (B/A {b / a:.3f})"
        if args.attention_reps:
            a, b = (min(times[k, "attend", s]) * 1e6 for k in builds)
            line += f"   attend_rows A {a:7.1f} us  B {b:7.1f} us  (B/A {b / a:.3f})"
        print(line)


if __name__ == "__main__":
    main()
