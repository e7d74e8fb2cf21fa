"""Weight files, read without building a model: safetensors headers (checked against the file) and
tensors read with plain reads, JSON files, what converting a GGUF file needs from `transformers`,
and the Hugging Face -> layerleap key mapping.  A bad file is a ``ModelFileError`` naming it.
``loading`` (folders, the cache, models) and ``gguf_q4`` (the 4-bit cache) both read through here."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from .. import validate as V
from ..errors import LayerleapError
from .config import ConfigError, ModelConfig


class ModelFileError(ConfigError):
    """A model file that is corrupt, truncated or missing: the message names the file."""


def check_vocab(config: ModelConfig, tokenizer, where: str, fix: str) -> None:
    """Refuse a tokenizer with more tokens than the embedding has rows (``config.vocab_size``): the ids
    past them would crash generation."""
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise ConfigError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens, the embedding {config.vocab_size} rows "
            f"(vocab_size), so token ids from {config.vocab_size} on have no embedding: {fix}"
        )


class GGUFContext:
    """What converting a GGUF file needs from `transformers`: the config, the tokenizer, the GGUF ->
    Hugging Face name map and the per-architecture tensor fix-ups (its own functions, reused)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        self.path = path
        local = dict(gguf_file=path.name, local_files_only=True)  # the file's own folder, never the Hub
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, **local)
        hf_config = AutoConfig.from_pretrained(path.parent, **local)
        self.parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        if "num_key_value_heads" not in self.parsed.get("config", {}):  # as llama.cpp: no GQA without head_count_kv
            hf_config.num_key_value_heads = hf_config.num_attention_heads  # (Qwen2Config's default is 32)
        reader = GGUFReader(str(path))
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        self._set_head_dim(hf_config, reader, arch)
        with torch.device("meta"):  # names and shapes only
            self.hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        self.expected = {k: tuple(v.shape) for k, v in self.hf.state_dict().items()}
        if self.hf.config.tie_word_embeddings:
            self.expected.pop("lm_head.weight", None)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.parsed.get("config", {}))
        self.key_map = get_gguf_hf_weights_map(self.hf, self.processor)
        unused = [t.name for t in reader.tensors if self.key_map.get(t.name) not in self.expected]
        if unused:  # e.g. a llama file's attention biases: ignored, they would leave another model
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise ConfigError(
                f"{path.name}: GGUF tensor {unused[0]}{more} has no place in layerleap's {arch} decoder, which "
                "would ignore it and so compute another model: choose a file without it"
            )
        del reader
        self.config = ModelConfig.from_hf(self._hf_dict(), name=path.stem)
        check_vocab(self.config, self.tokenizer, path.name, "the file is inconsistent, convert it again")

    def _set_head_dim(self, hf_config, reader, arch: str) -> None:
        """The file's head size (``{arch}.attention.key_length``, as llama.cpp reads it) where it is not
        ``hidden_size / head_count`` (Mistral Nemo's 128 beside 5120 / 32), which `transformers` assumes."""
        sizes = {}
        for kind in ("key", "value"):
            field = reader.fields.get(f"{arch}.attention.{kind}_length")
            sizes[kind] = field.contents() if field is not None else None
        key, value = sizes["key"], sizes["value"] if sizes["value"] is not None else sizes["key"]
        if key is None:
            return
        if value != key:
            raise ConfigError(
                f"{self.path.name}: heads with keys of {key} values and values of {value} "
                f"({arch}.attention.key_length, value_length): layerleap runs heads of one size"
            )
        if key != hf_config.hidden_size // hf_config.num_attention_heads:
            hf_config.head_dim = key

    def _hf_dict(self) -> dict:
        cfg = self.hf.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "transformers_version"):
            cfg.pop(k, None)
        return cfg

    def process(self, weights, gguf_name: str):
        """A dequantized tensor after the architecture's fix-ups (e.g. Llama's q/k row order)."""
        return self.processor.process(
            weights=weights, name=gguf_name, tensor_key_mapping=self.key_map, parsed_parameters=self.parsed
        ).weights

    def map_rows(self, gguf_name: str, n_rows: int) -> tuple[str | None, np.ndarray | None]:
        """A 2-D tensor's Hugging Face name and how the fix-ups reorder its rows (an index array, or
        None when they keep the order), found by passing row numbers through the fix-ups."""
        idx = np.arange(n_rows, dtype=np.float32).reshape(n_rows, 1)
        r = self.processor.process(
            weights=idx, name=gguf_name, tensor_key_mapping=self.key_map, parsed_parameters=self.parsed
        )
        out = np.asarray(r.weights)
        if out.shape != (n_rows, 1) or not np.array_equal(np.sort(out[:, 0]), idx[:, 0]):
            raise ConfigError(
                f"{gguf_name}: this architecture's GGUF fix-ups do more than reorder rows; "
                "load it as float32 or bfloat16"
            )
        order = out[:, 0].astype(np.int64)
        return self.key_map.get(r.name), (None if np.array_equal(order, np.arange(n_rows)) else order)

    def shape_error(self, gguf_name: str, name: str, shape) -> ConfigError:
        """The error for tensor ``gguf_name`` (Hugging Face ``name``) of ``shape``, not the config's."""
        rows = name in ("model.embed_tokens.weight", "lm_head.weight")
        tokens = f" (a row per token: the tokenizer has {len(self.tokenizer)} tokens)" if rows else ""
        return ConfigError(
            f"{self.path.name}: GGUF tensor {gguf_name} -> {name} has shape {tuple(int(n) for n in shape)}, expected "
            f"{self.expected[name]}{tokens}: the file's tensors and metadata disagree, convert it again"
        )

    def save_config_and_tokenizer(self, out: Path) -> None:
        from ..files import write_json

        write_json(out / "config.json", self._hf_dict(), indent=2)
        save_tokenizer(self.tokenizer, out)


