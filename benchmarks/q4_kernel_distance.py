"""How far each q4 kernel's next-token distribution is from the fp32 model's: the mean KL divergence
(nats) and the top-1 agreement over the first 300 tokens of README.md, teacher-forced.  The native
block kernel is measured with 15-bit and with 8-bit activations (``LAYERLEAP_Q4_ACTIVATIONS``).

    python benchmarks/q4_kernel_distance.py
"""

import os
from pathlib import Path

import torch

import layerleap


def main() -> None:
    fp32 = layerleap.load("smollm2-135m", progress=lambda s: None)
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")[:3000]
    ids = torch.tensor([fp32.tokenizer(text)["input_ids"][:300]])
    with torch.inference_mode():
        ref = fp32(ids)[0].float().log_softmax(-1)  # [T, V]
    for kernel, bits in (("torch", "15"), ("blocks", "15"), ("blocks", "8")):
        os.environ["LAYERLEAP_Q4_KERNEL"], os.environ["LAYERLEAP_Q4_ACTIVATIONS"] = kernel, bits
        q4 = layerleap.load("smollm2-135m", dtype="q4", progress=lambda s: None)
        with torch.inference_mode():
            lq = q4(ids)[0].float().log_softmax(-1)  # [T, V]
        kl = (ref.exp() * (ref - lq)).sum(-1).mean().item()
        top1 = (lq.argmax(-1) == ref.argmax(-1)).float().mean().item()
        name = kernel if kernel == "torch" else f"{kernel}, {bits}-bit activations"
        print(f"{name:30}  formats {sorted({lin.format for lin in q4.projections()})}  KL {kl:.4f}  top-1 {top1:.1%}")


if __name__ == "__main__":
    main()
