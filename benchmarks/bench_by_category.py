"""Per-category rows of a `layerleap bench` report: ours against `transformers`, end to end and
decoding only (wall time less the time to the first token), as in docs/BENCHMARKS.md.

    python benchmarks/bench_by_category.py docs/results/bench_greedy_float32_xeon_t1.json [...]
"""

from __future__ import annotations

import collections
import json
import sys


def rows(report: dict, ours: str = "greedy", ref: str = "transformers") -> list[str]:
    dtype = report["config"].get("dtype", "?")
    sums = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0, 0]))
    for r in report["records"]:
        for key in (r["category"], "all"):
            s = sums[key][r["label"]]  # wall, decode wall, new tokens, ttft, runs
            s[0] += r["wall_s"]
            s[1] += r["wall_s"] - r["ttft_s"]
            s[2] += r["new_tokens"]
            s[3] += r["ttft_s"]
            s[4] += 1
    out = []
    for cat, by in sums.items():
        a, b = by[ours], by[ref]
        out.append(
            f"| {dtype} | {cat} ({a[4]}) | {a[2] / a[0]:.1f} | {b[2] / b[0]:.1f} | **{b[0] / a[0]:.2f}×** | "
            f"{b[1] / a[1]:.2f}× | {a[3] / a[4]:.2f} / {b[3] / b[4]:.2f} |"
        )
    return out


def main() -> None:
    print("| dtype | category (prompts) | ours tok/s | transformers tok/s | end to end | decoding | TTFT s |")
    print("|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            print("\n".join(rows(json.load(f))))


if __name__ == "__main__":
    main()