def save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, where a failed write (a full disk, a folder that cannot be
    written) is always an ``OSError``: `tokenizers` writes tokenizer.json in Rust and reports an I/O
    error as a plain ``Exception`` ("... (os error 28)")."""
    try:
        tokenizer.save_pretrained(folder)
    except OSError:
        raise
    except Exception as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1]))) from None


def gguf_context(path: Path) -> GGUFContext:
    """``GGUFContext(path)``; a file whose metadata `transformers` cannot read (its tokenizer, its config)
    is a ``ModelFileError`` naming the file and the cause, not that library's own exception."""
    try:
        return GGUFContext(path)
    except LayerleapError:
        raise
    except Exception as e:  # transformers, tokenizers and gguf raise many kinds for a bad file
        why = " ".join(str(e).split())[:120]
        raise ModelFileError(
            f"{path}: its metadata cannot be read ({type(e).__name__}: {why}): "
            "convert the model again with llama.cpp (or download the file again)"
        ) from None


def hf_to_ours(sd: dict, config: ModelConfig, consume: bool = False, column_major: bool = False, fuse=None) -> dict:
    """Map a Hugging Face Llama/Qwen2 state dict onto ours (fusing qkv and gate/up), asserting
    every name and shape.  ``consume`` empties ``sd`` as it goes; ``column_major`` builds the fused
    weights directly in that layout (see ``Transformer.optimize_layout``); ``fuse`` replaces the
    row concatenation (for weights that are not dense tensors, e.g. 4-bit rows)."""

    def cat_rows(parts):  # [out_i, in] pieces -> [sum out_i, in]
        return torch.cat([t.t() for t in parts], 1).t() if column_major else torch.cat(parts, 0)

    fuse = fuse or cat_rows

    c = config
    renamed = {
        k.removeprefix("model.") if not k.startswith("lm_head") else k: v
        for k, v in sd.items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    if consume:
        sd.clear()
    sd = renamed
    used: set[str] = set()

    def take(key, shape):
        if key not in sd:
            raise ConfigError(f"weight {key!r} is missing from the checkpoint")
        t = sd[key]
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"weight {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        used.add(key)
        if consume:
            del sd[key]  # free the source as soon as it is used (keeps the loading peak low)
        return t

    D, hd = c.hidden_size, c.head_dim
    out = {
        "tok_embeddings.weight": take("embed_tokens.weight", (c.vocab_size, D)),
        "norm.weight": take("norm.weight", (D,)),
    }
    for i in range(c.n_layers):
        p = f"layers.{i}."
        q = take(p + "self_attn.q_proj.weight", (c.n_heads * hd, D))
        k = take(p + "self_attn.k_proj.weight", (c.n_kv_heads * hd, D))
        v = take(p + "self_attn.v_proj.weight", (c.n_kv_heads * hd, D))
        out[p + "attn.qkv.weight"] = fuse([q, k, v])
        if c.qkv_bias:
            heads = (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads))
            out[p + "attn.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias", (m * hd,)) for n, m in heads])
        out[p + "attn.o.weight"] = take(p + "self_attn.o_proj.weight", (D, c.n_heads * hd))
        gate = take(p + "mlp.gate_proj.weight", (c.intermediate_size, D))
        up = take(p + "mlp.up_proj.weight", (c.intermediate_size, D))
        out[p + "mlp.gate_up.weight"] = fuse([gate, up])
        out[p + "mlp.down.weight"] = take(p + "mlp.down_proj.weight", (D, c.intermediate_size))
        out[p + "attn_norm.weight"] = take(p + "input_layernorm.weight", (D,))
        out[p + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight", (D,))
    if not c.tie_embeddings or "lm_head.weight" in sd:  # untied, or a tied checkpoint that stores its head
        out["lm_head.weight"] = take("lm_head.weight", (c.vocab_size, D))
    extra = sorted(set(sd) - used - set(out))
    if extra:
        raise ConfigError(f"unexpected weights in the checkpoint: {extra[:5]}{' …' if len(extra) > 5 else ''}")
    return out


_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_MAX = 100 << 20  # safetensors' own limit on the JSON header


def _header_json(path: Path) -> tuple[dict, int, int]:
    """A safetensors file's JSON header, its length and the file's size (``ModelFileError`` for a file
    whose header cannot be read)."""
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            text = f.read(n) if n is not None and n <= min(_HEADER_MAX, size - 8) else None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    if text is None:
        raise ModelFileError(
            f"{path} is not a safetensors file or is truncated ({size} bytes): replace it "
            "(re-download or re-convert the model)"
        )
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ModelFileError(
            f"{path} has a corrupt safetensors header: replace it (re-download or re-convert the model)"
        ) from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path} has a corrupt safetensors header: replace it")
    return header, n, size


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, from its header without importing `safetensors` (a
    load does not map its library); ``ModelFileError`` for a file whose header cannot be read."""
    meta = _header_json(path)[0].get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelFileError(f"{path} has a corrupt safetensors header (its metadata): replace it")
    return dict(meta)


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of a safetensors file and where its data starts, after checking that the
    header parses, every entry is consistent (dtype, shape, offsets) and the file holds all the data
    (a truncated or foreign file is a ``ModelFileError`` naming it)."""
    header, n, size = _header_json(path)
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = [V.integer(d, "dim", 0) for d in info["shape"]]
            begin, stop = (V.integer(x, "offset", 0) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, LayerleapError):
            raise ModelFileError(
                f"{path}: tensor {name!r} has a corrupt or unsupported header entry ({V.show(info)}): replace the file"
            ) from None
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise ModelFileError(
                f"{path}: tensor {name!r} has {stop - begin} bytes for shape {shape}: the file is corrupt, replace it"
            )
        entries[name] = {"dtype": info["dtype"], "shape": shape, "data_offsets": [begin, stop]}
    end = 0
    for name, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"]):  # back to back, as written
        if e["data_offsets"][0] != end:
            raise ModelFileError(
                f"{path}: tensor {name!r} does not start where the one before it ends (overlapping or "
                "gapped data): the file is corrupt, replace it"
            )
        end = e["data_offsets"][1]
    if 8 + n + end > size:
        raise ModelFileError(
            f"{path} is truncated: {size} bytes, its header needs {8 + n + end}: replace it "
            "(re-download or re-convert the model)"
        )
    return entries, 8 + n


