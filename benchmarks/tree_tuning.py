"""Choose the trees of medusa and hidden-transfer and self-spec's draft length per weight format, from
the measured per-depth acceptance and this machine's call-cost curve (as lookup_tuning.py chose
prompt lookup's).

Greedy acceptance is deterministic given the greedy output: a drafter's drafts from position ``q``
depend only on the tokens up to ``q`` (the accepted path is the greedy text), so one teacher-forced
pass over the greedy output gives, for every position, the rank of each of the next tokens among a
drafter's step-``i`` drafts (Hidden Transfer's pseudo states, Medusa's heads) and whether the
early exit's argmax is right (self-spec: a chain of ``k`` drafts keeps ``min(k, run of right
exits)``).  ``replay`` walks each tree or draft length through those ranks (a round keeps the
longest drafted path whose ranks the tree holds, plus the target's token) and prices each round in
one-token calls from the call-cost curve ``C(S)`` (``layerleap info --call-cost --json``) and the
unembedding's share ``u`` of the weights a step reads (decoding is weight-bound):

- medusa, ``n`` nodes, depth ``d``: ``C(n) + d u`` (each head ends in the full unembedding);
- hidden-transfer: layers ``[0, t_1)`` over ``n`` tokens, ``[t_i, t_i+1)`` over ``(i + 1) n`` (the
  pseudo states), each segment its layer share of ``C(S) - u``, then ``u`` for the nodes' logits and
  ``u`` for the kept node's pseudo states (one product over ``d`` rows);
- self-spec, ``k`` drafts at exit layer ``E`` of ``L``: ``k (E/L (1 - u) + u) + C(k + 1)``;

plus ``--overhead-ms`` a round for drafting in Python.  The score is the decoding-time speed-up over
greedy: emitted tokens per unit of call cost.

    python benchmarks/tree_tuning.py record --dtype float32 --prompts 2 --offset 20 --json ranks_f32.json
    layerleap info --dtype float32 --threads 2 --call-cost --json cc_f32.json
    python benchmarks/tree_tuning.py replay ranks_f32.json [more_ranks_f32.json ...] cc_f32.json

``--offset 20`` keeps the tuning prompts apart from the benchmark's (the first of each category).
``record --transfer FILE --medusa FILE`` records other weights files' ranks than the shipped ones.
"""

from __future__ import annotations

import argparse
import collections
import json

CATEGORIES = "summarization,qa,translation,math_reasoning,writing"
K = 8  # ranks beyond the top-8 count as misses
TREES = [
    "1",
    "2",
    "3",
    "1,1",
    "2,1",
    "3,1",
    "2,2",
    "4,1",
    "4,2",
    "1,1,1",
    "2,1,1",
    "3,1,1",
    "2,2,1",
    "3,2,1",
    "4,2,1",
    "1,1,1,1",
    "2,1,1,1",
]
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


