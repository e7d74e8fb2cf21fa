"""layerleap: faster decoding from what intermediate layers already know.

The names below are imported on first use (PEP 562), so ``import layerleap`` and the ``layerleap``
command start without loading torch: a Ctrl-C during start-up is then handled like any other."""

from __future__ import annotations

from .errors import LayerleapError

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "core.config",
    "tiny_config": "core.config",
    "KVCache": "core.kv_cache",
    "Transformer": "core.model",
    "load": "drafters.variants",
    "load_folder": "core.loading",
    "from_hf": "core.loading",
    "to_hf": "core.loading",
    "available_models": "core.loading",
    "generate": "decoding",
    "score": "decoding",
    "GenerationResult": "decoding",
    "GenerationConfig": "decoding",
    "GenerationError": "decoding",
    "METHODS": "decoding",
    "register": "decoding",
    "get_method": "decoding",
    "UnknownMethod": "decoding",
    "Option": "core.options",
    "Decoding": "decoding",
    "Grammar": "core.grammar",
    "TokenLogprob": "core.logprobs",
    "TopLogprob": "core.logprobs",
    "PromptCache": "core.prompt_cache",
    "stream": "streaming",
    "TextStream": "streaming",
}
__all__ = [*_EXPORTS, "LayerleapError"]


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:  # a submodule: layerleap.datasets, layerleap.core, ...
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
