"""What a call costs at long contexts: one-token steps at 1 and 2 threads, and calls over a chain of 4
and a 4-node tree against one token, at several cache lengths, with the attention part timed alone.

    python benchmarks/longctx_profile.py --dtypes q4,float32 --contexts 64,512,1024,2048 --rounds 7

The cache is filled once with ``max(--contexts)`` random tokens and cut back to each context before
its calls, so every context attends to real keys.  Each round times every (context, call, threads)
variant in turn, ``--calls`` calls each; the report gives medians over rounds, in ms per call:
``step`` the whole model call (embed, layers, logits), ``attn`` the layers' attention alone (the
call ``model.attend`` makes, on the cache's keys, once per layer), ``mask`` building the call's mask
(``KVCache.attention_mask``), ``rest`` = step - attn - mask (products, norms, rope, cache writes,
Python).  ``ratio`` is a call's step time over the one-token step at the same context and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import layerleap
from layerleap.core import model as model_mod
from layerleap.core import tree


def calls() -> dict:
    """``{name: (ids [1, S], depths [S], mask [S, S] | None)}``: one token, a chain of 4, a 4-node tree."""
    four = tree.build("0;1;0.0")  # root, two children, one grandchild
    return {
        "one": (torch.tensor([[42]]), torch.zeros(1, dtype=torch.long), None),
        "chain4": (torch.tensor([[42, 43, 44, 45]]), torch.arange(4), None),
        "tree4": (torch.tensor([[42, 43, 44, 45]]), four.depths, four.mask),
    }


def timed(fn, n: int) -> float:
    """ms per call of ``fn`` over ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def attention_only(model, cache, ctx: int, ids, mask) -> float:
    """One call's attention over every layer, as ``model.attend`` runs it (random queries)."""
    c = model.config
    S = ids.shape[1]
    m, total = cache.attention_mask(0, S, mask)
    keys = model_mod.Keys([ctx], total, m, c.n_heads // c.n_kv_heads, mask is None)
    q = torch.randn(1, c.n_heads, S, c.head_dim, dtype=cache.k.dtype)
    ks = [cache.k[layer, :, :, :total] for layer in range(c.n_layers)]
    vs = [cache.v[layer, :, :, :total] for layer in range(c.n_layers)]

    def run():
        for k, v in zip(ks, vs):
            model_mod.attend(q, k, v, keys)

    return run


def step_call(model, cache, ctx: int, call):
    """One model call over ``call`` = (ids, depths, mask) after ``ctx`` cached tokens."""
    ids, depths, mask = call
    pos = (ctx + depths).unsqueeze(0)
    n = model.config.n_layers

    def run():
        cache.lengths[:] = ctx  # back to the context (the filled slots stay as the prompt wrote them)
        model.logits(model.run_layers(model.embed(ids), 0, n, pos, cache, mask))

    return run


def mask_call(cache, call):
    """Building the mask of ``call``."""
    ids, _, mask = call
    return lambda: cache.attention_mask(0, ids.shape[1], mask)


def profile(model, contexts: list[int], threads: list[int], rounds: int, n_calls: int) -> dict:
    """``{(context, call, threads): {"step"|"attn"|"mask": [ms per round]}}``."""
    kinds = calls()
    cache = model.new_cache(1, max(contexts) + 8)
    torch.set_num_threads(max(threads))
    g = torch.Generator().manual_seed(0)
    n = model.config.n_layers
    prompt = torch.randint(0, model.config.vocab_size, (1, max(contexts)), generator=g)
    model.run_layers(model.embed(prompt), 0, n, torch.arange(max(contexts)).unsqueeze(0), cache)
    variants = [(ctx, kind, t) for ctx in contexts for kind in kinds for t in threads]
    variants = [v for v in variants if v[1] == "one" or v[2] == threads[0]]
    samples = {v: {"step": [], "attn": [], "mask": []} for v in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for v in variants:
            ctx, kind, t = v
            torch.set_num_threads(t)
            ids, _, mask = kinds[kind]
            cache.lengths[:] = ctx
            step = timed(step_call(model, cache, ctx, kinds[kind]), n_calls)
            attn = timed(attention_only(model, cache, ctx, ids, mask), n_calls)
            mk = timed(mask_call(cache, kinds[kind]), n_calls)
            if r:
                for key, val in (("step", step), ("attn", attn), ("mask", mk)):
                    samples[v][key].append(val)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="q4,float32")
    ap.add_argument("--contexts", default="64,512,1024,2048")
    ap.add_argument("--threads", default="1,2", help="thread counts for one-token steps (calls of 4: the first)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=8, help="calls per variant per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    report = {"load_before": os.getloadavg(), "args": vars(args), "rows": []}
    for dtype in args.dtypes.split(","):
        model = layerleap.load(args.model, dtype=dtype)
        with torch.inference_mode():
            samples = profile(model, contexts, threads, args.rounds, args.calls)
        for (ctx, kind, t), s in samples.items():
            med = {k: statistics.median(x) for k, x in s.items()}
            one = statistics.median(samples[(ctx, "one", t)]["step"])
            report["rows"].append(
                {
                    "dtype": dtype,
                    "context": ctx,
                    "call": kind,
                    "threads": t,
                    **{f"{k}_ms": round(x, 3) for k, x in med.items()},
                    "rest_ms": round(med["step"] - med["attn"] - med["mask"], 3),
                    "ratio": round(med["step"] / one, 3),
                }
            )
            print(json.dumps(report["rows"][-1]), flush=True)
    report["load_after"] = os.getloadavg()
    print("load average before", report["load_before"], "after", report["load_after"])
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
