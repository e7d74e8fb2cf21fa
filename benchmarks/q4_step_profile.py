"""Where one q4 decoding step's time goes, part by part, against each part's bytes at the measured
bandwidth: the 4-bit and 8-bit block products grouped by weight (and by the GGUF type they came
from), attention over the cache, the other ATen calls of the layers (norms, rope, residual adds,
cache writes) and the rest (Python, dispatch).

    python benchmarks/q4_step_profile.py --model qwen2.5-coder-1.5b --threads 1,2 --context 256

Each group of products is timed as one pass over every layer's weight of that kind (more bytes than
the caches hold, as in a step), best of ``--repeats`` passes; a step is timed the same way.
``--variants super,fp32`` profiles the model as loaded and a twin whose Q4_K scales are expanded to
fp32 (the block kernel's layout before super-block scales; the same bits); ``old`` reads
``--old-folder``, a q4 folder converted before Q6_K tensors were kept (they are re-quantized there:
4 bits in the layers, 8 for the head), with fp32 Q4_K scales; ``requant`` is the model as loaded
with every weight fused from parts of different block types (``kernels.StackWeight``: Q4_K_M's Q4_K
``attn_q``/``attn_k`` over a Q6_K ``attn_v``) re-quantized to one 4-bit block weight (min-max groups
of 32), as conversions did before such parts were kept; after ``super`` it is the same loaded model,
those weights swapped in before each of its turns.  ``--decode-tokens`` adds greedy decoding on
a few prompts, the variants interleaved per prompt; ``--step-rounds`` times one-token calls, the variants in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import layerleap
from layerleap.core import native
from layerleap.eval.roofline import best_time as best, measure_bandwidth


def weight_kind(fmt) -> str:
    """A label for a packed weight: its class, bits and scale storage."""
    name = type(fmt).__name__
    bits = getattr(fmt, "bits", None)
    scales = getattr(fmt, "scales_kind", None) or (
        str(fmt.dm.dtype).removeprefix("torch.") if hasattr(fmt, "dm") else ""
    )
    return f"{name}{'' if bits is None else f' {bits}-bit'} {scales}".strip()


def groups(model) -> dict[str, list]:
    """``{label: [packed weights]}`` over the layers' projections and the head."""
    out: dict[str, list] = defaultdict(list)
    for blk in model.layers:
        for part, lin in (
            ("qkv", blk.attn.qkv),
            ("o", blk.attn.o),
            ("gate_up", blk.mlp.gate_up),
            ("down", blk.mlp.down),
        ):
            out[f"{part} [{weight_kind(lin.packed)}]"].append(lin.packed)
    out[f"head [{weight_kind(model.lm_head.packed)}]"].append(model.lm_head.packed)
    return out


def profile_threads(model, threads: int, context: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    bw = measure_bandwidth(torch.bfloat16, buffer_mb=512, repeats=5)
    gbs = bw.sum_gbs
    cache = model.new_cache(1, context + 64 * repeats + 64)
    tok = torch.tensor([[42]])
    rows = {}
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context)), cache=cache)

        def step():
            model(tok, cache=cache)
            cache.lengths -= 1  # the same context every step

        step_s = best(step, repeats)
        parts = 0.0
        for label, fmts in groups(model).items():
            x = torch.randn(1, fmts[0].in_features).to(torch.bfloat16)
            t = best(lambda x=x, fmts=fmts: [f(x) for f in fmts], repeats)
            nbytes = sum(f.nbytes for f in fmts)
            rows[label] = {"ms": t * 1e3, "MB": nbytes / 1e6, "roofline_ms": nbytes / gbs / 1e6, "n": len(fmts)}
            parts += t
        c = model.config
        kv = cache.k[0, :1, :, : context + 1]  # [1, Hkv, T, hd]
        q = torch.randn(1, c.n_heads, 1, c.head_dim).to(kv.dtype)
        mod = native.module()
        t = best(lambda: [mod.attend_rows(q, kv, kv, None) for _ in range(c.n_layers)], repeats)
        kv_mb = 2 * kv.numel() * kv.element_size() * c.n_layers / 1e6
        rows["attention (native, all layers)"] = {"ms": t * 1e3, "MB": kv_mb, "roofline_ms": kv_mb / gbs}
        parts += t
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
        aten = sum(
            e.self_cpu_time_total
            for e in prof.key_averages()
            if e.key.startswith("aten::") and "scaled_dot_product" not in e.key
        )
        rows["other ATen calls (norms, rope, adds, cache writes, lookups)"] = {"ms": aten / 1e3 / repeats}
        parts += aten / 1e6 / repeats
    rows["rest (Python, dispatch; step - parts)"] = {"ms": (step_s - parts) * 1e3}
    total_mb = sum(r.get("MB", 0) for r in rows.values())
    return {
        "threads": threads,
        "bandwidth_gbs_sum": round(gbs, 1),
        "step_ms": round(step_s * 1e3, 2),
        "roofline_ms": round(total_mb / gbs, 2),
        "parts": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in rows.items()},
    }


def load_old(folder: str, like):
    """The model of an older q4 folder (its check refuses it now): weights read as they are."""
    from pathlib import Path

    from layerleap.core.gguf_q4 import WEIGHTS, tensors_to_weights
    from layerleap.core.loading import build_q4
    from layerleap.core.weight_files import read_safetensors_file

    weights = tensors_to_weights(read_safetensors_file(Path(folder) / WEIGHTS))
    model = build_q4(like.config, weights, like.tokenizer)
    model.set_fingerprint(like.fingerprint)
    return fp32_scales(model)


