"""4-bit weights straight from a GGUF file, without a dense fp32 copy.

GGUF's Q4_0 and Q4_1 blocks (32 weights, a scale and a minimum or offset) and Q4_K's sub-blocks
(32 weights, a 6-bit scale and minimum under a super-block's fp16 pair) are 4-bit codes with one
affine map per group of 32 inputs: ``kernels.QuantizedRows`` holds exactly that, exact in fp32
(``QuantizedRows.dense()`` equals gguf's own dequantization bit for bit).

Q6_K tensors (which Q4_K_M files use for some ``ffn_down``/``attn_v`` and the LM head) are kept as
stored too (``kernels.Q6Rows``: 6-bit codes, an int8 scale per 16 inputs, an fp16 one per 256, exact),
and the native block kernel multiplies them as they are (beside torch's int4 kernel they are
re-quantized at load: 4 bits in the layers, 8 for the embedding and head).  Other block types keep the
file's precision where it matters and are re-quantized where it does not, and the conversion says
which:

- the embedding table and the LM head (GGUF files keep them at 6-8 bits): a Q8_0 table stays 8-bit
  codes with its scales (``kernels.Int8Rows``, exact), another type (F16, Q5_K, ...) is re-quantized
  to 8-bit groups of 32 (Q8_0, ``kernels.quantize_q8``); never 4 bits (on SmolLM2-135M a 4-bit LM
  head lowered the greedy top-1 agreement with the fp32 model from 97.8% to 87.5% of positions;
  ``docs/BENCHMARKS.md``);
- a projection fused from kept parts of different types (Q4_K_M's Q4_K ``attn_q``/``attn_k`` with a
  Q6_K ``attn_v``) keeps each part as stored (``kernels.MixedRows``; the block kernel multiplies it as
  ``kernels.StackWeight``);
- a projection inside a layer in another type (Q5_*, Q8_0, ...) is dequantized and re-quantized to
  4-bit groups of 32 (min-max), with the parts fused with it;
- fp32/fp16 tensors (norms, biases) stay dense.

``convert`` writes a q4 cache folder: ``config.json``, the tokenizer, and ``q4.safetensors`` with a
4-bit weight as ``NAME.codes`` (uint8 ``[N, K/2]``, the low nibble the even input), ``NAME.scale``
and ``NAME.minimum`` (fp32 ``[N, K/32]``), an 8-bit table as ``NAME.int8`` and ``NAME.int8_scale``,
a Q6_K weight as ``NAME.q6`` (uint8 codes ``[N, K]``), ``NAME.q6_scale`` (int8 ``[N, K/16]``) and
``NAME.q6_d`` (fp32 ``[N, K/256]``), a weight of mixed parts as ``NAME.parts`` (their count) and part
``i`` under ``NAME.part{i}`` in its own form, or ``NAME`` for a dense tensor; its metadata names the
model's fingerprint (computed from the exact values, so it equals the dense model's).  A folder
converted before Q6_K was kept (its metadata lacks ``q6_k``, and it re-quantized Q6_K tensors), or
before mixed parts were kept (it lacks ``mixed`` and re-quantized such a fused weight), fails
``check`` and is converted again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import ConfigError, ModelConfig
from ..files import remove_stale_temporaries, save_safetensors
from .kernels import GROUP, Q6_BLOCK, Int8Rows, MixedRows, Q6Rows, QuantizedRows, quantize, quantize_q8
from .model import Transformer

FORMAT = "layerleap-q4-v1"
WEIGHTS = "q4.safetensors"
EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
OUTER = ("model.embed_tokens.weight", "lm_head.weight")  # kept at the file's precision (see above)
BLOCKS_LAYOUT = "blocks16-v2"  # kernels.BlockWeight's layout (one for every CPU)
WEIGHT_KEYS = (".codes", ".scale", ".minimum", ".int8", ".int8_scale", ".q6", ".q6_scale", ".q6_d", ".parts")
SIDE_KEYS = tuple(k for k in WEIGHT_KEYS if k not in (".codes", ".int8", ".q6"))  # beside a weight's main tensor
STACK_PART_KEYS = ("codes", "dm", "bits", "out_features")  # a packed StackWeight's tensors per part
BLOCK_TENSORS = (
    ".codes",
    ".dm",
)  # the packed file's block-weight tensors (a StackWeight's parts' too): read into huge pages


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
    return QuantizedRows(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).reshape(n_rows, n_cols),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(n_rows, groups),
        torch.from_numpy(np.ascontiguousarray(minimum, dtype=np.float32)).reshape(n_rows, groups),
    )


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
    out = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.uint8)
    out[:, 0::2] = b & 0x0F
    out[:, 1::2] = b >> 4
    return out


def rows_to_tensors(name: str, rows: QuantizedRows) -> dict[str, torch.Tensor]:
    return {
        f"{name}.codes": pack_codes(rows.q),
        f"{name}.scale": rows.scale.contiguous(),
        f"{name}.minimum": rows.minimum.contiguous(),
    }


def weight_tensors(name: str, w) -> dict[str, torch.Tensor]:
    """One weight as the file's tensors (see the module's doc)."""
    if isinstance(w, QuantizedRows):
        return rows_to_tensors(name, w)
    if isinstance(w, Int8Rows):
        return {f"{name}.{k}": v for k, v in w.state().items()}
    if isinstance(w, Q6Rows):
        return {f"{name}.q6": w.q.contiguous(), f"{name}.q6_scale": w.sc.contiguous(), f"{name}.q6_d": w.d.contiguous()}
    if isinstance(w, MixedRows):
        out = {f"{name}.parts": torch.tensor([len(w.parts)])}
        for i, part in enumerate(w.parts):
            out.update(weight_tensors(f"{name}.part{i}", part))
        return out
    return {name: w.contiguous()}


def tensors_to_weights(tensors: dict[str, torch.Tensor]) -> dict:
    """The inverse of ``weight_tensors`` over a whole file: ``{name: QuantizedRows, Int8Rows, Q6Rows,
    MixedRows or tensor}``."""
    out: dict = {}
    for key, t in tensors.items():
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            out[name] = QuantizedRows(unpack_codes(t), tensors[f"{name}.scale"], tensors[f"{name}.minimum"])
        elif key.endswith(".int8"):
            name = key[: -len(".int8")]
            out[name] = Int8Rows(t, tensors[f"{name}.int8_scale"])
        elif key.endswith(".q6"):
            name = key[: -len(".q6")]
            out[name] = Q6Rows(t, tensors[f"{name}.q6_scale"], tensors[f"{name}.q6_d"])
        elif not key.endswith(SIDE_KEYS):
            out[key] = t
    for key, t in tensors.items():
        if key.endswith(".parts"):
            name = key[: -len(".parts")]
            out[name] = MixedRows([out.pop(f"{name}.part{i}") for i in range(int(t[0]))])
    return out


def q6_k_rows(data: np.ndarray, n_rows: int, n_cols: int) -> Q6Rows:
    """A Q6_K tensor's raw bytes (blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, an fp16 scale) -> exact ``Q6Rows`` (ggml's order of the codes)."""
    blocks = np.ascontiguousarray(data).reshape(-1, 210)
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0x0F).reshape(n, 2, 128) | ((qh & 0x03).reshape(n, 2, 128) << 4)  # [n, 2 halves, 128]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    d = _f16(blocks[:, 208:210])
    return Q6Rows(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).reshape(n_rows, n_cols),
        torch.from_numpy(sc.copy()).reshape(n_rows, n_cols // 16),
        torch.from_numpy(np.ascontiguousarray(d)).reshape(n_rows, n_cols // Q6_BLOCK),
    )


def q8_0_rows(data: np.ndarray, n_rows: int, n_cols: int) -> Int8Rows:
    """A Q8_0 tensor's raw bytes (blocks of an fp16 scale and 32 int8 codes) -> exact ``Int8Rows``."""
    blocks = np.ascontiguousarray(data).reshape(-1, 34)
    d = _f16(blocks[:, :2])[:, 0]
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    return Int8Rows(
        torch.from_numpy(q.copy()).reshape(n_rows, n_cols), torch.from_numpy(d.copy()).reshape(n_rows, n_cols // GROUP)
    )


# -- the conversion ---------------------------------------------------------------------------------
def check_sizes(config: ModelConfig, where: str) -> None:
    """Refuse a model whose layers' input sizes are not whole groups of ``GROUP`` (every projection's
    4-bit rows need them), naming ``where`` and the dtypes that load it."""
    sizes = {
        "hidden_size": config.hidden_size,
        "num_attention_heads x head_dim": config.n_heads * config.head_dim,
        "intermediate_size": config.intermediate_size,
    }
    off = [f"{k} {v}" for k, v in sizes.items() if v % GROUP]
    if off:
        raise ConfigError(
            f"{where}: dtype q4 multiplies 4-bit groups of {GROUP} inputs, and its {' and '.join(off)} "
            f"{'is' if len(off) == 1 else 'are'} not a multiple of {GROUP}: load it with dtype float32 or bfloat16"
        )


def convert(gguf_path: Path, out: Path, progress) -> None:
    """Read ``gguf_path`` into a q4 cache folder ``out`` (see the module's doc): every 2-D weight as its
    blocks (``QuantizedRows``, ``Q6Rows``, ``Int8Rows`` or ``MixedRows``: exact) or re-quantized, the
    rest dense."""
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm

    from .weight_files import gguf_context, hf_to_ours
    from .model import fingerprint_of

    ctx = gguf_context(gguf_path)
    check_sizes(ctx.config, gguf_path.name)
    reader = GGUFReader(str(gguf_path))
    hf: dict[str, QuantizedRows | torch.Tensor] = {}
    requantized: dict[str, str] = {}
    kept: dict[str, str] = {}  # 2-D tensors kept at the file's precision
    for t in tqdm(reader.tensors, desc="reading GGUF blocks (4-bit)", leave=False):
        qtype = t.tensor_type.name
        rows_n = int(t.shape[-1]) if len(t.shape) == 2 else 0  # GGUF lists [columns, rows]
        if rows_n:
            name, order = ctx.map_rows(t.name, rows_n)
        else:
            r = ctx.processor.process(
                weights=dequantize(t.data, t.tensor_type),
                name=t.name,
                tensor_key_mapping=ctx.key_map,
                parsed_parameters=ctx.parsed,
            )
            name, order = ctx.key_map.get(r.name), None
        if name is None or name not in ctx.expected:
            continue
        shape = ctx.expected[name]
        got = tuple(int(n) for n in reversed(t.shape))  # GGUF lists [columns, rows]
        if len(shape) == 2 and got != shape:  # before the blocks are reshaped to it
            raise ctx.shape_error(t.name, name, got)
        if len(shape) == 2 and qtype in EXACT_TYPES and shape[1] % GROUP == 0:
            rows = blocks_to_rows(t.data, qtype, *shape)
            hf[name] = rows if order is None else rows.take_rows(torch.from_numpy(order))
            continue
        if len(shape) == 2 and qtype == "Q6_K" and shape[1] % Q6_BLOCK == 0:
            rows = q6_k_rows(t.data, *shape)
            hf[name] = rows if order is None else rows.take_rows(torch.from_numpy(order))
            if name in OUTER:
                kept[name] = qtype
            continue
        if name in OUTER and qtype == "Q8_0" and order is None and shape[1] % GROUP == 0:
            hf[name] = q8_0_rows(t.data, *shape)
            kept[name] = qtype
            continue
        dense = dequantize(t.data, t.tensor_type)
        if len(shape) == 2:
            dense = dense.reshape(shape) if order is None else dense.reshape(shape)[order]
        else:
            dense = ctx.process(dense, t.name)
        w = torch.from_numpy(np.array(dense, dtype=np.float32, order="C", copy=True))
        if tuple(w.shape) != tuple(shape):
            raise ctx.shape_error(t.name, name, w.shape)
        if len(shape) == 2 and name not in OUTER:
            requantized[name] = qtype
            hf[name] = _Requantized(w)
        elif len(shape) == 2 and shape[1] % GROUP == 0 and qtype not in ("F32",):
            kept[name] = f"Q8_0 from {qtype}"
            hf[name] = _Requantized(w, bits=8)
        else:
            kept[name] = qtype
            hf[name] = w
    missing = sorted(set(ctx.expected) - set(hf))
    if missing:
        raise ConfigError(f"{gguf_path.name}: no GGUF tensor for {missing[:4]}{' …' if len(missing) > 4 else ''}")
    ours = hf_to_ours(hf, ctx.config, consume=True, fuse=_cat_rows)
    exact = {
        k: (
            v.exact
            if isinstance(v, _Requantized)
            else v.dense()
            if isinstance(v, (QuantizedRows, Int8Rows, Q6Rows, MixedRows))
            else v
        )
        for k, v in ours.items()
    }
    if ctx.config.tie_embeddings and "lm_head.weight" not in exact:
        exact["lm_head.weight"] = exact["tok_embeddings.weight"]
    fingerprint = fingerprint_of(ctx.config, exact)
    del exact
    tensors: dict[str, torch.Tensor] = {}
    for k, v in ours.items():
        if isinstance(v, _Requantized):
            v = quantize(v.exact) if v.bits == 4 else quantize_q8(v.exact)
        elif isinstance(v, torch.Tensor) and v.dim() == 2:
            v = v.to(torch.bfloat16)  # an outer matrix of another type: bf16, as it multiplies
        tensors.update(weight_tensors(k, v))
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "source": gguf_path.name,
        "requantized": json.dumps(dict(sorted(requantized.items()))),
        "kept": json.dumps({k: v for k, v in sorted(kept.items()) if v not in ("F32", "F16")}),
        "q6_k": "blocks",  # Q6_K tensors kept as stored (a folder without this re-quantized them: converted again)
        "mixed": "parts",  # fused parts of different types kept as stored (without: re-quantized, converted again)
    }
    save_safetensors(out / WEIGHTS, tensors, meta)
    ctx.save_config_and_tokenizer(out)
    outer = {k: v for k, v in kept.items() if k in OUTER}
    kept = ", ".join(f"{k} ({v})" for k, v in outer.items())
    progress(
        "4-bit weights: every layer's GGUF 4-bit (and Q6_K) blocks kept"
        + (
            f"; {len(requantized)} layer tensor(s) re-quantized to 4-bit groups of {GROUP} "
            f"({', '.join(sorted(set(requantized.values())))})"
            if requantized
            else ""
        )
        + (f"; embedding and LM head: {', '.join(f'{k} ({v})' for k, v in outer.items())}" if outer else "")
    )


