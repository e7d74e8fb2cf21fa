"""A second model inside one ``generate`` call: BiLD's small model, speculative decoding's draft.

``Run`` meters the main model (``run.forward`` counts its calls and token-layer evaluations).  A
``Companion`` gives the second model its own KV cache and its own meters, kept in ``run.extra``
under ``<name>_calls``, ``<name>_layer_evals`` and ``<name>_prompt_layer_evals`` (so they appear in
``GenerationResult.stats``).  Batch 1, as the two-model methods are.

``check_pair`` refuses pairs that cannot cooperate: different vocabularies or tokenizers, a
"small" model larger than the large one, different devices.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..core.run import GenerationError, Run
from ..core.kv_cache import KVCache
from ..core.model import Transformer


class Companion:
    def __init__(self, run: Run, model: Transformer, name: str, extra_slots: int = 0):
        self.run, self.model, self.name = run, model, name
        self.prompt = run.prompts[0]
        self.cache: KVCache = model.new_cache(1, len(self.prompt) + run.gen.max_new_tokens + extra_slots + 1)
        for key in ("calls", "layer_evals", "prompt_layer_evals"):
            run.extra.setdefault(f"{name}_{key}", 0)

    @property
    def length(self) -> int:
        """Tokens in the cache (every layer holds the same number)."""
        return int(self.cache.lengths[0, 0])

    def _count(self, key: str, n: int) -> None:
        self.run.extra[f"{self.name}_{key}"] += n

    def prefill(self) -> torch.Tensor:
        """Run the prompt through every layer; -> logits ``[V]`` for the first new position."""
        ids = torch.tensor([self.prompt], dtype=torch.long, device=self.model.device)
        logits = self.model(ids, cache=self.cache)
        self._count("calls", 1)
        n = self.model.config.n_layers  # counted as Run.prefill counts: the last position predicts a new token
        self._count("prompt_layer_evals", n * (len(self.prompt) - 1))
        self._count("layer_evals", n)
        return logits[0, -1]

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens`` (one model call over every layer) -> logits ``[S, V]``, row ``i`` predicting
        the token after ``tokens[i]``."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        n = self.length
        pos = torch.arange(n, n + len(tokens), device=self.model.device).unsqueeze(0)
        logits = self.model(ids, positions=pos, cache=self.cache)
        self._count("calls", 1)
        self._count("layer_evals", self.model.config.n_layers * len(tokens))
        return logits[0]

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens (no-op when it holds fewer)."""
        if length < self.length:
            self.cache.truncate(length)


_SAME_TOKENIZER: dict[tuple[int, int], bool] = {}


def _same_tokenizer(a, b) -> bool:
    key = (id(a), id(b))
    if key not in _SAME_TOKENIZER:
        _SAME_TOKENIZER[key] = a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())
    return _SAME_TOKENIZER[key]


def check_pair(large: Transformer, other: Transformer, role: str, option: str) -> None:
    """Refuse a second model (``role`` "small" or "draft", passed as ``option``) that cannot work with
    ``large``: a different vocabulary or tokenizer, more parameters than ``large``, another device."""
    if not isinstance(other, Transformer):
        raise GenerationError(f"{option}= must be a layerleap model (layerleap.load(...)), got {type(other).__name__}")
    v1, v2 = large.config.vocab_size, other.config.vocab_size
    if v1 != v2:
        raise GenerationError(f"the {role} model's vocabulary has {v2} tokens and the large model's {v1}: the two "
                              f"models must share one tokenizer; choose a {role} model of the same family")
    t1, t2 = large.tokenizer, other.tokenizer
    if t1 is not None and t2 is not None and not _same_tokenizer(t1, t2):
        raise GenerationError(f"the {role} model's tokenizer differs from the large model's (same size, other "
                              f"tokens): choose a {role} model trained with the same tokenizer")
    n1, n2 = large.n_params(), other.n_params()
    if n2 > n1:
        raise GenerationError(f"the {role} model ({n2 / 1e6:.1f}M parameters) is larger than the large model "
                              f"({n1 / 1e6:.1f}M): pass the smaller one as {option}= and generate with the larger")
    if large.device != other.device:
        raise GenerationError(f"the {role} model is on {other.device} and the large model on {large.device}: "
                              "move both to one device")


def truncated(model: Transformer, n_layers: int, head=None) -> Transformer:
    """Layers ``[0, n_layers)`` of ``model`` as a model of their own, sharing its weights (no copy), with
    ``head`` (a callable ``h -> logits``; default the model's final norm and unembedding) as its
    output: an early-exit draft for speculative decoding, or the early-exit form's small model seen
    from outside."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < model.config.n_layers:
        raise GenerationError(f"a truncated model needs 1 <= n_layers < {model.config.n_layers}, got {n_layers!r}")
    cfg = dataclasses.replace(model.config, n_layers=n_layers, name=f"{model.config.name}[:{n_layers}]")
    with torch.device("meta"):
        t = Transformer(cfg, tokenizer=model.tokenizer, source=None)
    t.tok_embeddings, t.norm, t.lm_head = model.tok_embeddings, model.norm, model.lm_head
    t.layers = nn.ModuleList(model.layers[:n_layers])
    t.rope_cos, t.rope_sin = model.rope_cos, model.rope_sin
    if head is not None:
        if isinstance(head, nn.Module):
            t.exit_head = head  # registered: moves with the model and counts in n_params
        # an instance attribute shadows the class's ``logits`` method (nn.Module.__setattr__ would only
        # register a module, which attribute lookup finds after the method)
        object.__setattr__(t, "logits", head)
    return t.eval()