def fp32_scales(model):
    """``model`` with every super-block scale layout expanded to fp32 scales (in place)."""
    from layerleap.core.kernels import BlockWeight

    for mod in model.modules():
        fmt = getattr(mod, "packed", None)
        if isinstance(fmt, BlockWeight) and fmt.dm.dtype == torch.uint8:
            mod.packed = BlockWeight(fmt.codes, fmt._dm_blocks(), fmt.out_features, fmt.bits, fmt.bias, fmt.fine)
    return model


def requantized_mixed(model) -> dict:
    """``{module: a 4-bit block weight}`` for every stacked weight of ``model``: its rows re-quantized."""
    from layerleap.core.kernels import BlockWeight, StackWeight, quantize

    return {
        mod: BlockWeight.from_rows(quantize(mod.packed.dense()), mod.packed.bias)
        for mod in model.modules()
        if isinstance(getattr(mod, "packed", None), StackWeight)
    }


class Variant:
    """A model to time, with the formats ``use`` puts into some of its modules first: two variants of one
    loaded model differ in those weights only, not in where the others sit in memory."""

    def __init__(self, model, formats: dict | None = None):
        self.model, self.formats = model, formats or {}

    def use(self):
        for mod, fmt in self.formats.items():
            mod.packed = fmt
        return self.model


PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "How do I reverse a linked list in C? Show the code.",
]


def decode(models: dict, threads: int, n_prompts: int, tokens: int, rounds: int = 1) -> dict:
    """Greedy decode tok/s (tokens after the first over the time after it) per variant, interleaved."""
    torch.set_num_threads(threads)
    spent = {k: [0.0, 0] for k in models}
    for variant in models.values():  # warm-up
        layerleap.generate(variant.use(), PROMPTS[0], "greedy", 4, chat=True, stop_at_eos=False)
    for i, text in enumerate(PROMPTS[:n_prompts] * rounds):
        for name, variant in list(models.items())[:: -1 if i % 2 else 1]:  # ABBA: neither always goes first
            model = variant.use()
            t0 = time.perf_counter()
            res = layerleap.generate(model, text, "greedy", tokens, chat=True, stop_at_eos=False)
            wall = time.perf_counter() - t0
            spent[name][0] += wall - res.stats["ttft_s"]
            spent[name][1] += len(res.token_ids) - 1
    return {k: round(n / s, 2) for k, (s, n) in spent.items()}


def interleaved_steps(models: dict, threads: int, context: int, rounds: int) -> dict:
    """A one-token call's cost per variant after ``context`` tokens, the variants taking turns: each
    round, the best of 3 calls by the thread's CPU time (ms); the minimum and median over the rounds."""
    torch.set_num_threads(threads)
    tok, caches = torch.tensor([[42]]), {}
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.inference_mode():
        for name, variant in models.items():
            model = variant.use()
            caches[name] = model.new_cache(1, context + 8)
            model(torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0)), cache=caches[name])
        for r in range(rounds):
            for name, variant in list(models.items())[:: -1 if r % 2 else 1]:
                model, cache, best_s = variant.use(), caches[name], float("inf")
                for _ in range(3):
                    t0 = time.thread_time()
                    model(tok, cache=cache)
                    best_s = min(best_s, time.thread_time() - t0)
                    cache.lengths -= 1  # the same context every call
                times[name].append(best_s * 1e3)
    return {k: {"min_ms": round(min(t), 2), "median_ms": round(statistics.median(t), 2)} for k, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--variants", default="super", help="super (as loaded), fp32 (scales expanded), old, requant (mixed parts)"
    )
    ap.add_argument("--old-folder", default=None, help="an older q4 folder of the same model (variant old)")
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="times over the prompts (decoding)")
    ap.add_argument("--step-rounds", type=int, default=0, help="rounds of one-token calls, variants in turn")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    models = {}
    for v in args.variants.split(","):
        if v == "old":
            models[v] = Variant(load_old(args.old_folder, next(iter(models.values())).model))
        elif v == "requant" and "super" in models:  # the loaded model, its stacked weights swapped in turn
            m = models["super"].model
            swapped = requantized_mixed(m)
            models["super"].formats = {mod: mod.packed for mod in swapped}
            models[v] = Variant(m, swapped)
        else:
            m = layerleap.load(args.model, dtype="q4")
            models[v] = Variant(fp32_scales(m) if v == "fp32" else m, requantized_mixed(m) if v == "requant" else None)
    out = {"variants": {}, "decode_tok_s": {}, "step_cpu_ms": {}}
    for t in map(int, args.threads.split(",")):
        if args.step_rounds:
            out["step_cpu_ms"][t] = interleaved_steps(models, t, args.context, args.step_rounds)
        if args.decode_tokens:
            out["decode_tok_s"][t] = decode(models, t, args.prompts, args.decode_tokens, args.rounds)
        for v, variant in models.items():
            if not args.no_profile:
                out["variants"].setdefault(v, []).append(profile_threads(variant.use(), t, args.context, args.repeats))
    from layerleap.files import json_text, write_text

    text = json_text(out, indent=1)
    print(text)
    if args.json:
        write_text(args.json, text + "\n")


if __name__ == "__main__":
    main()