def record_one(model, prompt: list[int], out: list[int], transfer="trained", medusa="trained") -> dict:
    """Per-position draft ranks of the projections ``transfer`` and the heads ``medusa`` ("trained": the
    shipped files, else a weights file) and the early exit's hits, over the greedy text ``out``."""
    import torch

    from layerleap.core.run import GenerationConfig, Run
    from layerleap.drafters import medusa_transfer as W
    from layerleap.drafters.exit_heads import get_head
    from layerleap.drafters.trees import pseudo_layout, transfer_pass
    from layerleap.methods.self_spec import default_exit_layer

    rec = {}
    ids = torch.tensor([out])
    n = len(out)
    with torch.inference_mode():
        # Hidden Transfer: the pseudo states of every position of the greedy text, in one pass
        proj = W.get_drafter(model, "transfer", transfer)
        run = Run(model, [prompt], GenerationConfig(max_new_tokens=n + 8))
        cache = run.new_cache(extra=n * (proj.steps + 1))
        run.prefill(cache)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        layout = pseudo_layout(mask, torch.arange(n), proj.steps)
        _, pseudo = transfer_pass(run, cache, ids, layout, proj, proj.steps)  # [1, steps, n, D]
        rec["transfer"] = _ranks(model.logits(pseudo[0].transpose(0, 1)), out, proj.steps)
        # Medusa and the early exit: last-layer and layer-E states of the greedy text
        heads = W.get_drafter(model, "medusa", medusa)
        E = default_exit_layer(model.config.n_layers)
        head = get_head(model, E, "auto")
        cache = model.new_cache(1, len(prompt) + n + 1)
        model(torch.tensor([prompt]), cache=cache)
        pos = (len(prompt) + torch.arange(n)).unsqueeze(0)
        hE = model.run_layers(model.embed(ids), 0, E, pos, cache)
        hL = model.run_layers(hE, E, model.config.n_layers, pos, cache)
        z = model.final_norm(hL[0])
        rec["medusa"] = _ranks(
            torch.stack([heads.logits(i, z) for i in range(1, heads.steps + 1)], 1), out, heads.steps
        )
        exit_tok = head(hE)[0].argmax(-1).tolist()  # the exit's draft of out[p + 1] from position p
        rec["exit_right"] = [int(p + 1 < n and exit_tok[p] == out[p + 1]) for p in range(n)]
        rec["exit_layer"] = E
        rec["transfer_layers"] = proj.layers
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
        rows.append(
            {
                "id": p.id,
                "category": p.category,
                "prompt": r.prompt_ids,
                "out": r.token_ids,
                **record_one(model, r.prompt_ids, r.token_ids, args.transfer, args.medusa),
            }
        )
        print(f"{len(rows)} {p.category} {p.id}", flush=True)
    from layerleap.eval.roofline import weight_bytes_per_token

    lm = model.lm_head
    head_bytes = lm.packed.nbytes if lm.packed is not None else lm.weight.numel() * lm.weight.element_size()
    from layerleap.files import json_text, write_text

    report = {
        "dtype": args.dtype,
        "n_layers": model.config.n_layers,
        "unembed_share": head_bytes / weight_bytes_per_token(model),
        "weights": {"transfer": args.transfer, "medusa": args.medusa},
        "rows": rows,
    }
    write_text(args.json, json_text(report))  # atomic: a run stopped while writing keeps the old file


# -- replay ---------------------------------------------------------------------------------------
def accepted_tree(ranks: list[int], paths: set[tuple[int, ...]]) -> int:
    """Drafts a tree keeps at one position: the longest prefix of the true tokens' ranks it holds."""
    a = 0
    while a < len(ranks) and ranks[a] >= 0 and tuple(ranks[: a + 1]) in paths:
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


def _json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def curve(path: str) -> dict[int, float]:
    """``C(S)``: the call-cost ratios of a ``layerleap info --call-cost --json`` report (or of
    ``call_cost_any.py``'s), extended linearly beyond its sizes and interpolated between them."""
    d = _json(path)
    d = d.get("call_cost", d)
    pts = {int(p["new_tokens"]): p["ms"] for p in d["points"]}
    xs = sorted(pts)
    out = {}
    for S in range(1, 129):
        lo = max([x for x in xs if x <= S], default=xs[0])
        hi = min([x for x in xs if x >= S], default=None)
        if hi is None:  # beyond: the last segment's slope
            a, b = xs[-2], xs[-1]
            ms = pts[b] + (pts[b] - pts[a]) / (b - a) * (S - b)
        else:
            ms = pts[lo] if hi == lo else pts[lo] + (pts[hi] - pts[lo]) * (S - lo) / (hi - lo)
        out[S] = ms / pts[1]
    return out


def round_cost(
    method: str, option, C: dict[int, float], u: float, L: int, layers: list[int], E: int, ud: float | None = None
) -> float:
    """One round in one-token calls (the module docstring's model); ``ud``: a draft row's unembedding
    (the draft vocabulary's), ``u`` where not given."""
    from layerleap.core.tree import build

    ud = u if ud is None else ud
    if method == "self-spec":
        return option * (E / L * (1 - u) + ud) + C[option + 1]
    buf = build(option)
    n, d = buf.n, buf.depth
    if method == "medusa":
        return C[n] + d * ud
    bounds = [0] + layers[:d] + [L]
    body = sum((bounds[i + 1] - bounds[i]) / L * (C[(i + 1) * n] - u) for i in range(d + 1))
    return body + u + ud


