"""Greedy decoding with two builds of the native layers in one process, interleaved per prompt and
thread count: ``--old-library`` (a ``layerleap_decoder*.so`` built from another ``decoder.cpp``, e.g.
the one ``layerleap native --status`` names in an older checkout) against this checkout's build.

    python benchmarks/native_decode_ab.py --old-library ~/.cache/layerleap/native/<tag>/layerleap_decoder.so \\
        --dtype q4 --threads 1,2 --categories summarization,qa,translation,math_reasoning,writing --prompts 2

Spec-Bench's first ``--prompts`` prompts of each category through the chat template (as
``llamacpp_vs_layerleap.py``), ``--max-new-tokens`` each; decode tok/s counts the tokens after the
first over the time after it.  Reports per thread count and build the total decode tok/s and the
new build's ratio, and whether the two builds gave the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import torch

import layerleap
from layerleap.core import native
from layerleap.datasets import spec_bench
from layerleap.decoding import chat_token_ids


def load_library(path: str):
    spec = importlib.util.spec_from_file_location("layerleap_decoder", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-library", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--categories", default="summarization,qa,translation,math_reasoning,writing")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    builds = {"old": load_library(args.old_library), "new": native.module()}
    if builds["new"] is None:
        raise SystemExit("this checkout's native layers are not built: run `layerleap native --build`")
    model = layerleap.load(args.model, dtype=args.dtype)
    prompts = spec_bench(categories=args.categories.split(","), n=args.prompts)
    ids = [
        chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
        for p in prompts
    ]
    threads = [int(t) for t in args.threads.split(",")]
    report = {"load_before": os.getloadavg(), "args": vars(args), "records": []}
    for mod in builds.values():  # warm-up
        native.module = lambda mod=mod: mod
        layerleap.generate(model, ids[0], "greedy", 8, stop_at_eos=False)
    for i, (p, x) in enumerate(zip(prompts, ids)):
        for t in threads:
            torch.set_num_threads(t)
            for side, mod in builds.items() if i % 2 == 0 else reversed(builds.items()):
                native.module = lambda mod=mod: mod
                t0 = time.perf_counter()
                res = layerleap.generate(model, x, "greedy", args.max_new_tokens, stop_at_eos=False)
                wall = time.perf_counter() - t0
                rec = {
                    "prompt": p.id,
                    "category": p.category,
                    "prompt_tokens": len(x),
                    "threads": t,
                    "build": side,
                    "tokens": len(res.token_ids),
                    "decode_s": wall - res.stats["ttft_s"],
                    "token_ids": list(res.token_ids),
                }
                report["records"].append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "token_ids"}), flush=True)
    report["load_after"] = os.getloadavg()
    summary = {}
    for t in threads:
        for side in builds:
            recs = [r for r in report["records"] if r["threads"] == t and r["build"] == side]
            summary[f"{t}/{side}"] = sum(r["tokens"] - 1 for r in recs) / sum(r["decode_s"] for r in recs)
        summary[f"{t}/new vs old"] = summary[f"{t}/new"] / summary[f"{t}/old"]
    by = {(r["prompt"], r["threads"], r["build"]): r["token_ids"] for r in report["records"]}
    summary["same tokens"] = all(by[(p, t, "old")] == by[(p, t, "new")] for p, t, _ in by)
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    print("load average before", report["load_before"], "after", report["load_after"])
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
