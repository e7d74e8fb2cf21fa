"""q4 ``eagle`` and ``auto`` (and greedy) with this engine's cheaper EAGLE rounds on and off, interleaved
prompt by prompt in one process: "off" drafts with the torch EAGLE step over the whole shipped draft
vocabulary and computes the logits in Python (``EagleHead.native_step``, ``methods.eagle.DRAFT_VOCAB_SIZE``
and ``Transformer._native_logits`` switched off); "on" is as shipped.  The outputs must agree token for
token (the methods are lossless and the logits bitwise the same); the report gives tokens per second,
tokens per call and milliseconds per call of each, by the wall clock and by this process's CPU time (on a
shared machine at one thread the CPU time is the steadier measure: time spent waiting for a core is not in it).

    python benchmarks/q4_eagle_round_ab.py --threads 2 --prompts 3

Spec-Bench first turns (summarization, qa, translation, math_reasoning, writing; ``--prompts`` each), 64
new tokens, chat template on; the order of "on" and "off" alternates from prompt to prompt."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import layerleap
from layerleap import datasets
from layerleap.core.model import Transformer
from layerleap.drafters.medusa_transfer import EagleHead
from layerleap.methods import eagle as eagle_method

CATEGORIES = "summarization,qa,translation,math_reasoning,writing"


def switch(on: bool, saved: dict) -> None:
    """The cheaper rounds on (as shipped) or off."""
    EagleHead.native_step = saved["native_step"] if on else (lambda self, vocab: None)
    Transformer._native_logits = saved["native_logits"] if on else (lambda self, h: None)
    eagle_method.DRAFT_VOCAB_SIZE = saved["sizes"] if on else {k: None for k in saved["sizes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--methods", default="greedy,eagle,auto")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="on/off pairs per prompt and method")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype="q4")
    methods = args.methods.split(",")
    prompts = [p.text for p in datasets.spec_bench(categories=CATEGORIES, n=args.prompts)]
    saved = {
        "native_step": EagleHead.native_step,
        "native_logits": Transformer._native_logits,
        "sizes": dict(eagle_method.DRAFT_VOCAB_SIZE),
    }
    sums = {(m, v): [0.0, 0, 0, 0.0] for m in methods for v in ("off", "on")}
    ratios: dict[str, list[float]] = {m: [] for m in methods}  # per pair: on's seconds over off's
    for m in methods:  # warm-up: kernels measured, weights loaded, both ways
        for on in (False, True):
            switch(on, saved)
            layerleap.generate(model, prompts[0], method=m, max_new_tokens=16, chat=True)
    for i, p in enumerate(prompts):
        for m, rep in [(m, rep) for rep in range(args.repeats) for m in methods]:
            outs, pair = set(), {}
            for on in (False, True) if (i + rep) % 2 == 0 else (True, False):
                switch(on, saved)
                t, c = time.perf_counter(), time.process_time()
                r = layerleap.generate(model, p, method=m, max_new_tokens=args.max_new_tokens, chat=True)
                s = sums[(m, "on" if on else "off")]
                pair[on] = time.perf_counter() - t
                s[0] += pair[on]
                s[3] += time.process_time() - c
                s[1] += r.stats.new_tokens
                s[2] += r.stats.model_calls
                outs.add(tuple(r.token_ids))
            assert len(outs) == 1, f"{m} on prompt {i}: the output changed with the cheaper rounds"
            ratios[m].append(pair[True] / pair[False])
    switch(True, saved)
    report = {"threads": args.threads, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": []}
    for (m, v), (secs, tokens, calls, cpu) in sums.items():
        greedy = sums.get(("greedy", v))
        row = {
            "method": m,
            "rounds": v,
            "tokens_per_s": tokens / secs,
            "tokens_per_call": tokens / calls,
            "ms_per_call": secs / calls * 1e3,
            "vs_greedy": (tokens / secs) / (greedy[1] / greedy[0]) if greedy else None,
            "cpu_ms_per_call": cpu / calls * 1e3,
            "cpu_ms_per_token": cpu / tokens * 1e3,
            "cpu_vs_greedy": (greedy[3] / greedy[1]) / (cpu / tokens) if greedy else None,
        }
        report["rows"].append(row)
        vs = "" if row["vs_greedy"] is None else f"  {row['vs_greedy']:.3f}x greedy ({v})"
        print(
            f"{m:7s} {v:3s}: {row['tokens_per_s']:6.1f} tok/s  {row['tokens_per_call']:.3f} tokens/call  "
            f"{row['ms_per_call']:.3f} ms/call{vs}  |  CPU {row['cpu_ms_per_call']:.3f} ms/call "
            f"{row['cpu_ms_per_token']:.3f} ms/token"
            + ("" if row["cpu_vs_greedy"] is None else f" {row['cpu_vs_greedy']:.3f}x greedy ({v})")
        )
    for m, r in ratios.items():
        report[f"{m}_median_on_over_off"] = statistics.median(r)
        print(f"{m:7s} median over {len(r)} pairs of on's wall time over off's: {statistics.median(r):.3f}")
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, q4, {args.threads} threads; outputs identical")
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
