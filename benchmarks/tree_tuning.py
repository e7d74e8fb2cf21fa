"""Choose the trees of medusa and hidden-transfer and self-spec's draft length per weight format, from
the measured per-depth acceptance and this machine's measured round costs (as lookup_tuning.py
chose prompt lookup's).

Greedy acceptance is deterministic given the greedy output: a drafter's drafts from position ``p``
depend only on the tokens up to ``p`` (the accepted path is the greedy text), so one teacher-forced
pass over the greedy output gives, for every position, the rank of each of the next tokens among a
drafter's step-``i`` drafts (Hidden Transfer's pseudo states, Medusa's heads) and whether the
early exit's argmax is right (self-spec: a chain of ``k`` drafts keeps ``min(k, run of right
exits)``).  ``replay`` walks a tree or draft length through those ranks (a round keeps the longest
drafted path whose ranks the tree holds, plus the target's token) and prices each round with the
round cost measured for that tree on this machine (``time``: the method itself, decoding time over
rounds, best of ``--repeat``, interleaved with greedy), so the score is the decoding-time speed-up
over greedy: accepted tokens per unit of round cost.

    python benchmarks/tree_tuning.py record --dtype float32 --prompts 4 --offset 20 --json ranks_f32.json
    python benchmarks/tree_tuning.py time --dtype float32 --json cost_f32.json
    python benchmarks/tree_tuning.py replay ranks_f32.json cost_f32.json

``--offset 20`` keeps the tuning prompts apart from the benchmark's (the first of each category).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

CATEGORIES = "summarization,qa,translation,math_reasoning,writing"
K = 8  # ranks beyond the top-8 count as misses
TREES = ["1", "2", "3", "1,1", "2,1", "3,1", "2,2", "4,1", "4,2", "1,1,1", "2,1,1", "3,1,1", "2,2,1", "3,2,1",
         "4,2,1", "1,1,1,1", "2,1,1,1"]
DRAFT_LENS = [1, 2, 3, 4, 5, 6]


# -- record: per-position ranks from one teacher-forced pass --------------------------------------
def _ranks(step_logits, out: list[int], steps: int) -> list[list[int]]:
    """``step_logits`` ``[n, steps, V]`` drafts from each position ``q`` -> per position the rank (-1:
    beyond top-K) of the true token of each step: step ``s`` (1-based) from ``q`` drafts ``out[q + 1 + s]``
    (the target's own token ``out[q + 1]`` is the tree's root)."""
    top = step_logits.topk(K, dim=-1).indices.tolist()  # [n, steps, K]
    rows = []
    for p in range(len(out)):
        row = []
        for i in range(steps):
            t = p + 2 + i
            if t >= len(out):
                break
            row.append(top[p][i].index(out[t]) if out[t] in top[p][i] else -1)
        rows.append(row)
    return rows


def record_one(model, prompt: list[int], out: list[int]) -> dict:
    import torch
    from layerleap.core.run import GenerationConfig, Run
    from layerleap.drafters import medusa_transfer as W
    from layerleap.drafters.exit_heads import get_head
    from layerleap.drafters.trees import transfer_pass
    from layerleap.methods.self_spec import default_exit_layer
    rec = {}
    ids = torch.tensor([out])
    n = len(out)
    with torch.inference_mode():
        # Hidden Transfer: the pseudo states of every position of the greedy text, in one pass
        proj = W.get_drafter(model, "transfer")
        run = Run(model, [prompt], GenerationConfig(max_new_tokens=n + 8))
        cache = run.new_cache(extra=n * (proj.steps + 1))
        run.prefill(cache)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        _, pseudo = transfer_pass(run, cache, ids, mask, torch.arange(n), proj, proj.steps)  # [1, steps, n, D]
        rec["transfer"] = _ranks(model.logits(pseudo[0].transpose(0, 1)), out, proj.steps)
        # Medusa and the early exit: last-layer and layer-E states of the greedy text
        heads = W.get_drafter(model, "medusa")
        E = default_exit_layer(model.config.n_layers)
        head = get_head(model, E, "auto")
        cache = model.new_cache(1, len(prompt) + n + 1)
        model(torch.tensor([prompt]), cache=cache)
        pos = (len(prompt) + torch.arange(n)).unsqueeze(0)
        hE = model.run_layers(model.embed(ids), 0, E, pos, cache)
        hL = model.run_layers(hE, E, model.config.n_layers, pos, cache)
        z = model.final_norm(hL[0])
        rec["medusa"] = _ranks(torch.stack([heads.logits(i, z) for i in range(1, heads.steps + 1)], 1), out,
                               heads.steps)
        exit_tok = head(hE)[0].argmax(-1).tolist()  # the exit's draft of out[p + 1] from position p
        rec["exit_right"] = [int(p + 1 < n and exit_tok[p] == out[p + 1]) for p in range(n)]
        rec["exit_layer"] = E
    return rec


def cmd_record(args) -> None:
    import torch
    import layerleap
    from layerleap.datasets import spec_bench
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    rows = []
    for p in spec_bench(categories=args.categories.split(","), n=args.prompts, offset=args.offset):
        r = layerleap.generate(model, p.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
        rows.append({"id": p.id, "category": p.category, "prompt": r.prompt_ids, "out": r.token_ids,
                     **record_one(model, r.prompt_ids, r.token_ids)})
        print(f"{len(rows)} {p.category} {p.id}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"dtype": args.dtype, "rows": rows}, f)


# -- time: ms per round of each tree and draft length on this machine -----------------------------
def cmd_time(args) -> None:
    import torch
    import layerleap
    from layerleap.datasets import spec_bench
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    prompt = spec_bench(categories=["writing"], n=1, offset=args.offset)[0].text
    variants = [("greedy", {})] + [(m, {"tree": t}) for m in ("hidden-transfer", "medusa") for t in TREES] \
        + [("self-spec", {"draft_len": k}) for k in DRAFT_LENS]
    best: dict[str, float] = {}
    for rep in range(args.repeat):  # round-robin: a burst of other work hits every variant alike
        for m, opt in variants:
            key = f"{m} {json.dumps(opt)}"
            t = time.perf_counter()
            r = layerleap.generate(model, prompt, m, args.max_new_tokens, stop_at_eos=False, chat=True, **opt)
            decode_ms = (r.stats["wall_s"] - r.stats["ttft_s"]) * 1e3
            rounds = r.stats.get("rounds") or (len(r.token_ids) - 1)
            best[key] = min(best.get(key, float("inf")), decode_ms / max(1, rounds))
            print(f"{rep} {key:40} {best[key]:7.2f} ms/round ({time.perf_counter() - t:.1f} s)", flush=True)
    with open(args.json, "w") as f:
        json.dump({"dtype": args.dtype, "threads": args.threads, "ms_per_round": best}, f, indent=1)


# -- replay ---------------------------------------------------------------------------------------
def accepted_tree(ranks: list[int], paths: set[tuple[int, ...]]) -> int:
    """Drafts a tree keeps at one position: the longest prefix of the true tokens' ranks it holds."""
    a = 0
    while a < len(ranks) and ranks[a] >= 0 and tuple(ranks[:a + 1]) in paths:
        a += 1
    return a


