"""Exit heads: next-token logits from the hidden state after layer ``layer`` (PPD §4.3's early
prediction, BiLD's early-exit small model, the self-speculative drafter).

Four kinds behind one interface, ``head(h [B, S, D]) -> logits [B, S, V]``:

- ``shared`` (PPD's "N"): the model's own final norm and unembedding on the intermediate state;
- ``lens`` (a trained "tuned lens"): an affine ``D x D`` map in front of the frozen final norm and
  unembedding, initialised to the identity, so an untrained lens is the shared head;
- ``full`` (PPD's "Y"): a trainable RMSNorm and ``V x D`` unembedding, initialised from the model's;
- ``adapter`` (BiLD's aligned head, ``layerleap align``): a trainable RMSNorm and a low-rank adapter
  in front of the frozen unembedding.

Trained heads are saved as one weights file per set of layers (``drafters.weights``: the model's
fingerprint and the training budget in its metadata); loading into another model is refused.  Heads
for the embedded default ship in ``layerleap/data/heads/`` and are found by fingerprint
(``get_head(model, layer, "trained")``).  ``layerleap align`` writes an adapter head in the same
format; ``load_exit_head`` reads any heads file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import validate as V
from ..core.model import RMSNorm, Transformer
from ..core.run import GenerationError
from . import weights

KINDS = ("shared", "lens", "full")
SHIPPED_DIR = Path(__file__).parent.parent / "data" / "heads"


class HeadError(GenerationError):
    """A head that cannot be made or loaded: the message names the problem and the fix."""


class ExitHead(nn.Module):
    """``h [B, S, D]`` after layer ``layer`` -> logits ``[B, S, V]``."""

    kind = "shared"

    def __init__(self, model: Transformer, layer: int, vocab: torch.Tensor | None = None):
        super().__init__()
        check_layer(model, layer)
        self.layer = layer
        self._model = [model]  # a list: the backbone is neither a submodule nor saved with the head
        self.register_buffer("vocab", None)  # [n] long ids of a sub-vocabulary head (saved), else None
        if vocab is not None:  # a sub-vocabulary head: logits only for these ids, -inf elsewhere
            ids = torch.as_tensor(vocab, dtype=torch.long).reshape(-1).clone()
            V = model.config.vocab_size
            if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= V or len(torch.unique(ids)) != len(ids):
                raise HeadError(f"a head's vocab must be distinct token ids in [0, {V}), got {len(ids)} ids")
            self.register_buffer("vocab", ids.to(model.device))
            # the rows of the frozen unembedding it multiplies (derived, not saved)
            self.register_buffer("sub_weight", model.head_rows(self.vocab).contiguous(), persistent=False)

    def _scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """``[B, S, len(vocab)]`` -> ``[B, S, V]`` with -inf outside the sub-vocabulary."""
        out = sub.new_full((*sub.shape[:-1], self.model.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab, sub)

    @property
    def model(self) -> Transformer:
        return self._model[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.vocab is not None:
            return self._scatter(F.linear(self.normed(h), self.sub_weight).float())
        return self.model.logits(h)

    # the two stages, for logits over part of the vocabulary (training's candidate sets, sub-vocab heads)
    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` -> the state the unembedding multiplies (after the final norm)."""
        return self.model.final_norm(h)

    def unembed_weight(self) -> torch.Tensor:
        """The ``[V, D]`` unembedding this head multiplies by."""
        return self.model.head_weight()

    def own_unembedding(self) -> torch.Tensor | None:
        """The head's own ``[V, D]`` unembedding, or None where it multiplies by the model's (found
        without ``head_weight()``, which dequantizes a packed head: 90 ms on the q4 default)."""
        return None if type(self).unembed_weight is ExitHead.unembed_weight else self.unembed_weight()

    def logits_at(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, len(ids)]`` of the vocabulary entries ``ids`` only (fp32)."""
        return F.linear(self.normed(h).float(), self.unembed_weight()[ids].float())


class LensHead(ExitHead):
    """``unembed(final_norm(h + h W^T + b))`` with ``W, b`` trained (zero at start: the shared head)."""

    kind = "lens"

    def __init__(self, model: Transformer, layer: int, vocab: torch.Tensor | None = None):
        super().__init__(model, layer, vocab)
        D = model.config.hidden_size
        self.proj = nn.Linear(D, D, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.vocab is not None:
            return self._scatter(F.linear(self.normed(h), self.sub_weight).float())
        h32 = h.to(self.proj.weight.dtype)
        return self.model.logits((h32 + self.proj(h32)).to(h.dtype))

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        h32 = h.to(self.proj.weight.dtype)
        return self.model.final_norm((h32 + self.proj(h32)).to(h.dtype))


class FullHead(ExitHead):
    """A trainable RMSNorm and ``V x D`` unembedding, initialised from the model's final ones."""

    kind = "full"

    def __init__(self, model: Transformer, layer: int, vocab: torch.Tensor | None = None):
        if vocab is not None:
            raise HeadError("a full head has its own V x D unembedding: a sub-vocabulary is for shared and lens heads")
        super().__init__(model, layer)
        c = model.config
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(model.norm.weight.float())
            self.lm_head.weight.copy_(model.head_weight().float())  # dense, or unpacked from a packed head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h.to(self.lm_head.weight.dtype)))

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.to(self.lm_head.weight.dtype))

    def unembed_weight(self) -> torch.Tensor:
        return self.lm_head.weight