class _Requantized:
    """A dense weight to be quantized after fusion (its exact values feed the fingerprint)."""

    def __init__(self, exact: torch.Tensor, bits: int = 4):
        self.exact, self.bits = exact, bits
        self.shape = exact.shape


def _cat_rows(parts: list):
    """``hf_to_ours``'s fuse: kept blocks stay as stored (``MixedRows`` when their types differ); with a
    dense tensor or ``_Requantized`` among them, all is re-quantized."""
    if all(isinstance(p, (QuantizedRows, Q6Rows)) for p in parts):
        return MixedRows.of(parts)
    dense = [
        p.exact if isinstance(p, _Requantized) else p.dense() if isinstance(p, (QuantizedRows, Q6Rows)) else p
        for p in parts
    ]
    return _Requantized(torch.cat(dense, 0))


def check(folder: Path) -> tuple:
    """Check a q4 cache folder without reading its weights: -> (config, metadata, header).  Every
    problem (config, tokenizer, a truncated or foreign weights file, a missing weight) raises a
    ``LayerleapError`` that names the file."""
    from .weight_files import ModelFileError, read_json, safetensors_header, safetensors_metadata

    config = ModelConfig.from_hf(read_json(folder / "config.json", "model config"), name=folder.name)
    for tok in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / tok).is_file():
            read_json(folder / tok, "tokenizer file")
    path = folder / WEIGHTS
    header = safetensors_header(path)
    meta = safetensors_metadata(path)
    if meta.get("format") != FORMAT or not meta.get("fingerprint"):
        raise ModelFileError(
            f"{path} is not a layerleap 4-bit weights file (format {meta.get('format')!r}): delete it to convert again"
        )
    if meta.get("q6_k") != "blocks" and "Q6_K" in meta.get("requantized", "") + meta.get("kept", ""):
        raise ModelFileError(f"{path} re-quantized its Q6_K tensors (an older conversion): delete it to convert again")
    if meta.get("mixed") != "parts" and "fused from mixed types" in meta.get("requantized", ""):
        raise ModelFileError(
            f"{path} re-quantized its weights fused from mixed block types (an older conversion): "
            "delete it to convert again"
        )
    names = {k.rsplit(".", 1)[0] if k.endswith(WEIGHT_KEYS) else k for k in header[0]}
    need = {"tok_embeddings.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight"
        for i in range(config.n_layers)
        for n in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    }
    missing = sorted(need - names)
    if missing:
        raise ModelFileError(
            f"{path} lacks {missing[:3]}: the 4-bit weights are incomplete, delete the folder to convert again"
        )
    return config, meta, header


