"""Draft lengths and trees priced by the shipped call-cost curve against this machine's measured one.

Measures the model's curve here (what ``layerleap info --call-cost`` saves) into a scratch cache,
then decodes each prompt with every method twice, once per curve (``$LAYERLEAP_CALL_COST=shipped``
switches), interleaved with greedy, and prints the speed-up over greedy per method and curve.
Both settings give greedy's tokens (checked); only the speed differs.

    python benchmarks/curve_ab.py --dtype q4 --threads 1 --prompts 2 --offset 20 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

METHODS = {
    "prompt-lookup": ("prompt-lookup", {}),
    "medusa dynamic": ("medusa", {"tree": "dynamic"}),
    "hidden-transfer dynamic": ("hidden-transfer", {"tree": "dynamic"}),
    "auto": ("auto", {}),
}
CATEGORIES = "summarization,qa,translation,math_reasoning,writing"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2, help="per category")
    ap.add_argument("--offset", type=int, default=20, help="skip this many prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="rounds per prompt; each setting keeps its fastest")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()

    import torch

    import layerleap
    from layerleap.core import cost_curve
    from layerleap.datasets import spec_bench
    from layerleap.drafters.lengths import curve_for
    from layerleap.eval import roofline

    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    scratch = tempfile.mkdtemp(prefix="curve_ab_")
    real_cache = os.environ.get("LAYERLEAP_CACHE")
    cc = roofline.call_cost(model, sizes=cost_curve.SIZES)
    os.environ["LAYERLEAP_CACHE"] = scratch
    os.environ.pop(cost_curve.ENV, None)
    cost_curve.save(model, {p["new_tokens"]: p["ratio"] for p in cc.points}, cc.points[0]["ms"])
    measured = curve_for(model)
    os.environ[cost_curve.ENV] = "shipped"
    shipped = curve_for(model)
    if real_cache is None:
        os.environ.pop("LAYERLEAP_CACHE")
    else:
        os.environ["LAYERLEAP_CACHE"] = real_cache
    print(f"{args.dtype}, {args.threads} threads; c(1..8), c(16):")
    print("  shipped  " + " ".join(f"{shipped(s):.2f}" for s in cost_curve.SIZES))
    print("  measured " + " ".join(f"{measured(s):.2f}" for s in cost_curve.SIZES))

    prompts = spec_bench(None, CATEGORIES, args.prompts, args.offset)
    chosen = [m.strip() for m in args.methods.split(",")]
    wall = {(m, c): 0.0 for m in chosen for c in ("shipped", "measured")}
    greedy_wall = 0.0

    def timed(method: str, opts: dict, curve: str, prompt: str):
        os.environ["LAYERLEAP_CACHE"] = scratch
        if curve == "shipped":
            os.environ[cost_curve.ENV] = "shipped"
        else:
            os.environ.pop(cost_curve.ENV, None)
        t = time.perf_counter()
        out = layerleap.generate(model, prompt, method, args.max_new_tokens, chat=True, **opts)
        return time.perf_counter() - t, out

    for i, p in enumerate(prompts):
        best: dict = {}
        for r in range(args.repeat):
            order = [("greedy", "shipped")] + [(m, c) for m in chosen for c in ("shipped", "measured")]
            if r % 2:
                order.reverse()
            for m, c in order:
                method, opts = ("greedy", {}) if m == "greedy" else METHODS[m]
                s, out = timed(method, opts, c, p.text)
                if (m, c) not in best or s < best[(m, c)][0]:
                    best[(m, c)] = (s, out)
        ref = best[("greedy", "shipped")][1].token_ids
        greedy_wall += best[("greedy", "shipped")][0]
        for key in wall:
            s, out = best[key]
            if out.token_ids != ref:
                raise SystemExit(f"{key} differs from greedy on prompt {i}")
            wall[key] += s
        print(f"prompt {i + 1}/{len(prompts)} ({p.category}) done", flush=True)

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens, fastest of {args.repeat}, speed-up over greedy:")
    print("| method | shipped curve | measured curve |")
    print("|---|---|---|")
    for m in chosen:
        print(f"| {m} | {greedy_wall / wall[(m, 'shipped')]:.3f}x | {greedy_wall / wall[(m, 'measured')]:.3f}x |")


if __name__ == "__main__":
    main()