def read_safetensors_file(
    path: Path, dtype: torch.dtype | None = None, header: tuple[dict, int] | None = None, place=None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file tensor by tensor with plain reads, so every tensor owns its memory
    (no file mapping stays resident beside the weights); floating tensors are cast to ``dtype``
    one at a time.  The header is checked first (``safetensors_header``).  ``place(name, nbytes)``,
    when given, returns a uint8 tensor of ``nbytes`` to read tensor ``name`` into (e.g. room in a
    ``cpu.HugePageArena``), or None for memory of its own."""
    entries, base = header or safetensors_header(Path(path))
    out = {}
    with open(path, "rb") as f:
        for name, info in entries.items():
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            room = place(name, end - begin) if place is not None and end > begin else None
            buf = bytearray(end - begin) if room is None else room.numpy()
            if f.readinto(buf) != end - begin:
                raise ModelFileError(f"{path} is truncated at tensor {name!r}: replace it")
            dt = _ST_DTYPES[info["dtype"]]
            if room is not None:
                t = room.view(dt)
            else:
                t = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
            t = t.reshape(info["shape"])
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def read_json(path: Path, what: str = "file") -> dict:
    """A JSON object from ``path`` (``files.read_json``); a ``ModelFileError`` naming the file when it is not one."""
    from ..files import read_json as read

    return read(path, what, f"repair or replace the {what}", error=ModelFileError, limit=None)


# -- a GGUF file's header, read without the tensors -------------------------------------------------
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path, fix: str | None = None) -> tuple[dict, list[tuple[str, int, list[int], int]], int]:
    """A GGUF file's metadata (scalars and strings; arrays skipped), its tensor infos ``(name, type
    id, dims, offset)`` and where the tensor data starts, read with plain reads (the ``gguf`` reader
    maps every tensor at once and fails without naming what is wrong in a truncated file).  A header
    that does not parse raises ``ModelFileError`` naming the file (and ``fix``, when given, as the fix)."""
    import mmap
    import struct

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ModelFileError(f"{path} is empty: {fix or 'it is not a GGUF file'}") from None
    pos = 0

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(buf):
            raise struct.error("string past the end")
        v = bytes(buf[pos : pos + n]).decode("utf-8", "replace")
        pos += n
        return v

    def value(kind: int):
        nonlocal pos
        if kind in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            item, n = take("<I"), take("<Q")
            if item in _GGUF_SCALARS:
                pos += n * struct.calcsize(_GGUF_SCALARS[item])
            else:
                for _ in range(n):
                    value(item)
            return None
        raise struct.error(f"unknown value type {kind}")

    try:
        if bytes(buf[:4]) != b"GGUF":
            raise ModelFileError(f"{path} does not start with GGUF's magic bytes: {fix or 'it is not a GGUF file'}")
        pos = 4
        version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
        if version not in (2, 3) and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise ModelFileError(
                f"{path} is a big-endian GGUF file: layerleap reads little-endian ones, convert the model again "
                "without --bigendian"
            )
        if version not in (2, 3):
            raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            tensors.append((name, take("<I"), dims, take("<Q")))
        align = meta.get("general.alignment")
        align = align if isinstance(align, int) and align > 0 else 32  # else refused by ``loading.check_gguf``
        start = (pos + align - 1) // align * align
    except struct.error:
        raise ModelFileError(
            f"{path}: the GGUF header is cut short or corrupt: {fix or 'download or convert it again'}"
        ) from None
    finally:
        buf.close()
    return meta, tensors, start