def read(folder: Path) -> tuple[dict[str, QuantizedRows | torch.Tensor], dict]:
    """A q4 cache folder's weights (our names) and its metadata (checked first, ``check``)."""
    from .weight_files import read_safetensors_file

    _, meta, header = check(folder)
    return tensors_to_weights(read_safetensors_file(folder / WEIGHTS, header=header)), meta


# -- the packed layout, cached per CPU --------------------------------------------------------------
def packed_file(folder: Path) -> Path:
    """The packed cache for this CPU's 4-bit format: the block layout is the same on every CPU, torch's
    int4 layout depends on the CPU and torch version."""
    from .kernels import packed_layout, q4_format

    if q4_format() == "blocks":
        return folder / f"packed-{BLOCKS_LAYOUT}.safetensors"
    return folder / f"packed-{packed_layout()}.safetensors"


def save_packed(folder: Path, model) -> None:
    """Cache ``model``'s weights as they multiply (best effort: an unwritable cache only costs packing
    again): int4 and int8 formats as their tensors, a oneDNN-packed matrix as its dense bf16 weight
    (packed again at load), the norms.  The metadata maps every packed module to the module whose
    tensors it uses (a tied head shares the embedding's 4-bit weight) and to its format."""
    from ..errors import LayerleapError
    from .kernels import BlockWeight, Int4Weight, Int8Rows, StackWeight
    from .model import Embedding, Linear

    tensors, modules, first = {}, {}, {}
    for name, mod in model.named_modules():
        if not isinstance(mod, (Linear, Embedding)) or mod.packed is None:
            continue
        fmt = mod.packed
        if not isinstance(fmt, (Int4Weight, Int8Rows, BlockWeight, StackWeight)):  # oneDNN: stored dense, packed again
            tensors[f"{name}.weight"] = fmt.dense().contiguous()
            if fmt.bias is not None:
                tensors[f"{name}.bias"] = fmt.bias
            continue
        owner = first.setdefault(id(fmt), name)
        modules[name] = [owner, type(fmt).__name__]
        if owner == name:
            tensors.update({f"{name}.{k}": v for k, v in fmt.state().items()})
            tensors[f"{name}.out_features"] = torch.tensor([fmt.out_features])
    tensors.update({n: p.detach() for n, p in model.named_parameters()})  # norms, dense tables
    meta = {"format": FORMAT + "-packed", "fingerprint": model.fingerprint, "modules": json.dumps(modules)}
    path = packed_file(folder)
    try:
        path.unlink(missing_ok=True)  # the cache's own file, unreadable or stale (else it was loaded): rebuilt
        remove_stale_temporaries(path)  # a killed process's half-written copy, as large as the file
        save_safetensors(path, tensors, meta)
    except (LayerleapError, OSError):
        pass


