"""A multi-turn chat with and without a prompt cache: each turn's prompt is the conversation so far (the chat
template over every earlier question and answer, then the next question), decoded with
``generate(..., prompt_cache=pc)`` and without, interleaved (the order alternating turn by turn), each
``--repeat`` times (repeat ``r`` with a cache of its own, which has seen the earlier turns once); the outputs
are checked equal, and the least time to the first token and of the whole call are printed per turn (the
least of the repeats: on a shared machine the other processes only add time).

    python benchmarks/prompt_cache_speed.py --threads 2 --turns 4 --max-new-tokens 32 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

import layerleap
from layerleap.core.cpu import cpu_signature

DATA = Path(__file__).resolve().parents[1] / "src" / "layerleap" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="greedy")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    questions = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines() if line.strip()]
    questions = [q for q in questions if len(q) < 600][: args.turns]  # turns of a chat, each a question
    caches = [layerleap.PromptCache() for _ in range(args.repeat)]
    layerleap.generate(model, "Hello", args.method, 4)  # warm-up (kernels, allocator), not timed
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"{cpu_signature()}; SmolLM2-135M {args.dtype}, {args.threads} thread(s), {args.method}; {len(questions)} "
          f"turns x {args.max_new_tokens} new tokens, {args.repeat} repeats")  # fmt: skip
    print("| turn | prompt tokens | reused | first token, no cache (ms) | with the cache (ms) | call, no cache (s) "
          "| with the cache (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|", flush=True)
    messages: list[dict] = []
    sums = {"cached": [0.0, 0.0], "plain": [0.0, 0.0]}
    for t, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        best = {"cached": [float("inf"), float("inf")], "plain": [float("inf"), float("inf")]}
        outs = set()
        for r, pc in enumerate(caches):
            for kind in ("cached", "plain") if (t + r) % 2 == 0 else ("plain", "cached"):
                kw = {"prompt_cache": pc} if kind == "cached" else {}
                res = layerleap.generate(model, messages, args.method, args.max_new_tokens, stop_at_eos=False, **kw)
                outs.add(tuple(res.token_ids))
                best[kind] = [min(best[kind][0], res.stats.ttft_s), min(best[kind][1], res.stats.wall_s)]
                if kind == "cached":
                    reused, n, text = res.stats.cached_prompt_tokens, res.stats.prompt_tokens, res.text
        if len(outs) != 1:
            raise SystemExit(f"turn {t + 1}: the output with the prompt cache differs from the output without it")
        for kind in sums:
            sums[kind] = [a + b for a, b in zip(sums[kind], best[kind])]
        (pt, pw), (ct, cw) = best["plain"], best["cached"]
        print(f"| {t + 1} | {n} | {reused} | {pt * 1e3:.0f} | {ct * 1e3:.0f} | {pw:.2f} | {cw:.2f} |", flush=True)
        messages.append({"role": "assistant", "content": text})
    (pt, pw), (ct, cw) = sums["plain"], sums["cached"]
    print(f"| all | | | {pt * 1e3:.0f} | {ct * 1e3:.0f} ({pt / ct:.1f}x) | {pw:.2f} | {cw:.2f} ({pw / cw:.2f}x) |")
    print(f"outputs equal with and without the cache at every turn; the least of {args.repeat} repeats")


if __name__ == "__main__":
    main()
