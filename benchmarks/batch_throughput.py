"""Batched throughput: a list of prompts decoded as one batch against one ``generate`` call per prompt.

For every method and batch size B, the same prompts are generated in batches of B (one ``generate``
call per batch, ``batch_size`` = B) and one call per prompt; the arms are interleaved: each round times
the per-prompt arm and every batch size once, the next round in the reverse order, and the fastest
round of each arm is kept.  Reported: generated tokens per second of each arm, their ratio, the model
calls, and whether the batched rows equal the rows decoded alone (greedy: token for token).

Every row generates exactly ``--max-new-tokens`` tokens (``stop_at_eos=False``), so both arms produce
the same number of tokens; prompts are token ids made once with the chat template (as ``layerleap
generate --chat`` does), so tokenizing is timed in neither arm.

    python benchmarks/batch_throughput.py --dtype float32 --threads 2 --methods greedy,prompt-lookup

Each run adds (or replaces) its methods' entries in docs/results/batch_throughput_<dtype>.json when
the prompts and settings match the file's, so one method at a time keeps every run short; the plot
docs/results/batch_throughput_<dtype>.png is redrawn from the whole file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import layerleap
from layerleap.datasets import spec_bench
from layerleap.decoding import chat_token_ids
from layerleap.files import pyplot, save_figure, write_json
from llamacpp_vs_layerleap import cpu_info, load_average

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = "writing,roleplay,reasoning,math,coding,translation,qa,math_reasoning"


def prompt_ids(model, categories: str, per_category: int) -> tuple[list[dict], list[list[int]]]:
    """The first ``per_category`` first-turn prompts of each category, in the file's order, as chat
    token ids -> (their description, their ids)."""
    prompts = spec_bench(categories=categories, n=per_category)
    ids = [
        chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
        for p in prompts
    ]
    return [{"id": p.id, "category": p.category, "tokens": len(i)} for p, i in zip(prompts, ids)], ids


def decode(model, prompts: list[list[int]], method: str, batch: int | None, max_new_tokens: int, seed_batch: int = 1):
    """One arm: ``batch`` None = one call per prompt, else calls of ``batch`` prompts -> (seconds, results,
    model calls).  A sampling method is seeded with 0; alone, prompt ``i`` gets the seed its row has in
    a batch of ``seed_batch`` (the call's seed plus the row index), so the arms sample the same tokens."""
    seed = 0 if layerleap.METHODS[method].sampling and layerleap.METHODS[method].default_sample else None
    kw = dict(stop_at_eos=False, seed=seed)
    t = time.perf_counter()
    if batch is None:
        res = [
            layerleap.generate(
                model, [p], method, max_new_tokens, **{**kw, "seed": None if seed is None else seed + i % seed_batch}
            )[0]
            for i, p in enumerate(prompts)
        ]
        calls = sum(r.stats["model_calls"] for r in res)
    else:
        res, calls = [], 0
        for i in range(0, len(prompts), batch):
            out = layerleap.generate(model, prompts[i : i + batch], method, max_new_tokens, **kw)
            res += out
            calls += out[0].stats["model_calls"]
    return time.perf_counter() - t, res, calls


def differing(alone, batched) -> list[dict]:
    """Rows whose tokens differ from the prompt decoded alone: index and first differing position."""
    out = []
    for i, (a, b) in enumerate(zip(alone, batched)):
        if a.token_ids != b.token_ids:
            pos = next(
                (j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                min(len(a.token_ids), len(b.token_ids)),
            )
            out.append({"row": i, "first_difference": pos})
    return out


def bench_method(model, prompts, method: str, args) -> dict:
    """Interleaved rounds over the per-prompt arm and every batch size -> the method's entry."""
    arms = [None, *args.batches]
    times = {a: [] for a in arms}
    calls, results = {}, {}
    for b in arms:  # warm-up: the method's code paths at each batch size, a few tokens
        decode(model, prompts[: b or 1], method, b, 4)
    for r in range(args.rounds):
        for b in arms if r % 2 == 0 else arms[::-1]:
            s, res, calls[b] = decode(model, prompts, method, b, args.max_new_tokens)
            times[b].append(s)
            results.setdefault(b, res)
            label = "per prompt" if b is None else f"batch {b}"
            print(
                f"  {method} round {r + 1}/{args.rounds} {label:>10}: {s:7.2f} s "
                f"{sum(len(x.token_ids) for x in res) / s:7.1f} tok/s",
                flush=True,
            )
    tokens = sum(len(x.token_ids) for x in results[None])
    alone = min(times[None])
    sizes = {}
    for b in args.batches:
        diff = None if layerleap.METHODS[method].default_sample else differing(results[None], results[b])
        sizes[str(b)] = {
            "batched_s": min(times[b]),
            "batched_rounds_s": times[b],
            "batched_tok_s": tokens / min(times[b]),
            "batched_model_calls": calls[b],
            "per_prompt_tok_s": tokens / alone,
            "ratio": alone / min(times[b]),
            "ratio_by_round": [a / t for a, t in zip(times[None], times[b])],
            "rows_differing": None if diff is None else len(diff),
            "differences": diff,
        }
    return {
        "tokens": tokens,
        "per_prompt_s": alone,
        "per_prompt_rounds_s": times[None],
        "per_prompt_model_calls": calls[None],
        "sizes": sizes,
    }


def sample_check(model, prompts, method: str, args) -> dict:
    """A sampling method (untimed): rows differing between a batch of B and each prompt alone seeded as
    its row is (the call's seed plus the row index), per B."""
    out = {}
    for b in args.batches:
        _, alone, _ = decode(model, prompts, method, None, args.max_new_tokens, seed_batch=b)
        _, batched, _ = decode(model, prompts, method, b, args.max_new_tokens)
        out[str(b)] = len(differing(alone, batched))
    return out


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (method, m) in zip(colors, sorted(report["methods"].items())):
        bs = sorted(int(b) for b in m["sizes"])
        ax.plot(bs, [m["sizes"][str(b)]["batched_tok_s"] for b in bs], "o-", color=color, label=f"{method} batched")
        ax.plot(
            bs,
            [m["sizes"][str(b)]["per_prompt_tok_s"] for b in bs],
            "--",
            color=color,
            label=f"{method} one call per prompt",
        )
    c = report["config"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(c["batches"], [str(b) for b in c["batches"]])
    ax.set_xlabel("batch size (prompts per generate call)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(
        f"SmolLM2-135M {c['dtype']}, {len(c['prompts'])} prompts x {c['max_new_tokens']} tokens, "
        f"{c['threads']} threads",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--methods",
        default="greedy,prompt-lookup",
        help="comma-separated batched methods (layerleap.METHODS[name].batched)",
    )
    ap.add_argument("--categories", default=CATEGORIES, help="Spec-Bench categories the prompts come from")
    ap.add_argument("--per-category", type=int, default=2, help="first-turn prompts per category (the first ones)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default docs/results/batch_throughput_<dtype>.json)")
    args = ap.parse_args()
    command = "python benchmarks/batch_throughput.py " + shlex.join(sys.argv[1:])
    print(command, flush=True)
    args.batches = [int(b) for b in args.batches.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in layerleap.METHODS or not layerleap.METHODS[m].batched:
            sys.exit(
                f"error: {m!r} is not a batched method: choose from "
                f"{', '.join(n for n, x in layerleap.METHODS.items() if x.batched)}"
            )
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    described, prompts = prompt_ids(model, args.categories, args.per_category)
    print(
        f"{len(prompts)} prompts ({args.categories}, first {args.per_category} each), "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens, {args.max_new_tokens} new tokens each",
        flush=True,
    )
    out = Path(args.out or ROOT / "docs" / "results" / f"batch_throughput_{args.dtype}.json")
    config = {
        "model": "smollm2-135m",
        "dtype": args.dtype,
        "threads": args.threads,
        "prompts": described,
        "categories": args.categories,
        "max_new_tokens": args.max_new_tokens,
        "batches": args.batches,
        "rounds": args.rounds,
        "kept": "fastest round of each arm",
        "stop_at_eos": False,
    }
    report = {"config": config, "methods": {}}
    if out.is_file():
        old = json.loads(out.read_text(encoding="utf-8"))
        if old.get("config") == config:
            report = old
        else:
            print(f"{out} holds other settings: starting it afresh", flush=True)
    with torch.inference_mode():
        for method in methods:
            machine = {
                "cpu": cpu_info(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "load_average_start": load_average(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            print(f"{method}: {args.rounds} rounds, load average {machine['load_average_start']}", flush=True)
            entry = bench_method(model, prompts, method, args)
            if layerleap.METHODS[method].default_sample:
                entry["sampled_rows_differing"] = sample_check(model, prompts, method, args)
                print(
                    f"  {method}: sampled rows differing from alone, by B: {entry['sampled_rows_differing']}",
                    flush=True,
                )
            machine["load_average_end"] = load_average()
            report["methods"][method] = {**entry, "machine": machine, "command": command}
            for b, s in entry["sizes"].items():
                print(
                    f"  {method} B={b:>2}: per prompt {s['per_prompt_tok_s']:6.1f} tok/s, batched "
                    f"{s['batched_tok_s']:6.1f} tok/s, x{s['ratio']:.2f}, rows differing {s['rows_differing']}",
                    flush=True,
                )
            write_json(out, report)
            plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    main()
