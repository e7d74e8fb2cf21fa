"""How close the 4-bit dtype is to the dense fp32 model, and how exact its weight mapping is.

    python benchmarks/q4_quality.py --prompts 40 --max-new-tokens 64 --json docs/results/q4_quality.json

1. The mapping: every 4-bit weight of the GGUF (Q4_1 blocks: ``w = d*q + m`` with fp16 ``d``, ``m``)
   against what the loaded kernel multiplies by: torch's int4 kernel's ``(q - 8) * scale + zero`` with
   ``scale`` and ``zero = m + 8d`` rounded to bf16, or the native block kernel's own blocks (the file's
   values, so |Δw| is 0); max and mean |Δw|, and relative to mean |w|.  ``LAYERLEAP_Q4_KERNEL=torch``
   measures torch's int4 kernel on a CPU whose q4 uses the block kernel.
2. Quality on Spec-Bench prompts (chat template; the first prompts of every category in turn):
   - free-running greedy: q4's tokens against fp32's (identical prompts, first difference);
   - teacher-forced on fp32's greedy tokens: top-1 agreement and the logits' |Δ| (mean, max).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import layerleap
from layerleap.core import gguf_q4
from layerleap.datasets import spec_bench
from layerleap.files import write_json
from layerleap.core.kernels import BlockWeight, Int4Weight, QuantizedRows
from layerleap.core.loading import cache_root


def mapping_error(model) -> dict:
    folder = next(p for p in cache_root().iterdir() if p.name.endswith("-q4") and p.name.startswith("smollm2"))
    weights, _ = gguf_q4.read(folder)
    mods = dict(model.named_modules())
    worst, tot_abs, tot_w, n, tensors, kinds = 0.0, 0.0, 0.0, 0, 0, set()
    for name, rows in weights.items():
        if not isinstance(rows, QuantizedRows):
            continue
        mod = mods.get(name.rsplit(".", 1)[0])
        packed = getattr(mod, "packed", None)
        if isinstance(packed, Int4Weight):
            kernel = Int4Weight._dequantize(packed.codes(), *packed._scale_zero())
            assert torch.equal(packed.codes(), rows.q), name  # the codes are the GGUF's, bit for bit
        elif isinstance(packed, BlockWeight):
            kernel = packed.dense()  # the file's codes, scales and minimums as they are
        else:
            continue
        kinds.add(type(packed).__name__)
        exact = rows.dense()
        d = (kernel - exact).abs()
        worst = max(worst, float(d.max()))
        tot_abs += float(d.double().sum())
        tot_w += float(exact.abs().double().sum())
        n += d.numel()
        tensors += 1
    if not tensors:
        raise SystemExit(f"{folder}: no 4-bit tensor of the q4 model is held by a 4-bit kernel")
    return {
        "kernel": ", ".join(sorted(kinds)),
        "tensors": tensors,
        "weights": n,
        "max_abs_dw": worst,
        "mean_abs_dw": tot_abs / n,
        "mean_abs_w": tot_w / n,
        "relative_mean_dw": tot_abs / tot_w,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense = layerleap.load("smollm2-135m", dtype="float32")
    q4 = layerleap.load("smollm2-135m", dtype="q4")
    report = {
        "command": "python benchmarks/q4_quality.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
        "mapping": mapping_error(q4),
    }
    cats = sorted({p.category for p in spec_bench()})
    per_cat = -(-args.prompts // len(cats))
    prompts = [p for i in range(per_cat) for c in cats for p in spec_bench(categories=[c], n=per_cat)[i : i + 1]]
    prompts = prompts[: args.prompts]
    same, first, agree, total, dl_sum, dl_max, rows = 0, [], 0, 0, 0.0, 0.0, []
    t0 = time.time()
    for i, p in enumerate(prompts):
        ref = layerleap.generate(dense, p.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
        got = layerleap.generate(q4, p.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
        k = next((j for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), len(ref.token_ids))
        same += k == len(ref.token_ids)
        first.append(k)
        seq = torch.tensor([ref.prompt_ids + ref.token_ids])
        n0 = len(ref.prompt_ids) - 1
        with torch.inference_mode():
            l32 = dense(seq)[0, n0:-1].float()
            lq = q4(seq)[0, n0:-1].float()
        agree += int((l32.argmax(-1) == lq.argmax(-1)).sum())
        total += l32.shape[0]
        d = (l32 - lq).abs()
        dl_sum += float(d.mean(-1).sum())
        dl_max = max(dl_max, float(d.max()))
        rows.append(
            {
                "id": p.id,
                "category": p.category,
                "first_difference": k,
                "teacher_forced_agreement": float((l32.argmax(-1) == lq.argmax(-1)).float().mean()),
            }
        )
        print(
            f"[{i + 1}/{len(prompts)}] {p.category} {p.id}: first difference {k}, {time.time() - t0:.0f} s", flush=True
        )
    report["quality"] = {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "identical_outputs": same,
        "mean_first_difference": sum(first) / len(first),
        "teacher_forced_top1_agreement": agree / total,
        "mean_abs_logit_delta": dl_sum / total,
        "max_abs_logit_delta": dl_max,
        "per_prompt": rows,
    }
    report["load_average_end"] = list(os.getloadavg())
    print(
        json.dumps(
            {k: v for k, v in report.items() if k != "quality"}
            | {"quality": {k: v for k, v in report["quality"].items() if k != "per_prompt"}},
            indent=1,
        )
    )
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
