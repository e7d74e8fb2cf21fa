"""Greedy decoding on Spec-Bench prompts at several thread counts, interleaved per prompt: decode tok/s
(the tokens after the first over the time after it) per thread count, and the tokens, so that two
builds of the native layers (two checkouts, run one after the other, alternating) can be compared.

    PYTHONPATH=<checkout>/src python benchmarks/decode_threads.py --dtype q4 --threads 1,2 \\
        --categories summarization,qa,translation,math_reasoning,writing --prompts 2 --json out.json

(One process cannot hold two builds: the second library of the same name loads as the first.)
Spec-Bench's first ``--prompts`` prompts of each category through the chat template (as
``llamacpp_vs_layerleap.py``), ``--max-new-tokens`` each.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import layerleap
from layerleap.core import native
from layerleap.datasets import spec_bench
from layerleap.decoding import chat_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--categories", default="summarization,qa,translation,math_reasoning,writing")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if native.module() is None:
        raise SystemExit("this checkout's native layers are not built: run `layerleap native --build`")
    model = layerleap.load(args.model, dtype=args.dtype)
    prompts = spec_bench(categories=args.categories.split(","), n=args.prompts)
    ids = [
        chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
        for p in prompts
    ]
    threads = [int(t) for t in args.threads.split(",")]
    report = {"load_before": os.getloadavg(), "args": vars(args), "library": native.status()["library"], "records": []}
    layerleap.generate(model, ids[0], "greedy", 8, stop_at_eos=False)  # warm-up
    for p, x in zip(prompts, ids):
        for t in threads:
            torch.set_num_threads(t)
            t0 = time.perf_counter()
            res = layerleap.generate(model, x, "greedy", args.max_new_tokens, stop_at_eos=False)
            wall = time.perf_counter() - t0
            rec = {
                "prompt": p.id,
                "category": p.category,
                "prompt_tokens": len(x),
                "threads": t,
                "tokens": len(res.token_ids),
                "decode_s": wall - res.stats["ttft_s"],
                "token_ids": list(res.token_ids),
            }
            report["records"].append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "token_ids"}), flush=True)
    report["load_after"] = os.getloadavg()
    summary = {}
    for t in threads:
        recs = [r for r in report["records"] if r["threads"] == t]
        summary[f"{t} threads decode tok/s"] = sum(r["tokens"] - 1 for r in recs) / sum(r["decode_s"] for r in recs)
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    print("load average before", report["load_before"], "after", report["load_after"])
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
