"""Placing models on a device, and method options that name a second model (``speculative``'s ``draft=``,
``bild``'s ``small=``).

On the command line and in a server request such an option is a model name or folder; ``ModelLoader``
loads it once, with the main model's dtype and device, and ``resolve_models`` swaps the names in a
method's options for the loaded models.  Which options take a model is declared by the method
(``register(..., models=("draft",))``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .decoding import get_method
from .errors import LayerleapError
from .core.loading import to_device  # noqa: F401  (placing a model: re-exported for the commands)
from .core.model import Transformer


class ModelLoader:
    """Loads models by name or folder once each (``loader(name)``), with one dtype and device."""

    def __init__(self, dtype="float32", device: str = "cpu", progress: Callable[[str], None] | None = None):
        self.dtype, self.device, self.progress = dtype, device, progress
        self.models: dict[str, Transformer] = {}

    def __call__(self, name: str) -> Transformer:
        if name not in self.models:
            from .core.loading import load

            model = load(name, dtype=self.dtype, progress=self.progress)
            self.models[name] = to_device(model, self.device)
            if self.progress is not None:
                self.progress(f"loaded {name} ({self.dtype}) for a method option")
        return self.models[name]


def model_options(method: str) -> tuple[str, ...]:
    """The options of ``method`` that take a second model."""
    return get_method(method).models


def resolve_models(method: str, options: dict, loader: Callable[[str], Transformer]) -> dict:
    """``options`` with every model-valued option given as a name or path replaced by ``loader(name)``."""
    out = dict(options)
    for key in model_options(method):
        value = out.get(key)
        if isinstance(value, (str, Path)):
            try:
                out[key] = loader(str(value))
            except LayerleapError as e:
                raise LayerleapError(f"{method} option {key}={value}: {e}") from None
    return out
