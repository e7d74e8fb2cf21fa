"""Model variants: a packaged model with trained low-rank weight deltas merged in.

A variant is a weights file (``weights``: kind ``variant``) of low-rank deltas ``ΔW = (alpha / r) B A``
for some of each decoder layer's projections (``attn.qkv``, ``attn.o``, ``mlp.gate_up``,
``mlp.down``): ``A`` ``[r, in]`` and ``B`` ``[out, r]`` under ``layers.{l}.{projection}.A`` / ``.B``.
Loading merges them into the dense weights before the weights are packed for the CPU's kernel, so a
variant runs exactly as fast as the model it came from.  A full 135M model is 540 MB; its deltas
at rank 16 are 8 MB.

``layerleap.load(MODEL, variant=FILE)`` loads a file of deltas; a name instead of a path loads the file
shipped as ``data/variants/MODEL/NAME.safetensors`` (none ships for smollm2-135m: neither a CPU
fine-tune nor 48 s on an H200 keeps a quality budget against the base model, ``docs/QUALITY.md``).
The merged model has a fingerprint of its own (the base's and the file's), so heads trained for
the base model are not silently used with it.  Written by ``layerleap finetune variant``
(``train/variant.py``), with the training budget every trained file records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..core.loading import load as load_base, to_device
from ..core.model import Transformer
from .. import validate as V
from ..errors import LayerleapError
from . import weights

KIND = "variant"
PROJECTIONS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
FOLDER = Path(__file__).resolve().parent.parent / "data" / "variants"


class VariantError(LayerleapError, ValueError):
    pass


def projection(model: Transformer, layer: int, name: str):
    """The ``Linear`` of projection ``name`` (one of ``PROJECTIONS``) in decoder layer ``layer``."""
    mod = model.layers[layer]
    for part in name.split("."):
        mod = getattr(mod, part)
    return mod


def delta_names(layer: int, name: str) -> tuple[str, str]:
    return f"layers.{layer}.{name}.A", f"layers.{layer}.{name}.B"


def merge(model: Transformer, build: dict, tensors: dict[str, torch.Tensor]) -> Transformer:
    """Add each delta ``(alpha / r) B A`` to the model's dense weights (in fp32) and pack them again."""
    rank, alpha = int(build["rank"]), float(build["alpha"])
    model.unpack()
    with torch.no_grad():
        for layer in build["layers"]:
            for name in build["projections"]:
                a, b = (tensors[k] for k in delta_names(layer, name))  # [r, in], [out, r]
                lin = projection(model, layer, name)
                if a.shape != (rank, lin.in_features) or b.shape != (lin.out_features, rank):
                    raise RuntimeError(
                        f"layer {layer} {name}: deltas {tuple(b.shape)} x {tuple(a.shape)} do not fit "
                        f"a {lin.out_features} x {lin.in_features} weight"
                    )
                w = lin.weight.float() + (alpha / rank) * (b.float() @ a.float())
                lin.weight.copy_(w.to(lin.weight.dtype))
    return model.optimize_layout()


def _build(model: Transformer, build: dict, tensors: dict) -> dict:
    """The build and the deltas, checked before any weight changes (``weights.read`` turns a ``KeyError``,
    ``TypeError``, ``ValueError`` or ``RuntimeError`` into a ``VariantError`` naming the file)."""
    rank, alpha = int(build["rank"]), float(build["alpha"])
    layers, names = [int(x) for x in build["layers"]], [str(x) for x in build["projections"]]
    if rank < 1:
        raise ValueError(f"rank {rank} is not positive")
    bad = [x for x in layers if not 0 <= x < model.config.n_layers] + [x for x in names if x not in PROJECTIONS]
    if bad:
        raise ValueError(f"no layer or projection {bad[0]!r} in this model (projections: {', '.join(PROJECTIONS)})")
    for layer in layers:
        for name in names:
            lin = projection(model, layer, name)
            shapes = ((rank, lin.in_features), (lin.out_features, rank))
            for key, shape in zip(delta_names(layer, name), shapes):
                t = tensors[key]
                if tuple(t.shape) != shape:
                    raise ValueError(f"tensor {key} is {list(t.shape)}, not {list(shape)}")
                weights.finite_float(key, t)
    return {
        "build": {**build, "rank": rank, "alpha": alpha, "layers": layers, "projections": names},
        "tensors": tensors,
    }


VARIANT = weights.Kind(KIND, "model variant deltas", "layerleap finetune variant", VariantError, _build)


def _plain(name) -> bool:
    """Whether ``name`` is one name, not a path (a model folder's path or a variant file's joins no folder
    of the shipped variants)."""
    name = str(name)
    return bool(name) and name not in (".", "..") and Path(name).name == name


def shipped_variants(model_name: str) -> list[str]:
    """Names of the variants shipped for a packaged model (none for a model folder's path)."""
    if not _plain(model_name):
        return []
    folder = FOLDER / str(model_name)
    return sorted(p.stem for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def variant_file(model_name: str, variant: str) -> Path:
    """The file of ``variant``: a shipped name for ``model_name``, or a path."""
    if not isinstance(variant, (str, Path)) or not str(variant).strip():
        raise VariantError(f"variant must be a shipped variant name or a .safetensors file, got {variant!r}")
    with V.raising(VariantError):
        q = V.path(variant, "variant")
    if _plain(model_name) and _plain(variant):
        p = FOLDER / str(model_name) / f"{variant}.safetensors"
        if p.is_file():
            return p
    if q.suffix.lower() == ".safetensors" and q.is_file():
        return q
    names = shipped_variants(str(model_name))
    choose = f"choose one of {', '.join(names)} or give" if names else "none ships with the package: give"
    raise VariantError(
        f"no variant {str(variant)!r} for {model_name}: {choose} a .safetensors file written by "
        "`layerleap finetune variant`"
    )


def apply(model: Transformer, path: str | Path) -> Transformer:
    """Merge the variant file ``path`` (checked against the model's fingerprint) into ``model``."""
    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16) or model.dtype_name == "q4":
        raise VariantError("a variant merges into dense weights: load the model with dtype float32 or bfloat16, not q4")
    base_fp = model.fingerprint
    got = weights.read(model, path, VARIANT)
    merge(model, got["build"], got["tensors"])
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    model.set_fingerprint(hashlib.sha256(f"{base_fp}+{digest}".encode()).hexdigest()[: len(base_fp)])
    model.variant = Path(path).stem
    model.variant_file = str(path)  # what `--variant` names to load it again
    return model


def load(
    name_or_path: str = "smollm2-135m",
    dtype="float32",
    progress=None,
    variant: str | None = None,
    device: str = "cpu",
) -> Transformer:
    """``core.loading.load``, then the ``variant``'s deltas merged in (a shipped name or a file), on
    ``device`` ("cpu", "cuda", "cuda:1"; ``core.loading.to_device``)."""
    if variant is None:
        return to_device(load_base(name_or_path, dtype, progress), device)
    path = variant_file(name_or_path, variant)
    if dtype in ("q4",):
        raise VariantError("a variant merges into dense weights: load it with dtype float32 or bfloat16, not q4")
    return to_device(apply(load_base(name_or_path, dtype, progress), path), device)


__all__ = [
    "PROJECTIONS",
    "VARIANT",
    "VariantError",
    "apply",
    "delta_names",
    "load",
    "merge",
    "projection",
    "shipped_variants",
    "variant_file",
]