def load_packed(folder: Path, config, tokenizer):
    """The model from ``packed_file`` when it is there and sound, else None (then it is rebuilt)."""
    from ..errors import LayerleapError
    from .cpu import HugePageArena
    from .kernels import KernelError
    from .weight_files import read_safetensors_file, safetensors_header, safetensors_metadata

    path = packed_file(folder)
    if not path.is_file():
        return None
    try:
        meta = safetensors_metadata(path)
        if meta.get("format") != FORMAT + "-packed":
            return None
        header = safetensors_header(path)
        blocks = [e["data_offsets"] for k, e in header[0].items() if k.endswith(BLOCK_TENSORS)]
        arena = HugePageArena(sum(HugePageArena.size(stop - begin) for begin, stop in blocks))
        place = (
            (lambda name, n: arena.take(n) if name.endswith(BLOCK_TENSORS) else None) if arena.buf is not None else None
        )
        tensors = read_safetensors_file(path, header=header, place=place)
        model = build_q4_packed(
            config, tensors, json.loads(meta["modules"]), tokenizer, in_huge_pages=place is not None
        )
    except (LayerleapError, KernelError, KeyError, ValueError, RuntimeError, TypeError):
        return None
    except OSError:  # another process loading the model removed the file meanwhile (``save_packed``): rebuilt
        return None
    model.set_fingerprint(meta["fingerprint"])
    return model