def walk(n: int, accepted) -> int:
    """Model calls to emit the ``n - 1`` tokens after the first: a round with root ``out[p]`` keeps
    ``accepted(p)`` drafts and adds the target's token."""
    p, rounds = 0, 0
    while p < n - 1:
        p += min(accepted(p), n - 2 - p) + 1
        rounds += 1
    return rounds


def tree_walk(n: int, ranks: list[list[int]], paths: set) -> int:
    """``walk`` for a tree drafted from the last kept node (``p - 1``); none in the first round."""
    return walk(n, lambda p: 0 if p == 0 else accepted_tree(ranks[p - 1], paths))


def cmd_replay(args) -> None:
    from layerleap.core.tree import parse_tree
    data = json.load(open(args.ranks))
    cost = json.load(open(args.cost))["ms_per_round"]
    g = cost["greedy {}"]
    rows = data["rows"]
    cats = sorted({r["category"] for r in rows})
    table = []
    for m, kind in (("hidden-transfer", "transfer"), ("medusa", "medusa")):
        for t in TREES:
            key = f"{m} {json.dumps({'tree': t})}"
            if key not in cost:
                continue
            paths = set(parse_tree(t))
            per = collections.defaultdict(lambda: [0, 0])
            for r in rows:
                n = len(r["out"])
                per[r["category"]][0] += tree_walk(n, r[kind], paths)
                per[r["category"]][1] += n - 1
            table.append((m, f"tree={t}", per, cost[key]))
    for k in DRAFT_LENS:
        key = f"self-spec {json.dumps({'draft_len': k})}"
        if key not in cost:
            continue
        per = collections.defaultdict(lambda: [0, 0])
        for r in rows:
            n, right = len(r["out"]), r["exit_right"]

            def run_len(p, right=right, k=k):
                a = 0
                while a < k and p + a < len(right) and right[p + a]:
                    a += 1
                return a
            per[r["category"]][0] += walk(n, run_len)
            per[r["category"]][1] += n - 1
        table.append(("self-spec", f"draft_len={k}", per, cost[key]))
    print(f"{data['dtype']}: greedy {g:.2f} ms/token; speed-up = tokens x greedy ms / (rounds x round ms)")
    print(f"{'method':16} {'option':14} {'ms/round':>8} {'tok/call':>8} {'all':>6} "
          + " ".join(f"{c[:8]:>8}" for c in cats))
    for m, opt, per, ms in sorted(table, key=lambda x: (x[0], -_speed(x[2], x[3], g))):
        rounds, toks = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        print(f"{m:16} {opt:14} {ms:8.2f} {toks / rounds:8.2f} {_speed(per, ms, g):6.3f} "
              + " ".join(f"{per[c][1] * g / (per[c][0] * ms):8.3f}" for c in cats))


def _speed(per, ms: float, g: float) -> float:
    rounds, toks = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return toks * g / (rounds * ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="greedy outputs and every position's draft ranks to a JSON file")
    t = sub.add_parser("time", help="ms per round of each tree / draft length (and greedy) on this machine")
    for p in (r, t):
        p.add_argument("--dtype", default="float32")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--offset", type=int, default=20)
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--json", required=True)
    r.add_argument("--categories", default=CATEGORIES)
    r.add_argument("--prompts", type=int, default=4)
    t.add_argument("--repeat", type=int, default=3)
    p = sub.add_parser("replay", help="rank trees and draft lengths by decoding-time speed-up over greedy")
    p.add_argument("ranks")
    p.add_argument("cost")
    args = ap.parse_args()
    {"record": cmd_record, "time": cmd_time, "replay": cmd_replay}[args.cmd](args)


if __name__ == "__main__":
    main()