def cmd_replay(args) -> None:
    from layerleap.core.tree import parse_tree

    files = [_json(path) for path in args.ranks]
    data = next(f for f in files if "unembed_share" in f)  # the model's facts (one dtype)
    rows = [r for f in files for r in f["rows"]]
    C = curve(args.call_cost)
    cc = _json(args.call_cost)
    g_ms = cc.get("call_cost", cc)["points"][0]["ms"]
    over = args.overhead_ms / g_ms
    u, L = data["unembed_share"], data["n_layers"]
    ud = None if args.draft_ms is None else args.draft_ms / g_ms
    layers, E = next(r["transfer_layers"] for r in data["rows"]), rows[0]["exit_layer"]
    cats = sorted({r["category"] for r in rows})
    table = []
    for m, kind in (("hidden-transfer", "transfer"), ("medusa", "medusa")):
        steps = len(rows[0][kind][0])
        for t in TREES:
            if len(t.split(",")) > steps:
                continue
            paths = set(parse_tree(t))
            per = collections.defaultdict(lambda: [0, 0])
            for r in rows:
                n = len(r["out"])
                per[r["category"]][0] += tree_walk(n, r[kind], paths)
                per[r["category"]][1] += n - 1
            table.append((m, f"tree={t}", per, round_cost(m, t, C, u, L, layers, E, ud) + over))
    for k in DRAFT_LENS:
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
        table.append(("self-spec", f"draft_len={k}", per, round_cost("self-spec", k, C, u, L, layers, E, ud) + over))
    print(
        f"{data['dtype']}: {len(rows)} prompts, unembedding {u:.0%} of a step's weights, one-token call "
        f"{g_ms:.2f} ms; speed-up = tokens / (rounds x round cost in one-token calls)"
    )
    print(
        f"{'method':16} {'option':14} {'cost':>6} {'tok/call':>8} {'all':>6} " + " ".join(f"{c[:8]:>8}" for c in cats)
    )
    for m, opt, per, cost in sorted(table, key=lambda x: (x[0], -_speed(x[2], x[3]))):
        rounds, toks = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        print(
            f"{m:16} {opt:14} {cost:6.2f} {toks / rounds:8.2f} {_speed(per, cost):6.3f} "
            + " ".join(f"{per[c][1] / (per[c][0] * cost):8.3f}" for c in cats)
        )


def _speed(per, cost: float) -> float:
    rounds, toks = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return toks / (rounds * cost)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="greedy outputs and every position's draft ranks to a JSON file")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--offset", type=int, default=20)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--json", required=True)
    r.add_argument("--categories", default=CATEGORIES)
    r.add_argument("--prompts", type=int, default=2)
    r.add_argument("--transfer", default="trained", help="projections: trained (shipped) or a weights file")
    r.add_argument("--medusa", default="trained", help="Medusa heads: trained (shipped) or a weights file")
    p = sub.add_parser("replay", help="rank trees and draft lengths by decoding-time speed-up over greedy")
    p.add_argument("ranks", nargs="+", help="record's JSON files (one dtype)")
    p.add_argument("call_cost", help="layerleap info --call-cost --json output (or call_cost_any.py's)")
    p.add_argument("--overhead-ms", type=float, default=0.5, help="per drafting round, beyond the call")
    p.add_argument(
        "--draft-ms",
        type=float,
        default=None,
        help="one draft row's unembedding in ms (the draft vocabulary's: benchmarks/draft_vocab_head.py); "
        "default: the full unembedding's share of a step",
    )
    args = ap.parse_args()
    {"record": cmd_record, "replay": cmd_replay}[args.cmd](args)


if __name__ == "__main__":
    main()
