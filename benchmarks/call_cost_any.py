"""The call-cost curve with only the model core's layer API (embed, run_layers, logits, new_cache,
truncate), so that it also runs on an older checkout of layerleap: ``layerleap info --call-cost``'s
measurement, for before/after comparisons on one machine.

    python benchmarks/call_cost_any.py --dtype float32 --threads 2
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/call_cost_any.py --dtype float32 --threads 2

Both interleave: ``--rounds`` rounds, each timing every size once; the best of the rounds is kept.
``--clock cpu`` (one thread only) times the calling thread's CPU time instead of the wall clock, so
that other processes on a shared machine do not count.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import layerleap


def primed_calls(model, sizes: list[int], context: int):
    """``call(s)``: one model call over ``s`` random new tokens after a cached ``context``-token random
    prompt (its logits ``[1, s, V]``), the cache cut back to the prompt after each.  Under
    ``torch.inference_mode()``."""
    n, vocab = model.config.n_layers, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, context + max(sizes))
    prompt = torch.randint(0, vocab, (1, context), generator=g)
    model.logits(model.run_layers(model.embed(prompt), 0, n, torch.arange(context).unsqueeze(0), cache))
    ids = {s: torch.randint(0, vocab, (1, s), generator=g) for s in sizes}
    pos = {s: (context + torch.arange(s)).unsqueeze(0) for s in sizes}

    def call(s: int) -> torch.Tensor:
        y = model.logits(model.run_layers(model.embed(ids[s]), 0, n, pos[s], cache))
        cache.truncate(context)
        return y

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    sizes = [int(s) for s in args.sizes.split(",")]
    times = {s: [] for s in sizes}
    with torch.inference_mode():
        call = primed_calls(model, sizes, args.context)
        for s in sizes:
            call(s)
        for _ in range(args.rounds):
            for s in sizes:
                t = clock()
                call(s)
                times[s].append(clock() - t)
    best = {s: min(v) * 1e3 for s, v in times.items()}
    out = {
        "layerleap": os.path.dirname(layerleap.__file__),
        "dtype": args.dtype,
        "threads": args.threads,
        "context": args.context,
        "rounds": args.rounds,
        "clock": args.clock,
        "cpu": platform.processor() or platform.machine(),
        "load_average": list(os.getloadavg()),
        "points": [
            {"new_tokens": s, "ms": round(best[s], 2), "ratio": round(best[s] / best[sizes[0]], 3)} for s in sizes
        ],
    }
    print(
        f"{out['layerleap']}  {args.dtype}, {args.threads} threads, context {args.context}, best of {args.rounds}, "
        f"{args.clock} clock"
    )
    for p in out["points"]:
        print(f"  S={p['new_tokens']:<3} {p['ms']:8.2f} ms  x{p['ratio']:.2f}")
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, out)


if __name__ == "__main__":
    main()
