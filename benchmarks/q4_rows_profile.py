"""Where a q4 call over S new tokens spends its time, part by part, at each S: the whole call, its
layers and its LM head apart, each weight kind's block products over every layer (on the call's
threads through ``at::parallel_for``, and on 1 thread), attention over the cache, and what is left
of the layers (norms, rope, cache writes, adds, the team's hand-offs).

    python benchmarks/q4_rows_profile.py --threads 2 --sizes 1,2,4,8 --context 256

Every part is timed as in a call (the same shapes, S rows of bf16 activations); each figure is the
best of ``--repeats`` rounds, the sizes and parts interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

import layerleap
from layerleap.core import native


CLOCK = time.perf_counter


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the thread's CPU time (1 thread)")
    args = ap.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu times one thread: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    model = layerleap.load(args.model, dtype="q4")
    mod = native.module()
    c, n = model.config, model.config.n_layers
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = defaultdict(list)
    for blk in model.layers:
        for part, lin in (("qkv", blk.attn.qkv), ("o", blk.attn.o)):
            kinds[part].append(lin.packed)
        for part, lin in (("gate_up", blk.mlp.gate_up), ("down", blk.mlp.down)):
            kinds[part].append(lin.packed)
    kinds["head"].append(model.lm_head.packed)
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        cache = model.new_cache(1, args.context + max(sizes))
        model(torch.randint(0, c.vocab_size, (1, args.context), generator=g), cache=cache)
        for s in sizes:
            ids = torch.randint(0, c.vocab_size, (1, s), generator=g)
            pos = (args.context + torch.arange(s)).unsqueeze(0)
            h0 = model.embed(ids)
            hl = model.run_layers(h0, 0, n, pos, cache)
            cache.truncate(args.context)
            parts = {}

            def call(h0=h0, pos=pos):
                model.logits(model.run_layers(h0, 0, n, pos, cache))
                cache.truncate(args.context)

            def layers(h0=h0, pos=pos):
                model.run_layers(h0, 0, n, pos, cache)
                cache.truncate(args.context)

            def layers_noteam(h0=h0, pos=pos):
                was = mod.team_settings(0)
                model.run_layers(h0, 0, n, pos, cache)
                cache.truncate(args.context)
                mod.team_settings(was[0])

            parts["call"] = best_ms(call, args.repeats)
            parts["layers (team)"] = best_ms(layers, args.repeats)
            parts["layers (no team)"] = best_ms(layers_noteam, args.repeats)
            parts["head (norm + logits)"] = best_ms(lambda hl=hl: model.logits(hl), args.repeats)
            for kind, fmts in kinds.items():
                x = torch.randn(s, fmts[0].in_features, generator=g).to(torch.bfloat16)
                parts[f"{kind} x{len(fmts)}"] = best_ms(lambda x=x, fmts=fmts: [f(x) for f in fmts], args.repeats)
                torch.set_num_threads(1)
                parts[f"{kind} x{len(fmts)} 1 thread"] = best_ms(
                    lambda x=x, fmts=fmts: [f(x) for f in fmts], args.repeats
                )
                torch.set_num_threads(args.threads)
            kv = cache.k[0, :1, :, : args.context + s]
            vv = cache.v[0, :1, :, : args.context + s]
            q = torch.randn(1, c.n_heads, s, c.head_dim, generator=g).to(kv.dtype)
            mask = torch.ones(1, 1, s, args.context + s, dtype=torch.bool).tril(args.context)
            parts[f"attention x{n}"] = best_ms(
                lambda q=q, kv=kv, vv=vv, mask=mask: [mod.attend_rows(q, kv, vv, mask) for _ in range(n)], args.repeats
            )
            prods = sum(v for k, v in parts.items() if k.endswith(f"x{n}") and "head" not in k)
            parts["layers - products - attention"] = parts["layers (team)"] - prods
            out[s] = {k: round(v, 3) for k, v in parts.items()}
            print(s, json.dumps(out[s]), flush=True)
    base = out[sizes[0]]
    print(f"{'part':<36}" + "".join(f"{'S=' + str(s):>16}" for s in sizes))
    for k in base:
        print(f"{k:<36}" + "".join(f"{out[s][k]:>8.2f} x{out[s][k] / max(base[k], 1e-9):<6.2f}" for s in sizes))
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, out)


if __name__ == "__main__":
    main()
