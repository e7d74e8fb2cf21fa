"""A second model inside one ``generate`` call: BiLD's small model, speculative decoding's draft
(``DraftModel``, the drafter over a ``Companion``).

``Run`` meters the main model (``run.forward`` counts its calls and token-layer evaluations).  A
``Companion`` gives the second model its own KV cache and its own meters, a
``core.stats.CompanionStats`` the whole batch shares (flat in ``GenerationResult.stats`` as
``<name>_calls``, ``<name>_layer_evals`` and ``<name>_prompt_layer_evals``).  One cache row per prompt.

``check_pair`` refuses pairs that cannot cooperate: different vocabularies or tokenizers, a
"small" model larger than the large one, different devices.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn

from ..core.cpu import release_freed_memory
from ..core.run import LONG_PROMPT_PASS, GenerationError, Run
from ..core.kv_cache import KVCache
from ..core.model import Transformer
from ..core.stats import CompanionStats
from .base import ChainRule, StepDrafter


class Companion:
    """The second model's cache (one row per prompt, left padded as ``Run.prefill`` pads) and meters."""

    def __init__(self, run: Run, model: Transformer, name: str, round_tokens: int = 0):
        self.run, self.model, self.name = run, model, name
        longest = max(len(p) for p in run.prompts)
        ctx, n = model.config.max_position, run.gen.max_new_tokens
        if longest + n > ctx:  # past it, its positions would be wrong: drafts (BiLD: output) silently worse
            raise GenerationError(
                f"a prompt has {longest} tokens; with max_new_tokens={n} that exceeds the {name} model's context "
                f"({ctx} positions): shorten the prompt, lower max_new_tokens or choose a {name} model with a "
                "longer context"
            )
        self.cache: KVCache = model.new_cache(run.batch, longest + run.gen.max_new_tokens + round_tokens + 1)
        self.meters = CompanionStats(name)
        run.record_all(self.meters)

    def length(self, row: int = 0) -> int:
        """Tokens of ``row`` in the cache, left padding excluded (every layer holds the same number)."""
        return int(self.cache.lengths[0, row] - self.cache.pad[row])

    def _count(self, key: str, n: int) -> None:
        setattr(self.meters, key, getattr(self.meters, key) + n)

    def prefill(self) -> torch.Tensor:
        """Run the prompts through every layer; -> logits ``[B, V]`` for the first new position (the last
        prompt position's alone, as ``Run.prefill`` gives the main model's: the other positions' would be a
        ``[B, T, V]`` tensor, 431 MB for a 709-token prompt and a 151,936-word vocabulary)."""
        prompts = self.run.prompts
        ids, pos = self.run.padded_prompts(self.cache)  # [B, T], [B, T]
        n = self.model.config.n_layers
        h = self.model.run_layers(self.model.embed(ids), 0, n, pos, self.cache)  # [B, T, D]
        logits = self.model.logits(h[:, -1:])[:, 0]  # [B, V]
        del h
        self._count("calls", 1)
        # counted as Run.prefill counts: the last position predicts a new token
        self._count("prompt_layer_evals", n * sum(len(p) - 1 for p in prompts))
        self._count("layer_evals", n * len(prompts))
        if sum(map(len, prompts)) >= LONG_PROMPT_PASS:
            release_freed_memory()  # as Run.prefill_at: the pass's freed buffers go back before decoding
        return logits

    def forward_rows(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append each listed row's tokens (ONE model call over every layer; other rows and shorter
        lists are padded with filler tokens, then rolled back) -> row -> logits ``[S_b, V]``, row ``i``
        predicting the token after ``tokens[i]``."""
        B, S = self.cache.batch, max(len(t) for t in feed.values())
        ids = torch.zeros(B, S, dtype=torch.long)
        for row, t in feed.items():
            ids[row, : len(t)] = torch.tensor(t, dtype=torch.long)
        start = self.cache.lengths[0].clone()
        pos = ((start - self.cache.pad).unsqueeze(1) + torch.arange(S)).clamp(max=self.model.config.max_position - 1)
        logits = self.model(ids.to(self.model.device), positions=pos.to(self.model.device), cache=self.cache)
        keep = start.clone()
        for row, t in feed.items():
            keep[row] += len(t)
        self.cache.truncate(keep)
        self._count("calls", 1)
        self._count("layer_evals", self.model.config.n_layers * sum(len(t) for t in feed.values()))
        return {row: logits[row, : len(t)] for row, t in feed.items()}

    def truncate(self, lengths: dict[int, int]) -> None:
        """Roll each listed row back to its first ``lengths[row]`` tokens (no-op where it holds fewer)."""
        new = self.cache.lengths[0].clone()
        for row, n in lengths.items():
            new[row] = min(int(new[row]), n + int(self.cache.pad[row]))
        if bool((new != self.cache.lengths[0]).any()):
            self.cache.truncate(new)


# tokenizer -> other tokenizer -> same vocabulary: held weakly, so that the answers go with the tokenizers
# (a model loaded and freed in a long-lived process leaves nothing behind, and no freed one's id is reused)
_SAME_TOKENIZER: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary[object, bool]]" = (
    weakref.WeakKeyDictionary()
)


def _same_tokenizer(a, b) -> bool:
    if a is b:
        return True
    try:
        per = _SAME_TOKENIZER.setdefault(a, weakref.WeakKeyDictionary())
        if b in per:
            return per[b]
    except TypeError:  # a tokenizer that takes no weak reference (or no hash): compared each time
        per = None
    same = len(a) == len(b) and a.get_vocab() == b.get_vocab()
    if per is not None:
        try:
            per[b] = same
        except TypeError:
            pass
    return same


def check_pair(large: Transformer, other: Transformer, role: str, option: str) -> None:
    """Refuse a second model (``role`` "small" or "draft", passed as ``option``) that cannot work with
    ``large``: a different vocabulary or tokenizer, more parameters than ``large``, another device."""
    if not isinstance(other, Transformer):
        raise GenerationError(f"{option}= must be a layerleap model (layerleap.load(...)), got {type(other).__name__}")
    v1, v2 = large.config.vocab_size, other.config.vocab_size
    if v1 != v2:
        raise GenerationError(
            f"the {role} model's vocabulary has {v2} tokens and the large model's {v1}: the two "
            f"models must share one tokenizer; choose a {role} model of the same family"
        )
    t1, t2 = large.tokenizer, other.tokenizer
    if t1 is not None and t2 is not None and not _same_tokenizer(t1, t2):
        raise GenerationError(
            f"the {role} model's tokenizer differs from the large model's (same size, other "
            f"tokens): choose a {role} model trained with the same tokenizer"
        )
    n1, n2 = large.n_params(), other.n_params()
    if n2 > n1:
        raise GenerationError(
            f"the {role} model ({n2 / 1e6:.1f}M parameters) is larger than the large model "
            f"({n1 / 1e6:.1f}M): pass the smaller one as {option}= and generate with the larger"
        )
    if large.device != other.device:
        raise GenerationError(
            f"the {role} model is on {other.device} and the large model on {large.device}: move both to one device"
        )


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


class DraftModel(StepDrafter):
    """Speculative decoding's drafter: a second, smaller model with the same tokenizer writes the
    chains (``ChainRule``); the target model scores them.  Both caches roll back to the accepted
    tokens; the draft model catches up on the target's tokens at the next round's start.  Its meters
    (``<name>_calls``, ``<name>_layer_evals``) count the whole batch."""

    batched = True
    draft_first = True  # the draft model has its own row for the first new position

    def __init__(self, run: Run, draft: Transformer, rule: ChainRule, name: str = "draft"):
        super().__init__(run, rule)
        self.model = Companion(run, draft, name, round_tokens=self.round_tokens())

    def prefill(self) -> torch.Tensor:
        logits = super().prefill()
        self.draft_logits = self.model.prefill()
        return logits

    def own_length(self, row: int) -> int:
        return self.model.length(row)

    def step_logits(self, feed: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        return {row: logits[-1] for row, logits in self.model.forward_rows(feed).items()}

    def update(self, cands, results) -> None:
        super().update(cands, results)
        self.model.truncate({row: len(self.seq(row)) + len(r[0]) for row, r in enumerate(results) if r is not None})
