"""Model configuration: the few numbers a Llama-family decoder needs."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..errors import LayerleapError

# Architectures whose weights map onto our decoder (Hugging Face `model_type`).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ConfigError(LayerleapError, ValueError):
    """A model folder or config that layerleap cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    name: str = "custom"

    def __post_init__(self):
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "max_position",
        ):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.qkv_bias and self.model_type != "qwen2":
            raise ConfigError(
                f"qkv_bias=True needs model_type='qwen2': transformers' attention_bias on "
                f"{self.model_type!r} also biases the output projection, which layerleap does not "
                "implement"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_hf(cls, hf: dict, name: str = "custom") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; refuse what we cannot run."""
        if not isinstance(hf, dict):
            raise ConfigError(f"a Hugging Face config is a dict (config.json's object), got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError(
                "config.json has no model_type: add the architecture of the weights, "
                f"one of {', '.join(SUPPORTED_MODEL_TYPES)} (layerleap runs Llama-family decoders)"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported architecture model_type={model_type!r}: layerleap runs Llama-family decoders "
                f"({', '.join(SUPPORTED_MODEL_TYPES)}); convert the model or choose another"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_scaling must be an object, got {str(rope)[:40]!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if rope_type == "linear" and type(factor) in (int, float) and factor == 1:  # positions / 1: the default
            rope_type = "default"
        if rope_type not in ("default", None):
            raise ConfigError(
                f"unsupported rope scaling {rope_type!r}: only the default rotary embedding is implemented"
            )
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' swish is SiLU too
            raise ConfigError(f"unsupported activation {hf.get('hidden_act')!r}: only SwiGLU (silu) is implemented")
        if hf.get("mlp_bias"):
            raise ConfigError("unsupported MLP bias (mlp_bias=true)")
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise ConfigError(
                "unsupported attention_bias=true: it puts biases on q, k, v and the output "
                "projection; layerleap implements Qwen2's q/k/v biases only"
            )
        qkv_bias = model_type == "qwen2"
        n_heads = _field(hf, "num_attention_heads")
        hidden = _field(hf, "hidden_size")
        n_kv = _field(hf, "num_key_value_heads", n_heads)
        head_dim = _field(hf, "head_dim", hidden // n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        vocab = _field(hf, "vocab_size")
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos_ids):
            raise ConfigError(f"eos_token_id {eos!r} is not a token id in [0, {vocab})")
        bos = hf.get("bos_token_id")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        max_position = _field(hf, "max_position_embeddings", max_position_default(model_type))
        max_position = min(max_position, sliding_window_bound(hf) or max_position)
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_field(hf, "intermediate_size"),
            n_layers=_field(hf, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
            rope_theta=_number({"rope_theta": theta}, "rope_theta", 10000.0),
            max_position=max_position,
            qkv_bias=qkv_bias,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            eos_token_ids=eos_ids,
            model_type=model_type,
            name=name,
        )

    def to_hf(self) -> dict:
        """The Hugging Face `config.json` dict for these numbers (for saving and for `transformers`)."""
        d = {
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            d["attention_bias"] = False
            d["mlp_bias"] = False
        if self.model_type == "mistral":
            d["sliding_window"] = None  # full attention (transformers' MistralConfig defaults to a 4096 window)
        return d


# transformers' LlamaConfig, Qwen2Config and MistralConfig defaults for an absent max_position_embeddings
_HF_MAX_POSITION = {"llama": 2048, "qwen2": 32768, "mistral": 131072}


def max_position_default(model_type) -> int:
    """The context `transformers` gives a config of ``model_type`` without ``max_position_embeddings``."""
    return _HF_MAX_POSITION.get(model_type, 2048)


_HF_SLIDING_WINDOW = 4096  # transformers' MistralConfig and Qwen2Config default for an absent sliding_window


def sliding_window_bound(hf: dict) -> int | None:
    """The sliding window that bounds the context of a Hugging Face config (``from_hf``'s
    ``max_position``): within the window, sliding-window attention is full attention.  None when no
    window applies or it is no shorter than ``max_position_embeddings``."""
    if not _sliding_window(hf, hf.get("model_type")):
        return None
    window = _field(hf, "sliding_window", _HF_SLIDING_WINDOW)
    return (
        window if window < _field(hf, "max_position_embeddings", max_position_default(hf.get("model_type"))) else None
    )


def _sliding_window(hf: dict, model_type: str) -> bool:
    """Whether `transformers` runs some layer of this config with sliding-window attention: every Mistral
    layer unless ``sliding_window`` is null (Mistral has no ``use_sliding_window``; a config that sets it
    does not turn the window off), Qwen2's layers its ``layer_types`` mark ``sliding_attention`` (or
    those from ``max_window_layers`` on) when ``use_sliding_window`` is set, no Llama layer."""
    if model_type == "mistral":
        return hf.get("sliding_window", _HF_SLIDING_WINDOW) is not None
    if model_type != "qwen2" or not hf.get("use_sliding_window") or hf.get("sliding_window", 0) is None:
        return False
    kinds = hf.get("layer_types")
    if isinstance(kinds, list):
        return "sliding_attention" in kinds
    n_layers, first = hf.get("num_hidden_layers"), hf.get("max_window_layers", 28)
    return not (isinstance(n_layers, int) and isinstance(first, int) and first >= n_layers)


def _field(hf: dict, key: str, default: int | None = None, most: int = 1 << 24) -> int:
    """A positive integer field of config.json (absent: ``default``)."""
    v = hf.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"{key} is missing: add it (a positive integer)")
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
        raise ConfigError(f"{key} must be a positive integer up to {most}, got {str(v)[:40]!r}")
    return v


def _number(hf: dict, key: str, default: float) -> float:
    v = default if hf.get(key) is None else hf[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{key} must be a positive number, got {v!r}")
    return float(v)


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight config for tests and examples."""
    base = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position=256,
        eos_token_ids=(2,),
        bos_token_id=1,
        name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)
