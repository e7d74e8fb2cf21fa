"""Markdown tables for docs/HEADS.md from the JSON files `layerleap match-rate --json` wrote
(docs/heads/match_rate_greedy.json, match_rate_sampling.json).  Formatting only: every figure is
hits / tokens from the JSON.

PYTHONPATH=src python benchmarks/heads_tables.py docs/heads/match_rate_greedy.json [--position-layers 15,23]
PYTHONPATH=src python benchmarks/heads_tables.py docs/heads/match_rate_sampling.json \
    --sampling docs/heads/match_rate_greedy.json
"""

import argparse
import json


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}"


def table2(report):
    """One row per (category, k, head), one column per layer; then all categories pooled."""
    res = report["results"]
    first = next(iter(res.values()))
    layers = first["config"]["layers"]
    ks = first["config"]["ks"]
    heads = list(first["rates"])
    lines = [
        "| category (tokens) | k | head | " + " | ".join(f"L{x}" for x in layers) + " |",
        "|---|---|---|" + "---|" * len(layers),
    ]
    pooled = {h: {x: {k: 0 for k in ks} for x in layers} for h in heads}
    total = 0
    for name, r in res.items():
        total += r["tokens"]
        for k in ks:
            for h in heads:
                cells = []
                for x in layers:
                    pooled[h][x][k] += r["hits"][h][str(x)][str(k)]
                    cells.append(pct(r["rates"][h][str(x)][str(k)]))
                lines.append(f"| {name} ({r['tokens']}) | {k} | {h} | " + " | ".join(cells) + " |")
    for k in ks:
        for h in heads:
            lines.append(
                f"| **all** ({total}) | {k} | {h} | "
                + " | ".join(f"**{pct(pooled[h][x][k] / total)}**" for x in layers)
                + " |"
            )
    return "\n".join(lines)


def positions(report, layer):
    """Tables 6-8's layout at one layer: one row per (category, k, head), one column per position group."""
    res = report["results"]
    lines = []
    for name, r in res.items():
        edges, G = r["bucket_edges"], r["config"]["max_new_tokens"]
        spans = [f"{a + 1}–{(edges[j + 1] if j + 1 < len(edges) else G)}" for j, a in enumerate(edges)]
        if not lines:
            lines = [
                "| category | k | head | " + " | ".join(spans) + " | total |",
                "|---|---|---|" + "---|" * (len(spans) + 1),
            ]
        tokens = " | ".join(map(str, r["bucket_tokens"]))
        lines.append(f"| {name}: tokens per group | | | {tokens} | {r['tokens']} |")
        for k in r["config"]["ks"]:
            for h in r["rates"]:
                cells = [pct(v) for v in r["by_position"][h][str(layer)][str(k)]]
                total = pct(r["rates"][h][str(layer)][str(k)])
                lines.append(f"| {name} | {k} | {h} | " + " | ".join(cells) + f" | {total} |")
    return "\n".join(lines)


def sampling(report, greedy, k=3):
    """Appendix B's layout: per category, greedy / top-k / top-p rows at top-k̂ = k, one column per layer."""
    rows = {}
    for name, r in greedy["results"].items():
        rows.setdefault(r.get("category", name), {})["greedy"] = r
    for _name, r in report["results"].items():
        rows.setdefault(r["category"], {})[r["mode"]] = r
    layers = next(iter(report["results"].values()))["config"]["layers"]
    lines = [
        "| category | decoding (tokens) | head | " + " | ".join(f"L{x}" for x in layers) + " |",
        "|---|---|---|" + "---|" * len(layers),
    ]
    for cat, modes in rows.items():
        if len(modes) < 2:
            continue
        for h in next(iter(modes.values()))["rates"]:
            for mode, r in modes.items():
                lines.append(
                    f"| {cat} | {mode} ({r['tokens']}) | {h} | "
                    + " | ".join(pct(r["rates"][h][str(x)][str(k)]) for x in layers)
                    + " |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--position-layers", default="15")
    ap.add_argument("--sampling", default=None, help="the greedy JSON to put beside a sampling JSON")
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args()
    rep = json.load(open(a.json, encoding="utf-8"))
    print(f"<!-- {a.json}: {rep['command']} -->\n")
    if a.sampling:
        print(sampling(rep, json.load(open(a.sampling, encoding="utf-8")), a.k))
    else:
        print(table2(rep))
        for x in a.position_layers.split(","):
            print(f"\nlayer {x}, by token position\n")
            print(positions(rep, int(x)))
