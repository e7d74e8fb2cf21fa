"""Every method against our greedy (and `transformers`' greedy and prompt lookup), one `layerleap bench`
per category so that a long run resumes where it stopped, then one table from the reports.

    python benchmarks/methods_bench.py run --dtype float32 --out docs/results/methods_float32 --repeat 2
    python benchmarks/methods_bench.py table docs/results/methods_float32 docs/results/methods_q4

``run`` skips a category whose report is complete (every prompt done, not interrupted) and reruns
the others; each category's report is ``OUT/CATEGORY.json``.  ``table`` prints the markdown rows of
docs/BENCHMARKS.md: per method, summed greedy wall time over the method's (end to end, and decoding
only after the first token), the same per category, against `transformers` greedy, tokens per call,
acceptance and how many outputs equal greedy's.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

CATEGORIES = ["summarization", "qa", "translation", "math_reasoning", "writing"]
METHODS = "sample,skipdecode,calm,bild,medusa,hidden-transfer,ppd,self-spec,prompt-lookup,auto"


def complete(path: Path) -> bool:
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return not rep.get("interrupted") and rep.get("prompts_done") == rep["config"].get("n_prompts")


def cmd_run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cat in args.categories.split(","):
        path = out / f"{cat}.json"
        if complete(path):
            print(f"{cat}: done ({path})", flush=True)
            continue
        cmd = [
            sys.executable,
            "-m",
            "layerleap",
            "bench",
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
            "--categories",
            cat,
            "--prompts",
            str(args.prompts),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--chat",
            "--methods",
            args.methods,
            "--repeat",
            str(args.repeat),
            "--json",
            str(path),
            "--html",
            str(out / f"{cat}.html"),
        ]
        cmd += ["--hf-extra", "lookup"] if args.hf else ["--no-baseline-hf"]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)


def _load(folder: Path) -> list[dict]:
    return [
        json.loads((folder / f"{c}.json").read_text(encoding="utf-8"))
        for c in CATEGORIES
        if (folder / f"{c}.json").exists()
    ]


def cmd_table(args) -> None:
    print(
        "| dtype | method | vs greedy (decoding) | "
        + " | ".join(CATEGORIES)
        + " | vs `transformers` greedy | tokens/call | acceptance | = greedy |"
    )
    print("|---" * (len(CATEGORIES) + 7) + "|")
    for folder in args.folders:
        reps = _load(Path(folder))
        if not reps:
            continue
        dtype = reps[0]["config"].get("dtype", "?")
        # label -> key -> [wall, decode wall]; key: category or "all"
        t = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0.0]))
        extra = collections.defaultdict(lambda: [[], [], 0, 0])  # tokens/call, acceptance, equal, counted
        for rep in reps:
            for r in rep["records"]:
                for key in (r["category"], "all"):
                    t[r["label"]][key][0] += r["wall_s"]
                    t[r["label"]][key][1] += r["wall_s"] - r["ttft_s"]
                e = extra[r["label"]]
                e[0].append(r["tokens_per_call"])
                if r.get("acceptance") is not None:
                    e[1].append(r["acceptance"])
                if r.get("matches_greedy") is not None:
                    e[2] += int(bool(r["matches_greedy"]))
                    e[3] += 1
        g, hf = t["greedy"], t.get("transformers")
        for label, by in t.items():
            if label == "greedy":
                continue
            e = extra[label]
            cats = " | ".join(f"{g[c][0] / by[c][0]:.2f}×" if by[c][0] else "-" for c in CATEGORIES)
            vs_hf = f"{hf['all'][0] / by['all'][0]:.2f}×" if hf else "-"
            acc = f"{sum(e[1]) / len(e[1]):.0%}" if e[1] else "-"
            same = f"{e[2]}/{e[3]}" if e[3] else "-"
            print(
                f"| {dtype} | `{label}` | **{g['all'][0] / by['all'][0]:.2f}×** ({g['all'][1] / by['all'][1]:.2f}×) "
                f"| {cats} | {vs_hf} | {sum(e[0]) / len(e[0]):.2f} | {acc} | {same} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one bench report per category (skipping those already complete)")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--categories", default=",".join(CATEGORIES))
    r.add_argument("--prompts", type=int, default=3)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--methods", default=METHODS)
    r.add_argument("--repeat", type=int, default=2)
    r.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time `transformers` greedy and its prompt lookup too (default on)",
    )
    r.add_argument("--out", required=True)
    t = sub.add_parser("table", help="the markdown table from run's folders")
    t.add_argument("folders", nargs="+")
    args = ap.parse_args()
    (cmd_run if args.cmd == "run" else cmd_table)(args)


if __name__ == "__main__":
    main()
