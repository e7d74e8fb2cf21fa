"""Choose prompt-lookup's draft length and n-gram sizes per weight format, without timing runs.

Greedy acceptance is deterministic: given a prompt and the greedy output, a variant's drafts and
how many of each the model accepts follow from the tokens alone.  ``record`` stores greedy outputs;
``replay`` walks every variant through them and prices each round with a measured call-cost curve
(ms for a call over S new tokens), so the score is accepted tokens per unit of call cost, the
decoding-time speed-up over greedy (prefill excluded).

    python benchmarks/lookup_tuning.py record --dtype q4 --prompts 10 --offset 20 --max-new-tokens 128 \
        --json lookup_outputs.json
    python benchmarks/call_cost_any.py --dtype float32 --threads 2 --sizes 1,2,3,4,5,6,7,8 --json cc.json
    python benchmarks/lookup_tuning.py replay lookup_outputs.json cc.json

``--offset 20`` keeps the tuning prompts apart from the benchmark's (the first of each category).
"""

from __future__ import annotations

import argparse
import collections
import json


def draft(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What ``NgramIndex.draft`` returns: the tokens after the latest earlier occurrence of the longest
    matching suffix (brute force)."""
    end = len(seq)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suf = seq[end - n :]
        for s in range(end - n - 1, -1, -1):
            if seq[s : s + n] == suf:
                return seq[s + n : s + n + k]
    return []


def replay(
    prompt: list[int], out: list[int], cost: dict[int, float], min_n: int, max_n: int, k: int, overhead_ms: float
) -> tuple[float, int]:
    """(ms of decoding after the first token, model calls) for one variant on one output."""
    seq, i, t, calls = list(prompt) + [out[0]], 1, 0.0, 0
    while i < len(out):
        d = draft(seq, min_n, max_n, min(k, len(out) - i - 1))
        a = 0
        while a < len(d) and d[a] == out[i + a]:
            a += 1
        t += cost[1 + len(d)] + (overhead_ms if d else 0.0)
        calls += 1
        seq += out[i : i + a + 1]
        i += a + 1
    return t, calls


def cmd_record(args) -> None:
    import torch
    import layerleap
    from layerleap.datasets import spec_bench

    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    rows = []
    for p in spec_bench(categories=args.categories.split(","), n=args.prompts, offset=args.offset):
        r = layerleap.generate(model, p.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
        rows.append({"id": p.id, "category": p.category, "prompt": r.prompt_ids, "out": r.token_ids})
        print(f"{len(rows)} {p.category} {p.id}", flush=True)
    from layerleap.files import json_text, write_text

    write_text(args.json, json_text(rows))  # atomic: a run stopped while writing keeps the old file


def cmd_replay(args) -> None:
    rows = json.load(open(args.outputs, encoding="utf-8"))
    cc = json.load(open(args.call_cost, encoding="utf-8"))
    points = cc["points"] if "points" in cc else None
    cost = {int(p["new_tokens"]): p["ms"] for p in points} if points else {int(s): v for s, v in cc.items()}
    top = max(cost)
    for s in range(top + 1, 66):  # beyond the measured sizes: the last step's slope
        cost[s] = cost[top] + (cost[top] - cost[top - 1]) * (s - top)
    cats = sorted({r["category"] for r in rows})
    results = []
    for min_n, max_n in ((1, 3), (1, 4), (2, 4), (2, 5), (3, 5)):
        for k in range(1, 11):
            per = collections.defaultdict(lambda: [0.0, 0.0])
            for r in rows:
                t, _ = replay(r["prompt"], r["out"], cost, min_n, max_n, k, args.overhead_ms)
                per[r["category"]][0] += t
                per[r["category"]][1] += (len(r["out"]) - 1) * cost[1]
            overall = sum(v[1] for v in per.values()) / sum(v[0] for v in per.values())
            results.append((overall, {c: per[c][1] / per[c][0] for c in per}, min_n, max_n, k))
    results.sort(key=lambda x: -x[0])
    print(f"{'all':>6} " + " ".join(f"{c[:8]:>8}" for c in cats) + "   min_ngram max_ngram draft_len")
    for overall, sp, min_n, max_n, k in results[: args.top]:
        print(f"{overall:6.3f} " + " ".join(f"{sp[c]:8.3f}" for c in cats) + f"   {min_n:9} {max_n:9} {k:9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="greedy outputs of Spec-Bench prompts (token ids) to a JSON file")
    r.add_argument("--dtype", default="q4")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--categories", default="summarization,math_reasoning,qa,translation,rag")
    r.add_argument("--prompts", type=int, default=10)
    r.add_argument("--offset", type=int, default=20)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--json", required=True)
    p = sub.add_parser("replay", help="rank variants by decoding-time speed-up over greedy")
    p.add_argument("outputs")
    p.add_argument("call_cost", help="call_cost_any.py --json output (or {S: ms})")
    p.add_argument("--overhead-ms", type=float, default=0.3, help="per drafting round, beyond the call")
    p.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    (cmd_record if args.cmd == "record" else cmd_replay)(args)


if __name__ == "__main__":
    main()
