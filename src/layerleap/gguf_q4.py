"""4-bit weights straight from a GGUF file, without a dense fp32 copy.

GGUF's Q4_0 and Q4_1 blocks (32 weights, a scale and a minimum or offset) and Q4_K's sub-blocks
(32 weights, a 6-bit scale and minimum under a super-block's fp16 pair) are 4-bit codes with one
affine map per group of 32 inputs: ``kernels.QuantizedRows`` holds exactly that, exact in fp32
(``QuantizedRows.dense()`` equals gguf's own dequantization bit for bit).  Tensors of other block
types (Q8_0, Q6_K, Q5_*, ...) are dequantized and re-quantized to 4-bit groups of 32 (min-max), and
the conversion says which; fp32/fp16 tensors (norms, biases) stay dense.

``convert`` writes a q4 cache folder: ``config.json``, the tokenizer, and ``q4.safetensors`` with
each weight as ``NAME.codes`` (uint8 ``[N, K/2]``, the low nibble the even input), ``NAME.scale``
and ``NAME.minimum`` (fp32 ``[N, K/32]``), or ``NAME`` for a dense tensor; its metadata names the
model's fingerprint (computed from the exact values, so it equals the dense model's).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError
from .files import save_safetensors
from .kernels import GROUP, QuantizedRows, quantize

FORMAT = "layerleap-q4-v1"
WEIGHTS = "q4.safetensors"
EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


# -- GGUF blocks -> QuantizedRows -------------------------------------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """``[n, half]`` bytes -> ``[n, 2 * half]`` codes: low nibbles first, then high (GGUF's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def blocks_to_rows(data: np.ndarray, qtype: str, n_rows: int, n_cols: int) -> QuantizedRows:
    """A Q4_0/Q4_1/Q4_K tensor's raw bytes (``[n_rows, bytes per row]``) -> exact ``QuantizedRows``."""
    raw = np.ascontiguousarray(data).reshape(-1)
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(-1, head + 16)  # [n_blocks, bytes]
        d = _f16(blocks[:, :2])[:, 0]
        q = _nibbles(blocks[:, head:], 16)  # [n_blocks, 32]
        minimum = -8 * d if qtype == "Q4_0" else _f16(blocks[:, 2:4])[:, 0]
        scale = d
    elif qtype == "Q4_K":
        blocks = raw.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of codes
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1]
        sc, mn = _q4k_scale_min(blocks[:, 4:16])  # [n, 8] each
        scale = (d * sc.astype(np.float32)).reshape(-1)  # [n * 8] sub-blocks of 32
        minimum = -(dmin * mn.astype(np.float32)).reshape(-1)
        qs = blocks[:, 16:].reshape(n, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low) and 2c+1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, 32)
    else:
        raise ConfigError(f"GGUF block type {qtype} does not map onto 4-bit groups")
    groups = n_cols // GROUP
    return QuantizedRows(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).reshape(n_rows, n_cols),
                         torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(n_rows, groups),
                         torch.from_numpy(np.ascontiguousarray(minimum, dtype=np.float32)).reshape(n_rows, groups))


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums per super-block (ggml's packing)."""
    s = np.ascontiguousarray(scales).reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# -- nibble storage -------------------------------------------------------------------------------
def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` -> bytes ``[N, K/2]`` (the even input in the low nibble)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_codes(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(b.shape[0], -1)


def rows_to_tensors(name: str, rows: QuantizedRows) -> dict[str, torch.Tensor]:
    return {f"{name}.codes": pack_codes(rows.q), f"{name}.scale": rows.scale.contiguous(),
            f"{name}.minimum": rows.minimum.contiguous()}


def tensors_to_weights(tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedRows | torch.Tensor]:
    """The inverse of ``rows_to_tensors`` over a whole file: ``{name: QuantizedRows or dense tensor}``."""
    out: dict[str, QuantizedRows | torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            out[name] = QuantizedRows(unpack_codes(t), tensors[f"{name}.scale"], tensors[f"{name}.minimum"])
        elif not key.endswith((".scale", ".minimum")):
            out[key] = t
    return out


# -- the conversion ---------------------------------------------------------------------------------
def convert(gguf_path: Path, out: Path, progress) -> None:
    """Read ``gguf_path`` into a q4 cache folder ``out`` (see the module's doc): every 2-D weight as
    ``QuantizedRows`` (exact for Q4_0/Q4_1/Q4_K, re-quantized otherwise), the rest dense."""
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm

    from .loading import gguf_context, hf_to_ours
    from .model import fingerprint_of
    ctx = gguf_context(gguf_path, out)
    reader = GGUFReader(str(gguf_path))
    hf: dict[str, QuantizedRows | torch.Tensor] = {}
    requantized: dict[str, str] = {}
    for t in tqdm(reader.tensors, desc="reading GGUF blocks (4-bit)", leave=False):
        qtype = t.tensor_type.name
        rows_n = int(t.shape[-1]) if len(t.shape) == 2 else 0  # GGUF lists [columns, rows]
        if rows_n:
            name, order = ctx.map_rows(t.name, rows_n)
        else:
            r = ctx.processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                      tensor_key_mapping=ctx.key_map, parsed_parameters=ctx.parsed)
            name, order = ctx.key_map.get(r.name), None
        if name is None or name not in ctx.expected:
            continue
        shape = ctx.expected[name]
        if len(shape) == 2 and qtype in EXACT_TYPES and shape[1] % GROUP == 0:
            rows = blocks_to_rows(t.data, qtype, *shape)
            hf[name] = rows if order is None else rows.take_rows(torch.from_numpy(order))
            continue
        dense = dequantize(t.data, t.tensor_type)
        if len(shape) == 2:
            dense = dense.reshape(shape) if order is None else dense.reshape(shape)[order]
        else:
            dense = ctx.process(dense, t.name)
        w = torch.from_numpy(np.array(dense, dtype=np.float32, order="C", copy=True))
        if tuple(w.shape) != tuple(shape):
            raise ConfigError(f"GGUF tensor {t.name} -> {name} has shape {tuple(w.shape)}, expected {shape}")
        if len(shape) == 2:
            requantized[name] = qtype
            hf[name] = _Requantized(w)
        else:
            hf[name] = w
    missing = sorted(set(ctx.expected) - set(hf))
    if missing:
        raise ConfigError(f"{gguf_path.name}: no GGUF tensor for {missing[:4]}{' …' if len(missing) > 4 else ''}")
    ours = hf_to_ours(hf, ctx.config, consume=True, fuse=_cat_rows)
    exact = {k: (v.exact if isinstance(v, _Requantized) else v.dense() if isinstance(v, QuantizedRows) else v)
             for k, v in ours.items()}
    if ctx.config.tie_embeddings and "lm_head.weight" not in exact:
        exact["lm_head.weight"] = exact["tok_embeddings.weight"]
    fingerprint = fingerprint_of(ctx.config, exact)
    del exact
    tensors: dict[str, torch.Tensor] = {}
    for k, v in ours.items():
        if isinstance(v, _Requantized):
            v = quantize(v.exact)
        tensors.update(rows_to_tensors(k, v) if isinstance(v, QuantizedRows) else {k: v.contiguous()})
    meta = {"format": FORMAT, "fingerprint": fingerprint, "source": gguf_path.name,
            "requantized": json.dumps(_requantized_ours(requantized, ctx.config))}
    save_safetensors(out / WEIGHTS, tensors, meta)
    ctx.save_config_and_tokenizer(out)
    progress(f"4-bit weights: {len(requantized)} GGUF tensor(s) re-quantized to 4-bit groups of {GROUP} "
             f"({', '.join(sorted(set(requantized.values())))})" if requantized else
             "4-bit weights: every GGUF weight kept its 4-bit blocks")


class _Requantized:
    """A dense weight to be quantized after fusion (its exact values feed the fingerprint)."""

    def __init__(self, exact: torch.Tensor):
        self.exact = exact
        self.shape = exact.shape


def _cat_rows(parts: list):
    """``hf_to_ours``'s fuse for mixed parts: rows of QuantizedRows, dense tensors or _Requantized."""
    if all(isinstance(p, QuantizedRows) for p in parts):
        return QuantizedRows.cat(parts)
    dense = [p.exact if isinstance(p, _Requantized) else p.dense() if isinstance(p, QuantizedRows) else p for p in parts]
    return _Requantized(torch.cat(dense, 0))


def _requantized_ours(requantized: dict[str, str], config) -> dict[str, str]:
    """HF names -> block type, for the report (q/k/v and gate/up are fused under our names)."""
    return dict(sorted(requantized.items()))


def read(folder: Path) -> tuple[dict[str, QuantizedRows | torch.Tensor], dict]:
    """A q4 cache folder's weights (our names) and its metadata."""
    from .files import read_safetensors_meta
    from .loading import read_safetensors_file
    meta = read_safetensors_meta(folder / WEIGHTS)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{folder / WEIGHTS} is not a layerleap 4-bit weights file (format {meta.get('format')!r})")
    return tensors_to_weights(read_safetensors_file(folder / WEIGHTS)), meta
