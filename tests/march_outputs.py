"""The native extension's outputs on fixed random inputs, for comparing builds for other ``-march``
targets (``tests/test_native_march.py``): run as ``python tests/march_outputs.py OUT.pt`` under the
build ``$LAYERLEAP_NATIVE_MARCH`` names, it saves a dict of named tensors (block products, attention,
the layers of tiny models in q4 and bf16) and the build's name and paths."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import random_model  # noqa: E402

from layerleap.core import kernels, native  # noqa: E402
from layerleap.core.kernels import BlockWeight, Int8Rows, QuantizedRows  # noqa: E402
from layerleap.core.loading import build, quantize_model  # noqa: E402

# outputs whose arithmetic is exact integer sums scaled by fused multiply-adds (std::fma on every
# path): the same bits on every build.  The others are fp32 sums the compiler fuses where the target
# has FMA; without it (x86-64) they are rounded twice and may differ by float rounding.
EXACT_PREFIXES = ("blocks/",)


def _block_weights(g: torch.Generator) -> dict[str, BlockWeight]:
    n, k = 45, 320
    scale = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
    minimum = (-torch.rand(n, k // 32, generator=g) * 0.4).half().float()
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q8 = Int8Rows(
        torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
        (torch.rand(n, k // 32, generator=g) * 0.01).half().float(),
    )
    return {
        "4bit-fp16": BlockWeight.from_rows(QuantizedRows(codes, scale, minimum)),
        "4bit-fp32": BlockWeight.from_rows(QuantizedRows(codes, scale + 1e-5, minimum)),
        "8bit": BlockWeight.from_int8(q8),
    }


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # a group of zeros
    x[1 % m] = torch.round(x[1 % m] * 4) / 4  # exact ties
    x[2 % m, 40] = 1e4  # an outlier
    return x


def _random_attention(mod, t: dict) -> None:
    """attend_rows on random shapes: ragged key counts (not multiples of 8 or 16), head dims with partial
    slices (hd % 16 of 4, 8, 12: the tail of each key's dot product), 1 to 24 query rows a key head, fp32,
    bf16 and fp16, masks of every kind (none, causal, random, rows with every key masked, strided),
    strided queries and keys, 1 and 2 threads."""
    g = torch.Generator().manual_seed(7)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    threads = torch.get_num_threads()
    for i in range(96):
        dt = pick([torch.float32, torch.bfloat16, torch.float16])
        B, hkv, grp = pick([1, 1, 2]), pick([1, 2, 3]), pick([1, 2, 3, 4])
        S = pick([1, 2, 3, 5, 8, 9, 17, 24]) // grp or 1
        hd = pick([64, 128, 16, 8, 20, 24, 36, 40, 44, 72, 80, 100])
        T = pick([1, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100, 255, 257, 300, 520])
        q = (torch.randn(B, S, hkv * grp, hd, generator=g) * 2).to(dt).transpose(1, 2)  # strided
        if i % 3:
            q = q.contiguous()
        k = (torch.randn(B, hkv, T + 5, hd, generator=g) * 2).to(dt)[:, :, 2 : 2 + T]  # strided keys
        v = torch.randn(B, hkv, T, hd, generator=g).to(dt)
        kind = pick(["none", "causal", "random", "dead rows", "strided"])
        mask = None
        if kind == "causal":
            mask = torch.ones(S, T, dtype=torch.bool).tril(max(0, T - S)).view(1, 1, S, T)
        elif kind == "random":
            mask = torch.rand(pick([1, B]), 1, S, T, generator=g) < pick([0.1, 0.5, 0.9])
        elif kind == "dead rows":
            mask = torch.rand(1, 1, S, T, generator=g) < 0.7
            mask[:, :, ::2] = False
        elif kind == "strided":
            mask = (torch.rand(1, 1, S, 2 * T, generator=g) < 0.8)[..., ::2]
        torch.set_num_threads(1 + i % 2)
        t[f"attend/random/{i}/{str(dt)[6:]}/hd{hd}/T{T}/S{S}/{kind}"] = mod.attend_rows(q, k, v, mask)
    torch.set_num_threads(threads)


def outputs() -> dict:
    mod = native.module()
    if mod is None:
        raise SystemExit(f"no native build for -march={native.march()}: run `layerleap native --build`")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out: dict = {
        "build": native.build_dir().name,
        "paths": list(mod.blocks_paths()),
        "features": list(mod.build_features()),
        "tensors": {},
    }
    t = out["tensors"]
    x = _activations(g, 17, 320)
    for name, w in _block_weights(g).items():
        for fine in (True, False):
            for m in (1, 3, 8, 17):
                for dt in (torch.float32, torch.bfloat16):
                    key = f"blocks/{name}/{'fine' if fine else 'coarse'}/{m}/{str(dt)[6:]}"
                    t[key] = mod.block_matmul(x[:m].to(dt), w.codes, w.dm, w.out_features, fine, "")
    for hd in (64, 40):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            for S, T in ((1, 23), (5, 300)):
                q = torch.randn(1, 9, S, hd, generator=g).to(dt)
                k, v = (torch.randn(1, 3, T, hd, generator=g).to(dt) for _ in range(2))
                mask = torch.rand(1, 1, S, T, generator=g) < 0.7
                mask[..., 0] = True
                t[f"attend/{hd}/{str(dt)[6:]}/{S}"] = mod.attend_rows(q, k, v, mask)
    _random_attention(mod, t)
    for name in ("llama-gqa-tied", "mistral-gqa-untied"):
        m32 = random_model(name)
        sd = {k: v.clone() for k, v in m32.dense_state().items()}
        if m32.config.tie_embeddings:
            del sd["lm_head.weight"]
        models = {"fp32": m32, "bf16": build(m32.config, sd, torch.bfloat16), "q4": quantize_model(random_model(name))}
        for fmt, m in models.items():
            gen = torch.Generator().manual_seed(1)
            V = m.config.vocab_size
            with torch.inference_mode():
                cache = m.new_cache(2, 40)
                cache.pad[1:] = 3
                calls = [m(torch.randint(0, V, (2, 9), generator=gen), cache=cache)]
                calls.append(m(torch.randint(0, V, (2, 1), generator=gen), cache=cache))
                tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
                calls.append(m(torch.randint(0, V, (2, 4), generator=gen), cache=cache, mask=tree))
            for i, y in enumerate(calls):
                t[f"layers/{name}/{fmt}/call{i}"] = y
            t[f"layers/{name}/{fmt}/k"] = cache.k.clone()
    return out


if __name__ == "__main__":
    import os

    os.environ.setdefault(kernels.Q4_ENV, "blocks")  # the block kernel, not a measured choice
    result = outputs()
    tmp = Path(sys.argv[1] + ".tmp")
    torch.save(result, tmp)
    tmp.replace(sys.argv[1])
