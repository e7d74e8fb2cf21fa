"""Drafting methods with logits processors (repetition, presence and frequency penalties), timed against
greedy decoding with the same setting, interleaved per prompt: each method's output is checked equal to
greedy's under the setting (the processors stay lossless), and its time summed over the prompts.

    python benchmarks/penalties_speed.py --threads 1 --prompts 2 --max-new-tokens 64 --methods prompt-lookup,auto
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import layerleap
from layerleap.core.cpu import cpu_signature

SETTINGS = {
    "none": {},
    "repetition_penalty=1.1": {"repetition_penalty": 1.1},
    "presence_penalty=0.5": {"presence_penalty": 0.5},
    "frequency_penalty=0.3": {"frequency_penalty": 0.3},
}
DATA = Path(__file__).resolve().parents[1] / "src" / "layerleap" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=2, help="per category (the 21st on of each)")
    ap.add_argument("--categories", default="summarization,qa,translation,math_reasoning")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="prompt-lookup,auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    questions = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    prompts = []
    for cat in args.categories.split(","):
        prompts += [q["turns"][0] for q in questions if q["category"] == cat][20 : 20 + args.prompts]
    methods = ["greedy", *args.methods.split(",")]
    wall = {(s, m): 0.0 for s in SETTINGS for m in methods}
    calls = {(s, m): 0 for s in SETTINGS for m in methods}
    tokens = {(s, m): 0 for s in SETTINGS for m in methods}
    for i, prompt in enumerate(prompts):
        for s, kw in SETTINGS.items():
            want = None
            for m in methods:
                r = layerleap.generate(model, prompt, m, max_new_tokens=args.max_new_tokens, chat=True, **kw)
                want = r.token_ids if want is None else want
                if r.token_ids != want:
                    raise SystemExit(f"{m} with {s} differs from greedy's output on prompt {i}")
                wall[(s, m)] += r.stats.wall_s
                calls[(s, m)] += r.stats.model_calls
                tokens[(s, m)] += r.stats.new_tokens
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    n = f"{len(prompts)} prompts x {args.max_new_tokens} new tokens"
    print(f"\n{cpu_signature()}; {args.dtype}, {args.threads} thread(s); {n}")
    print("| setting | greedy tok/s | " + " | ".join(f"`{m}` vs greedy (tokens/call)" for m in methods[1:]) + " |")
    print("|---|---|" + "---|" * (len(methods) - 1))
    for s in SETTINGS:
        g = wall[(s, "greedy")]
        cells = [f"{g / wall[(s, m)]:.2f}x ({tokens[(s, m)] / calls[(s, m)]:.2f})" for m in methods[1:]]
        print(f"| {s} | {tokens[(s, 'greedy')] / g:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