class AdapterHead(ExitHead):
    """``unembed(norm(h + up(down(h))))``: a trainable RMSNorm (initialised from the model's final norm)
    and a rank-``rank`` adapter (``rank = 0``: a full D x D matrix; ``up`` zero at start, so an
    untrained head is the shared head) in front of the model's frozen unembedding."""

    kind = "adapter"

    def __init__(self, model: Transformer, layer: int, vocab: torch.Tensor | None = None, rank: int = 64):
        if vocab is not None:
            raise HeadError("an adapter head has its own norm: a sub-vocabulary is for shared and lens heads")
        super().__init__(model, layer)
        D = model.config.hidden_size
        self.norm = RMSNorm(D, model.config.rms_norm_eps)
        r = D if not rank or rank >= D else rank
        self.down = nn.Linear(D, r, bias=False)
        self.up = nn.Linear(r, D, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(model.norm.weight.float())
            nn.init.normal_(self.down.weight, std=D**-0.5)
            self.up.weight.zero_()  # starts as the shared head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.unembed(self.normed(h))

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(self.up.weight.dtype)
        return self.norm(h + self.up(self.down(h))).to(self.model.dtype)


_CLASSES = {"shared": ExitHead, "lens": LensHead, "full": FullHead}


def check_layer(model: Transformer, layer: int, name: str = "an exit head's layer") -> None:
    n = model.config.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n:
        raise HeadError(f"{name} must be an integer in [1, {n}] (the number of layers run), got {layer!r}")


def new_head(model: Transformer, layer: int, kind: str = "lens", vocab=None) -> ExitHead:
    """A fresh head (untrained: equal to the shared head).  ``vocab``: token ids to restrict the
    head to (shared/lens): its unembedding is ``len(vocab) x D``, other logits are -inf -- drafts from
    it stay lossless in the verifying methods, and it costs ``len(vocab) / V`` of a full head."""
    if kind not in _CLASSES:
        raise HeadError(f"unknown head kind {kind!r}: choose one of {', '.join(KINDS)}")
    return _CLASSES[kind](model, layer, vocab).to(model.device)


def with_vocab(head: ExitHead, vocab) -> ExitHead:
    """The same trained head restricted to the sub-vocabulary ``vocab``."""
    out = new_head(head.model, head.layer, head.kind, vocab)
    state = {k: v for k, v in head.state_dict().items() if k != "vocab"}
    out.load_state_dict({**out.state_dict(), **state})
    return out.eval().requires_grad_(False)


def rank_by_count(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: all ``vocab_size`` ids, most frequent in ``ids`` first (ties, and the ids
    never seen, by increasing id), and each id's count."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=vocab_size)
    return torch.argsort(-counts.double() + torch.arange(vocab_size) * 1e-9), counts


def sub_vocab_heads(heads: dict[int, ExitHead] | list[ExitHead], vocab) -> list[ExitHead]:
    """Each (shared or lens) head restricted to the token ids ``vocab``, by layer: what
    ``save_heads`` writes as a sub-vocabulary heads file."""
    items = heads.values() if isinstance(heads, dict) else heads
    return [with_vocab(h, vocab) for h in sorted(items, key=lambda h: h.layer)]


# -- files ----------------------------------------------------------------------------------------
def _build(model: Transformer, build: dict, tensors: dict) -> dict[int, ExitHead]:
    """The heads of a weights file by layer (``weights.Kind.build``)."""
    out = {}
    for layer, kind in zip(build["layers"], build["kinds"]):
        prefix = f"layer{layer}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if kind == "adapter":  # its rank is its tensors' (0: a full D x D matrix)
            head = AdapterHead(model, layer, rank=int(state["down.weight"].shape[0]) if "down.weight" in state else 0)
        else:
            head = new_head(model, layer, kind, state.get("vocab"))
        head.load_state_dict(state)
        out[layer] = head.eval().requires_grad_(False).to(model.device)
    return out


HEADS = weights.Kind("exit-heads", "exit heads", "layerleap train heads", HeadError, _build)


def save_heads(
    heads: list[ExitHead],
    path,
    meta: dict | None = None,
    dtype: torch.dtype = torch.float32,
    budget: weights.Budget | None = None,
) -> Path:
    """Write heads (one model, distinct layers; any kinds, adapter heads too) to one weights file,
    atomically.  ``dtype``: the storage type (bf16 halves a shipped file; loading casts back)."""
    if not heads:
        raise HeadError("no heads to save")
    model = heads[0].model
    layers = [h.layer for h in heads]
    if len(set(layers)) != len(layers) or any(h.model is not model for h in heads):
        raise HeadError("save_heads takes heads of one model at distinct layers")
    tensors = {f"layer{h.layer}.{k}": v for h in heads for k, v in h.state_dict().items()}
    build = {"layers": layers, "kinds": [h.kind for h in heads]}
    return weights.write(path, model, HEADS.name, build, tensors, budget, meta, dtype)


def read_meta(path) -> dict:
    """A heads file's metadata (``weights.read_meta``: an earlier format's keys mapped onto today's)."""
    return weights.read_meta(path, HeadError, "train them again with `layerleap train heads`", "exit heads")


def load_heads(model: Transformer, path) -> dict[int, ExitHead]:
    """Heads from a file written by ``save_heads``, by layer; refuses a file made for another model.
    Read once per model and file (``weights.load``)."""
    return weights.load(model, path, HEADS)


def shipped_files(model: Transformer) -> list[Path]:
    """The shipped heads files made for this model (matched by fingerprint; looked up once per model)."""
    return weights.shipped(model, SHIPPED_DIR, HEADS)


def trained_layers(model: Transformer) -> list[int]:
    """Layers with a shipped trained head for this model."""
    return sorted({x for p in shipped_files(model) for x in json.loads(read_meta(p)["build"])["layers"]})


def get_head(model: Transformer, layer: int, head="auto") -> ExitHead:
    """The exit head for ``layer``.  ``head``: "shared"; "trained" (a shipped head for this model and
    layer); "auto" (trained if shipped, else shared); a path to a heads file; or an ``ExitHead``."""
    if isinstance(head, ExitHead):
        if head.layer != layer or head.model is not model:
            raise HeadError(
                f"the given head is for layer {head.layer} of another model or layer: pass one for layer {layer}"
            )
        return head
    check_layer(model, layer)
    if head == "shared":
        return new_head(model, layer, "shared")
    if head in ("trained", "auto"):
        for p in shipped_files(model):
            heads = load_heads(model, p)
            if layer in heads:
                return heads[layer]
        if head == "auto":
            return new_head(model, layer, "shared")
        have = trained_layers(model)
        raise HeadError(
            f"no shipped trained head for layer {layer} of {model.config.name}"
            + (f" (shipped layers: {', '.join(map(str, have))})" if have else " (none ship for this model)")
            + ": use head='shared', or train one with `layerleap train heads` and pass its file"
        )
    if isinstance(head, (str, Path)):
        heads = load_heads(model, head)
        if layer not in heads:
            if len(heads) == 1:
                (have,) = heads
                raise HeadError(
                    f"exit head {head} is for exit_layer={have}, not {layer}: pass exit_layer={have} "
                    f"or train a head for layer {layer}"
                )
            raise HeadError(f"{head} has heads for layers {', '.join(map(str, sorted(heads)))}, not {layer}")
        return heads[layer]
    raise HeadError(f"head must be 'shared', 'trained', 'auto', a heads file or an ExitHead, got {V.show(head)}")


def load_exit_head(model: Transformer, layer: int, path) -> ExitHead:
    """The head for ``layer`` from a heads file (``layerleap train heads``, or an adapter head from
    ``layerleap align``); refuses a file made for another model or layer.  Read once per model and
    file (``weights.load``)."""
    return get_head(model, layer, Path(path).expanduser())
