"""layerleap: faster decoding from what intermediate layers already know."""

from .config import ModelConfig, tiny_config
from .decoding import (METHODS, Decoding, GenerationConfig, GenerationError, GenerationResult, generate, get_method,
                       register)
from .errors import LayerleapError
from .kv_cache import KVCache
from .loading import available_models, from_hf, load, load_folder, to_hf
from .model import Transformer
from .streaming import TextStream, stream

__version__ = "0.1.0"
__all__ = ["ModelConfig", "tiny_config", "KVCache", "Transformer", "load", "load_folder", "from_hf", "to_hf",
           "available_models", "generate", "stream", "TextStream", "Decoding", "GenerationResult", "GenerationConfig", "GenerationError", "METHODS",
           "register", "get_method", "LayerleapError"]
