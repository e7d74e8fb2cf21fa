"""Self-speculative drafting by skipping middle layers (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et
al. 2024) on this model: how often a draft made with some layers skipped is the full model's next
token, and what such drafts could give at the best draft length.

A draft is made right after a verification call, so every earlier position's keys and values in every
layer come from the full model; only the draft's own position runs with layers skipped.  That is
computed here exactly, for every answer position at once: the full model's states and keys/values are
taken from one pass over the text, and each position's draft query attends to the full model's
keys/values of the earlier positions and to its own (skip-path) key/value.  The layers to skip are
chosen greedily, one at a time, by the highest agreement with the full model's next token (layer 0
and the last layer always run).

The speed-up bound prices a round of ``g`` drafts at ``g`` draft steps plus one verification call over
``g + 1`` tokens (this machine's call-cost curve, ``drafters.lengths.curve_for``); a draft step costs
its share of the layers' multiply-adds plus the draft vocabulary's unembedding share; drafts are taken
to be accepted independently with the measured agreement ``a`` (accepted tokens per round
``(1 - a^(g+1)) / (1 - a)``).  It ignores the drafter's own overheads, so it is an upper bound.

    PYTHONPATH=src python benchmarks/layer_skip_probe.py [--prompts 2] [--tokens 48] [--skip 12]

Spec-Bench prompts from the 21st of each category (none of the benchmark tables'), chat template,
greedy answers, fp32, 2 threads."""

from __future__ import annotations

import argparse
import math

import torch

import layerleap
from layerleap.core.cpu import cpu_signature
from layerleap.datasets import spec_bench
from layerleap.files import write_json
from layerleap.drafters.draft_vocab import get_draft_vocab
from layerleap.drafters.lengths import curve_for
from layerleap.train.data import chat_token_ids

CATEGORIES = "summarization,qa,translation,math_reasoning,writing"


def full_pass(model, ids: torch.Tensor):
    """The full model over ``ids`` ``[1, N]``: each layer's input states ``[L, N, D]``, its rotated keys
    and values ``[L, Hkv, N, hd]``, the rope tables, and the final states ``[N, D]``."""
    N = ids.shape[1]
    cos, sin = model._rope(torch.arange(N).unsqueeze(0), torch.float32, None)
    h = model.embed(ids)
    ks, vs = [], []
    for block in model.layers:
        _, k, v = block.attn.project(block.attn_norm(h), cos, sin)
        ks.append(k[0])
        vs.append(v[0])
        h = block(h, cos, sin, 0, None, None)
    return torch.stack(ks), torch.stack(vs), cos, sin, h[0]


def draft_states(model, ids, rows: torch.Tensor, ks, vs, cos, sin, keep: list[int]) -> torch.Tensor:
    """The last states ``[R, D]`` of the positions ``rows`` run through the layers ``keep`` only, each
    attending to the full model's keys/values of the positions before it and to its own."""
    block0 = model.layers[0]
    H, Hkv, hd = block0.attn.n_heads, block0.attn.n_kv, block0.attn.hd
    g = H // Hkv
    h = model.embed(ids[:, rows])  # [1, R, D]
    c, s = cos[:, rows], sin[:, rows]
    N = ks.shape[2]
    before = torch.arange(N).unsqueeze(0) < rows.unsqueeze(1)  # [R, N]: the keys each row sees besides its own
    for layer in keep:
        block = model.layers[layer]
        q, k, v = block.attn.project(block.attn_norm(h), c, s)  # q [1, H, R, hd], k/v [1, Hkv, R, hd]
        kf = ks[layer].repeat_interleave(g, 0)  # [H, N, hd]
        vf = vs[layer].repeat_interleave(g, 0)
        k_own, v_own = k[0].repeat_interleave(g, 0), v[0].repeat_interleave(g, 0)  # [H, R, hd]
        scores = q[0] @ kf.transpose(1, 2) / math.sqrt(hd)  # [H, R, N]
        scores = scores.masked_fill(~before, float("-inf"))
        own = (q[0] * k_own).sum(-1, keepdim=True) / math.sqrt(hd)  # [H, R, 1]
        p = torch.cat([scores, own], -1).softmax(-1)
        y = p[..., :N] @ vf + p[..., N:] * v_own  # [H, R, hd]
        h = h + block.attn.o(y.transpose(0, 1).reshape(1, len(rows), H * hd))
        h = h + block.mlp(block.mlp_norm(h))
    return h[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category")
    ap.add_argument("--tokens", type=int, default=48, help="greedy answer tokens per prompt")
    ap.add_argument("--skip", type=int, default=12, help="layers to skip, at most")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = layerleap.load("smollm2-135m", dtype="float32")
    vocab = get_draft_vocab(model, "auto")
    n = model.config.n_layers
    cfg = model.config
    layer_macs = cfg.hidden_size * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    layer_macs += cfg.n_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    head_macs, sub_macs = cfg.vocab_size * cfg.hidden_size, len(vocab.ids) * cfg.hidden_size
    step_macs = n * layer_macs + head_macs
    curve = curve_for(model)
    texts = []
    with torch.inference_mode():
        for p in spec_bench(categories=CATEGORIES, n=args.prompts, offset=20):
            ids = chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
            out = layerleap.generate(model, ids, "greedy", args.tokens).token_ids
            t = torch.tensor([ids + out])
            ks, vs, cos, sin, last = full_pass(model, t)
            rows = torch.arange(len(ids) - 1, t.shape[1] - 1)
            want = model.logits(last[rows]).argmax(-1)
            texts.append((t, rows, ks, vs, cos, sin, want))

        def agreement(keep: list[int]) -> float:
            hit = total = 0
            for t, rows, ks, vs, cos, sin, want in texts:
                h = draft_states(model, t, rows, ks, vs, cos, sin, keep)
                hit += int((model.logits(h).argmax(-1) == want).sum())
                total += len(rows)
            return hit / total

        def bound(a: float, kept: int) -> tuple[float, int]:
            draft = (kept * layer_macs + sub_macs) / step_macs  # a draft step, in one-token calls
            best = (1.0, 0)
            for gamma in range(1, 9):
                tokens = sum(a**i for i in range(gamma + 1))
                best = max(best, (tokens / (gamma * draft + curve(gamma + 1)), gamma))
            return best

        keep = list(range(n))
        full = agreement(keep)
        rows_out = [{"skipped": [], "agreement": full}]
        print(f"{cpu_signature()}; {len(texts)} prompts x {args.tokens} tokens; fp32")
        print(f"agreement with all layers: {full:.3f}")
        print("| layers skipped | which | first draft agrees | draft step (of a call) | bound (drafts a round) |")
        print("|---|---|---|---|---|")
        while n - len(keep) < args.skip:
            best = max(((agreement([x for x in keep if x != c]), c) for c in keep if 0 < c < n - 1))
            keep.remove(best[1])
            speed, gamma = bound(best[0], len(keep))
            skipped = sorted(set(range(n)) - set(keep))
            draft = (len(keep) * layer_macs + sub_macs) / step_macs
            row = {"skipped": skipped, "agreement": best[0], "draft_step": draft, "bound": speed, "gamma": gamma}
            rows_out.append(row)
            which = ",".join(map(str, skipped))
            print(f"| {len(skipped)} | {which} | {best[0]:.1%} | {draft:.2f} | {speed:.2f}× ({gamma}) |", flush=True)
    if args.json:
        write_json(args.json, {"cpu": cpu_signature(), "prompts": len(texts), "tokens": args.tokens, "rows": rows_out})


if __name__ == "__main__":
    main()