def assemble_q4(
    config: ModelConfig, formats: dict, dense: dict, tokenizer=None, source=None, in_huge_pages: bool = False
) -> Transformer:
    """Put ``formats`` (module name -> packed weight) and ``dense`` tensors (state_dict names, cast to
    bf16) into a Transformer built on the meta device; refuse anything left unfilled.  The block
    weights' tensors move into huge pages (``kernels.to_huge_pages``) unless ``in_huge_pages`` says
    they were read there."""
    from .kernels import to_huge_pages
    from .model import rope_tables

    with torch.device("meta"):
        model = Transformer(config, tokenizer=tokenizer, source=source)
    mods = dict(model.named_modules())
    if not in_huge_pages:
        to_huge_pages(formats.values())
    for name, fmt in formats.items():
        mods[name].pack(fmt)
    if config.tie_embeddings and "lm_head.weight" in dense:
        model.lm_head.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, device="meta"))  # untied
    _, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in dense.items()}, strict=False, assign=True
    )
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and "rope" not in n]
    if unexpected or left:
        raise ConfigError(f"4-bit weights do not fit the config: unexpected {unexpected[:3]}, missing {left[:3]}")
    cos, sin = rope_tables(config)
    model.rope_cos, model.rope_sin = cos, sin
    return model.eval().requires_grad_(False).optimize_layout()


