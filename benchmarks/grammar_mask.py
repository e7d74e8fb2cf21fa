"""The cost of structured output per token on SmolLM2-135M (49,152-token vocabulary): the grammar's token
mask (llguidance computing it, and layerleap unpacking it and masking the logits) against a model step.

    python benchmarks/grammar_mask.py --threads 1 --repeats 5 --json grammar_mask.json

For each grammar, SmolLM2 decodes greedily under it (a chat prompt asking for that output); then the
grammar is compiled anew (timed) and the output's tokens are replayed: once for the grammar's first
use (llguidance's bitmask alone: it builds its lexer states as they are first needed), then
``--repeats`` times, timing at every token llguidance's bitmask alone,
``Constraint.mask(logits)`` (the bitmask computed, unpacked to ``[V]`` and applied: what decoding
pays per token) and ``advance``.  The model step is greedy decoding's
time per token on the same prompt without a grammar, measured between the grammar runs (interleaved).
Prompt lookup decodes each prompt under its grammar too (between two greedy runs): its model calls,
and its speed over greedy's (the mean of the two), with the same tokens checked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import layerleap
from layerleap import Grammar, generate
from layerleap.core import grammar as grammar_cache
from layerleap.core.cpu import cpu_signature
from layerleap.files import write_json

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
CASES = [
    ("json_schema", Grammar.json(PERSON), "Describe a fictional person as JSON (name, age, city, hobbies)."),
    ("json_object", Grammar.json(), "Describe the planet Mars as a JSON object."),
    ("regex", Grammar.regex(r"[A-Z][a-z]+( [a-z]+){3,12}\."), "Write one sentence about the sea."),
    ("gbnf", Grammar.gbnf('root ::= item (", " item){2,9}\nitem ::= [a-z]+'), "List some fruits."),
]


def ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "mean": 1e3 * statistics.fmean(xs),
        "p50": 1e3 * xs[len(xs) // 2],
        "p99": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
    }


def replay(model, grammar: Grammar, tokens: list[int], eos: tuple[int, ...], logits: torch.Tensor) -> dict:
    """Per-token times over ``tokens``, each pass from a fresh ``Constraint``: ``bitmask`` (llguidance
    computing the mask alone), ``mask`` (``Constraint.mask(logits)``: the mask computed, unpacked and
    applied, what decoding pays per token) and ``advance``."""
    times: dict[str, list[float]] = {"bitmask": [], "mask": [], "advance": []}
    c = grammar.start(model, 1, eos)[0]
    for t in tokens:
        t0 = time.perf_counter()
        c.matcher.unsafe_compute_mask_ptr(c.bits.data_ptr(), c.bits.numel() * 4)
        times["bitmask"].append(time.perf_counter() - t0)
        c.advance(t)
        if c.stopped:
            break
    c = grammar.start(model, 1, eos)[0]
    for t in tokens:
        t0 = time.perf_counter()
        c.mask(logits)
        t1 = time.perf_counter()
        c.advance(t)
        times["mask"].append(t1 - t0)
        times["advance"].append(time.perf_counter() - t1)
        if c.stopped:
            break
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", progress=lambda m: None)
    eos = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + (model.tokenizer.eos_token_id,)))
    t0 = time.perf_counter()
    Grammar.json().start(model, 1, eos)
    setup_s = time.perf_counter() - t0  # llguidance's view of the tokenizer, built once per model
    logits = torch.randn(model.config.vocab_size)
    rows, steps = [], []
    for name, grammar, prompt in CASES:
        plain = generate(model, prompt, "greedy", args.max_tokens, chat=True, stop_at_eos=False)
        steps.append(plain.stats["wall_s"] / len(plain.token_ids))
        out = generate(model, prompt, "greedy", args.max_tokens, chat=True, grammar=grammar)
        lookup = generate(model, prompt, "prompt-lookup", args.max_tokens, chat=True, grammar=grammar)
        again = generate(model, prompt, "greedy", args.max_tokens, chat=True, grammar=grammar)
        assert lookup.token_ids == out.token_ids == again.token_ids, "prompt lookup under a grammar is lossless"
        grammar_cache._MODELS[model].matchers.clear()  # compile anew: the first use of the grammar, timed
        t0 = time.perf_counter()
        grammar.start(model, 1, eos)
        compile_s = time.perf_counter() - t0
        times = {"bitmask": [], "mask": [], "advance": []}
        first = []
        for i in range(args.repeats + 1):
            for k, v in replay(model, grammar, out.token_ids, eos, logits).items():
                if i == 0 and k == "bitmask":
                    first = v  # the grammar's first masks: llguidance builds its lexer states as needed
                elif i > 0:
                    times[k] += v
        row = {"grammar": name, "tokens": len(out.token_ids), "compile_ms": 1e3 * compile_s, "text": out.text}
        row["first_bitmask"] = {**ms(first), "max": 1e3 * max(first)}
        row["calls"] = {"greedy": out.stats["model_calls"], "prompt-lookup": lookup.stats["model_calls"]}
        greedy_s = (out.stats["wall_s"] + again.stats["wall_s"]) / 2  # greedy before and after prompt lookup
        row["prompt_lookup_speedup"] = greedy_s / lookup.stats["wall_s"]
        row.update({k: ms(v) for k, v in times.items()})
        rows.append(row)
    step_ms = 1e3 * statistics.median(steps)
    result = {
        "cpu": cpu_signature(),
        "threads": args.threads,
        "tokenizer_setup_s": setup_s,
        "greedy_step_ms": step_ms,
        "rows": rows,
    }
    print(f"CPU: {result['cpu']}, {args.threads} thread(s); tokenizer set-up {setup_s:.2f} s once per model")
    print(f"greedy step (no grammar): {step_ms:.2f} ms per token")
    for r in rows:
        calls = r["calls"]
        print(
            f"{r['grammar']}: {r['tokens']} tokens, model calls greedy {calls['greedy']}, prompt lookup "
            f"{calls['prompt-lookup']} (same tokens), prompt lookup {r['prompt_lookup_speedup']:.2f}x greedy's speed"
        )
    print(
        "| grammar | tokens | compile | first use: bitmask mean (max) | bitmask mean | mask+apply mean | p50 | p99 "
        "| advance mean | of a step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_token = r["mask"]["mean"] + r["advance"]["mean"]
        print(
            f"| {r['grammar']} | {r['tokens']} | {r['compile_ms']:.1f} ms | {r['first_bitmask']['mean']:.3f} ms "
            f"({r['first_bitmask']['max']:.2f} ms) | {r['bitmask']['mean']:.3f} ms | "
            f"{r['mask']['mean']:.3f} ms | {r['mask']['p50']:.3f} ms | {r['mask']['p99']:.3f} ms | "
            f"{r['advance']['mean']:.3f} ms | {100 * per_token / step_ms:.2f}% |"
        )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
