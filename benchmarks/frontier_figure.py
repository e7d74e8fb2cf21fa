"""Some curves of a `layerleap eval frontier` report as a figure and a Markdown table (e.g. BiLD's
ablation apart from CALM):

    python benchmarks/frontier_figure.py REPORT.json OUT.png bild,bild-no-rollback,bild-no-fallback

Table columns per point: each category's score against the references (ROUGE-L, BLEU), agreement
with greedy's text (ROUGE-L), outputs identical to greedy's, the full model's perplexity of the output
over its perplexity of greedy's, layer passes per token, the wall-clock speed-up over greedy (summed
times), and the same per token (time per generated token; outputs that stop at EOS earlier than
greedy's do not count as faster).
"""

from __future__ import annotations

import json
import sys

from layerleap.commands.skipdecode import _frontier_figure
from layerleap.eval.frontier import summary
from layerleap.files import save_figure


def per_token_speedup(rows: list[dict], greedy: dict[str, dict]) -> float:
    """Greedy's seconds per token over the point's, both summed over the categories."""
    g = sum(greedy[r["category"]]["seconds"] for r in rows) / sum(greedy[r["category"]]["tokens"] for r in rows)
    return g / (sum(r["seconds"] for r in rows) / sum(r["tokens"] for r in rows))


def table(report: dict, only: list[str]) -> str:
    greedy = {r["category"]: r for r in report["rows"] if r["label"] == "greedy"}
    cats = [c for c in report["categories"] if c in greedy]
    metric = {c: greedy[c]["metric"] for c in cats}
    head = [f"{c} ({metric[c]})" for c in cats]
    out = [
        "| point | "
        + " | ".join(head)
        + " | agreement | identical | ppl ratio | layers / token | speed-up | per token |",
        "|---" * (len(cats) + 7) + "|",
    ]
    for s in report["summary"]:
        if s.get("group", s["method"]) not in ("greedy", *only):
            continue
        rows = [r for r in report["rows"] if r["label"] == s["label"]]
        scores = " | ".join(f"{s['scores'][c]:.1f}" if c in s["scores"] else "–" for c in cats)
        out.append(
            f"| {s['label']} | {scores} | {s['agreement']:.1f} | "
            f"{sum(r['identical'] for r in rows)}/{sum(r['n'] for r in rows)} | {s['ppl_ratio']:.2f} | "
            f"{s['layers_per_token']:.1f} | {s['speedup']:.2f}× | {per_token_speedup(rows, greedy):.2f}× |"
        )
    return "\n".join(out)


def main(report: str, out: str, groups: str) -> None:
    with open(report, encoding="utf-8") as f:
        data = json.load(f)
    data.setdefault("summary", summary(data["rows"]))  # a report still being written
    only = groups.split(",")
    print(table(data, only))
    save_figure(_frontier_figure(data, only), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