def build_q4_packed(
    config: ModelConfig, tensors: dict, modules: dict, tokenizer=None, in_huge_pages: bool = False
) -> Transformer:
    """A 4-bit model from the packed cache (``gguf_q4.save_packed``): ``modules`` maps each packed
    module to [the module whose tensors it uses, the format's class name]; ``in_huge_pages``: the
    block weights' tensors were read into huge pages (``assemble_q4``)."""
    from .kernels import BlockWeight, Int4Weight, Int8Rows, StackWeight

    formats, made = {}, {}
    for name, (owner, kind) in modules.items():
        if owner not in made:
            n = int(tensors.pop(f"{owner}.out_features")[0])
            if kind == "Int4Weight":
                made[owner] = Int4Weight.from_packed(
                    tensors.pop(f"{owner}.packed"),
                    tensors.pop(f"{owner}.scale_zero"),
                    n,
                    tensors.pop(f"{owner}.bias", None),
                )
            elif kind == "BlockWeight":
                made[owner] = BlockWeight(
                    tensors.pop(f"{owner}.codes"),
                    tensors.pop(f"{owner}.dm"),
                    n,
                    int(tensors.pop(f"{owner}.bits")[0]),
                    tensors.pop(f"{owner}.bias", None),
                )
            elif kind == "Int8Rows":
                made[owner] = Int8Rows(tensors.pop(f"{owner}.int8"), tensors.pop(f"{owner}.int8_scale"))
            elif kind == "StackWeight":
                n_parts = int(tensors[f"{owner}.parts"][0])
                keys = ["parts", "bias"] + [f"part{i}.{k}" for i in range(n_parts) for k in STACK_PART_KEYS]
                state = {k: tensors.pop(f"{owner}.{k}") for k in keys if f"{owner}.{k}" in tensors}
                made[owner] = StackWeight.from_state(state)
            else:
                raise ConfigError(f"unknown packed format {kind!r}")
        formats[name] = made[owner]
    return assemble_q4(config, formats, tensors, tokenizer, in_huge_pages=in_huge_pages)
